"""Real Ray actors for every cluster (actor_train, actor_infer, reference, critic, one reward cluster per domain)
driven through an RLVR step. (A short end-to-end `roll run` into a real MLflow server, with its checkpoint, is
tests/test_mlflow_server.py's `trained` run.)"""

from __future__ import annotations

from collections import Counter

import pytest
import ray
import torch

from roll_core.config import load_config
from roll_core.config.shares import domain_shares
from roll_pipeline.driver.pipeline import RLVRPipeline
from tests.conftest import EXAMPLES

SMALL = [
    "rollout_batch_size=4",
    "num_return_sequences_in_group=4",
    "actor_train.training_args.per_device_train_batch_size=8",
    "actor_train.training_args.gradient_accumulation_steps=2",
    "actor_train.training_args.warmup_steps=0",
    "actor_train.training_args.learning_rate=1e-3",
    "actor_infer.generating_args.max_new_tokens=24",
    "validation.max_prompts=8",
    "validation.generating_args.max_new_tokens=24",
]


def progress_probs(base, rate, *, strength, floor, ceil):
    """The progress mixer's probabilities for two domains, from its documented rule (roll_core/algorithms/
    mixing.py): configured probability times (rate / the probability-weighted mean rate) ** strength, normalised;
    a domain past a bound is set to it and the other gets the rest."""
    mean = sum(base[d] * rate[d] for d in base)
    weights = {d: base[d] * (rate[d] / mean) ** strength for d in base}
    probs = {d: w / sum(weights.values()) for d, w in weights.items()}
    for d, p in probs.items():
        bound = ceil if p > ceil else floor if p < floor else None
        if bound is not None:
            (other,) = set(probs) - {d}
            return {d: bound, other: 1.0 - bound}
    return probs


class ProgressMixerModel:
    """What domain_mixer progress (floor 0.125, ceil 0.875, strength 0.2, smoothing 0.5) must do over math_code's
    0.75 / 0.25, rollout after rollout: the configured probabilities before anything is measured, then the rule
    applied to the groups kept per second that the previous rollouts' schedulers logged (smoothed)."""

    BASE = {"math": 0.75, "code": 0.25}

    def __init__(self) -> None:
        self.rate: dict[str, float] = {}
        self.expected = dict(self.BASE)

    def check(self, rollout, size: int, group: int, step: int) -> None:
        """The rollout's probabilities and prompts are the expected ones; then learn from what it measured."""
        m = rollout.metrics
        for d in self.BASE:
            assert m[f"mix/{d}"] == pytest.approx(self.expected[d], rel=1e-9), (step, d)
        prompts = {d: int(m[f"mix/{d}/prompts"]) for d in self.BASE}
        assert prompts == domain_shares(self.expected, size), step
        assert Counter(rollout.batch.meta["domain"]) == {d: group * k for d, k in prompts.items()}, step
        assert all(m[f"scheduler/{d}/groups_kept"] == prompts[d] for d in self.BASE)  # no filter drops a group
        measured = {d: m[f"scheduler/{d}/groups_kept"] / m[f"scheduler/{d}/wall_s"] for d in self.BASE}
        self.rate = measured if not self.rate else {d: 0.5 * self.rate[d] + 0.5 * measured[d] for d in self.BASE}
        self.expected = progress_probs(self.BASE, self.rate, strength=0.2, floor=0.125, ceil=0.875)
        assert self.expected != pytest.approx(self.BASE), "the measured rates moved the probabilities"


@pytest.mark.slow
def test_every_cluster_runs_a_step_on_real_actors_and_the_progress_mixer_moves_their_rollouts(
    tmp_path, tiny_model, local_ray, mlflow_db
):
    """One pipeline with every cluster (actor_train, actor_infer, reference, critic, a reward cluster per domain)
    on real actors, driven through an RLVR step with multi-turn math trajectories on the transformers engine; and
    domain_mixer progress driving its real rollouts, before and after that step: each rollout's domain
    probabilities are the mixer's rule applied to the groups kept per second that the previous rollouts'
    schedulers logged (smoothed), and each domain's prompts in the batch follow them. (Three tests with a pipeline
    each until 2026-12-06, this file's two and test_multi_turn.py's step on hf_infer: docs/testing.md.)"""
    size, group = 8, 2
    overrides = [
        *SMALL,
        f"rollout_batch_size={size}",
        f"num_return_sequences_in_group={group}",
        "max_steps=1",
        f"output_dir={tmp_path / 'run'}",
        f"tracking.tracking_uri={mlflow_db(tmp_path / 'mlflow.db')}",
        # two passes over the batch, so that actor_train's separate log-prob pass runs (update_gives_old_log_probs
        # is off) and its old log-probs can be held against the reference's
        "ppo_epochs=2",
        "use_kl_loss=true",
        "kl_loss_coef=0.01",
        "adv_estimator=gae",
        # the critic's micro-batches cut by tokens (roll_core/models/microbatches.py), actor_train's by rows
        "critic={training_args: {per_device_train_batch_size: 8, gradient_accumulation_steps: 2, learning_rate: 1e-3,"
        " max_tokens_per_microbatch: 320}}",
        "rewards.math.group_filters={}",
        "rewards.code.group_filters={}",
        # math multi-turn, code single-turn: each math trajectory takes three model turns with two tool answers
        # between them (the tiny model never calls a tool: tests/test_multi_turn.py's Echo answers every turn)
        "rewards.math.rollout={type: multi_turn, environment: 'tests.test_multi_turn:Echo', max_turns: 3}",
        "infer_is_cap=2.0",  # actor_infer returns the sampled tokens' log-probs
        # strength 0.2 keeps the probabilities inside the bounds, where the smoothing shows (math's reaches the
        # ceiling only at a rate 69 times code's; measured here: 3 to 5 times, math 0.79 to 0.81)
        "domain_mixer={type: progress, floor: 0.125, ceil: 0.875, strength: 0.2, smoothing: 0.5}",
    ]
    pipeline = RLVRPipeline(load_config(EXAMPLES / "math_code.yaml", overrides))
    mixer = ProgressMixerModel()
    try:
        pipeline.setup()
        clusters = {
            "actor_train": pipeline.runtime.actor_train,
            "actor_infer": pipeline.runtime.actor_infer,
            "reference": pipeline.runtime.reference,
            "critic": pipeline.runtime.critic,
            **{c.name: c for c in pipeline.runtime.reward_clusters()},
        }
        assert set(clusters) == {"actor_train", "actor_infer", "reference", "critic", "reward_math", "reward_code"}
        for name, cluster in clusters.items():
            assert len(cluster.workers) == 1, name

        def process(self) -> tuple[int, set[str]]:  # a worker's pid, and which of three imports its process holds
            import os
            import sys

            return os.getpid(), {m for m in ("sklearn", "deepspeed", "mlflow") if m in sys.modules}

        seen = {name: ray.get(c.workers[0].__ray_call__.remote(process)) for name, c in clusters.items()}
        assert len({pid for pid, _ in seen.values()}) == len(seen), "every cluster runs in its own process"
        # ...and imports transformers without scikit-learn (roll_core/lean_imports.py: 1.5 s of CPU a process)
        assert {name: "sklearn" in held for name, (_, held) in seen.items()} == dict.fromkeys(clusters, False)
        # ...and the training workers import DeepSpeed without MLflow (roll_core/lean_imports.py)
        trainers = ("actor_train", "critic")
        assert {name: seen[name][1] & {"deepspeed", "mlflow"} for name in trainers} == dict.fromkeys(trainers, {"deepspeed"})
        # ...and each domain's scheduler loads its tokenizer without transformers' generation code (torch's compiler)
        schedulers = pipeline.runtime.schedulers
        compiled = {d: ray.get(s.__ray_call__.remote(lambda self: "torch._dynamo" in __import__("sys").modules))
                    for d, s in schedulers.items()}
        assert compiled == {"math": False, "code": False}

        before = pipeline.runtime.actor_train.call_rank0("get_weights")
        rollout = pipeline.rollout()
        mixer.check(rollout, size, group, step=0)
        batch = rollout.batch
        assert len(batch) == size * group
        # domain_interleave_probs math 0.75, code 0.25 of rollout_batch_size 8 (nothing measured yet): 6 math
        # prompts and 2 code prompts, each with its group of 2, every group from one domain, and each row from its
        # domain's data (the example data's ids start with the domain's name)
        assert pipeline.resolved.domain_shares == {"math": 6, "code": 2}
        domains = batch.meta["domain"]
        assert Counter(domains) == {"math": 12, "code": 4}
        assert all(len(set(domains[g * group : (g + 1) * group])) == 1 for g in range(size))
        assert all(row_id.startswith(f"{d}-") for d, row_id in zip(domains, batch.meta["id"], strict=True))
        assert batch["group_ids"].tolist() == [g for g in range(size) for _ in range(group)]
        # the batch holds both kinds of rows, the single-turn ones filled in: three turns and two tool calls for
        # each math row, the tools' tokens in the sequence and out of the response mask
        math = torch.tensor([d == "math" for d in domains])
        assert batch["turns"][math].tolist() == [3.0] * 12 and batch["tool_calls"][math].tolist() == [2.0] * 12
        assert batch["turns"][~math].tolist() == [1.0] * 4 and not batch["tool_mask"][~math].any()
        assert (batch["tool_mask"][math].sum(1) > 0).all() and not (batch["tool_mask"] * batch["response_mask"]).any()
        trajectories = dict(enumerate(batch.meta["trajectory"]))
        assert all(len(trajectories[i]) == 5 if m else trajectories[i] is None for i, m in enumerate(math.tolist()))
        assert not pipeline.cfg.update_gives_old_log_probs
        batch = pipeline.compute_log_probs(batch)
        # actor_train's log-probs of the sampled tokens equal the engine's (same weights), tools' tokens between
        model_tokens = batch["response_mask"] > 0
        gap = (batch["old_log_probs"] - batch["infer_log_probs"]).abs()[model_tokens]
        assert float(gap.max()) < 1e-3, float(gap.max())
        batch = pipeline.compute_values(batch)
        batch, _ = pipeline.shape_rewards(batch)
        batch = pipeline.compute_advantages(batch)
        for key in ("old_log_probs", "ref_log_probs", "values", "token_level_rewards", "advantages", "returns"):
            assert batch[key].shape == batch["response_ids"].shape, key
        # actor and reference start from the same weights: their log-probs agree before any update
        assert torch.allclose(batch["old_log_probs"], batch["ref_log_probs"], atol=1e-4)
        # the critic's values give advantages to the model's tokens and none to the tools' (out of the loss)
        assert not batch["advantages"][batch["tool_mask"] > 0].any() and batch["advantages"][model_tokens].any()
        metrics = pipeline.train(batch)
        assert {"actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "critic/value_loss"} <= set(metrics)
        # each of the critic's micro-batches padded to its own rows, actor_train's to the batch's widths
        assert 0 < metrics["critic/pad_frac"] < metrics["actor/pad_frac"] < 1, metrics
        assert "critic/rows_over_token_budget" in metrics and "actor/rows_over_token_budget" not in metrics
        pipeline.weights.sync()
        after = pipeline.runtime.actor_train.call_rank0("get_weights")
        assert any(not torch.equal(before[k], after[k]) for k in before), "the policy's parameters changed"
        synced = pipeline.runtime.actor_infer.workers[0].__ray_call__.remote(
            lambda self: {k: v.clone() for k, v in self.strategy.model.state_dict().items()}
        )
        synced = ray.get(synced)
        assert all(torch.equal(after[k], synced[k]) for k in after), "actor_infer received the new weights"

        for step in (1, 2):  # the mixer goes on with the rates measured so far
            mixer.check(pipeline.rollout(), size, group, step)
    finally:
        pipeline.shutdown()

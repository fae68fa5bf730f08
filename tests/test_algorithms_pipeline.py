"""The algorithms where the pipeline and actor_train use them: config keys and their errors, the reward-shaping and
advantage stages on a hand-made batch, critic warm-up, and actor_train's whole objective (policy loss, KL loss,
entropy bonus) giving the same gradient whole or in micro-batches for every policy loss and aggregation mode."""

from __future__ import annotations

import math

import pytest
import torch

from roll_core.algorithms import LOSS_AGGREGATIONS, POLICY_LOSSES, batch_normalizer
from roll_core.algorithms.advantages import advantage_metrics
from roll_core.batch import Batch, loss_mask
from roll_core.config import ConfigError
from roll_core.models.forward import log_probs_from_logits
from roll_pipeline.driver.loop_state import Rollout
from roll_pipeline.driver.names import load_run_config
from roll_pipeline.driver.pipeline import RLVRPipeline
from tests.conftest import EXAMPLES
from workers.actor_train import policy_objective
from workers.critic import CriticWorker, value_objective

GAE = ["adv_estimator=gae", "critic={training_args: {per_device_train_batch_size: 64, gradient_accumulation_steps: 2}}"]


def config(*overrides: str):
    return load_run_config(EXAMPLES / "math_code.yaml", list(overrides))


def errors(*overrides: str) -> str:
    with pytest.raises(ConfigError) as info:
        config(*overrides)
    return str(info.value)


# ------------------------------------------------------------------------------------------- config


def test_algorithm_keys_load_from_yaml():
    cfg = config(
        "adv_estimator=rloo",
        "policy_loss=ppo_clip",
        "pg_clip_low=0.2",
        "pg_clip_high=0.28",
        "dual_clip_c=3",
        "loss_agg_mode=seq-mean-token-sum-norm",
        "whiten_advantages=true",
        "advantage_clip=5",
        "add_token_level_kl=true",
        "kl_penalty=low_var_kl",
        "kl_ctrl=adaptive",
        "target_kl=0.1",
        "reward_shaping={norm_mean_type: running, norm_std_type: running, reward_clip: 3, "
        "overlong_penalty: {buffer_len: 8}, difficulty_mask: {low: 0.1, high: 0.9}, length_mask: {max_tokens: 30}}",
    ).config
    assert cfg.clip_range == (0.2, 0.28)
    assert cfg.dual_clip_c == 3.0 and cfg.needs_reference
    assert cfg.reward_shaping.overlong_penalty.buffer_len == 8
    assert cfg.reward_shaping.difficulty_mask.low == 0.1
    assert config("pg_clip=0.1").config.clip_range == (0.1, 0.1)
    assert not config().config.needs_reference


def test_algorithm_config_errors_name_their_keys():
    msg = errors(
        "adv_estimator=ppo",
        "policy_loss=clip",
        "loss_agg_mode=mean",
        "kl_penalty=k4",
        "kl_ctrl=adaptive",
        "dual_clip_c=1",
        "pg_clip_low=1.5",
        "critic_warmup=3",
        "reward_shaping={norm_std_type: domain, overlong_penalty: {buffer_len: 64}, difficulty_mask: {low: 0.9, high: 0.1}}",
    )
    assert "adv_estimator: must be one of ['dr_grpo', 'gae', 'grpo', 'reinforce', 'reinforce_plus_plus'" in msg
    assert "policy_loss: must be one of ['cispo', 'gspo', 'ppo_clip', 'topr'], got 'clip'" in msg
    assert "loss_agg_mode: must be one of" in msg and "kl_penalty: must be one of" in msg
    assert "target_kl: kl_ctrl adaptive needs a target_kl > 0" in msg
    assert "dual_clip_c: must be > 1 (or null), got 1.0" in msg
    assert "pg_clip_low: must be in (0, 1], got 1.5" in msg
    assert "reward_shaping.norm_std_type: must be one of ['batch', 'group', 'running'], got 'domain'" in msg
    assert "reward_shaping.overlong_penalty.buffer_len: must be <= actor_infer.generating_args.max_new_tokens (32)" in msg
    assert "reward_shaping.difficulty_mask: low (0.9) must be <= high (0.1)" in msg
    assert "reward_shaping.overlong_penalty.buffer: unknown key" in errors("reward_shaping={overlong_penalty: {buffer: 4}}")


# ------------------------------------------------------------------------------------------- pipeline stages


def hand_batch() -> Batch:
    """Two math groups of two responses; the last response is masked (its reward could not be computed)."""
    response_mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [1.0, 1.0, 0.0]])
    old = torch.tensor([[-1.0, -1.0, 0.0], [-1.0, -2.0, -1.0], [-0.5, 0.0, 0.0], [-1.0, -1.0, 0.0]])
    return Batch(
        {
            "response_mask": response_mask,
            "scores": torch.tensor([1.0, 0.0, 1.0, 7.0]),
            "in_loss": torch.tensor([1.0, 1.0, 1.0, 0.0]),
            "group_ids": torch.tensor([0, 0, 1, 1]),
            "old_log_probs": old,
            "ref_log_probs": old - torch.tensor([[0.5, 0.5, 0.0], [0.0, 1.0, 0.5], [1.0, 0.0, 0.0], [3.0, 3.0, 0.0]]),
        },
        {"domain": ["math"] * 4, "correct": [True, False, True, None]},
    )


def test_shape_rewards_applies_the_kl_penalty_and_adapts_its_coefficient():
    pipeline = RLVRPipeline(
        config("add_token_level_kl=true", "kl_penalty=k1", "kl_ctrl=adaptive", "init_kl_coef=0.1", "target_kl=0.1",
               "kl_horizon=40")
    )
    batch, metrics = pipeline.shape_rewards(hand_batch())
    # k1 = old - ref per token: [0.5, 0.5], [0, 1, 0.5], [1]; the masked sample gets nothing
    assert batch["token_level_rewards"].tolist() == [
        [pytest.approx(-0.05), pytest.approx(0.95), 0.0],
        [0.0, pytest.approx(-0.1), pytest.approx(-0.05)],
        [pytest.approx(0.9), 0.0, 0.0],
        [0.0, 0.0, 0.0],
    ]
    # per-response mean KL: 0.5, 0.5, 1.0 -> 2/3 over the 3 samples in the loss; error clipped to +0.2, 4 samples
    assert metrics["kl_penalty/kl"] == pytest.approx(2 / 3)
    assert metrics["kl_penalty/coef"] == 0.1
    assert pipeline.loop.kl_ctrl.value == pytest.approx(0.1 * (1 + 0.2 * 4 / 40))
    assert metrics["reward_shaping/math/samples_in_loss"] == 3.0


@pytest.mark.parametrize("in_loss, expected", [([1.0, 0.0, 0.0, 0.0], 0.5), ([0.0] * 4, 0.0)])
def test_the_kl_penalty_measures_the_mean_over_the_samples_in_the_loss(in_loss, expected):
    """kl_penalty/kl (what the adaptive controller steers by) is the mean over the samples in the loss of each one's
    token-mean KL: one sample, its own; none, 0 rather than 0 / 0."""
    pipeline = RLVRPipeline(config("add_token_level_kl=true", "kl_penalty=k1"))
    batch = hand_batch()
    _, metrics = pipeline.shape_rewards(batch.update({"in_loss": torch.tensor(in_loss)}))
    assert metrics["kl_penalty/kl"] == expected


def test_shape_rewards_masks_by_difficulty_and_advantages_follow_the_mask():
    pipeline = RLVRPipeline(
        config("reward_shaping={difficulty_mask: {low: 0.1, high: 0.9}}", "adv_estimator=rloo", "advantage_clip=0.4")
    )
    batch, _ = pipeline.shape_rewards(hand_batch())
    # group 1 has one valid sample scoring 1 (mean 1 > 0.9): masked; group 0 (mean 0.5) stays
    assert batch["in_loss"].tolist() == [1.0, 1.0, 0.0, 0.0]
    assert pipeline.shaped_scores.tolist() == [1.0, 0.0, 0.0, 0.0]  # the sample table's: 0 out of the loss
    batch = pipeline.compute_advantages(batch)
    # rloo in group 0: 1 - 0 = 1 and 0 - 1 = -1, clipped to 0.4, on the valid tokens only
    expected = torch.tensor([[0.4, 0.4, 0.0], [-0.4, -0.4, -0.4], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    assert torch.equal(batch["advantages"], expected)


def test_compute_advantages_whitens_over_the_samples_in_the_loss():
    pipeline = RLVRPipeline(config("adv_estimator=dr_grpo", "whiten_advantages=true"))
    batch, _ = pipeline.shape_rewards(hand_batch())
    adv = pipeline.compute_advantages(batch)["advantages"]
    # dr_grpo: group 0 -> [0.5, -0.5], group 1 has one valid sample -> 0; tokens [.5,.5,-.5,-.5,-.5,0]
    tokens = [0.5, 0.5, -0.5, -0.5, -0.5, 0.0]
    mean = sum(tokens) / 6
    std = math.sqrt(sum((x - mean) ** 2 for x in tokens) / 5)
    assert adv[0, :2].tolist() == pytest.approx([(0.5 - mean) / std] * 2, rel=1e-5)
    assert adv[2, 0] == pytest.approx((0.0 - mean) / std, rel=1e-5)
    assert adv[3].tolist() == [0.0, 0.0, 0.0] and adv[0, 2] == 0.0


def two_domain_batch() -> Batch:
    """A math group and a code group of three responses each, every response two tokens, all in the loss; code's
    scores are on another scale (fractions of tests passed, times 10). Each domain name is a string of its own, as
    a batch gathered from Ray's workers holds them (equal, not the same object)."""
    math_, code = ("".join(["ma", "th"]) for _ in range(3)), ("".join(["co", "de"]) for _ in range(3))
    return Batch(
        {
            "response_mask": torch.ones(6, 2),
            "scores": torch.tensor([1.0, 0.0, 0.0, 10.0, 2.0, 6.0]),
            "in_loss": torch.ones(6),
            "group_ids": torch.tensor([0, 0, 0, 1, 1, 1]),
        },
        {"domain": [*math_, *code], "correct": [True, False, False, True, False, False]},
    )


def test_a_domains_own_reward_shaping_replaces_the_top_level_block_for_that_domain():
    pipeline = RLVRPipeline(config("reward_shaping={reward_scale: 3.0}", "rewards.code.reward_shaping={reward_clip: 5}"))
    batch, metrics = pipeline.shape_rewards(two_domain_batch())
    final = batch["token_level_rewards"][:, -1].tolist()
    assert final == [3.0, 0.0, 0.0, 5.0, 2.0, 5.0]  # math scaled by the top level; code clipped, not scaled
    assert "reward_shaping/code/clip_frac" in metrics and "reward_shaping/math/clip_frac" not in metrics


def test_advantage_statistics_come_from_each_domain_with_advantage_scope_domain():
    """reinforce_plus_plus whitens returns: over the batch, code's large scores set the scale and every math
    advantage is negative; per domain, each domain's advantages have mean 0 and std 1 of its own."""
    def advantages(*overrides: str) -> torch.Tensor:
        pipeline = RLVRPipeline(config("adv_estimator=reinforce_plus_plus", "gamma=1.0", *overrides))
        batch, _ = pipeline.shape_rewards(two_domain_batch())
        batch = pipeline.compute_advantages(batch)
        return batch["advantages"], advantage_metrics(batch["advantages"], loss_mask(batch), batch.meta["domain"])

    merged, _ = advantages()
    assert (merged[:3] < 0).all()
    written, _ = advantages("advantage_scope=batch")  # as a YAML file gives it: a string of its own
    assert torch.equal(written, merged)
    per_domain, metrics = advantages("advantage_scope=domain")
    for domain, rows in (("math", slice(0, 3)), ("code", slice(3, 6))):
        assert float(per_domain[rows].mean()) == pytest.approx(0.0, abs=1e-6)
        assert float(per_domain[rows].flatten().std()) == pytest.approx(1.0, rel=1e-4)
        assert metrics[f"advantages/{domain}/mean"] == pytest.approx(0.0, abs=1e-6)
    assert per_domain[0, 0] > 0  # math's right answer is above math's mean
    # a domain's own whitening and clipping: dr_grpo centres each group; only code is whitened and clipped
    own, _ = advantages("adv_estimator=dr_grpo", "advantage_scope=domain", "rewards.code.whiten_advantages=true",
                        "rewards.code.advantage_clip=1.0")
    assert own[:3, 0].tolist() == pytest.approx([2 / 3, -1 / 3, -1 / 3])
    # code whitened: [4, -4, 0] over sqrt(64 / 5) is [1.118, -1.118, 0], then clipped to 1
    assert own[3:, 0].tolist() == pytest.approx([1.0, -1.0, 0.0]) and float(own[3:].mean()) == pytest.approx(0.0, abs=1e-6)


def test_per_domain_advantage_settings_need_the_domain_scope():
    msg = errors("rewards.code.whiten_advantages=true", "rewards.math.advantage_clip=-1",
                 "rewards.math.reward_shaping={overlong_penalty: {buffer_len: 64}}")
    assert "rewards.code.whiten_advantages: a domain's own value needs advantage_scope: domain" in msg
    assert "rewards.math.advantage_clip: must be > 0 (or null), got -1.0" in msg
    assert "rewards.math.reward_shaping.overlong_penalty.buffer_len: must be <= actor_infer" in msg


class FakeCluster:
    def __init__(self, name: str) -> None:
        self.name = name
        self.calls = 0

    def call_async_dispatch(self, method: str, batch: Batch) -> list[dict[str, float]]:
        self.calls += 1
        return [{f"{self.name}/loss": 1.0}, {f"{self.name}/loss": 3.0}]  # two ranks

    def call_names(self, method: str) -> list[str]:
        return [f"{self.name}[{rank}].{method}" for rank in range(2)]


def test_critic_warmup_trains_only_the_critic_for_its_steps(monkeypatch):
    pipeline = RLVRPipeline(config(*GAE, "critic_warmup=2"))
    monkeypatch.setattr(pipeline.runtime, "wait_for", lambda refs, names: refs)
    pipeline.runtime.actor_train, pipeline.runtime.critic = FakeCluster("actor"), FakeCluster("critic")
    seen = []
    for step in (1, 2, 3):
        pipeline.loop.step = step
        seen.append(pipeline.train(Batch()))
    assert pipeline.runtime.critic.calls == 3 and pipeline.runtime.actor_train.calls == 1
    assert [m["critic/warmup"] for m in seen] == [1.0, 1.0, 0.0]
    assert "actor/loss" not in seen[0] and seen[2]["actor/loss"] == 2.0  # averaged over the actor's ranks only
    assert seen[2]["critic/loss"] == 2.0


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ((), True),  # the example: 16 prompts x 8 = 128 samples, one mini-batch of 64 x 2
        (("ppo_epochs=2",), False),
        # two optimizer steps in one pass: actor_train computes the second mini-batch's itself before the first
        (("actor_train.training_args.gradient_accumulation_steps=1",), True),
        (("add_token_level_kl=true",), False),  # the KL reward penalty reads them before the update
        (("infer_is_cap=2.0",), False),  # compared with actor_infer's log-probs before the update
        (("async_generation_ratio=1",), False),
        (("use_kl_loss=true",), True),  # the reference's log-probs, not the old ones
    ],
)
def test_old_log_probs_come_from_the_update_when_nothing_reads_them_before_it(overrides, expected):
    assert config(*overrides).config.update_gives_old_log_probs is expected


class LogProbCluster:
    def __init__(self, value: float) -> None:
        self.value = value
        self.calls = 0

    def dispatch(self, method: str, batch: Batch) -> list[torch.Tensor]:
        assert method == "compute_log_probs"
        self.calls += 1
        return [torch.full((2, 3), self.value)]


def test_the_log_prob_stage_skips_actor_train_when_the_update_gives_them():
    for overrides, asks_actor in (((), False), (("ppo_epochs=2",), True)):
        pipeline = RLVRPipeline(config("use_kl_loss=true", *overrides))
        pipeline.runtime.actor_train, pipeline.runtime.reference = LogProbCluster(-1.0), LogProbCluster(-2.0)
        batch = pipeline.compute_log_probs(Batch({"response_mask": torch.ones(2, 3)}))
        assert pipeline.runtime.actor_train.calls == int(asks_actor)
        assert ("old_log_probs" in batch) == asks_actor
        assert pipeline.runtime.reference.calls == 1 and batch["ref_log_probs"].eq(-2.0).all()


def offpolicy_batch() -> Batch:
    """Three responses of three tokens: the third token of the second is padding, the third response is out of the
    loss. Per token, old - infer log-prob: [0.5, -1, 0], [0, 1, pad], [2, 2, 2] (not in the loss)."""
    return Batch(
        {
            "response_mask": torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]),
            "in_loss": torch.tensor([1.0, 1.0, 0.0]),
            "old_log_probs": torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.2, -9.0], [-1.0, -1.0, -1.0]]),
            "infer_log_probs": torch.tensor([[-1.5, -1.0, -0.5], [-0.3, -1.2, 0.0], [-3.0, -3.0, -3.0]]),
        }
    )


def test_importance_weights_are_the_training_policy_over_the_sampling_one():
    """RLVRPipeline.importance_weights on a hand-made batch: weight exp(old - infer) per token (the policy that is
    trained over the one that sampled), truncated at infer_is_cap, its statistics over the tokens in the loss, and
    the staleness in updates. Swapping the two log-probs changes every number checked here."""
    pipeline = RLVRPipeline(config("infer_is_cap=1.5"))
    pipeline.loop.trained_version = 3
    batch, metrics = pipeline.importance_weights(offpolicy_batch(), generated_with=2)
    e = math.exp
    in_loss = [0.5, -1.0, 0.0, 0.0, 1.0]  # old - infer on the 5 tokens in the loss
    assert metrics["offpolicy/staleness"] == 1.0
    assert metrics["offpolicy/is_weight_mean"] == pytest.approx(sum(e(x) for x in in_loss) / 5, rel=1e-6)
    assert metrics["offpolicy/is_weight_max"] == pytest.approx(e(1.0), rel=1e-6)
    assert metrics["offpolicy/is_truncated_frac"] == pytest.approx(2 / 5)  # e^0.5 and e^1 are above 1.5
    # KL(mu || pi_old) by k3 from mu's samples: mean of e^x - 1 - x, x = old - infer
    assert metrics["offpolicy/kl_infer_old"] == pytest.approx(sum(e(x) - 1 - x for x in in_loss) / 5, rel=1e-5)
    # the weights: min(e^x, 1.5) on every response token (the loss's sample mask is applied with the loss)
    expected = [[1.5, e(-1.0), 1.0], [1.0, 1.5, 0.0], [1.5, 1.5, 1.5]]
    assert batch["infer_is_weights"].tolist() == [[pytest.approx(w, rel=1e-6) for w in row] for row in expected]

    # without a cap: the statistics, no truncation and no weights
    uncapped, metrics = RLVRPipeline(config()).importance_weights(offpolicy_batch(), generated_with=0)
    assert "infer_is_weights" not in uncapped and metrics["offpolicy/is_truncated_frac"] == 0.0
    assert metrics["offpolicy/staleness"] == 0.0
    # without inference log-probs (not collected): the staleness alone
    plain = offpolicy_batch().select(range(3))
    plain = Batch({k: plain[k] for k in ("response_mask", "in_loss", "old_log_probs")})
    pipeline.loop.trained_version = 6
    _, metrics = pipeline.importance_weights(plain, generated_with=3)
    assert metrics == {"offpolicy/staleness": 3.0, "offpolicy/staleness_min": 3.0, "offpolicy/staleness_max": 3.0,
                       "offpolicy/partial_frac": 0.0}
    # with the versions that sampled each token (a partial rollout in the second row): those, not generated_with
    versions = torch.tensor([[4, 4, 4], [4, 5, 0], [5, 5, 5]])
    _, metrics = pipeline.importance_weights(plain.update({"token_versions": versions}), generated_with=3)
    assert metrics["offpolicy/staleness_max"] == 2.0 and metrics["offpolicy/staleness_min"] == 1.0
    assert metrics["offpolicy/partial_frac"] == pytest.approx(1 / 3)


class LaunchRecorder:
    """RLVRPipeline's launches and waits, recorded instead of run (a rollout is its launch number)."""

    def __init__(self, pipeline: RLVRPipeline) -> None:
        self.events: list[tuple[str, int]] = []
        self.launched = 0
        self.switches: list[int | None] = []
        """Each launch's switch_at (partial_rollout_token)."""
        pipeline.launch_rollout = self.launch
        pipeline.finish_rollout = self.finish
        pipeline.weights.ensure = lambda: self.events.append(("sync", pipeline.loop.step))

    def launch(self, switch_at: int | None = None) -> Rollout:
        self.launched += 1
        self.events.append(("launch", self.launched))
        self.switches.append(switch_at)
        return Rollout(version=self.launched)

    def finish(self, rollout: Rollout) -> Rollout:
        if rollout.batch is None:
            self.events.append(("finish", rollout.version))
        return Rollout(version=rollout.version, batch=Batch(), metrics={})


@pytest.mark.parametrize("k", [1, 2, 3])
def test_rollouts_are_launched_k_steps_ahead_and_none_past_the_last_step(k):
    pipeline = RLVRPipeline(config(f"async_generation_ratio={k}", "max_steps=5"))
    recorder = LaunchRecorder(pipeline)
    trained = []
    for step in range(1, 6):
        pipeline.loop.step = step
        trained.append(pipeline.rollout().version)
        pipeline.launch_ahead()
        assert len(pipeline.loop.pending_rollouts) == min(k, 5 - step)
    assert trained == [1, 2, 3, 4, 5] and recorder.launched == 5  # each step trains its own, in launch order
    launches = [n for kind, n in recorder.events if kind == "launch"]
    assert launches == [1, 2, 3, 4, 5]
    # step 1 launches its own rollout and the next k; every later step one more, until the last one is out
    first_wait = recorder.events.index(("finish", 1))
    assert recorder.events[:first_wait] == [("launch", 1)]
    assert [n for kind, n in recorder.events[first_wait + 1 : recorder.events.index(("finish", 2))]
            if kind == "launch"] == list(range(2, min(k + 2, 6)))


def test_a_deterministic_run_waits_for_the_rollouts_in_flight_before_each_launch():
    """The sync before a launch then never lands while a rollout generates, and two steps never fill at once."""
    pipeline = RLVRPipeline(config("async_generation_ratio=3", "max_steps=6", "deterministic=true"))
    recorder = LaunchRecorder(pipeline)
    pipeline.loop.step = 1
    pipeline.rollout()
    pipeline.launch_ahead()
    assert recorder.events == [("launch", 1), ("finish", 1), ("launch", 2), ("finish", 2), ("launch", 3),
                               ("finish", 3), ("launch", 4)]
    recorder.events.clear()
    pipeline.loop.step = 2
    pipeline.rollout()  # rollout 2, finished already
    pipeline.launch_ahead()
    assert recorder.events == [("finish", 4), ("launch", 5)]


def test_under_partial_rollout_token_launches_do_not_wait_and_syncs_come_before_each_wait():
    """Each token's weights follow the rule, so nothing waits before a launch; a rollout launched ahead may wait
    for the next version at its switch token, so the driver syncs before it waits for one (each step's rollout,
    and _settle's rollouts in flight). During the critic's warm-up the actor is not updated: no switch then."""
    pipeline = RLVRPipeline(
        config("async_generation_ratio=3", "max_steps=6", "deterministic=true", "partial_rollout_token=5")
    )
    recorder = LaunchRecorder(pipeline)
    pipeline.loop.step = 1
    pipeline.rollout()
    pipeline.launch_ahead()
    assert recorder.events == [("sync", 1), ("launch", 1), ("finish", 1), ("launch", 2), ("launch", 3), ("launch", 4)]
    assert recorder.switches == [None, 5, 5, 5]  # step 1's own rollout is launched with the weights it trains
    recorder.events.clear()
    pipeline.loop.step = 2
    pipeline.rollout()
    pipeline.launch_ahead()
    assert recorder.events == [("sync", 2), ("finish", 2), ("launch", 5)]
    recorder.events.clear()
    pipeline._settle()
    assert recorder.events == [("sync", 2), ("finish", 3), ("finish", 4), ("finish", 5), ("sync", 2)]

    warming = RLVRPipeline(load_run_config(EXAMPLES / "ppo_gae.yaml", [
        "async_generation_ratio=2", "max_steps=6", "deterministic=true", "partial_rollout_token=5", "critic_warmup=1",
    ]))
    recorder = LaunchRecorder(warming)
    for warming.loop.step in (1, 2):
        warming.rollout()
        warming.launch_ahead()
    assert recorder.switches == [None, None, None, 5]  # the rollouts launched at step 1 wait for no update


def test_partial_rollout_token_errors_name_what_it_needs():
    on = ("deterministic=true", "async_generation_ratio=2")
    assert config(*on, "partial_rollout_token=3").config.partial_rule
    assert "partial_rollout_token: must be >= 1" in errors(*on, "partial_rollout_token=0")
    assert "partial_rollout_token: applies to deterministic runs" in errors(
        "async_generation_ratio=2", "partial_rollout_token=3"
    )
    assert "partial_rollout_token: needs async_generation_ratio >= 1" in errors(
        "deterministic=true", "partial_rollout_token=3"
    )
    assert "partial_rollout_token: needs the transformers engine" in errors(
        *on, "partial_rollout_token=3", "actor_infer.strategy_args.strategy_name=vllm"
    )


def test_a_resumed_run_with_fewer_steps_ahead_or_an_earlier_end_launches_nothing_more_until_it_catches_up():
    """A checkpoint of a run further ahead, resumed with a smaller async_generation_ratio or an earlier max_steps:
    the restored rollouts are trained in turn, and nothing is launched past either bound."""
    cases = (  # (overrides, the first step resumed, rollouts held, launches counted after each step)
        (("async_generation_ratio=2", "max_steps=20"), 5, 4, [0, 0, 1]),  # steps 5-8 held, 2 ahead: one at step 7
        (("async_generation_ratio=3", "max_steps=4"), 3, 4, [0, 0]),  # steps 3-6 held, the run ends at 4
    )
    for overrides, first, held, launched in cases:
        pipeline = RLVRPipeline(config(*overrides))
        recorder = LaunchRecorder(pipeline)
        pipeline.loop.pending_rollouts = [Rollout(version=v, batch=Batch(), metrics={}) for v in range(held)]
        counts = []
        for pipeline.loop.step in range(first, first + len(launched)):
            pipeline.rollout()
            pipeline.launch_ahead()
            counts.append(recorder.launched)
        assert counts == launched, overrides


def test_async_generation_ratio_is_a_whole_number_of_steps():
    assert config("async_generation_ratio=3").config.async_steps == 3
    assert config().config.async_steps == 0
    for bad in ("1.5", "-1"):
        assert "async_generation_ratio: must be a whole number >= 0" in errors(f"async_generation_ratio={bad}")


def test_sequence_weights_and_geometric_rejection_on_the_pipeline_batch():
    """offpolicy_correction at the response level on the same batch: old - infer sums to -0.5 and 1 on the two
    responses in the loss (means -1/6 and 1/2). Sequence weights min(e^sum, 2) on every token of a response; the
    geometric rejection with bounds [1/1.5, 1.5] keeps e^(-1/6) ~ 0.85 and rejects e^0.5 ~ 1.65, and loss_mask
    then leaves the rejected response's tokens out, so the loss and its normaliser never see them."""
    cfg = config("offpolicy_correction={is_level: sequence, is_cap: 2.0, rs_level: geometric, rs_upper: 1.5}")
    batch, metrics = RLVRPipeline(cfg).importance_weights(offpolicy_batch(), generated_with=0)
    e = math.exp
    expected = [[e(-0.5)] * 3, [2.0, 2.0, 0.0], [2.0] * 3]  # the third (out of the loss): e^6 -> 2
    assert batch["infer_is_weights"].tolist() == [[pytest.approx(w, rel=1e-6) for w in row] for row in expected]
    assert batch["offpolicy_keep"].tolist() == [[1.0] * 3, [0.0] * 3, [0.0] * 3]
    assert loss_mask(batch).tolist() == [[1.0] * 3, [0.0] * 3, [0.0] * 3]
    # over the 5 tokens and 2 responses in the loss: the second response's 2 tokens truncated (e^1 > 2) and rejected
    assert metrics["offpolicy/is_truncated_frac"] == pytest.approx(2 / 5)
    assert metrics["offpolicy/is_truncated_seq_frac"] == 0.5
    assert metrics["offpolicy/rs_rejected_frac"] == pytest.approx(2 / 5)
    assert metrics["offpolicy/rs_rejected_seq_frac"] == 0.5
    # the token-level metrics are the same whatever the correction
    token = RLVRPipeline(config("infer_is_cap=2.0")).importance_weights(offpolicy_batch(), generated_with=0)[1]
    assert {k: metrics[k] for k in ("offpolicy/is_weight_mean", "offpolicy/kl_infer_old")} == {
        k: token[k] for k in ("offpolicy/is_weight_mean", "offpolicy/kl_infer_old")
    }


def test_infer_is_cap_is_the_token_level_shorthand_and_the_correction_keys_are_checked():
    def cfg(*overrides: str):
        return config(*overrides).config

    assert cfg("infer_is_cap=1.5").correction == cfg("offpolicy_correction={is_level: token, is_cap: 1.5}").correction
    assert not cfg().needs_infer_log_probs
    assert cfg("offpolicy_correction={rs_level: token}").needs_infer_log_probs
    assert cfg("offpolicy_correction={rs_level: sequence, is_cap: 4}").correction.rejection_bounds == (0.25, 4.0)
    msg = errors("infer_is_cap=2.0", "offpolicy_correction={is_level: sequence}")
    assert "infer_is_cap: is the shorthand for offpolicy_correction.is_level token; set one or the other" in msg
    msg = errors("offpolicy_correction={is_level: seq}")
    assert "offpolicy_correction.is_level: expected one of ['token', 'sequence', None], got 'seq'" in msg
    msg = errors("offpolicy_correction={is_cap: 0, rs_level: geometric, rs_upper: 1.001, rs_lower: 1.2}")
    assert "offpolicy_correction.is_cap: must be > 0, got 0" in msg
    assert "offpolicy_correction.rs_lower: must be below the upper bound 1.001, got 1.2" in msg
    assert "offpolicy_correction.rs_upper: must be > 0" in errors("offpolicy_correction={rs_level: token, rs_upper: 0}")
    # the upper bound defaults to is_cap: an is_cap of 0 is reported, not divided by
    assert "offpolicy_correction.is_cap: must be > 0, got 0" in errors("offpolicy_correction={rs_level: token, is_cap: 0}")


# ------------------------------------------------------------------------------------------- critic objective


def critic_batch() -> Batch:
    """Three responses of three tokens (the second has two, the third is out of the loss) with the values that
    computed the advantages (`values`) and the returns."""
    return Batch(
        {
            "prompt_ids": torch.ones(3, 2, dtype=torch.long),
            "prompt_mask": torch.ones(3, 2),
            "response_ids": torch.ones(3, 3, dtype=torch.long),
            "response_mask": torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]),
            "in_loss": torch.tensor([1.0, 1.0, 0.0]),
            "values": torch.tensor([[0.0, 0.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]),
            "returns": torch.tensor([[1.0, 0.0, 0.0], [2.0, 0.0, 5.0], [0.0, 0.0, 0.0]]),
        }
    )


# The critic's new estimates, and per token 0.5 * max((v - R)^2, (v_old + clip(v - v_old, -0.2, 0.2) - R)^2):
# row 0: 0.5 -> max(.25, .64) clipped; 0.1 -> .01 either way (a tie is not clipped); -0.5 -> max(.25, .04)
# row 1: 1.5 -> max(.25, .64) clipped; 0.9 -> .81 either way; the third token is padding; row 2 is out of the loss.
NEW_VALUES = [[0.5, 0.1, -0.5], [1.5, 0.9, 7.0], [3.0, 3.0, 3.0]]
TOKEN_LOSS = [[0.32, 0.005, 0.125], [0.32, 0.405]]


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", sum(TOKEN_LOSS[0] + TOKEN_LOSS[1]) / 5),
        ("seq-mean-token-mean", (sum(TOKEN_LOSS[0]) / 3 + sum(TOKEN_LOSS[1]) / 2) / 2),
    ],
    ids=["token-mean", "seq-mean-token-mean"],
)
def test_critic_objective_is_the_clipped_value_loss_aggregated_like_the_policys(mode, expected):
    cfg = config(f"loss_agg_mode={mode}").config
    batch = critic_batch()
    norm = batch_normalizer(loss_mask(batch), mode)
    values = torch.tensor(NEW_VALUES, requires_grad=True)
    loss, parts = value_objective(values, batch, cfg, 0.2, norm, token_norm=5.0)
    assert float(loss.detach()) == pytest.approx(expected, rel=1e-5)
    assert parts["value_loss"] == pytest.approx(expected, rel=1e-5)
    assert parts["value_clipfrac"] == pytest.approx(2 / 5)  # a fraction of the tokens in the loss, in every mode
    loss.backward()
    # No gradient where the clipped term is the larger (it is constant in v past the clip), on padding or out of
    # the loss; token-mean elsewhere: (v - R) / 5
    grad = values.grad.tolist()
    assert grad[0][0] == 0.0 and grad[1][0] == 0.0 and grad[1][2] == 0.0 and grad[2] == [0.0, 0.0, 0.0]
    if mode == "token-mean":
        assert grad[0][1:] == [pytest.approx(0.1 / 5), pytest.approx(-0.5 / 5)]
        assert grad[1][1] == pytest.approx(0.9 / 5)
    # in micro-batches with the mini-batch's normalisers: the same loss and clip fraction, summed
    total, clipfrac = 0.0, 0.0
    for rows in ([0], [1, 2]):
        part, diag = value_objective(values[rows].detach(), batch.select(rows), cfg, 0.2, norm, token_norm=5.0)
        total, clipfrac = total + float(part), clipfrac + diag["value_clipfrac"]
    assert total == pytest.approx(expected, rel=1e-5) and clipfrac == pytest.approx(2 / 5)
    # value_clip unset: the plain squared error, nothing clipped
    plain, parts = value_objective(values.detach(), batch, cfg, None, norm, token_norm=5.0)
    assert parts["value_clipfrac"] == 0.0
    if mode == "token-mean":
        assert float(plain) == pytest.approx((0.125 + 0.005 + 0.125 + 0.125 + 0.405) / 5, rel=1e-5)


class FixedValues(torch.nn.Module):
    """A value model whose estimate at the state before response token t is a fixed table's (B, R) entry."""

    def __init__(self, values: list[list[float]]) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(torch.tensor(values))

    def forward(self, input_ids, attention_mask, position_ids):
        batch, width = input_ids.shape
        before = torch.zeros(batch, width - self.table.shape[1] - 1)
        logits = torch.cat([before, self.table, torch.zeros(batch, 1)], dim=1).unsqueeze(-1)
        return type("Output", (), {"logits": logits})()


def test_the_critic_workers_objective_reads_its_model_and_its_sections_value_clip():
    cfg = config("adv_estimator=gae", "critic={value_clip: 0.2}").config
    worker = CriticWorker.__new__(CriticWorker)  # the objective alone: no Ray actor, no DeepSpeed engine
    worker.cfg, worker.section = cfg, cfg.critic
    worker.strategy = type("Strategy", (), {"engine": FixedValues(NEW_VALUES)})()
    batch = critic_batch()
    norm = batch_normalizer(loss_mask(batch), cfg.loss_agg_mode)
    loss, parts = worker.objective(batch, norm, token_norm=5.0)
    want, want_parts = value_objective(torch.tensor(NEW_VALUES), batch, cfg, 0.2, norm, 5.0)
    assert float(loss.detach()) == pytest.approx(float(want)) and parts == pytest.approx(want_parts)
    assert parts["value_clipfrac"] == pytest.approx(2 / 5)
    loss.backward()
    assert worker.strategy.engine.table.grad.abs().sum() > 0


# ------------------------------------------------------------------------------------------- actor objective


def objective_inputs(seed: int, n: int = 8, width: int = 6, vocab: int = 5):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, width, vocab, generator=gen, requires_grad=True)
    tokens = torch.randint(0, vocab, (n, width), generator=gen)
    lengths = torch.randint(1, width + 1, (n,), generator=gen)
    mask = (torch.arange(width) < lengths.unsqueeze(-1)).float()
    with torch.no_grad():
        current, _ = log_probs_from_logits(logits, tokens)
    batch = Batch(
        {
            "response_mask": mask,
            "in_loss": torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0]),
            "old_log_probs": current + torch.randn(n, width, generator=gen) * 0.3,
            "ref_log_probs": current + torch.randn(n, width, generator=gen) * 0.3,
            "advantages": torch.randn(n, width, generator=gen) * mask,
        }
    )
    return logits, tokens, batch


@pytest.mark.parametrize("mode", LOSS_AGGREGATIONS.names())
@pytest.mark.parametrize("loss", POLICY_LOSSES.names())
def test_actor_objective_gives_the_same_gradient_in_micro_batches(mode, loss):
    cfg = config(
        f"loss_agg_mode={mode}", f"policy_loss={loss}", "pg_clip_high=0.28", "dual_clip_c=3",
        "use_kl_loss=true", "kl_loss_coef=0.1", "entropy_loss_coef=0.01",
    ).config
    logits, tokens, batch = objective_inputs(0)
    norm = batch_normalizer(loss_mask(batch), mode)

    def gradient(pieces: list[slice]) -> torch.Tensor:
        logits.grad = None
        for rows in pieces:
            log_probs, entropy = log_probs_from_logits(logits[rows], tokens[rows], with_entropy=True)
            micro = batch.select(range(8)[rows])
            objective, parts = policy_objective(log_probs, entropy, micro, cfg, norm)
            objective.backward()
        assert {"pg_loss", "clipfrac", "approx_kl", "entropy", "kl_loss"} <= set(parts)
        return logits.grad.clone()

    whole = gradient([slice(0, 8)])
    assert whole.abs().sum() > 0
    assert torch.allclose(whole, gradient([slice(0, 3), slice(3, 6), slice(6, 8)]), atol=1e-6)
    assert torch.allclose(whole, gradient([slice(i, i + 1) for i in range(8)]), atol=1e-6)


@pytest.mark.parametrize("mode", LOSS_AGGREGATIONS.names())
def test_rejected_tokens_leave_the_objective_and_its_normaliser(mode):
    """The off-policy rejection (`offpolicy_keep`) does to the actor's objective what taking the tokens out of the
    response mask does: the same loss, the same gradient, under every aggregation (normaliser included); and the
    gradient differs from the one without the rejection."""
    cfg = config(f"loss_agg_mode={mode}", "use_kl_loss=true", "kl_loss_coef=0.1").config
    logits, tokens, batch = objective_inputs(1)
    keep = torch.ones_like(batch["response_mask"])
    keep[0, :2] = 0.0  # two tokens of the first response
    keep[3] = 0.0  # the whole fourth
    rejected = batch.update({"offpolicy_keep": keep})
    trimmed = batch.update({"response_mask": batch["response_mask"] * keep})

    def run(b: Batch) -> tuple[float, torch.Tensor]:
        logits.grad = None
        log_probs, entropy = log_probs_from_logits(logits, tokens, with_entropy=True)
        objective, _ = policy_objective(log_probs, entropy, b, cfg, batch_normalizer(loss_mask(b), mode))
        objective.backward()
        return float(objective), logits.grad.clone()

    (loss_r, grad_r), (loss_t, grad_t), (_, grad_all) = run(rejected), run(trimmed), run(batch)
    assert loss_r == pytest.approx(loss_t, rel=1e-6) and torch.allclose(grad_r, grad_t, atol=1e-7)
    assert grad_r[3].abs().sum() == 0 and grad_all[3].abs().sum() > 0
    assert not torch.allclose(grad_r, grad_all, atol=1e-6)


def test_entropy_outside_the_graph_when_only_logged():
    """With entropy_loss_coef 0 actor_train computes the entropy outside autograd: same values, same gradient,
    and no (B, R, vocabulary) product kept for the backward pass."""
    cfg = config("entropy_loss_coef=0.0").config
    logits, tokens, batch = objective_inputs(0)
    norm = batch_normalizer(loss_mask(batch), cfg.loss_agg_mode)
    results = {}
    for entropy_grad in (True, False):
        logits.grad = None
        log_probs, entropy = log_probs_from_logits(logits, tokens, with_entropy=True, entropy_grad=entropy_grad)
        assert (entropy.grad_fn is not None) == entropy_grad
        objective, parts = policy_objective(log_probs, entropy, batch, cfg, norm)
        objective.backward()
        results[entropy_grad] = (entropy.detach(), parts["entropy"], logits.grad.clone())
    assert torch.equal(results[True][0], results[False][0])
    assert float(results[True][1]) == float(results[False][1])
    assert results[True][2].abs().sum() > 0
    assert torch.equal(results[True][2], results[False][2])


def test_a_group_of_one_is_refused_where_the_estimator_needs_a_group():
    """The stated rule for groups of one: the group estimators give such a response advantage 0 (a group left
    with one valid response by masking too, tests/test_algorithms.py), so a config whose every group has one
    response, which would learn nothing, is refused; the estimators without a group baseline take it."""
    one = ["num_return_sequences_in_group=1", "actor_train.training_args.per_device_train_batch_size=8"]
    for estimator in ("grpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline"):
        assert "num_return_sequences_in_group: adv_estimator " + estimator in errors(*one, f"adv_estimator={estimator}")
    assert config(*one, "adv_estimator=reinforce_plus_plus").config.num_return_sequences_in_group == 1

"""Item 3 of `make bench`: actor_train's update against a bare torch forward/backward/AdamW loop on the same batch.

    python -m benchmarks.bench_train [--repeats 3] [--calls 3] [--quick]

The batch is one RL step of bench_trl's config, made once: its first `rollout_batch_size` prompts, responses
sampled from a fixed seed (bench_generate's bare loop), math_rule scores, GRPO advantages (the registry's `grpo`)
and the old log-probs. Each way trains on that same batch `--calls` times per repetition, after one untimed call:

* bare: `AutoModelForCausalLM` and `torch.optim.AdamW` in this process; per mini-batch (the config's
  per_device_train_batch_size x gradient_accumulation_steps) a forward pass over prompt + response, the PPO-clip
  loss averaged per response then over responses (our seq-mean-token-mean), backward, gradient clipping, a step;
* worker: `ActorTrainWorker` built in this process (DeepSpeed engine, `train_step`);
* ray: the same worker as a Ray actor started as `RLVRPipeline` starts it, called from here.

Also the log-probs stage: `compute_log_probs` of the worker against a bare no-grad forward in micro-batches of
the config's infer_batch_size. Throughput is samples per second. All use actor_train's `torch_threads`. Afterwards
one in-process `train_step` runs under cProfile.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.bench_generate import Bare, profile_top, setup_batch
from benchmarks.summary import Comparison, Section, in_turn, print_section


def make_batch(cfg, tokenizer, prompts):
    """One RL step's training batch, as the pipeline hands it to actor_train.train_step."""
    from roll_pipeline.api import (
        ADVANTAGES,
        Batch,
        MathRuleScorer,
        SamplingDistribution,
        batched_log_probs,
        place_at_last_token,
        truncate_at_eos,
    )

    n = cfg.num_return_sequences_in_group
    bare = Bare(cfg, tokenizer, prompts)
    with torch.inference_mode():
        torch.manual_seed(0)
        out = bare.model.generate(input_ids=bare.ids, attention_mask=bare.mask, generation_config=bare.gen)
    responses, response_mask, _ = truncate_at_eos(
        out[:, bare.ids.shape[1] :], bare.eos, tokenizer.pad_token_id
    )
    scorer = MathRuleScorer(**cfg.rewards["math"].options)
    truths = [row["ground_truth"] for row in math_rows_of(cfg)[: len(prompts)] for _ in range(n)]
    texts = [
        tokenizer.decode(r[m > 0].tolist(), skip_special_tokens=True)
        for r, m in zip(responses, response_mask, strict=True)
    ]
    scores = torch.tensor([scorer.score(t, g).score for t, g in zip(texts, truths, strict=True)])
    batch = Batch(
        {
            "prompt_ids": bare.ids.repeat_interleave(n, 0),
            "prompt_mask": bare.mask.repeat_interleave(n, 0),
            "response_ids": responses,
            "response_mask": response_mask,
            "in_loss": torch.ones(len(responses)),
            "group_ids": torch.arange(len(prompts)).repeat_interleave(n),
        }
    )
    advantages, _ = ADVANTAGES.get("grpo")(
        token_level_rewards=place_at_last_token(scores, response_mask),
        response_mask=response_mask,
        group_ids=batch["group_ids"],
        in_loss=batch["in_loss"],
    )
    sampling = SamplingDistribution.of(cfg.actor_infer.generating_args)
    old = batched_log_probs(bare.model, batch, cfg.actor_train.infer_batch_size, sampling)
    return batch.update({"old_log_probs": old, "advantages": advantages})


def math_rows_of(cfg):
    from roll_pipeline.api import load_rows

    return [row for f in cfg.data.train_files for row in load_rows(f)]


class BareTrainer:
    """The plain loop a person would write for the same update (see the module docstring)."""

    def __init__(self, cfg) -> None:
        from transformers import AutoModelForCausalLM

        ta = cfg.actor_train.training_args
        self.model = AutoModelForCausalLM.from_pretrained(cfg.pretrain, dtype=torch.float32)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=ta.learning_rate,
            betas=(ta.adam_beta1, ta.adam_beta2),
            weight_decay=ta.weight_decay,
        )
        self.micro = ta.per_device_train_batch_size
        self.mini = ta.minibatch_size
        self.max_grad_norm = ta.max_grad_norm
        self.epochs = cfg.ppo_epochs
        self.clip = cfg.pg_clip
        self.temperature = cfg.actor_infer.generating_args.temperature
        self.infer_batch_size = cfg.actor_train.infer_batch_size

    def _log_probs(self, t: dict[str, torch.Tensor]) -> torch.Tensor:
        ids = torch.cat([t["prompt_ids"], t["response_ids"]], dim=1)
        attention = torch.cat([t["prompt_mask"], t["response_mask"].long()], dim=1)
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        width = t["response_ids"].shape[1]
        logits = self.model(input_ids=ids, attention_mask=attention, position_ids=positions).logits
        logp = torch.log_softmax(logits[:, -width - 1 : -1].float() / self.temperature, dim=-1)
        return logp.gather(-1, t["response_ids"].unsqueeze(-1)).squeeze(-1)

    def train(self, batch) -> int:
        self.model.train()
        tensors = batch.tensors
        n = len(batch)
        for _ in range(self.epochs):
            for lo in range(0, n, self.mini):
                hi = min(lo + self.mini, n)
                self.optimizer.zero_grad(set_to_none=True)
                for mlo in range(lo, hi, self.micro):
                    t = {k: v[mlo : min(mlo + self.micro, hi)] for k, v in tensors.items()}
                    ratio = torch.exp(self._log_probs(t) - t["old_log_probs"])
                    adv = t["advantages"]
                    per_token = -torch.min(ratio * adv, ratio.clamp(1 - self.clip, 1 + self.clip) * adv)
                    mask = t["response_mask"]
                    per_response = (per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)
                    (per_response.sum() / (hi - lo)).backward()
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
                self.optimizer.step()
        return n * self.epochs

    @torch.no_grad()
    def log_probs(self, batch) -> int:
        self.model.eval()
        n = len(batch)
        for lo in range(0, n, self.infer_batch_size):
            self._log_probs({k: v[lo : lo + self.infer_batch_size] for k, v in batch.tensors.items()})
        return n


def rate(call, calls: int) -> float:
    """Samples per second over `calls` calls of `call() -> samples`."""
    start = time.perf_counter()
    samples = sum(call() for _ in range(calls))
    return samples / (time.perf_counter() - start)


def measure(repeats: int = 3, calls: int = 3, quick: bool = False, log=print) -> Section:
    import ray
    import torch.distributed as dist

    from roll_pipeline.api import ActorTrainWorker, Cluster, worker_env

    start_wall = time.perf_counter()
    figures: dict[str, list[float]] = {k: [] for k in ("bare", "worker", "ray", "bare_lp", "worker_lp")}
    saved_env = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="roll-bench-train-") as tmp:
        cfg, tokenizer, prompts = setup_batch(Path(tmp), quick)
        section_cfg = cfg.actor_train
        batch = make_batch(cfg, tokenizer, prompts)
        steps = 10**6  # the LR schedule is constant; a large count keeps any decay out of the figures
        worker = ActorTrainWorker(
            name="actor_train", rank=0, world_size=1, pipeline_config=cfg, total_optimizer_steps=steps
        )
        cluster = None
        try:
            worker.initialize()
            torch.set_num_threads(section_cfg.torch_threads)
            bare = BareTrainer(cfg)
            ray.init(
                address="local",
                num_cpus=max(2, int(section_cfg.num_cpus_per_worker)),
                include_dashboard=False,
                log_to_driver=False,
            )
            cluster = Cluster(
                "actor_train",
                ActorTrainWorker,
                world_size=1,
                num_cpus=section_cfg.num_cpus_per_worker,
                num_gpus=0,
                worker_kwargs={"pipeline_config": cfg, "total_optimizer_steps": steps},
                env_vars=worker_env(section_cfg.torch_threads),
            )
            cluster.init_process_group()
            ray.get(cluster.call_async("initialize"))
            remote = cluster.workers[0]

            def in_process() -> int:
                worker.train_step(batch)
                return len(batch)

            def via_ray() -> int:
                ray.get(remote.train_step.remote(batch))
                return len(batch)

            def worker_lp() -> int:
                worker.compute_log_probs(batch)
                return len(batch)

            def bare_train() -> int:
                return bare.train(batch)

            def bare_lp() -> int:
                return bare.log_probs(batch)

            for call in (bare_train, in_process, via_ray, bare_lp, worker_lp):
                call()  # warm-up, untimed
            for r in range(repeats):
                b, ours = in_turn(
                    r,
                    lambda: (rate(bare_train, calls), rate(bare_lp, calls)),
                    lambda: (rate(in_process, calls), rate(via_ray, calls), rate(worker_lp, calls)),
                )
                for key, value in zip(
                    ("bare", "bare_lp", "worker", "ray", "worker_lp"), (*b, *ours), strict=True
                ):
                    figures[key].append(value)
                log(
                    f"  [train] repetition {r + 1}: bare {b[0]:.1f} samples/s, worker {ours[0]:.1f}, ray {ours[1]:.1f}; "
                    f"log-probs bare {b[1]:.1f}, worker {ours[2]:.1f}"
                )
            profile = profile_top(in_process)
        finally:
            if cluster is not None:
                cluster.shutdown()
            if ray.is_initialized():
                ray.shutdown()
            if dist.is_initialized():
                dist.destroy_process_group()
            os.environ.clear()
            os.environ.update(saved_env)
    ta = section_cfg.training_args
    mini = ta.minibatch_size
    section = Section(
        title="3. Training overhead",
        setup=(
            f"One RL step's batch of {len(batch)} samples ({cfg.rollout_batch_size} prompts x "
            f"{cfg.num_return_sequences_in_group} responses of up to {cfg.actor_infer.generating_args.max_new_tokens} "
            f"tokens), {len(batch) // mini} optimizer steps of {mini} samples each, {cfg.ppo_epochs} pass, "
            f"{section_cfg.torch_threads} torch threads, float32, DeepSpeed ZeRO stage "
            f"{section_cfg.strategy_args.strategy_config.get('zero_optimization', {}).get('stage', 0)} on our side; "
            f"{calls} timed calls per figure after an untimed warm-up. `bare`: a plain torch forward / PPO-clip loss / "
            "backward / clip / AdamW loop in this process. `ActorTrainWorker`: the worker class in this process "
            "(`train_step`, `compute_log_probs`). `via Ray`: the same worker as a Ray actor, called from this "
            "process. See benchmarks/bench_train.py."
        ),
        comparisons=[
            Comparison(
                "actor_train train_step",
                "samples/s",
                "ActorTrainWorker",
                tuple(figures["worker"]),
                "bare loop",
                tuple(figures["bare"]),
                higher_is_better=True,
            ),
            Comparison(
                "actor_train train_step via Ray",
                "samples/s",
                "ActorTrainWorker via Ray",
                tuple(figures["ray"]),
                "bare loop",
                tuple(figures["bare"]),
                higher_is_better=True,
            ),
            Comparison(
                "actor_train compute_log_probs",
                "samples/s",
                "ActorTrainWorker",
                tuple(figures["worker_lp"]),
                "bare no-grad forward",
                tuple(figures["bare_lp"]),
                higher_is_better=True,
            ),
        ],
    )
    section.details.append(
        "One in-process `train_step` call under cProfile (its top functions by cumulative "
        "time; `share` is of the whole call):\n\n" + profile
    )
    section.wall_s = time.perf_counter() - start_wall
    return section


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="bench_trl's tiny batch, for a smoke run")
    args = parser.parse_args(argv)
    section = measure(args.repeats, args.calls, args.quick)
    print_section(section)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

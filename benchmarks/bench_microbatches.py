"""The train stage with micro-batches of fixed rows against micro-batches cut by a token budget, padded or packed
(issue 80, items 2 and 4): seconds per train_step, the largest micro-batch in tokens run (padding included: what a
forward's activations grow with), and the share of the forwards' tokens that were padding (`actor/pad_frac`).

    python -m benchmarks.bench_microbatches [--repeats 5] [--budget 2048] [--prompt-tokens 32 96]
    python -m benchmarks.bench_microbatches --source tool_math|code [--rollouts 2] [--set KEY=VALUE ...]

The batch is synthetic, with a stated shape: `--prompts` prompts of `--prompt-tokens` MIN-MAX tokens (uniform),
each with `--group` responses whose lengths are log-normal (median 48 tokens, sigma 0.9; cut to 8-384), random
token ids, random advantages, old log-probs = the model's. One ActorTrainWorker (DeepSpeed, one rank) in this
process trains it in one optimizer step of all its rows, learning rate 1e-9 (the weights barely move; the work does
not depend on them). The sides are the same worker with `training_args` changed between calls:

* fixed: per_device_train_batch_size 8 rows a micro-batch, each padded to the batch's longest prompt and response;
* budget: training_args.max_tokens_per_microbatch = `--budget`, as the product plans it (microbatches.budget_plan:
  of the two plans below, the one whose forwards run fewer tokens);
* by_length and together: the worker's micro_batches forced to one of those plans (a subclass here);
  by_length: the same budget, rows by length alone (least padding; a prompt shared by rows of one micro-batch is
  still run once, forward.response_logits);
  together: the same budget, a prompt's rows next to each other (its prompt run once for all of them);
* packed: use_sequence_packing, 8 rows a micro-batch packed into one row of the tokens they read, attention by
  sdpa row by row (roll_core/models/row_attention.py: what a section that packs loads);
* packed_budget: use_sequence_packing with the budget, which then counts the tokens read;
* packed_mask: as packed, through transformers' sdpa with its block-diagonal mask (attention computed over the
  whole packed row, most of it masked).

`--source tool_math` and `--source code` train on real rollouts instead: `--rollouts` steps' batches generated
by the embedded models as the examples run them (examples/tool_math.yaml: two-turn trajectories of the tool model,
the python tool's output inside the response, out of the loss by tool_mask; examples/math_code.yaml with the code
domain alone), collected by an RLVRPipeline started in this process and shut down before the timing starts, with
the example's rows, prompts and responses; advantages random, as above. `--set KEY=VALUE` changes the example
(e.g. `actor_infer.generating_args.max_new_tokens=128` for longer code answers).

Memory per side: the bytes autograd kept for the backward over the largest micro-batch (torch's saved-tensor hooks,
each storage once, the weights left out: the activations, which is what a side changes; weights, gradients and
optimizer states are the same on every side), in MiB.

The worker loads its model as a packing section does (sdpa row by row); on padded micro-batches that kernel is sdpa
itself (tests/test_packing.py), so every side but packed_mask runs the kernels the product runs.

Each repetition runs every side once, in an order reversed every other repetition, after waiting for a quiet
machine; the load is printed per side. Then per side: median and range of seconds per call, the largest
micro-batch and pad_frac, and the memory kept. The process's resident memory did not separate the sides on this CPU
(the allocator keeps what an earlier call freed). On a GPU the saving would follow the padding share (an estimate,
not measured here): attention and the MLPs run on every padded token.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

from benchmarks.harness import machine, wait_for_quiet
from benchmarks.summary import spread, turn_order

ROOT = Path(__file__).resolve().parent.parent
SIDES = ("fixed", "budget", "by_length", "together", "packed", "packed_budget", "packed_mask")


def synthetic_batch(model, prompts: int, group: int, prompt_range: tuple[int, int] = (32, 96), seed: int = 0):
    """Left-padded prompts and right-padded responses of the stated shape; advantages and old log-probs."""
    from roll_pipeline.api import Batch, SamplingDistribution, batched_log_probs

    g = torch.Generator().manual_seed(seed)
    p_lens = torch.randint(prompt_range[0], prompt_range[1] + 1, (prompts,), generator=g).tolist()
    r_lens = (48 * torch.exp(0.9 * torch.randn(prompts * group, generator=g))).round().clamp(8, 384).long().tolist()
    rows = prompts * group
    width_p, width_r = max(p_lens), max(r_lens)
    prompt_ids = torch.zeros(rows, width_p, dtype=torch.long)
    prompt_mask = torch.zeros(rows, width_p, dtype=torch.long)
    response_ids = torch.zeros(rows, width_r, dtype=torch.long)
    response_mask = torch.zeros(rows, width_r)
    for k in range(prompts):
        ids = torch.randint(5, 400, (p_lens[k],), generator=g)
        for j in range(group):
            i = k * group + j
            prompt_ids[i, width_p - p_lens[k] :] = ids
            prompt_mask[i, width_p - p_lens[k] :] = 1
            response_ids[i, : r_lens[i]] = torch.randint(5, 400, (r_lens[i],), generator=g)
            response_mask[i, : r_lens[i]] = 1
    batch = Batch({
        "prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "response_ids": response_ids,
        "response_mask": response_mask, "advantages": torch.randn(rows, width_r, generator=g) * response_mask,
        "in_loss": torch.ones(rows),
    })
    with torch.no_grad():
        old = batched_log_probs(model, batch, 8, SamplingDistribution())
    return batch.update({"old_log_probs": old}), p_lens, r_lens


#: Each real source: the example and the one domain of it that generates.
EXAMPLE_OF = {"tool_math": ("tool_math.yaml", "tool_math"), "code": ("math_code.yaml", "code")}


def one_domain(name: str, domain: str, folder: Path) -> Path:
    """The example `name` with `domain` alone (its reward, data files and whole share), written to `folder` with
    its paths made absolute."""
    import yaml

    example = ROOT / "examples" / name
    cfg = yaml.safe_load(example.read_text())
    keep = lambda files: [str((example.parent / f).resolve()) for f in files if Path(f).stem.startswith(domain)]  # noqa: E731
    cfg |= {"pretrain": str((example.parent / cfg["pretrain"]).resolve()), "rewards": {domain: cfg["rewards"][domain]},
            "domain_interleave_probs": {domain: 1.0}}
    cfg["data"] |= {"train_files": keep(cfg["data"]["train_files"]), "val_files": keep(cfg["data"]["val_files"])}
    path = folder / name
    path.write_text(yaml.safe_dump(cfg))
    return path


def rollout_batch(source: str, rollouts: int, changes: list[str]):
    """`rollouts` steps' rollouts of the example `source` names, generated by a pipeline started here (and shut
    down): the train step's tensors of every row, and the example's config."""
    import tempfile

    from roll_pipeline.api import Batch, RLVRPipeline, load_run_config

    name, domain = EXAMPLE_OF[source]
    folder = Path(tempfile.mkdtemp(prefix="bench-microbatches-"))
    resolved = load_run_config(one_domain(name, domain, folder), [
        "validation.eval_at_start=false", f"output_dir={folder / 'run'}", f"tracking.tracking_uri=sqlite:///{folder}/mlflow.db",
        *changes,
    ])
    pipeline = RLVRPipeline(resolved)
    keys = ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "tool_mask")
    try:
        pipeline.setup()
        batches = []
        for step in range(1, rollouts + 1):
            pipeline.loop.step = step
            rollout = pipeline.rollout().batch
            batches.append(Batch({k: rollout[k] for k in keys if k in rollout.tensors}))
    finally:
        pipeline.shutdown()
    return Batch.concat(batches), resolved.config


def prepared(model, batch, seed: int = 0):
    """A rollout's batch as the train step takes it: random advantages on the response tokens, every row in the
    loss, and the model's own old log-probs."""
    from roll_pipeline.api import SamplingDistribution, batched_log_probs

    g = torch.Generator().manual_seed(seed)
    mask = batch["response_mask"]
    batch = batch.update({"advantages": torch.randn(mask.shape, generator=g) * mask, "in_loss": torch.ones(len(batch))})
    with torch.no_grad():
        old = batched_log_probs(model, batch, 8, SamplingDistribution())
    return batch.update({"old_log_probs": old})


class KeptBytes:
    """The most bytes autograd kept for the backward over one forward of `model` (saved-tensor hooks, each storage
    once, the model's parameters left out), across the forwards run inside `with self:`."""

    def __init__(self, model) -> None:
        self.weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.current: dict[int, int] = {}
        self.most = 0
        model.register_forward_pre_hook(lambda *_: self.next_forward())

    def next_forward(self) -> None:
        self.most = max(self.most, sum(self.current.values()))
        self.current = {}

    def pack(self, t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in self.weights and storage.device.type == "cpu":
            self.current[storage.data_ptr()] = storage.nbytes()
        return t

    def __enter__(self):
        self.most, self.current = 0, {}
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.hooks.__exit__(*exc)
        self.next_forward()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--budget", type=int, default=2048)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, nargs=2, default=(32, 96), metavar=("MIN", "MAX"))
    parser.add_argument("--model", type=Path, default=ROOT / "examples" / "models" / "tiny-qwen2")
    parser.add_argument("--quiet-wait", type=float, default=60.0)
    parser.add_argument("--source", choices=("synthetic", *EXAMPLE_OF), default="synthetic")
    parser.add_argument("--rollouts", type=int, default=2, help="steps' rollouts of the example (--source)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="an override of the example")
    args = parser.parse_args(argv)

    from roll_pipeline.api import (
        ActorTrainWorker,
        cut,
        load_run_config,
        over_budget,
        padding,
        prompt_groups,
        row_lengths,
        token_budget_plan,
    )

    class OneOrder(ActorTrainWorker):
        """actor_train whose token-budget plan is forced to one order (`order`), or the product's (None)."""

        order: str | None = None

        def micro_batches(self, minibatch):
            budget = self.section.training_args.max_tokens_per_microbatch
            if self.order is None or budget is None:
                return super().micro_batches(minibatch)
            lengths = row_lengths(minibatch)
            groups = prompt_groups(minibatch) if self.order == "together" else None
            plan = token_budget_plan(*lengths, budget, groups=groups)
            return cut(minibatch, plan, lengths), over_budget(*lengths, budget)

    model_path, prompt_length, new_tokens = args.model.resolve(), args.prompt_tokens[1], 384
    rollout = None
    if args.source != "synthetic":
        rollout, example = rollout_batch(args.source, args.rollouts, args.set)
        model_path, prompt_length = Path(example.pretrain), rollout["prompt_ids"].shape[1]
        new_tokens = rollout["response_ids"].shape[1]
        rows = len(rollout)
    else:
        rows = args.prompts * args.group
    if rows % 8:
        raise SystemExit(f"{rows} rows: the fixed side's 8-row micro-batches need a multiple of 8")
    cfg = load_run_config(ROOT / "examples" / "grpo.yaml", [
        f"pretrain={model_path}", f"rollout_batch_size={rows // 8}", "num_return_sequences_in_group=8",
        "use_kl_loss=false", "ppo_epochs=1", f"data.prompt_length={prompt_length}",
        f"actor_infer.generating_args.max_new_tokens={new_tokens}",
        "actor_train.training_args.per_device_train_batch_size=8",
        f"actor_train.training_args.gradient_accumulation_steps={rows // 8}",
        "actor_train.training_args.learning_rate=1e-9", "actor_train.use_sequence_packing=true",
    ]).config
    worker = OneOrder(name="actor_train", rank=0, world_size=1, pipeline_config=cfg, total_optimizer_steps=10**6)
    worker.initialize()
    torch.set_num_threads(cfg.actor_train.torch_threads)
    if rollout is None:
        batch, p_lens, r_lens = synthetic_batch(worker.strategy.module, args.prompts, args.group, args.prompt_tokens)
        p_lens = [p for p in p_lens for _ in range(args.group)]
    else:
        batch = prepared(worker.strategy.module, rollout)
        p_lens, r_lens = row_lengths(batch)
    packed = worker.section
    fixed = replace(packed, use_sequence_packing=False)
    budgeted = replace(fixed, training_args=replace(fixed.training_args, max_tokens_per_microbatch=args.budget))
    sections = {"fixed": fixed, "packed": packed, "packed_mask": packed,
                "packed_budget": replace(budgeted, use_sequence_packing=True)}
    model = worker.strategy.module
    kernel = model.config._attn_implementation

    def use(side: str) -> None:
        worker.section = sections.get(side, budgeted)
        worker.order = side if side in ("by_length", "together") else None
        model.set_attn_implementation("sdpa" if side == "packed_mask" else kernel)

    kept = KeptBytes(model)

    def run(side: str) -> tuple[float, dict[str, float]]:
        use(side)
        start = time.perf_counter()
        metrics = worker.train_step(batch)
        return time.perf_counter() - start, metrics

    def kept_mib(side: str) -> float:
        """Untimed: the hooks cost time."""
        use(side)
        with kept:
            worker.train_step(batch)
        return kept.most / 2**20

    def largest(side: str) -> int:
        use(side)
        micro_batches, _ = worker.micro_batches(batch)
        packed = worker.section.use_sequence_packing
        return max(padding([m], packed)[1] for m in micro_batches)

    print(f"# {machine()}")
    print(f"# attention: {kernel} (packed_mask: sdpa)")
    tools = f", tool tokens {int(batch['tool_mask'].sum())}" if "tool_mask" in batch else ""
    print(f"# {args.source}: {rows} rows, prompts {min(p_lens)}-{max(p_lens)} tokens, responses {min(r_lens)}-"
          f"{max(r_lens)} (median {statistics.median(r_lens):.0f}, 90th percentile "
          f"{sorted(r_lens)[int(0.9 * (len(r_lens) - 1))]}{tools}); budget {args.budget} tokens; torch threads "
          f"{torch.get_num_threads()}")
    memory = {side: kept_mib(side) for side in SIDES}  # also the warm-up, untimed
    seconds: dict[str, list[float]] = {side: [] for side in SIDES}
    pad: dict[str, float] = {}
    for r in range(args.repeats):
        for side in turn_order(r, list(SIDES)):
            quiet = wait_for_quiet(args.quiet_wait)
            load = os.getloadavg()[0]
            took, metrics = run(side)
            seconds[side].append(took)
            pad[side] = metrics["actor/pad_frac"]
            print(f"repetition {r + 1} {side:9s} {took:6.3f} s  pad_frac {pad[side]:.3f}  load {load:.2f} ({quiet})",
                  flush=True)
    print("\nside           s/step, median [range]     vs fixed  largest micro-batch (tokens)  pad_frac  kept MiB")
    base = statistics.median(seconds["fixed"])
    for side in SIDES:
        s = spread(seconds[side])
        print(f"{side:13s}  {s!s:26s}  {s.median / base:.2f}x     {largest(side):6d}                        "
              f"{pad[side]:.3f}     {memory[side]:.1f}")
    longer = sum(p + r > args.budget for p, r in zip(p_lens, r_lens, strict=True))
    print(f"\nrows longer than the budget (each ran alone): {longer}")


if __name__ == "__main__":
    main()

"""What examples/tool_math.yaml learns with the python tool against the same run with tools off, over seeds, and
what a multi-turn rollout costs per generated token against a single-turn one: the measurement behind issue 44's
item 6.

Per seed, two runs of the config to its end, the sides alternating from seed to seed (tools on first on the first
seed): `tools` as the example is, `no tools` with `rewards.tool_math.rollout=single_turn` (the same model, data and
steps; a call the model writes then runs nowhere and its answer is what it makes up). Prints per run the greedy
validation accuracy of the `mul` tag at the first and the last validation, the change, the run's wall time, the
tool calls per validation response at the end, and the rollout's seconds per 1000 generated tokens (time/rollout_s
over throughput/generated_tokens, summed over the steps: the model's sampled tokens only, a tool's are not
generated); then per side the spread over the seeds, and the per-seed difference of the last accuracy (tools minus
no tools). It waits for a quiet machine before each run and prints the load.

    python -m benchmarks.tool_math [--seeds 42 1 2] [--set KEY=VALUE ...] [--keep DIR]
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.first_run import build_of
from benchmarks.harness import add_run_options, machine, wait_for_quiet, work_folder
from benchmarks.summary import spread

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "examples" / "tool_math.yaml"
TAG = "mul"
SIDES = {"tools": [], "no tools": ["rewards.tool_math.rollout=single_turn"]}


@dataclass(frozen=True)
class Run:
    seed: int
    side: str
    first: float
    last: float
    wall_s: float
    calls_per_response: float
    rollout_s_per_k_tokens: float
    load: str


def run_once(seed: int, side: str, overrides: list[str], work: Path) -> Run:
    import mlflow

    from roll_pipeline.api import RLVRPipeline, load_run_config

    out = work / f"{side.replace(' ', '_')}-seed{seed}"
    uri = f"sqlite:///{work / 'mlflow.db'}"
    resolved = load_run_config(CONFIG, [*SIDES[side], *overrides, f"seed={seed}", f"output_dir={out}",
                                        f"tracking.tracking_uri={uri}"])
    load = os.getloadavg()[0]
    started = time.perf_counter()
    pipeline = RLVRPipeline(resolved)
    try:
        pipeline.setup()
        summary = pipeline.run()
    finally:
        pipeline.shutdown()
    wall_s = time.perf_counter() - started
    change = summary["change"]
    if change is None:
        raise SystemExit(f"seed {seed}: the run validated fewer than twice (eval_steps); nothing to compare")
    row = next(r for r in change["rows"] if r.kind == "tag" and r.name == TAG)
    client = mlflow.tracking.MlflowClient(uri)
    history = {key: {m.step: m.value for m in client.get_metric_history(summary["run_id"], key)}
               for key in ("time/rollout_s", "throughput/generated_tokens", f"val_tool_calls/{TAG}/mean")}
    steps = history["time/rollout_s"]
    tokens = sum(history["throughput/generated_tokens"].get(step, 0.0) for step in steps)
    calls = history[f"val_tool_calls/{TAG}/mean"]
    return Run(seed, side, row.first.accuracy, row.last.accuracy, wall_s,
               calls[max(calls)] if calls else 0.0, 1000 * sum(steps.values()) / max(tokens, 1.0),
               f"{load:.2f} -> {os.getloadavg()[0]:.2f}")


def describe(runs: list[Run]) -> list[str]:
    lines = []
    for side in SIDES:
        mine = [r for r in runs if r.side == side]
        if not mine:
            continue
        last, change = spread([r.last for r in mine]), spread([r.last - r.first for r in mine])
        cost = spread([r.rollout_s_per_k_tokens for r in mine])
        wall = spread([r.wall_s for r in mine])
        lines.append(f"{side:<9} last accuracy min {last.low:.3f} median {last.median:.3f} max {last.high:.3f}; "
                     f"change min {change.low:+.3f} median {change.median:+.3f} max {change.high:+.3f}; "
                     f"rollout s per 1000 generated tokens {cost.low:.2f} / {cost.median:.2f} / {cost.high:.2f}; "
                     f"wall s {wall.low:.0f} / {wall.median:.0f} / {wall.high:.0f}")
    by_seed = {}
    for r in runs:
        by_seed.setdefault(r.seed, {})[r.side] = r
    gaps = [pair["tools"].last - pair["no tools"].last for pair in by_seed.values() if len(pair) == 2]
    if gaps:
        gap = spread(gaps)
        lines.append(f"tools minus no tools, last accuracy, over {gap.n} seeds: min {gap.low:+.3f} median "
                     f"{gap.median:+.3f} max {gap.high:+.3f}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[42, 1, 2])
    parser.add_argument("--set", dest="overrides", nargs="*", default=[], metavar="KEY=VALUE")
    parser.add_argument("--sides", nargs="+", default=list(SIDES), choices=list(SIDES))
    add_run_options(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    print(machine(), flush=True)
    print(f"{CONFIG} {' '.join(args.overrides)}; policy {build_of(CONFIG, args.overrides)}", flush=True)
    print(f"{'seed':>5} {'side':<9} {'first':>6} {'last':>6} {'change':>7} {'calls':>6} {'s/1k tok':>8} "
          f"{'wall s':>7}  load", flush=True)
    runs = []
    with work_folder(args.keep, "tool-math-") as work:
        for i, seed in enumerate(args.seeds):
            order = args.sides if i % 2 == 0 else args.sides[::-1]
            for side in order:
                quiet = wait_for_quiet(args.quiet_wait)
                run = run_once(seed, side, args.overrides, work)
                runs.append(run)
                print(f"{seed:>5} {side:<9} {run.first:>6.3f} {run.last:>6.3f} {run.last - run.first:>+7.3f} "
                      f"{run.calls_per_response:>6.2f} {run.rollout_s_per_k_tokens:>8.2f} {run.wall_s:>7.0f}  "
                      f"{run.load} ({quiet})", flush=True)
    for line in describe(runs):
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

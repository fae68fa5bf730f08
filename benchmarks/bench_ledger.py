"""The difficulty ledger's effect: kept groups per second of rollout, with and without it, on the same run.

    python -m benchmarks.bench_ledger [--repeats 3] [--steps 30]

bench_trl's config (GRPO on 32 `add` prompts, 16 prompts x 8 responses a step, no KL) with the `std_filter`
group filter on, so a group whose responses are all right or all wrong is dropped and another prompt drawn: the
work the ledger (`dynamic_sampling.ledger.enabled`) tries to save by passing over rows whose recent groups were
uniform. The tiny policy learns these prompts within a few dozen steps, so uniform (all right) groups grow
common as the run goes on. Each repetition runs both sides, one right after the other (the ledger first in odd
repetitions), each a pipeline of its own from the same seed. Per run, over the steps after the first: kept groups
per second of rollout (the schedulers' groups kept over their wall time), prompts generated per kept group,
prompts skipped by the ledger, steps that hit the redraw bound, rollout seconds per step, and the greedy
accuracy on the 32 prompts at the end. Not part of `make bench`.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from benchmarks.harness import wait_for_quiet
from benchmarks.summary import in_turn, spread

FILTER = "rewards.math.group_filters={std_filter: {}}"


def one_run(config: Path, steps: int, out: Path, ledger: bool) -> dict[str, float]:
    from benchmarks.bench_trl import run_pipeline

    run = run_pipeline(config, steps, out, [FILTER, f"dynamic_sampling.ledger.enabled={str(ledger).lower()}"])
    history = run["history"]
    timed = [s for s in range(2, steps + 1) if "scheduler/math/wall_s" in history.get(s, {})]

    def total(key: str) -> float:
        return sum(history[s].get(f"scheduler/math/{key}", 0.0) for s in timed)

    end = run["summary"]["end"] or {}
    return {
        "kept_per_s": total("groups_kept") / total("wall_s"),
        "generated_per_kept": total("prompts_drawn") / total("groups_kept"),
        "skipped": total("skipped_by_ledger"),
        "bound_hits": total("bound_hit"),
        "rollout_s": total("wall_s") / len(timed),
        "accuracy": end.get("val_correct/all/mean", float("nan")),
        "load": os.getloadavg()[0],
    }


def main(argv: list[str] | None = None) -> int:
    from benchmarks.bench_trl import write_config

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--quiet-wait", type=float, default=60.0)
    args = parser.parse_args(argv)
    print(f"{wait_for_quiet(args.quiet_wait)}; {args.steps} steps per run, {args.repeats} repetitions")
    runs: dict[str, list[dict[str, float]]] = {"ledger": [], "off": []}
    with tempfile.TemporaryDirectory() as tmp:
        config = write_config(Path(tmp))
        for r in range(args.repeats):
            on, off = in_turn(
                r,
                lambda r=r: one_run(config, args.steps, Path(tmp) / f"on{r}", True),
                lambda r=r: one_run(config, args.steps, Path(tmp) / f"off{r}", False),
            )
            runs["ledger"].append(on)
            runs["off"].append(off)
            for name, run in (("ledger", on), ("off", off)):
                print(f"repetition {r + 1} {name:>6}: " + "  ".join(f"{k} {v:.3g}" for k, v in run.items()), flush=True)
    print("\nmedian [min, max] over the repetitions")
    for key in ("kept_per_s", "generated_per_kept", "skipped", "bound_hits", "rollout_s", "accuracy"):
        print(f"{key:>20}: ledger {spread([r[key] for r in runs['ledger']])}   off {spread([r[key] for r in runs['off']])}")
    ratios = [a["kept_per_s"] / b["kept_per_s"] for a, b in zip(runs["ledger"], runs["off"], strict=True)]
    print(f"{'kept/s ledger / off':>20}: {spread(ratios)} (per repetition)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

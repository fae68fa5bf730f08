"""Rollouts generated k steps ahead against synchronous ones, side by side on the embedded example.

`python -m benchmarks.bench_async [--ks 0 1 2 3] [--steps 40] [--eval-steps 10] [--repeats 5]
[--config examples/math_code.yaml]` runs the same config synchronously (k = 0) and with `async_generation_ratio: k`
(and `infer_is_cap: 2`) for each k, the modes alternating within each repetition, and prints per run: the
wall-clock seconds per step (median over the steps after the first two and before the last, which validates), the
greedy validation accuracy at the start and the end, the largest staleness and the mean share of partial responses
(`offpolicy/partial_frac`); per mode: the median and range of the step time over the repetitions, its ratio to the
synchronous run of the same repetition, and the accuracy after equal wall time (each repetition: the last
validation each mode had finished by the time the fastest mode had finished all its steps). The machine's load is
printed before each run. Every figure comes from the runs it prints; nothing is assumed.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.harness import machine, wait_for_quiet

ROOT = Path(__file__).resolve().parent.parent


def mode_overrides(k: int) -> list[str]:
    return [] if k == 0 else [f"async_generation_ratio={k}", "infer_is_cap=2.0"]


def run_once(config: str, steps: int, eval_steps: int, overrides: list[str], out: Path) -> dict:
    from roll_pipeline.api import RLVRPipeline
    from roll_pipeline.api import load_run_config as load_config

    resolved = load_config(
        config,
        [
            f"max_steps={steps}",
            f"eval_steps={eval_steps}",
            "save_steps=0",
            f"output_dir={out}",
            f"tracking.tracking_uri=sqlite:///{out}/mlflow.db",
            *overrides,
        ],
    )
    pipeline = RLVRPipeline(resolved)
    marks: list[float] = []
    curve: list[tuple[float, float]] = []
    try:
        pipeline.setup()
        started = time.perf_counter()

        def on_step(step: int, metrics: dict[str, float]) -> None:
            marks.append(time.perf_counter())
            if "val_correct/all/mean" in metrics:
                curve.append((marks[-1] - started, metrics["val_correct/all/mean"]))

        summary = pipeline.run(on_step=on_step)
        trained = [m for m in pipeline.loop.history.values() if "time/step_s" in m]
    finally:
        pipeline.shutdown()
    gaps = [b - a for a, b in zip(marks, marks[1:], strict=False)][2:-1]  # not warm-up, not the last (validates)
    start = summary["start"]["val_correct/all/mean"]
    return {
        "step_s": statistics.median(gaps),
        "start": start,
        "end": summary["end"]["val_correct/all/mean"],
        "curve": [(0.0, start), *curve],
        "rollout_s": [m["time/rollout_s"] for m in trained],
        "rest_s": [m["time/step_s"] - m["time/rollout_s"] for m in trained],
        "max_staleness": max(m.get("offpolicy/staleness_max", 0.0) for m in trained),
        "partial_frac": statistics.mean(m.get("offpolicy/partial_frac", 0.0) for m in trained),
    }


def modelled_step_s(generate_s: list[float], train_s: list[float], k: int) -> float:
    """The mean step time if generation ran on devices of its own (a GPU pool beside the training one), from a
    synchronous run's per-step times: generating a rollout (`generate_s`: rollout, rewards) and the rest of the
    step (`train_s`: log-probs, update, sync). Rollouts generate one after the other; rollout t is launched when
    step t - k's rollout is collected (k = 0: when step t - 1 has trained and synced); a step trains when its
    rollout is done and the step before has trained. The first and last steps are left out (start-up, drain)."""
    n = len(generate_s)
    gen_end, collect, train_end = [0.0] * n, [0.0] * n, [0.0] * n
    for t in range(n):
        # k = 0: launched once step t - 1 has trained and synced; else once step t - k's rollout is collected
        launch_after = train_end if k == 0 else collect
        back = max(k, 1)
        launch = launch_after[t - back] if t >= back else 0.0
        gen_end[t] = max(gen_end[t - 1] if t else 0.0, launch) + generate_s[t]
        collect[t] = max(gen_end[t], train_end[t - 1] if t else 0.0)
        train_end[t] = collect[t] + train_s[t]
    middle = train_end[1:-1]
    return (middle[-1] - middle[0]) / max(1, len(middle) - 1)


def accuracy_at(curve: list[tuple[float, float]], seconds: float) -> float:
    """The last validation finished by `seconds` into the run."""
    return [acc for at, acc in curve if at <= seconds][-1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "examples" / "math_code.yaml"))
    parser.add_argument("--ks", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--eval-steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quiet-wait", type=float, default=60.0,
                        help="seconds to wait for a quiet machine before each run (default: %(default)s)")
    args = parser.parse_args(argv)
    print(machine(), flush=True)
    results: dict[int, list[dict]] = {k: [] for k in args.ks}
    at_equal_wall: dict[int, list[float]] = {k: [] for k in args.ks}
    with tempfile.TemporaryDirectory(prefix="roll-bench-async-") as tmp:
        for r in range(args.repeats):
            for k in args.ks:
                quiet = wait_for_quiet(args.quiet_wait)
                result = run_once(args.config, args.steps, args.eval_steps, mode_overrides(k), Path(tmp) / f"k{k}-{r}")
                results[k].append(result)
                print(
                    f"repeat {r} k={k}: {result['step_s']:.2f} s/step, val_correct/all/mean {result['start']:.3f} -> "
                    f"{result['end']:.3f} after {args.steps} steps (validations at s: "
                    f"{', '.join(f'{t:.0f}' for t, _ in result['curve'])}), max staleness "
                    f"{result['max_staleness']:.0f}, partial responses {result['partial_frac']:.3f} ({quiet})",
                    flush=True,
                )
            wall = min(results[k][r]["curve"][-1][0] for k in args.ks)
            for k in args.ks:
                at_equal_wall[k].append(accuracy_at(results[k][r]["curve"], wall))
    print(f"\n{'k':<4}{'s/step median (range)':>26}{'vs k=0 (range)':>20}{'val end':>10}{'val at equal wall':>20}")
    for k, runs in results.items():
        times = [run["step_s"] for run in runs]
        ratios = [a["step_s"] / s["step_s"] for s, a in zip(results.get(0, runs), runs, strict=True)]
        print(
            f"{k:<4}{statistics.median(times):>12.2f} ({min(times):.2f}-{max(times):.2f})"
            f"{statistics.median(ratios):>10.2f} ({min(ratios):.2f}-{max(ratios):.2f})"
            f"{statistics.median(run['end'] for run in runs):>10.3f}{statistics.median(at_equal_wall[k]):>20.3f}"
        )
    if 0 in results:
        print("\nThe GPU case on paper (generation on devices of its own; modelled_step_s over each synchronous run's "
              "own per-step rollout and training times):")
        for run in results[0]:
            g, t = run["rollout_s"], run["rest_s"]
            modelled = ", ".join(f"k={k} {modelled_step_s(g, t, k):.2f}" for k in (0, 1, 2, 3))
            print(f"  rollout {statistics.mean(g):.2f} s/step (max {max(g):.2f}), the rest {statistics.mean(t):.2f}: "
                  f"modelled s/step {modelled}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Async rollouts against synchronous ones, side by side on the embedded example.

`python -m benchmarks.bench_async [--steps 40] [--repeats 2] [--config examples/math_code.yaml]` runs the same
config synchronously and with `async_generation_ratio: 1` (and `infer_is_cap: 2`), alternating, `--repeats`
times each, and prints the wall-clock seconds per step (median over the steps after the first two and before the
last, which validates), the async/sync ratio per repetition, and greedy validation accuracy at the start and the
end of every run. Every figure comes from the runs it prints; nothing is assumed.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODES = {"sync": [], "async": ["async_generation_ratio=1", "infer_is_cap=2.0"]}


def run_once(config: str, steps: int, overrides: list[str], out: Path) -> dict:
    from roll_pipeline.api import RLVRPipeline
    from roll_pipeline.api import load_run_config as load_config

    resolved = load_config(
        config,
        [
            f"max_steps={steps}",
            "eval_steps=0",
            "save_steps=0",
            f"output_dir={out}",
            f"tracking.tracking_uri=sqlite:///{out}/mlflow.db",
            *overrides,
        ],
    )
    pipeline = RLVRPipeline(resolved)
    marks: list[float] = []
    try:
        pipeline.setup()
        summary = pipeline.run(on_step=lambda step, metrics: marks.append(time.perf_counter()))
        staleness = [m.get("offpolicy/staleness", 0.0) for m in pipeline.loop.history.values() if "time/step_s" in m]
    finally:
        pipeline.shutdown()
    gaps = [b - a for a, b in zip(marks, marks[1:], strict=False)][2:-1]  # not warm-up, not the last (validates)
    return {
        "step_s": statistics.median(gaps),
        "start": summary["start"]["val_correct/all/mean"],
        "end": summary["end"]["val_correct/all/mean"],
        "max_staleness": max(staleness),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "examples" / "math_code.yaml"))
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    results: dict[str, list[dict]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory(prefix="roll-bench-async-") as tmp:
        for r in range(args.repeats):
            for mode, overrides in MODES.items():
                result = run_once(args.config, args.steps, overrides, Path(tmp) / f"{mode}{r}")
                results[mode].append(result)
                print(
                    f"repeat {r} {mode:>5}: {result['step_s']:.2f} s/step, val_correct/all/mean "
                    f"{result['start']:.3f} -> {result['end']:.3f} after {args.steps} steps, "
                    f"max staleness {result['max_staleness']:.0f}",
                    flush=True,
                )
    ratios = [a["step_s"] / s["step_s"] for s, a in zip(results["sync"], results["async"], strict=True)]
    print(f"\n{'mode':<8}{'s/step (median of runs)':>26}{'val start':>12}{'val end':>10}")
    for mode, runs in results.items():
        print(
            f"{mode:<8}{statistics.median(r['step_s'] for r in runs):>26.2f}"
            f"{statistics.median(r['start'] for r in runs):>12.3f}{statistics.median(r['end'] for r in runs):>10.3f}"
        )
    print(
        f"async/sync step time: median {statistics.median(ratios):.2f} "
        f"(range {min(ratios):.2f}-{max(ratios):.2f} over {len(ratios)} pairs)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

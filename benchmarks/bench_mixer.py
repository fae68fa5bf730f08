"""The adaptive domain mixture against static shares, in equal wall time, on the math+code example.

    python -m benchmarks.bench_mixer [--repeats 2] [--steps 40] [--eval-steps 10]

examples/math_code.yaml (the embedded tiny policy; 16 prompts a step, math and code half and half) run with
`domain_mixer.type=static` and with `progress`, each a pipeline of its own from the same seed, validating at step
0 and every `--eval-steps` steps (validation costs the same on both sides). The sides alternate which goes first.
For each run the clock is read at the end of every step; the comparison is at equal wall time: T is the shorter
of the two runs' durations, and each side's figures are those of its last validation finished by T (per domain
accuracy `val_domain/<domain>/correct_mean`, and overall). Also printed: steps done by T, the mean share of
prompts each domain got, and each domain's kept groups per rollout second. Not part of `make bench`: a
measurement for the mixer's documented claim (docs/dynamic-sampling.md), honest either way.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from benchmarks.harness import wait_for_quiet
from benchmarks.summary import in_turn, spread

ROOT = Path(__file__).resolve().parent.parent
DOMAINS = ("math", "code")


def one_run(steps: int, eval_steps: int, out: Path, mixer: str) -> dict:
    from roll_pipeline.api import RLVRPipeline, load_run_config

    resolved = load_run_config(
        ROOT / "examples" / "math_code.yaml",
        [
            f"max_steps={steps}",
            f"eval_steps={eval_steps}",
            "save_steps=0",
            f"output_dir={out}",
            f"tracking.tracking_uri=sqlite:///{out}/mlflow.db",
            f"domain_mixer.type={mixer}",
        ],
    )
    pipeline = RLVRPipeline(resolved)
    ends: dict[int, float] = {}
    try:
        pipeline.setup()
        start = time.perf_counter()
        pipeline.run(on_step=lambda step, metrics: ends.__setitem__(step, time.perf_counter() - start))
        history = dict(pipeline.loop.history)
    finally:
        pipeline.shutdown()
    return {"ends": ends, "history": history}


def at_time(run: dict, limit_s: float) -> dict[str, float]:
    """A run's figures at `limit_s` seconds: its last validation by then, its steps, shares and rates."""
    history, ends = run["history"], run["ends"]
    done = [s for s in sorted(ends) if ends[s] <= limit_s + 1e-9]
    validated = [s for s in [0, *done] if "val_correct/all/mean" in history.get(s, {})]
    last = history[validated[-1]]
    out = {"steps": float(len(done)), "validated_at": float(validated[-1]), "all": last["val_correct/all/mean"]}
    for d in DOMAINS:
        out[d] = last.get(f"val_domain/{d}/correct_mean", float("nan"))
        shares = [history[s].get(f"mix/{d}", float("nan")) for s in done]
        out[f"share_{d}"] = sum(shares) / len(shares) if shares else float("nan")
        kept = sum(history[s].get(f"scheduler/{d}/groups_kept", 0.0) for s in done)
        wall = sum(history[s].get(f"scheduler/{d}/wall_s", 0.0) for s in done)
        out[f"kept_per_s_{d}"] = kept / wall if wall else float("nan")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--eval-steps", type=int, default=10)
    parser.add_argument("--quiet-wait", type=float, default=60.0)
    parser.add_argument(
        "--out", default=None, help="keep the runs here (each with its MLflow store, for `roll report A B`)"
    )
    args = parser.parse_args(argv)
    print(f"{wait_for_quiet(args.quiet_wait)}; {args.steps} steps, validation every {args.eval_steps}", flush=True)
    table: dict[str, list[dict[str, float]]] = {"progress": [], "static": []}
    with tempfile.TemporaryDirectory() as scratch:
        tmp = args.out or scratch
        for r in range(args.repeats):
            progress, static = in_turn(
                r,
                lambda r=r: one_run(args.steps, args.eval_steps, Path(tmp) / f"p{r}", "progress"),
                lambda r=r: one_run(args.steps, args.eval_steps, Path(tmp) / f"s{r}", "static"),
            )
            limit = min(max(progress["ends"].values()), max(static["ends"].values()))
            for name, run in (("progress", progress), ("static", static)):
                figures = at_time(run, limit)
                table[name].append(figures)
                print(
                    f"repetition {r + 1} {name:>8} at {limit:.0f} s (load {os.getloadavg()[0]:.2f}): "
                    + "  ".join(f"{k} {v:.3g}" for k, v in figures.items()),
                    flush=True,
                )
    print("\nmedian [min, max] over the repetitions, at equal wall time")
    for key in table["static"][0]:
        print(f"{key:>16}: progress {spread([f[key] for f in table['progress']])}"
              f"   static {spread([f[key] for f in table['static']])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

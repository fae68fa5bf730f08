"""Step time of bench_trl's pipeline run two ways, side by side: what one change is worth.

    python -m benchmarks.bench_ab --a dynamic_sampling.request_mode=prompt \
        --b dynamic_sampling.request_mode=wave [--repeats 4] [--steps 12]
    python -m benchmarks.bench_ab --a-tree /tmp/before --b-tree . [--repeats 4]

A side is a source tree (a checkout of another commit, `git worktree add /tmp/before <commit>`; default: this
one) and overrides of the config. Each repetition runs A and B one right after the other (A first in even
repetitions, B first in odd ones), each a pipeline of its own in a fresh interpreter started in its tree (its
Ray workers import that tree's code), on bench_trl's config: GRPO on 32 `add` prompts, 16 prompts x 8 responses,
2 optimizer steps a step, no KL. A run's step time is the median over its steps after the first, the last (which
validates) left out. Printed: per repetition both step times, the ratio B / A, the median seconds of each stage,
generated tokens per step and the machine's load; then the median ratio and its range. Not part of `make bench`:
a tool for measuring one change before it goes in.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.harness import wait_for_quiet
from benchmarks.summary import in_turn, spread

ROOT = Path(__file__).resolve().parent.parent

# Runs in the side's tree: only what bench_trl has had since it was written (write_config, run_pipeline).
CHILD = """
import json, statistics, sys
from pathlib import Path
from benchmarks.bench_trl import run_pipeline, write_config
out, steps, overrides = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
out.mkdir(parents=True)
run = run_pipeline(write_config(out), steps, out / "run", overrides)
print("RESULT " + json.dumps({"step": statistics.median(run["step_s"]), "stages": run["stages"],
                              "tokens": run["tokens"]}))
"""


def run_side(tree: Path, overrides: list[str], steps: int, out: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(out), str(steps), *overrides],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"the run in {tree} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT ") :]) | {"load": os.getloadavg()[0]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--a", nargs="*", default=[], help="config overrides of side A")
    parser.add_argument("--b", nargs="*", default=[], help="config overrides of side B")
    parser.add_argument("--a-tree", type=Path, default=ROOT, help="source tree of side A")
    parser.add_argument("--b-tree", type=Path, default=ROOT, help="source tree of side B")
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--quiet-wait", type=float, default=60.0)
    args = parser.parse_args(argv)
    sides = {"A": (args.a_tree.resolve(), args.a), "B": (args.b_tree.resolve(), args.b)}
    for name, (tree, overrides) in sides.items():
        print(f"{name}: {tree} {overrides}")
    print(wait_for_quiet(args.quiet_wait))
    ratios = []
    with tempfile.TemporaryDirectory(prefix="roll-bench-ab-") as tmp_dir:
        tmp = Path(tmp_dir)

        def side(name: str, r: int) -> dict:
            tree, overrides = sides[name]
            return run_side(tree, overrides, args.steps, tmp / f"{name}{r}")

        for r in range(args.repeats):
            a, b = in_turn(r, lambda r=r: side("A", r), lambda r=r: side("B", r))
            ratios.append(b["step"] / a["step"])
            for name, x in (("A", a), ("B", b)):
                stages = " ".join(f"{k} {v:.3f}" for k, v in sorted(x["stages"].items()) if v > 0.0005)
                print(
                    f"rep {r + 1} {name}: {x['step']:.3f} s/step, {x['tokens']:.0f} tokens/step, load "
                    f"{x['load']:.2f}; {stages}",
                    flush=True,
                )
            print(f"rep {r + 1}: B / A = {ratios[-1]:.3f}", flush=True)
    print(f"B / A step time: median {spread(ratios)} over {len(ratios)} repetitions")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""What a user's first run learns, over several seeds: the measurement behind issue 42's first item.

Runs an example config (default: examples/math_code.yaml, what `make run` runs) to its end once per seed, with
`seed=<seed>` and any `--set KEY=VALUE` overrides, its outputs and MLflow store in a temporary folder. Prints, per
run, the end-of-run table's rows for `all` and each domain (greedy accuracy at the first and the last validation,
the paired change, McNemar's p, Holm-adjusted over the domains, and the verdict) with the run's wall time and the
machine's load; then, per scope, the change's min / median / max over the seeds and on how many of them it was a
significant gain.

    python -m benchmarks.first_run [--seeds 42 1 2 3] [--config examples/math_code.yaml] [--set KEY=VALUE ...]

The runs are the example's own (240 steps, about 5 minutes each on 2 cores); `--set max_steps=40 eval_steps=40`
checks that the script works; `--keep DIR` keeps the runs' outputs and MLflow store (`roll report DIR/seed42`).
Which build of the embedded model the runs used is printed from its build_info.json: builds differ by processor
(docs/embedded-models.md), and so do their figures.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.harness import add_run_options, machine, wait_for_quiet, work_folder
from benchmarks.summary import spread

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class ScopeResult:
    """One scope (``all`` or a domain) of one run."""

    seed: int
    scope: str
    first: float
    last: float
    change: float
    p_adjusted: float
    verdict: str


def run_once(config: Path, seed: int, overrides: list[str], work: Path) -> tuple[list[ScopeResult], dict]:
    """Run the config to its end; its `all` and domain rows, and the run's summary."""
    from roll_pipeline.api import RLVRPipeline, load_run_config

    resolved = load_run_config(config, [
        *overrides, f"seed={seed}", f"output_dir={work / f'seed{seed}'}",
        f"tracking.tracking_uri=sqlite:///{work / 'mlflow.db'}",
    ])
    pipeline = RLVRPipeline(resolved)
    try:
        pipeline.setup()
        summary = pipeline.run()
    finally:
        pipeline.shutdown()
    change = summary["change"]
    if change is None:
        raise SystemExit(f"seed {seed}: the run validated fewer than twice (eval_steps); nothing to compare")
    rows = []
    for row in change["rows"]:
        if row.kind == "tag" or row.change is None:
            continue
        rows.append(ScopeResult(seed, row.name if row.kind == "domain" else "all", row.first.accuracy,
                                row.last.accuracy, row.change.difference, row.change.p_adjusted,
                                row.verdict(change["alpha"])))
    return rows, summary


def describe(results: list[ScopeResult], seeds: list[int]) -> list[str]:
    """Per scope, in first-seen order: the change over the seeds and how many were significant gains."""
    lines = []
    for scope in dict.fromkeys(r.scope for r in results):
        mine = [r for r in results if r.scope == scope]
        change = spread([r.change for r in mine])
        better = sum(r.verdict == "better" for r in mine)
        lines.append(f"{scope:<10} change over {change.n} of {len(seeds)} seeds: min {change.low:+.3f}, median "
                     f"{change.median:+.3f}, max {change.high:+.3f}; a significant gain on {better}")
    return lines


def build_of(config: Path, overrides: list[str]) -> str:
    from roll_pipeline.api import load_run_config

    pretrain = Path(load_run_config(config, overrides).config.pretrain)
    info_path = pretrain / "build_info.json"
    if not info_path.exists():
        return f"{pretrain} (no build_info.json: not an embedded build)"
    info = json.loads(info_path.read_text())
    return f"{pretrain} (weights sha256 {info.get('weights_sha256', '?')[:8]}, build seed {info.get('seed')})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[42, 1, 2, 3])
    parser.add_argument("--config", type=Path, default=ROOT / "examples" / "math_code.yaml")
    parser.add_argument("--set", dest="overrides", nargs="*", default=[], metavar="KEY=VALUE")
    add_run_options(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    print(machine(), flush=True)
    print(f"{args.config} {' '.join(args.overrides)}; policy {build_of(args.config, args.overrides)}", flush=True)
    results: list[ScopeResult] = []
    with work_folder(args.keep, "first-run-") as work:
        for seed in args.seeds:
            quiet = wait_for_quiet(args.quiet_wait)
            started = time.perf_counter()
            rows, summary = run_once(args.config, seed, args.overrides, work)
            wall = time.perf_counter() - started
            print(f"seed {seed}: {summary['steps']} steps in {wall:.0f} s ({quiet}; load after "
                  f"{os.getloadavg()[0]:.2f})", flush=True)
            for r in rows:
                print(f"  {r.scope:<10} {r.first:.3f} -> {r.last:.3f}  {r.change:+.3f}  p_holm {r.p_adjusted:.3f}  "
                      f"{r.verdict}", flush=True)
            results.extend(rows)
    for line in describe(results, args.seeds):
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

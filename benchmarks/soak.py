"""Soak: a long run of an example with the resident memory of every process in its tree sampled throughout.

`python -m benchmarks.soak [--steps 500] [--config examples/math_code.yaml] [--warmup-steps 50]` (`make soak`)
starts `roll run` and, every `--interval-s`, records the RSS of the run's whole process tree: the driver, Ray's
own processes, every worker, and the processes under them (reward scoring processes, sandboxes). After the run
it compares each long-lived process (alive from the end of the warm-up to the end) between the warm-up and the
end of the run, and the tree's total, and exits 1 if any grew by more than `--max-growth` (10%).

The warm-up ends at `--warmup-steps`; the step each sample belongs to comes from the run's tracking spool, which
holds every step's metrics with their timestamps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
_MB = 1024 * 1024


@dataclass
class Series:
    name: str
    samples: list[tuple[float, float]] = field(default_factory=list)
    """(time, RSS in MB)."""


def label(proc: psutil.Process) -> str:
    """A readable name: Ray sets worker titles to `ray::ClassName...`; others by their command line."""
    try:
        cmd = proc.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return "?"
    if cmd and cmd[0].startswith("ray::"):
        return cmd[0].split(".")[0].split(" ")[0]
    words = [Path(c).name for c in cmd[:3]]
    return " ".join(words)[:60]


def sample_tree(root: psutil.Process, series: dict[int, Series], now: float) -> float:
    total = 0.0
    try:
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    for proc in procs:
        try:
            rss = proc.memory_info().rss / _MB
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        total += rss
        # Named at every sample: a Ray worker is `ray::IDLE` until its actor class takes the process.
        entry = series.setdefault(proc.pid, Series(""))
        entry.name = f"{label(proc)} (pid {proc.pid})"
        entry.samples.append((now, rss))
    return total


def step_times(output_dir: Path) -> dict[int, float]:
    """Step -> wall time (s) of its metrics, from the run's spool."""
    times: dict[int, float] = {}
    for entries in output_dir.glob("mlflow_spool/*/entries.jsonl"):
        for line in entries.read_text().splitlines():
            entry = json.loads(line)
            for _key, _value, ts, step in entry.get("metrics", []):
                times.setdefault(int(step), ts / 1000)
    return times


def window(samples: list[tuple[float, float]], start: float, end: float) -> float | None:
    values = [rss for t, rss in samples if start <= t <= end]
    return statistics.median(values) if values else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="examples/math_code.yaml")
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--warmup-steps", type=int, default=50)
    parser.add_argument("--interval-s", type=float, default=5.0)
    parser.add_argument("--max-growth", type=float, default=0.10)
    parser.add_argument("--output-dir", default=None)
    parser.add_argument("overrides", nargs="*", help="more key.path=value overrides for the run")
    args = parser.parse_args(argv)

    out = Path(args.output_dir or tempfile.mkdtemp(prefix="roll-soak-"))
    argv_run = [
        sys.executable, "-m", "roll_pipeline.cli", "run", args.config, f"max_steps={args.steps}",
        f"output_dir={out}", f"eval_steps={max(args.steps // 5, 1)}", f"save_steps={max(args.steps // 5, 1)}",
        f"tracking.tracking_uri=sqlite:///{out}/mlflow.db", *args.overrides,
    ]
    print(f"soak: {' '.join(argv_run[2:])}", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    log = (out / "run.log").open("wb")
    proc = subprocess.Popen(argv_run, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    root = psutil.Process(proc.pid)
    series: dict[int, Series] = {}
    totals: list[tuple[float, float]] = []
    start = time.time()
    last_report = start
    while proc.poll() is None:
        now = time.time()
        totals.append((now, sample_tree(root, series, now)))
        if now - last_report > 60:
            done = max(step_times(out), default=0)
            print(f"  {now - start:6.0f} s: step {done}, tree RSS {totals[-1][1]:.0f} MB", flush=True)
            last_report = now
        time.sleep(args.interval_s)
    log.close()
    if proc.returncode != 0:
        print(f"soak: the run failed (exit {proc.returncode}); see {out / 'run.log'}")
        return 1

    times = step_times(out)
    warm = times.get(args.warmup_steps)
    end = max(times.values())
    if warm is None:
        print(f"soak: step {args.warmup_steps} not found in the run's metrics")
        return 1
    span = max(args.interval_s * 6, 60.0)  # compare medians over about a minute
    # Between the warm-up and the end, three more points show whether a growth levels off or keeps on.
    marks = [warm + (end - span - warm) * i / 4 for i in (1, 2, 3)]
    rows = []
    for s in series.values():
        first, last = s.samples[0][0], s.samples[-1][0]
        if first > warm or last < end - span:
            continue  # not alive through the whole comparison
        at_warm, at_end = window(s.samples, warm, warm + span), window(s.samples, end - span, end)
        if at_warm and at_end:
            between = [window(s.samples, m, m + span) or float("nan") for m in marks]
            rows.append((s.name, at_warm, between, at_end, at_end / at_warm - 1))
    total_warm, total_end = window(totals, warm, warm + span), window(totals, end - span, end)
    total_between = [window(totals, m, m + span) or float("nan") for m in marks]
    rows.sort(key=lambda r: -r[1])
    print(
        f"\nRSS (MB, median over {span:.0f} s) after step {args.warmup_steps}, at a quarter, a half and three "
        f"quarters of the rest, and at step {max(times)}:"
    )
    print(f"{'process':<50}{'warm':>7}{'1/4':>7}{'1/2':>7}{'3/4':>7}{'end':>7}{'growth':>9}")
    for name, a, mid, b, g in [
        *rows,
        ("whole tree", total_warm, total_between, total_end, total_end / total_warm - 1),
    ]:
        print(f"{name[:50]:<50}{a:>7.0f}" + "".join(f"{m:>7.0f}" for m in mid) + f"{b:>7.0f}{g:>+9.1%}")
    print(f"run: {max(times)} steps in {end - start:.0f} s; outputs in {out}")
    grown = [r for r in rows if r[4] > args.max_growth]
    if grown:
        print(f"soak: {len(grown)} process(es) grew by more than {args.max_growth:.0%} after the warm-up")
        return 1
    print(f"soak: no process grew by more than {args.max_growth:.0%} after the warm-up")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

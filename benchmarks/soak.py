"""Soak: a long run of an example with the resident memory of every process in its tree sampled throughout.

`python -m benchmarks.soak [--steps 500] [--config examples/math_code.yaml] [--warmup-steps 50]` (`make soak`)
starts `roll run` and, every `--interval-s`, records the RSS of the run's whole process tree: the driver, Ray's
own processes, every worker, and the processes under them (reward scoring processes, sandboxes). After the run
it compares each long-lived process (alive from the end of the warm-up to the end) between the warm-up and the
end of the run, and the tree's total, and exits 1 if any grew by more than `--max-growth` (10%).

What is compared is each point's floor: the lowest sample in about a minute. A worker's RSS goes up while it
works on a step (activations, a checkpoint being written) and back down after it (workers.base's
release_free_memory: actor_infer's after each batch, actor_train's at most every 10 s), so a minute's median
depends on how many samples fell inside a step; a leak, or memory the allocator keeps, raises the floor. The
default interval, a second, is short beside the idle spell that follows actor_train's release, so every
minute's floor sees at least one. The medians are printed beside the floors, and every sample is written to
`rss_samples.csv` in the output folder.

The warm-up ends at `--warmup-steps`; the step each sample belongs to comes from the run's tracking spool, which
holds every step's metrics with their timestamps.
"""

from __future__ import annotations

import argparse
import csv
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
        # Named at every sample: a Ray worker is `ray::IDLE` until its actor class takes the process. A process
        # on its way out may no longer show its command line ("?"): it keeps the name it had.
        entry = series.setdefault(proc.pid, Series(""))
        name = label(proc)
        if name != "?" or not entry.name:
            entry.name = f"{name} (pid {proc.pid})"
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


def window(samples: list[tuple[float, float]], start: float, end: float, stat=statistics.median) -> float | None:
    values = [rss for t, rss in samples if start <= t <= end]
    return stat(values) if values else None


def write_samples(path: Path, series: dict[int, Series], totals: list[tuple[float, float]], start: float) -> None:
    """Every sample, for a closer look: time since the start, pid (0: the whole tree), name, RSS in MB."""
    with path.open("w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["time_s", "pid", "name", "rss_mb"])
        out.writerows((f"{t - start:.1f}", 0, "whole tree", f"{rss:.1f}") for t, rss in totals)
        for pid, s in series.items():
            out.writerows((f"{t - start:.1f}", pid, s.name, f"{rss:.1f}") for t, rss in s.samples)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="examples/math_code.yaml")
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--warmup-steps", type=int, default=50)
    parser.add_argument("--interval-s", type=float, default=1.0)
    parser.add_argument("--max-growth", type=float, default=0.10)
    parser.add_argument("--output-dir", default=None)
    parser.add_argument("overrides", nargs="*", help="more key.path=value overrides for the run")
    args = parser.parse_args(argv)

    out = Path(args.output_dir or tempfile.mkdtemp(prefix="roll-soak-"))
    argv_run = [
        sys.executable, "-m", "roll_pipeline.driver.cli", "run", args.config, f"max_steps={args.steps}",
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
    write_samples(out / "rss_samples.csv", series, totals, start)

    def growth(before: float, after: float) -> float:
        return after / before - 1 if before > 0 else 0.0

    span = max(args.interval_s * 6, 60.0)  # about a minute of samples per point
    # Between the warm-up and the end, three more points show whether a growth levels off or keeps on.
    marks = [warm, *(warm + (end - span - warm) * i / 4 for i in (1, 2, 3)), end - span]
    rows = []
    for s in series.values():
        first, last = s.samples[0][0], s.samples[-1][0]
        if first > warm or last < end - span:
            continue  # not alive through the whole comparison
        floors = [window(s.samples, m, min(m + span, end), min) for m in marks]
        medians = [window(s.samples, m, min(m + span, end)) for m in (marks[0], marks[-1])]
        if None not in floors and None not in medians:
            rows.append((s.name, floors, medians))
    totals_floor = [window(totals, m, min(m + span, end), min) for m in marks]
    totals_median = [window(totals, m, min(m + span, end)) for m in (marks[0], marks[-1])]
    rows.sort(key=lambda r: -r[1][0])
    rows.append(("whole tree", totals_floor, totals_median))
    print(
        f"\nRSS (MB) after step {args.warmup_steps}, at a quarter, a half and three quarters of the rest, and at step "
        f"{max(times)}: the floor (lowest sample) of {span:.0f} s at each point, which the check uses, and the "
        f"median of the first and last {span:.0f} s"
    )
    print(f"{'process':<50}{'warm':>7}{'1/4':>7}{'1/2':>7}{'3/4':>7}{'end':>7}{'growth':>9}  | median{'warm':>7}{'end':>7}{'growth':>9}")
    for name, floors, (med_warm, med_end) in rows:
        print(
            f"{name[:50]:<50}" + "".join(f"{v:>7.0f}" for v in floors) + f"{growth(floors[0], floors[-1]):>+9.1%}"
            f"  |       {med_warm:>7.0f}{med_end:>7.0f}{growth(med_warm, med_end):>+9.1%}"
        )
    print(f"run: {max(times)} steps in {end - start:.0f} s; outputs in {out} (every sample: rss_samples.csv)")
    grown = [r for r in rows[:-1] if growth(r[1][0], r[1][-1]) > args.max_growth]
    if grown:
        print(f"soak: {len(grown)} process(es) grew by more than {args.max_growth:.0%} after the warm-up")
        return 1
    print(f"soak: no process grew by more than {args.max_growth:.0%} after the warm-up")
    return 0

if __name__ == "__main__":
    raise SystemExit(main())

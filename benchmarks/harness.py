"""What every benchmark shares: the machine it ran on, and a quiet machine to measure on (or the record that
there was none). The figures' arithmetic and reports are benchmarks/summary.py; the project's code is reached only
through roll_pipeline.api."""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import tempfile
import threading
import time
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        import psutil

        memory = f", {psutil.virtual_memory().total / 2**30:.0f} GiB memory"
    except ImportError:
        memory = ""
    versions = []
    for package in ("torch", "transformers", "deepspeed", "ray", "trl", "accelerate"):
        try:
            versions.append(f"{package} {metadata.version(package)}")
        except metadata.PackageNotFoundError:
            versions.append(f"{package} not installed")
    return (
        f"{os.cpu_count()} CPUs ({cpu}){memory}, {platform.system()} {platform.release()}, Python "
        f"{platform.python_version()}; {', '.join(versions)}"
    )


def wait_for_quiet(timeout_s: float) -> str:
    """Wait until the 1-minute load average is under half the cores (the benchmark's own processes then have the
    machine), at most ``timeout_s``; says which it was. Each row also prints the load while it was measured."""
    threshold = (os.cpu_count() or 1) / 2
    deadline = time.monotonic() + timeout_s
    while os.getloadavg()[0] >= threshold and time.monotonic() < deadline:
        time.sleep(1.0)
    load = os.getloadavg()[0]
    if load < threshold:
        return f"quiet machine: load {load:.2f} < {threshold:.1f}"
    return f"NOT QUIET: load {load:.2f} >= {threshold:.1f} after waiting {timeout_s:.0f}s; figures are lower"


def add_run_options(parser: argparse.ArgumentParser) -> None:
    """`--keep DIR` and `--quiet-wait S`, for the benchmarks that run the pipeline to its end, seed after seed."""
    parser.add_argument("--keep", type=Path, default=None, metavar="DIR",
                        help="keep the runs' outputs and MLflow store in DIR (default: a temporary folder, removed)")
    parser.add_argument("--quiet-wait", type=float, default=60.0,
                        help="seconds to wait for a quiet machine before each run (default: %(default)s)")


@contextlib.contextmanager
def work_folder(keep: Path | None, prefix: str) -> Iterator[Path]:
    """Where the runs write: `keep` (made if missing, left in place) or a temporary folder removed at the end."""
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
        yield keep
        return
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        yield Path(tmp)


def cpu_seconds() -> float:
    """CPU seconds of this process and of its children that have ended (their children included, as each
    waited for its own: a sandbox's program counts once bubblewrap, its parent here, has been reaped)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def rate_and_cpu(work, concurrency: int, seconds: float, finish=None) -> tuple[float, float]:
    """(calls of ``work()`` per second from ``concurrency`` threads over about ``seconds``, CPU milliseconds per
    call of this process and its ended children). ``finish`` (off the rate's clock, on the CPU's) ends what the
    calls left running: a scorer's close, which kills and reaps its sandboxes, so that the CPU of every program
    they ran (reused zygote sandboxes reap their runs themselves) and of their starts is counted."""
    cpu0 = cpu_seconds()
    done = [0] * concurrency
    stop = time.monotonic() + seconds

    def loop(i: int) -> None:
        while time.monotonic() < stop:
            work()
            done[i] += 1

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(concurrency)]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - start
    if finish is not None:
        finish()
    calls = sum(done)
    return calls / elapsed, 1000 * (cpu_seconds() - cpu0) / max(calls, 1)


def rate(work, concurrency: int, seconds: float) -> float:
    """Calls of ``work()`` per second from ``concurrency`` threads, over about ``seconds``."""
    return rate_and_cpu(work, concurrency, seconds)[0]

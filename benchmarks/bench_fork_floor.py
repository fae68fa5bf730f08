"""The floor under a stdin/stdout test run in a forked child: what forking an interpreter costs, outside any sandbox.

    python benchmarks/bench_fork_floor.py [--forks 500]

The sandbox's interpreter (this one's base interpreter, `-I -S`), with the zygote's preloaded modules, forks
`--forks` children one after another, each given a pipe as stdin; `empty` children exit at once, `program`
children first run the stdio-5 workload's program (longest increasing subsequence over one line of input). CPU
milliseconds per child, of the parent and of the children (reaped), and wall milliseconds; each variant is measured
three times. This is what `stdio_tests` (workers/rewards/sandbox/stdio_tests.py) pays per test at the least, with
no sandbox, harness, pipes to the worker or judging.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CHILD = r"""
import os, sys, time
for name in ("collections", "functools", "heapq", "bisect", "itertools", "math", "string", "re", "ctypes", "socket",
             "select"):
    __import__(name)
code = compile(sys.argv[1], "solution.py", "exec")
forks = int(sys.argv[2])

def cpu():
    t = os.times()
    return t.user + t.system, t.children_user + t.children_system

for variant in ("empty", "program") * 3:
    (p0, c0), t0 = cpu(), time.perf_counter()
    for _ in range(forks):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.dup2(r, 0)
            if variant == "program":
                exec(code, {"__name__": "__main__", "__builtins__": __builtins__})
                sys.stdout.flush()
            os._exit(0)
        os.write(w, b"3 10 2 1 20\n")
        os.close(w)
        os.close(r)
        os.waitpid(pid, 0)
    (p1, c1), wall = cpu(), time.perf_counter() - t0
    print(f"{variant:>8}: parent {(p1 - p0) / forks * 1e3:.3f} ms  children {(c1 - c0) / forks * 1e3:.3f} ms"
          f"  wall {wall / forks * 1e3:.3f} ms per fork", file=sys.stderr, flush=True)
"""


def main(argv: list[str] | None = None) -> int:
    from benchmarks.bench_code_sandbox import WORKLOADS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--forks", type=int, default=500)
    args = parser.parse_args(argv)
    program = WORKLOADS["stdio-5"][0]
    python = getattr(sys, "_base_executable", sys.executable)
    print(f"interpreter {python}, {args.forks} forks per figure, load {os.getloadavg()[0]:.2f}")
    # The children's stdout goes to /dev/null: their output is not what is measured.
    proc = subprocess.run(
        [python, "-I", "-S", "-c", CHILD, program, str(args.forks)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        text=True, check=True,
    )
    print(proc.stderr, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

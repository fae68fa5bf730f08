"""Python tool calls per second: the `python` environment (each call in the code sandbox, earlier cells replayed)
beside a bare subprocess running the same program.

    python -m benchmarks.bench_tool_calls [--seconds 3] [--rounds 3] [--earlier 0 2 4]

A call is one `step` of PythonToolEnvironment with a cell that prints a product; `--earlier` sets how many cells
the trajectory ran before it (each replayed by the call, docs/environments.md). `bare` runs the same replay
program as `python -I -S -c PROGRAM` (no isolation, no pool): what a tool without a sandbox would cost. Threads:
`--concurrency` callers at once (the environment's sandbox pool has that concurrency). Figures are calls per
second, measured in `--rounds` turns with the two sides alternating; it waits (`--quiet-wait`) for the load average
to fall under half the cores, says whether it did, and prints the load beside each row.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from benchmarks.harness import rate, wait_for_quiet
from benchmarks.summary import in_turn, spread
from roll_pipeline.api import PythonToolEnvironment, replay_program

CELL = "x = {k} * 7\nprint(x * 123456789)"


def cells(earlier: int) -> list[str]:
    return [CELL.format(k=k) for k in range(earlier + 1)]


def tool_side(earlier: int, concurrency: int):
    env = PythonToolEnvironment(sandbox={"concurrency": concurrency})
    env.runner()  # the pool starts outside the measured window
    history = cells(earlier)

    def call() -> None:
        env.cells = history[:-1]
        step = env.step(f"<python>\n{history[-1]}\n</python>")
        assert step.tool_errors == 0, step.observation

    return call


def bare_side(earlier: int):
    program = replay_program(cells(earlier))

    def call() -> None:
        subprocess.run([sys.executable, "-I", "-S", "-c", program], check=True, capture_output=True)

    return call


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--earlier", type=int, nargs="+", default=[0, 2, 4])
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--quiet-wait", type=float, default=60.0)
    args = parser.parse_args(argv)
    print(f"{wait_for_quiet(args.quiet_wait)}; {os.cpu_count()} cores, {args.concurrency} callers, "
          f"{args.seconds:g} s per measurement, {args.rounds} rounds")
    print(f"{'earlier cells':>14} {'tool calls/s':>22} {'bare calls/s':>22} {'bare / tool':>18}  load")
    for earlier in args.earlier:
        tool_call, bare_call = tool_side(earlier, args.concurrency), bare_side(earlier)
        tool, bare = [], []
        for r in range(args.rounds):
            ours, theirs = in_turn(
                r,
                lambda tool_call=tool_call: rate(tool_call, args.concurrency, args.seconds),
                lambda bare_call=bare_call: rate(bare_call, args.concurrency, args.seconds),
            )
            tool.append(ours)
            bare.append(theirs)
        ratio = spread([b / t for b, t in zip(bare, tool, strict=True)])
        print(f"{earlier:>14} {str(spread(tool)):>22} {str(spread(bare)):>22} {str(ratio):>18}  "
              f"{os.getloadavg()[0]:.2f}", flush=True)
        PythonToolEnvironment.close_runners()
    print("(median [min, max] over the rounds)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Sandboxed executions per second of the code_sandbox scorer, beside bare `python` subprocesses.

    python benchmarks/bench_code_sandbox.py [--seconds 3] [--concurrency 1 2 4]

Five workloads, each at every concurrency (that many threads calling the scorer, and a scorer whose
``concurrency`` is the same; ``--pool-size`` sets how many sandboxes it keeps started ahead):

* trivial: ``print("hello")`` against one stdin/stdout test (one program run);
* call-5: a typical function (longest increasing subsequence) against 5 call-based tests (one run, 5 calls);
* stdio-5: the same task as a stdin/stdout program against 5 tests (5 runs);
* assert-5: the same function against 5 assert statements (one checked run: the program's sandbox and the
  checker's, 5 calls relayed);
* check-5: the same, as a HumanEval-style ``check(candidate)`` that loops over 5 cases (one test).

Columns: ``zygote``, the scorer as configured by default (reused sandboxes whose zygote forks a child per run);
``strict``, the scorer with ``isolation: strict`` (a pre-started sandbox of its own per run); ``bare``, the same
programs as plain subprocesses of the same interpreter (``-I -S``), without isolation, harness or judging; then
CPU milliseconds per sample (this process and its reaped children: each scorer's sandboxes are started inside the
measured window and closed at its end, so their starts and runs count). Figures are samples scored per second
(one sample = one program against all its tests), each measured in ``--rounds`` turns with the three sides
alternating. The machine's other load shows up in these numbers: it waits (``--quiet-wait``) for the load average
to fall under half the cores and says whether it did, prints the load beside each row (the benchmark's own
sandboxes count in it), and only figures taken in one run compare.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.harness import cpu_seconds, rate_and_cpu, wait_for_quiet  # noqa: E402
from roll_pipeline.api import CodeSandboxScorer, Sandbox, run_checked  # noqa: E402

LIS = """
def lis(xs):
    best = []
    for x in xs:
        lo, hi = 0, len(best)
        while lo < hi:
            mid = (lo + hi) // 2
            if best[mid] < x:
                lo = mid + 1
            else:
                hi = mid
        best[lo:lo + 1] = [x]
    return len(best)
"""
LIS_INPUTS = [
    [3, 10, 2, 1, 20],
    [50, 3, 10, 7, 40, 80],
    [1, 2, 3, 4],
    [4, 3, 2, 1],
    list(range(200, 0, -3)) + [5, 6],
]
LIS_OUTPUTS = [3, 4, 4, 1, 3]
CHECK = (
    "def check(candidate):\n"
    f"    cases = {list(zip(LIS_INPUTS, LIS_OUTPUTS, strict=True))!r}\n"
    "    for xs, want in cases:\n"
    "        assert candidate(xs) == want\n"
)

WORKLOADS = {
    "trivial": ('print("hello")\n', {"inputs": [""], "outputs": ["hello\n"]}),
    "call-5": (LIS, {"fn_name": "lis", "inputs": [[x] for x in LIS_INPUTS], "outputs": LIS_OUTPUTS}),
    "stdio-5": (
        LIS + "print(lis(list(map(int, input().split()))))\n",
        {
            "inputs": [" ".join(map(str, x)) + "\n" for x in LIS_INPUTS],
            "outputs": [f"{y}\n" for y in LIS_OUTPUTS],
        },
    ),
    "assert-5": (
        LIS,
        {"asserts": [f"assert lis({x!r}) == {y}" for x, y in zip(LIS_INPUTS, LIS_OUTPUTS, strict=True)]},
    ),
    "check-5": (LIS, {"asserts": [CHECK + "check(lis)\n"]}),
}


def scorer_rate_and_cpu(scorer: CodeSandboxScorer, name: str, concurrency: int, seconds: float):
    """``rate_and_cpu`` of the scorer on workload ``name``: its sandboxes are started within the window (the first
    call starts the pool) and closed at its end, so every start and every run is counted."""
    scorer.close()
    return rate_and_cpu(scorer_runner(scorer, name), concurrency, seconds, finish=scorer.close)


def bare_runner(python: str, name: str):
    code, tests = WORKLOADS[name]
    if name in ("assert-5", "check-5"):
        driver = code + "\n" + "\n".join(tests["asserts"]) + "\n"

        def work() -> None:
            subprocess.run([python, "-I", "-S", "-c", driver], capture_output=True, check=True)

        return work
    if name == "call-5":
        driver = code + f"\nimport json\nprint(json.dumps([lis(*a) for a in {tests['inputs']!r}]))\n"

        def work() -> None:
            out = subprocess.run([python, "-I", "-S", "-c", driver], capture_output=True, check=True).stdout
            assert json.loads(out) == tests["outputs"]

        return work

    def work() -> None:
        for stdin, expected in zip(tests["inputs"], tests["outputs"], strict=True):
            out = subprocess.run([python, "-I", "-S", "-c", code], input=stdin.encode(), capture_output=True)
            assert out.stdout.decode() == expected

    return work


class ColdStarts:
    """Stands in for the scorer's pool: each run's sandboxes started at request time instead of ahead."""

    def __init__(self, spec) -> None:
        self.spec = spec

    def _started(self) -> Sandbox:
        sandbox = Sandbox(self.spec)
        sandbox.wait_ready(30.0)
        return sandbox

    def run(self, job: dict, stdin: bytes = b"", timeout_s: float | None = None):
        limits = self.spec.limits
        return self._started().run(job, stdin, limits.output_bytes, min(limits.timeout_s, timeout_s or 1e9))

    def run_checked(self, program_job: dict, checker_job: dict, timeout_s: float | None = None):
        limits = self.spec.limits
        program, checker = self._started(), self._started()
        timeout = min(limits.timeout_s, timeout_s or 1e9)
        outcomes, reusable = run_checked(
            program, checker, program_job, checker_job, limits.output_bytes, timeout
        )
        if reusable:
            checker.kill()
        return outcomes


class ColdScorer(CodeSandboxScorer):
    """The scorer's own judging, on sandboxes started at request time."""

    def _executor_here(self):
        return ColdStarts(self.spec)


class TimedStarts(ColdStarts):
    """ColdStarts that adds up the seconds of each part of a run: starting the sandbox (the process, the
    namespaces, the harness up and ready) and running the job in it (hand-over, the program, its report)."""

    def __init__(self, spec) -> None:
        super().__init__(spec)
        self.start_s = self.run_s = 0.0

    def run(self, job: dict, stdin: bytes = b"", timeout_s: float | None = None):
        limits = self.spec.limits
        t0 = time.perf_counter()
        sandbox = self._started()
        t1 = time.perf_counter()
        out = sandbox.run(job, stdin, limits.output_bytes, min(limits.timeout_s, timeout_s or 1e9))
        self.start_s += t1 - t0
        self.run_s += time.perf_counter() - t1
        return out


def cost_split(name: str, samples: int, isolated: bool = True) -> dict[str, float]:
    """Median-free totals over `samples` sequential samples of workload `name` (trivial, call-5 or stdio-5), in
    milliseconds per sample: ``start`` (sandbox start-up), ``run`` (job in the started sandbox), ``judge`` (the
    scorer's own work: parsing tests, building jobs, comparing outputs), ``total`` and ``cpu``. ``isolated``
    False: the same harness and judging without bubblewrap, seccomp or cgroups (the harness's own cost)."""
    import dataclasses

    base = CodeSandboxScorer(concurrency=1)
    spec = base.spec
    base.close()
    if not isolated:
        spec = dataclasses.replace(spec, bwrap=None, seccomp=None, memory_cgroups=None)
    starts = TimedStarts(spec)

    class Scorer(CodeSandboxScorer):
        def _executor_here(self):
            return starts

    scorer = Scorer(concurrency=1)
    work = scorer_runner(scorer, name)
    work()  # warm-up: imports, the first parse
    starts.start_s = starts.run_s = 0.0
    cpu0, t0 = cpu_seconds(), time.perf_counter()
    for _ in range(samples):
        work()
    total, cpu = time.perf_counter() - t0, cpu_seconds() - cpu0
    ms = 1000 / samples
    return {
        "start": starts.start_s * ms,
        "run": starts.run_s * ms,
        "judge": (total - starts.start_s - starts.run_s) * ms,
        "total": total * ms,
        "cpu": cpu * ms,
    }


def zygote_cost(name: str, samples: int) -> dict[str, float]:
    """Milliseconds per sample, wall and CPU, of the scorer as configured by default (reused zygote sandboxes, so
    no start on a run's path), `samples` one after the other; the pool's starts and close are counted in both."""
    scorer = CodeSandboxScorer(concurrency=1)
    work = scorer_runner(scorer, name)
    work()  # warm-up: imports, the first parse
    scorer.close()
    cpu0, t0 = cpu_seconds(), time.perf_counter()
    for _ in range(samples):
        work()
    scorer.close()
    ms = 1000 / samples
    return {"total": (time.perf_counter() - t0) * ms, "cpu": (cpu_seconds() - cpu0) * ms}


def bare_cost(python: str, name: str, samples: int) -> dict[str, float]:
    """Milliseconds per sample of `bare_runner`, wall and CPU (this process and its children)."""
    work = bare_runner(python, name)
    work()
    cpu0, t0 = cpu_seconds(), time.perf_counter()
    for _ in range(samples):
        work()
    ms = 1000 / samples
    return {"total": (time.perf_counter() - t0) * ms, "cpu": (cpu_seconds() - cpu0) * ms}


def scorer_runner(scorer: CodeSandboxScorer, name: str):
    code, tests = WORKLOADS[name]
    text = json.dumps(tests)

    def work() -> None:
        assert scorer.score(code, "", test_cases=text).correct

    return work


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="measuring time per figure")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument(
        "--pool-size", type=int, default=None, help="sandboxes started ahead (default 2x conc)"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="each figure is measured in this many turns, the sides alternating",
    )
    parser.add_argument(
        "--quiet-wait", type=float, default=60.0, help="seconds to wait for a quiet machine before measuring"
    )
    args = parser.parse_args(argv)
    print(
        f"cpus: {os.cpu_count()}  seconds per figure: {args.seconds} in {args.rounds} turns"
        f"  pool size: {args.pool_size or '2x conc'}  {wait_for_quiet(args.quiet_wait)}"
    )
    print(
        f"{'workload':<9} {'conc':>4} {'zygote/s':>9} {'strict/s':>9} {'bare/s':>8}  zygote/bare  strict/bare"
        "  zygote CPU ms  bare CPU ms  load(1 min)"
    )
    for name in WORKLOADS:
        for concurrency in args.concurrency:
            sides = {
                "zygote": CodeSandboxScorer(concurrency=concurrency, pool_size=args.pool_size),
                "strict": CodeSandboxScorer(
                    concurrency=concurrency, pool_size=args.pool_size, isolation="strict"
                ),
            }
            totals = {side: [0.0, 0.0] for side in (*sides, "bare")}
            turn = args.seconds / args.rounds
            try:
                for r in range(args.rounds):
                    order = list(totals) if r % 2 == 0 else list(reversed(totals))
                    for side in order:
                        if side == "bare":
                            figure = rate_and_cpu(
                                bare_runner(sides["zygote"].spec.python, name), concurrency, turn
                            )
                        else:
                            figure = scorer_rate_and_cpu(sides[side], name, concurrency, turn)
                        totals[side][0] += figure[0] / args.rounds
                        totals[side][1] += figure[1] / args.rounds
            finally:
                for scorer in sides.values():
                    scorer.close()
            zygote, strict, bare = (totals[k] for k in ("zygote", "strict", "bare"))
            print(
                f"{name:<9} {concurrency:>4} {zygote[0]:>9.1f} {strict[0]:>9.1f} {bare[0]:>8.1f}"
                f"  {zygote[0] / bare[0]:>11.2f}  {strict[0] / bare[0]:>11.2f}  {zygote[1]:>13.1f}"
                f"  {bare[1]:>11.1f}  {os.getloadavg()[0]:>11.2f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""All of a sample's stdin/stdout tests in one run of a reused sandbox (``stdio_tests``): the program compiled
once, a forked child per test. Verdicts are those of a run per test, nothing a test leaves reaches the next,
and the process that runs the tests is out of the tests' reach."""

from __future__ import annotations

import json

import pytest

from tests.test_code_sandbox_zygote import CLEAN, RESIDUE, no_leftovers
from workers.rewards.code_sandbox import CodeSandboxScorer
from workers.rewards.sandbox.formats import parse_test_cases
from workers.rewards.sandbox.layers import IsolationUnavailable
from workers.rewards.sandbox.prestarted import SandboxPool
from workers.rewards.sandbox.process import EXITED, OUTPUT_LIMIT, TIMEOUT, RunOutput, SandboxUnavailable
from workers.rewards.sandbox.stdio_tests import output_budget, per_test_outputs, stdio_tests_job

# The tests' parent (the run's process) is there too in a batched run: it is the only other process allowed.
RESIDUE_BESIDE_PARENT = RESIDUE.replace("(1, os.getpid())", "(1, os.getpid(), os.getppid())")


@pytest.fixture(scope="module")
def scorer():
    try:
        # The limits are wall clock: 4 s a test, where every program but the one that sleeps 30 s takes
        # milliseconds (the memory program wrote 384 MiB to pass before, and under a full background load ran past
        # a 1 s limit, 2026-11-28, and past 4 s in loaded make tests, 2026-12-01 and 12-03: see PROGRAMS).
        scorer = CodeSandboxScorer(timeout_s=4.0, concurrency=1, sample_timeout_s=12.0)
    except IsolationUnavailable as err:
        pytest.skip(f"this host cannot isolate the sandbox: {err}")
    if not scorer.reuses():
        scorer.close()
        pytest.skip("stdin/stdout tests share a run only in reused sandboxes")
    yield scorer
    scorer.close()


def outcomes(scorer, code: str, inputs: list[str], outputs: list[str], batch_from: int) -> list[str]:
    scorer._BATCH_STDIO_FROM = batch_from
    try:
        return scorer.outcomes(parse_test_cases(json.dumps({"inputs": inputs, "outputs": outputs})), code)
    finally:
        scorer._BATCH_STDIO_FROM = CodeSandboxScorer._BATCH_STDIO_FROM


PROGRAMS = {
    "right": "print(sum(map(int, input().split())))",
    "wrong_on_one": "n = sum(map(int, input().split()))\nprint(n + (n == 7))",
    "crash_on_one": "n = sum(map(int, input().split()))\nassert n != 7\nprint(n)",
    "timeout_on_second": "import time\nn = sum(map(int, input().split()))\nif n == 7: time.sleep(30)\nprint(n)",
    "floods_on_one": "n = sum(map(int, input().split()))\nprint('x' * (2 << 20) if n == 3 else n)",
    "exit_fast": "import os, sys\nprint(sum(map(int, open(0).read().split())), flush=True)\nos._exit(0)",
    "exit_code": "import sys\nprint(sum(map(int, input().split())))\nsys.exit(1)",
    "quits": "print(sum(map(int, input().split())))\nexit()",
    # 48 MiB where it passes (n = 3), past the 512 MiB RLIMIT_AS where it must not (896 MiB, 2.3 GiB): refused at
    # once, no page written. It wrote 384 MiB to pass before (0.37 s idle), which under a loaded make test ran
    # past the 4 s limit and came out "timeout" (2026-12-01, 2026-12-03).
    "memory": "n = sum(map(int, input().split()))\nx = bytearray(n << (24 if n < 5 else 27))\nprint(n)",
    "stdout_closed": "import sys\nprint(sum(map(int, input().split())))\nsys.stdout.close()",
    "forges": (
        "import os\nos.write(3, b'{\"ev\": \"exit\", \"ok\": true}\\n{\"ev\": \"test\", \"i\": 2, \"status\": \"exited\"}\\n')"
        "\nprint(0)"
    ),
    "syntax": "print(",
}
INPUTS = ["1 2\n", "3 4\n", "5 6 7\n"]
OUTPUTS = ["3\n", "7\n", "18\n"]


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_verdicts_are_those_of_a_run_per_test(scorer, name):
    # Every program's tests take milliseconds but the one that sleeps 30 s on purpose, so no verdict here follows
    # the machine's load (the limit is 4 s a test).
    batched = outcomes(scorer, PROGRAMS[name], INPUTS, OUTPUTS, batch_from=2)
    alone = outcomes(scorer, PROGRAMS[name], INPUTS, OUTPUTS, batch_from=10**9)
    assert batched == alone


#: A few of the verdicts above, spelled out, so that equal-but-wrong on both paths cannot pass.
VERDICTS = {
    "right": ["passed"] * 3,
    "wrong_on_one": ["passed", "wrong_answer", "passed"],
    "crash_on_one": ["passed", "runtime_error", "passed"],
    "timeout_on_second": ["passed", "timeout", "timeout"],  # after a timeout, the rest too
    "floods_on_one": ["output_limit", "passed", "passed"],
    "exit_fast": ["passed"] * 3,
    "exit_code": ["runtime_error"] * 3,
    "quits": ["passed"] * 3,
    "memory": ["passed", "memory_limit", "memory_limit"],
    "forges": ["runtime_error"] * 3,  # two exit reports: the forged one and the harness's
    "syntax": ["syntax_error"] * 3,
}


@pytest.mark.parametrize("name", sorted(VERDICTS))
def test_the_verdicts_themselves(scorer, name):
    assert outcomes(scorer, PROGRAMS[name], INPUTS, OUTPUTS, batch_from=2) == VERDICTS[name]


def test_nothing_a_test_leaves_reaches_the_next(scorer):
    scorer.close()  # its sandboxes would count as left over (it starts others when next used)
    pool = SandboxPool(scorer.spec, concurrency=1)
    try:
        run = pool.run_tests(stdio_tests_job(RESIDUE_BESIDE_PARENT, [""] * 4, scorer.limits), 1 << 22, 8.0)
        after = pool.run({"mode": "stdio", "code": RESIDUE, "limits": scorer.limits.for_job()})
    finally:
        pool.close()
    reports = per_test_outputs(run, 4)
    assert [r.status for r in reports] == [EXITED] * 4, run.stderr[-500:]
    assert [json.loads(r.stdout) for r in reports] == [CLEAN] * 4
    assert json.loads(after.stdout) == CLEAN  # nor the next run in the sandbox
    assert no_leftovers()


PEEKS_AT_PARENT = r"""
import os
parent = os.getppid()
results = []
for attempt in (
    lambda: open(f"/proc/{parent}/mem", "r+b"),
    lambda: os.listdir(f"/proc/{parent}/fd"),
    lambda: open(f"/proc/{parent}/fd/1", "wb"),
    lambda: open(f"/proc/{parent}/environ", "rb").read(),
):
    try:
        attempt()
        results.append("done")
    except OSError as err:
        results.append(type(err).__name__)
print(results)
"""


def test_a_test_cannot_reach_into_the_process_that_runs_the_tests(scorer):
    # Not dumpable: its memory and descriptors (the worker's pipes, where it writes the reports) are closed to
    # the tests, as the zygote's are to a run.
    denied = str(["PermissionError"] * 4) + "\n"
    assert outcomes(scorer, PEEKS_AT_PARENT, ["", ""], [denied, denied], batch_from=2) == ["passed", "passed"]


def test_a_test_that_kills_the_tests_parent_fails_the_rest_and_the_sandbox_goes_on(scorer):
    kills = "import os, signal\nprint(1, flush=True)\nif input() == 'b': os.kill(os.getppid(), signal.SIGKILL)"
    assert outcomes(scorer, kills, ["a\n", "b\n", "c\n"], ["1\n"] * 3, batch_from=2) == [
        "passed",
        "runtime_error",
        "runtime_error",
    ]
    assert outcomes(scorer, PROGRAMS["right"], INPUTS, OUTPUTS, batch_from=2) == ["passed"] * 3


def test_one_run_per_sample(scorer):
    pool = scorer._executor_here()
    calls = []
    original = pool._run
    pool._run = lambda *args: calls.append(args[0]["mode"]) or original(*args)
    try:
        assert outcomes(scorer, PROGRAMS["right"], INPUTS, OUTPUTS, batch_from=2) == ["passed"] * 3
        assert outcomes(scorer, PROGRAMS["right"], INPUTS[:1], OUTPUTS[:1], batch_from=2) == ["passed"]
    finally:
        del pool._run
    assert calls == ["stdio_tests", "stdio"]  # a single test keeps its plain run (one fork fewer)


def test_a_pool_of_single_use_sandboxes_refuses_a_batch(scorer):
    pool = SandboxPool(scorer.spec, concurrency=1, reuse=False)
    try:
        with pytest.raises(ValueError, match="reused"):
            pool.run_tests(stdio_tests_job("print(1)", ["", ""], scorer.limits), 1 << 20, 2.0)
    finally:
        pool.close()


# ---- per_test_outputs, a pure function ----


def _run(events: list[dict], stdout: bytes = b"", status: str = EXITED, oom: bool = False) -> RunOutput:
    return RunOutput(status=status, stdout=stdout, events=events, exit_code=0, oom_killed=oom)


def _test(i: int, out: int, ch: int = 0, err: int = 0, status: str = EXITED, code: int | None = 0) -> dict:
    return {"ev": "test", "i": i, "status": status, "code": code, "out": out, "ch": ch, "err": err}


def test_outputs_are_cut_by_the_reported_lengths():
    channel = b'{"ev": "exit", "ok": true, "error": null}\n'
    stream = b"3\n" + channel + b"oops" + b"7\n" + channel
    got = per_test_outputs(_run([_test(0, 2, len(channel), 4), _test(1, 2, len(channel))], stream), 2)
    assert [g.stdout for g in got] == [b"3\n", b"7\n"]
    assert got[0].stderr == b"oops"
    assert got[1].events == [{"ev": "exit", "ok": True, "error": None}]


def test_outputs_of_tests_never_reported():
    # The run timed out: that test and the rest time out; the tests' parent died: runtime errors (or the memory
    # limit, when the cgroup killed for memory).
    assert [o.status for o in per_test_outputs(_run([_test(0, 0)], status=TIMEOUT), 3)] == [EXITED, TIMEOUT, TIMEOUT]
    died = per_test_outputs(_run([_test(0, 0)], oom=True), 2)[1]
    assert (died.status, died.exit_code, died.oom_killed) == (EXITED, None, True)
    after_timeout = per_test_outputs(_run([_test(0, 0, status=TIMEOUT, code=None)]), 2)
    assert [o.status for o in after_timeout] == [TIMEOUT, TIMEOUT]


def test_outputs_take_reports_in_order_and_refuse_what_does_not_add_up():
    # A report out of order, or with lengths past the stream, ends the reports: the rest fail.
    assert per_test_outputs(_run([_test(1, 0), _test(0, 0)]), 2)[1].exit_code is None
    assert per_test_outputs(_run([_test(0, 5)], b"abc"), 1)[0].exit_code is None
    assert per_test_outputs(_run([_test(0, 0, status="passed")]), 1)[0].exit_code is None
    # A CPU-limit kill is a timeout; only a SIGKILL under a cgroup OOM is the memory limit.
    cpu = per_test_outputs(_run([_test(0, 0, code=-24)]), 1)[0]
    assert cpu.status == TIMEOUT
    assert per_test_outputs(_run([_test(0, 0, code=-9)], oom=True), 1)[0].oom_killed
    assert not per_test_outputs(_run([_test(0, 0, code=-11)], oom=True), 1)[0].oom_killed
    assert per_test_outputs(_run([_test(0, 0, status=OUTPUT_LIMIT, code=None)]), 1)[0].status == OUTPUT_LIMIT


def test_outputs_of_a_program_that_does_not_compile_and_of_a_refusal():
    got = per_test_outputs(_run([{"ev": "syntax_error", "error": "SyntaxError"}]), 3)
    assert all(g.events == [{"ev": "syntax_error", "error": "SyntaxError"}] for g in got)
    with pytest.raises(SandboxUnavailable):
        per_test_outputs(_run([{"ev": "refused"}]), 1)


def test_output_budget_holds_every_test_at_its_limits():
    from workers.rewards.sandbox.isolation import SandboxLimits

    limits = SandboxLimits(output_bytes=1000)
    assert output_budget(3, limits) == 3 * (2000 + 4096) + 1000

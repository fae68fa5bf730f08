"""All of a sample's stdin/stdout tests in one run of a reused sandbox (the harness's ``stdio_tests`` job).

The run's process compiles the program once and forks a child per test (``harness._run_stdio_tests``); each
test's stdout, channel and stderr head come back one after another on the run's stdout, and an event per test
gives their lengths. ``per_test_outputs`` cuts that back into one ``RunOutput`` per test, the same a run of its own
would have given, so ``judge_stdio`` judges them unchanged. A test the run did not report (the run timed out,
or the program killed the process that runs its tests) fails: a timeout after a timeout, otherwise a runtime
error (or the memory limit when the sandbox's memory cgroup killed for memory). Events are claims of the
sandbox's user, as everywhere: they can turn a test into a failure, never into a pass.
"""

from __future__ import annotations

from workers.rewards.sandbox.isolation import SandboxLimits
from workers.rewards.sandbox.process import (
    EXITED,
    OUTPUT_LIMIT,
    TIMEOUT,
    RunOutput,
    SandboxUnavailable,
    parse_events,
)

#: Bytes of a test's stderr the harness forwards (``harness._STDERR_HEAD``).
STDERR_HEAD = 4096
_STATUSES = (EXITED, TIMEOUT, OUTPUT_LIMIT)
_SIGKILL = -9
_SIGXCPU = (-24, 128 + 24)


def stdio_tests_job(code: str, inputs: list[str], limits: SandboxLimits) -> dict:
    """The job: each test gets the limits' wall clock (its CPU limit is its own process's), its stdout, stderr
    and channel are each cut at ``output_bytes`` as a run's are."""
    return {
        "mode": "stdio_tests",
        "code": code,
        "inputs": list(inputs),
        "output_bytes": limits.output_bytes,
        "test_timeout_s": limits.timeout_s,
        "limits": limits.for_job(),
    }


def output_budget(tests: int, limits: SandboxLimits) -> int:
    """What the run may write to each of its outputs: every test's stdout and channel at their limits, and the
    stderr heads."""
    return tests * (2 * limits.output_bytes + STDERR_HEAD) + limits.output_bytes


def per_test_outputs(run: RunOutput, count: int) -> list[RunOutput]:
    """One ``RunOutput`` per test from the run's output (see the module docstring)."""
    if any(event.get("ev") == "refused" for event in run.events):
        raise SandboxUnavailable("the sandbox refused a stdio_tests job: it is not a reused sandbox's run")
    module = [event for event in run.events if event.get("ev") in ("syntax_error", "module_error")]
    if module:
        return [RunOutput(status=EXITED, events=module, exit_code=0) for _ in range(count)]
    outputs: list[RunOutput] = []
    offset = 0
    for event in run.events:
        if event.get("ev") != "test" or event.get("i") != len(outputs) or len(outputs) >= count:
            continue
        status, code = event.get("status"), event.get("code")
        sizes = [event.get(key) for key in ("out", "ch", "err")]
        if status not in _STATUSES or not all(type(n) is int and n >= 0 for n in sizes):
            break
        end = offset + sum(sizes)
        if end > len(run.stdout):
            break
        out, channel, err = (
            run.stdout[offset + sum(sizes[:k]) : offset + sum(sizes[: k + 1])] for k in range(3)
        )
        offset = end
        code = code if type(code) is int else None
        if status == EXITED and code in _SIGXCPU:
            status = TIMEOUT  # its CPU limit, as ``run_output`` counts it
        outputs.append(
            RunOutput(
                status=status,
                stdout=out,
                stderr=err,
                events=parse_events(channel),
                exit_code=code if status == EXITED else None,
                oom_killed=run.oom_killed and code == _SIGKILL,
            )
        )
    while len(outputs) < count:
        if run.status == TIMEOUT or (outputs and outputs[-1].status == TIMEOUT):
            outputs.append(RunOutput(status=TIMEOUT))
        else:
            outputs.append(RunOutput(status=EXITED, exit_code=None, oom_killed=run.oom_killed))
    return outputs

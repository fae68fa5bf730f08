"""Verdicts, decided in the worker from what the sandbox reported: pure functions over data.

Nothing the program made is trusted as an object: values arrive as tagged JSON (see ``harness.encode``), are
rebuilt here from plain built-in types only, and compared by code of the worker. Exit codes and the harness's
events are used only to find failures (a crash, a missing report), never as proof of a pass.

Comparison rules:

* call-based: ``values_match``. Booleans, strings and ``None`` must be equal and of the same type; an int expected
  needs that integer (an int, or a float that is exactly it: ``4.0`` for 4, never ``4.0000001``); a float
  expected matches any number within ``tolerance`` (relative or absolute); a JSON list matches a list or a tuple of matching items; a JSON object matches a dict
  with the same (string) keys and matching values.
* stdin/stdout: ``stdout_matches``. Both texts are split into lines; trailing whitespace on each line and trailing
  empty lines are ignored. Lines that still differ match if they have the same whitespace-separated tokens, where
  an expected integer token needs a token of exactly that value (``3``, ``3.0``, ``+3``; compared as decimals, so
  any number of digits), and two other tokens that both parse as numbers may differ within ``tolerance``.
* assert-style and check-function tests: judged by the checker sandbox (``relay.py``), whose verdicts arrive
  here as outcomes (``judge_checked``).
"""

from __future__ import annotations

import math
import re
from decimal import Decimal, InvalidOperation

from workers.rewards.sandbox.formats import CallTests
from workers.rewards.sandbox.harness import decode
from workers.rewards.sandbox.process import OUTPUT_LIMIT, TIMEOUT, RunOutput

PASSED = "passed"
SYNTAX_ERROR = "syntax_error"
RUNTIME_ERROR = "runtime_error"
MEMORY_LIMIT = "memory_limit"
WRONG_ANSWER = "wrong_answer"
#: Every way a test can fail, in the order they are listed as metrics.
FAILURE_KINDS = (SYNTAX_ERROR, RUNTIME_ERROR, TIMEOUT, MEMORY_LIMIT, OUTPUT_LIMIT, WRONG_ANSWER)

_INTEGER = re.compile(r"[+-]?\d+")


class UnsupportedTest(ValueError):
    """A test the checker cannot run without handing the program more than plain data."""


def error_kind(name: object) -> str:
    """The failure kind of an exception the harness named (``Unreportable``: a value that is not plain data)."""
    if name == "MemoryError":
        return MEMORY_LIMIT
    if name == "Unreportable":
        return WRONG_ANSWER
    return RUNTIME_ERROR


def values_match(actual: object, expected: object, tolerance: float) -> bool:
    """Whether a returned value matches the expected JSON value (rules in the module docstring)."""
    if expected is None or isinstance(expected, bool | str):
        return type(actual) is type(expected) and actual == expected
    if isinstance(expected, int | float):
        if type(actual) not in (int, float):
            return False
        if type(expected) is int:
            # An integer answer is that integer: an integral float equal to it, and nothing within a tolerance.
            return (
                actual == expected if type(actual) is int else actual.is_integer() and int(actual) == expected
            )
        try:
            return math.isclose(float(actual), float(expected), rel_tol=tolerance, abs_tol=tolerance)
        except OverflowError:
            return False
    if isinstance(expected, list):
        return (
            type(actual) in (list, tuple)
            and len(actual) == len(expected)
            and all(values_match(a, e, tolerance) for a, e in zip(actual, expected, strict=True))
        )
    if isinstance(expected, dict):
        return (
            type(actual) is dict
            and set(actual) == set(expected)
            and all(values_match(actual[k], expected[k], tolerance) for k in expected)
        )
    return False


def _exact_number(token: str) -> Decimal | None:
    try:
        number = Decimal(token)
    except InvalidOperation:
        return None
    return number if number.is_finite() else None


def _tokens_match(got: str, want: str, tolerance: float) -> bool:
    if got == want:
        return True
    if _INTEGER.fullmatch(want):
        # Exact decimal arithmetic: no digit limit (int() refuses 5000 digits) and no float rounding.
        number = _exact_number(got)
        return number is not None and number == Decimal(want)
    try:
        a, b = float(got), float(want)
    except ValueError:
        return False
    return math.isfinite(a) and math.isfinite(b) and math.isclose(a, b, rel_tol=tolerance, abs_tol=tolerance)


def stdout_matches(got: str, want: str, tolerance: float) -> bool:
    """Whether a program's stdout matches the expected output (rules in the module docstring)."""
    got_lines = [line.rstrip() for line in got.splitlines()]
    want_lines = [line.rstrip() for line in want.splitlines()]
    while got_lines and not got_lines[-1]:
        got_lines.pop()
    while want_lines and not want_lines[-1]:
        want_lines.pop()
    if len(got_lines) != len(want_lines):
        return False
    for got_line, want_line in zip(got_lines, want_lines, strict=True):
        if got_line == want_line:
            continue
        got_tokens, want_tokens = got_line.split(), want_line.split()
        if len(got_tokens) != len(want_tokens) or not all(
            _tokens_match(g, w, tolerance) for g, w in zip(got_tokens, want_tokens, strict=True)
        ):
            return False
    return True


# ---- verdicts per test ----


def _run_failure(output: RunOutput) -> str:
    """Why a test that got no report failed."""
    if output.status in (TIMEOUT, OUTPUT_LIMIT):
        return output.status
    return MEMORY_LIMIT if output.oom_killed else RUNTIME_ERROR


def module_failure(event: dict) -> str | None:
    """The failure of the program's whole module an event of the harness reports, or None for other events."""
    if event.get("ev") == "syntax_error":
        return SYNTAX_ERROR
    if event.get("ev") == "module_error":
        return error_kind(event.get("error"))
    return None


def _module_failure(output: RunOutput) -> str | None:
    for event in output.events:
        failure = module_failure(event)
        if failure is not None:
            return failure
    return None


def _reports(output: RunOutput, count: int) -> list[list[dict]]:
    reports: list[list[dict]] = [[] for _ in range(count)]
    for event in output.events:
        test = event.get("t")
        if type(test) is int and 0 <= test < count:
            reports[test].append(event)
    return reports


def judge_calls(suite: CallTests, output: RunOutput, tolerance: float) -> list[str]:
    """One outcome per call of a call-based suite, from the single run that made all the calls."""
    failure = _module_failure(output)
    if failure is not None:
        return [failure] * len(suite.inputs)
    outcomes = []
    for report, expected in zip(_reports(output, len(suite.inputs)), suite.outputs, strict=True):
        if not report:
            outcomes.append(_run_failure(output))
        elif len(report) > 1:
            # Two reports for one call: someone other than the harness wrote to the channel.
            outcomes.append(WRONG_ANSWER)
        elif "v" in report[0]:
            try:
                actual = decode(report[0]["v"])
            except (ValueError, TypeError, RecursionError):
                outcomes.append(WRONG_ANSWER)
                continue
            outcomes.append(PASSED if values_match(actual, expected, tolerance) else WRONG_ANSWER)
        else:
            outcomes.append(error_kind(report[0].get("e")))
    return outcomes


def judge_checked(outcomes: list[str]) -> list[str]:
    """The checker's outcomes, as verdicts; raises ``UnsupportedTest`` when a test could not be run as written
    (it handed the program something that is not plain data: a fault of the dataset, not of the program)."""
    for outcome in outcomes:
        if outcome.startswith("unsupported"):
            raise UnsupportedTest(outcome.partition(": ")[2] or outcome)
    return [
        outcome if outcome in FAILURE_KINDS or outcome == PASSED else RUNTIME_ERROR for outcome in outcomes
    ]


def judge_stdio(expected: str, output: RunOutput, tolerance: float) -> str:
    """The outcome of one stdin/stdout test: the program must end cleanly and print the expected output."""
    failure = _module_failure(output)
    if failure is not None:
        return failure
    if output.status != "exited":
        return output.status
    exits = [e for e in output.events if e.get("ev") == "exit"]
    if exits:
        if len(exits) > 1 or exits[0].get("ok") is not True:
            return error_kind(exits[0].get("error")) if len(exits) == 1 else RUNTIME_ERROR
    elif output.exit_code != 0:
        # Ended without the harness's exit report and not with status 0: killed, or crashed in C.
        return MEMORY_LIMIT if output.oom_killed else RUNTIME_ERROR
    got = output.stdout.decode("utf-8", errors="replace")
    return PASSED if stdout_matches(got, expected, tolerance) else WRONG_ANSWER

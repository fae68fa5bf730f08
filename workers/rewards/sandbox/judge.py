"""Verdicts, decided in the worker from what the sandbox reported: pure functions over data.

Nothing the program made is trusted as an object: values arrive as tagged JSON (see ``harness.encode``), are
rebuilt here from plain built-in types only, and compared by code of the worker. Exit codes and the harness's
events are used only to find failures (a crash, a missing report), never as proof of a pass.

Comparison rules:

* call-based: ``values_match``. Booleans, strings and ``None`` must be equal and of the same type; an int expected
  needs an equal int; any other number (float expected, or float returned) matches within ``tolerance``
  (relative or absolute); a JSON list matches a list or a tuple of matching items; a JSON object matches a dict
  with the same (string) keys and matching values.
* stdin/stdout: ``stdout_matches``. Both texts are split into lines; trailing whitespace on each line and trailing
  empty lines are ignored. Lines that still differ match if they have the same whitespace-separated tokens, where
  two tokens that both parse as numbers (and are not both integers) may differ within ``tolerance``; integers
  must be equal.
* assert-style: the assert's own comparison, applied by the worker to the rebuilt operand values.
"""

from __future__ import annotations

import ast
import math
import operator
import re
from collections.abc import Callable

from workers.rewards.sandbox.formats import PROBE_PREFIX, AssertTests, CallTests
from workers.rewards.sandbox.process import OUTPUT_LIMIT, TIMEOUT, RunOutput

PASSED = "passed"
SYNTAX_ERROR = "syntax_error"
RUNTIME_ERROR = "runtime_error"
MEMORY_LIMIT = "memory_limit"
WRONG_ANSWER = "wrong_answer"
#: Every way a test can fail, in the order they are listed as metrics.
FAILURE_KINDS = (SYNTAX_ERROR, RUNTIME_ERROR, TIMEOUT, MEMORY_LIMIT, OUTPUT_LIMIT, WRONG_ANSWER)

_INTEGER = re.compile(r"[+-]?\d+")
_MAX_SEQUENCE_RESULT = 1_000_000


class _Fail(Exception):
    """A check could not be evaluated: the test fails with ``kind``."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.kind = kind


def error_kind(name: object) -> str:
    """The failure kind of an exception the harness named (``Unreportable``: a value that is not plain data)."""
    if name == "MemoryError":
        return MEMORY_LIMIT
    if name == "Unreportable":
        return WRONG_ANSWER
    return RUNTIME_ERROR


def decode(value: object, depth: int = 0) -> object:
    """Rebuild a value from the harness's tagged JSON; raises ``ValueError`` on anything malformed."""
    if depth > 200:
        raise ValueError("value nested too deeply")
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list):
        return [decode(v, depth + 1) for v in value]
    if not isinstance(value, dict) or set(value) != {"__t", "v"}:
        raise ValueError("malformed value")
    tag, items = value["__t"], value["v"]
    if tag == "bytes" and isinstance(items, str):
        return bytes.fromhex(items)
    if tag == "int" and isinstance(items, str):
        return int(items, 16)
    if not isinstance(items, list):
        raise ValueError("malformed value")
    if tag == "tuple":
        return tuple(decode(v, depth + 1) for v in items)
    if tag == "set":
        return {decode(v, depth + 1) for v in items}
    if tag == "frozenset":
        return frozenset(decode(v, depth + 1) for v in items)
    if tag == "dict":
        if not all(isinstance(kv, list) and len(kv) == 2 for kv in items):
            raise ValueError("malformed dict")
        return {decode(k, depth + 1): decode(v, depth + 1) for k, v in items}
    raise ValueError(f"unknown tag {tag!r}")


def values_match(actual: object, expected: object, tolerance: float) -> bool:
    """Whether a returned value matches the expected JSON value (rules in the module docstring)."""
    if expected is None or isinstance(expected, bool | str):
        return type(actual) is type(expected) and actual == expected
    if isinstance(expected, int | float):
        if type(actual) not in (int, float):
            return False
        if type(actual) is int and type(expected) is int:
            return actual == expected
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


def _tokens_match(got: str, want: str, tolerance: float) -> bool:
    if got == want:
        return True
    if _INTEGER.fullmatch(got) and _INTEGER.fullmatch(want):
        return int(got) == int(want)
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


# ---- assert-style checks, evaluated in the worker ----

_COMPARE: dict[type, Callable[[object, object], object]] = {
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
    ast.In: lambda a, b: a in b,
    ast.NotIn: lambda a, b: a not in b,
    ast.Is: operator.is_,
    ast.IsNot: operator.is_not,
}
_BINARY: dict[type, Callable[[object, object], object]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
_FUNCTIONS: dict[str, Callable] = {
    "abs": abs,
    "all": all,
    "any": any,
    "bool": bool,
    "float": float,
    "frozenset": frozenset,
    "int": int,
    "len": len,
    "list": list,
    "max": max,
    "min": min,
    "round": round,
    "set": set,
    "sorted": sorted,
    "str": str,
    "sum": sum,
    "tuple": tuple,
    "math.isclose": math.isclose,
}
_TYPES = {t.__name__: t for t in (bool, bytes, dict, float, frozenset, int, list, set, str, tuple)}


def _binary(op: type, left: object, right: object) -> object:
    numbers = all(type(v) in (int, float, bool) for v in (left, right))
    if op is ast.Add and not numbers:
        if type(left) is not type(right) or type(left) not in (str, list, tuple, bytes):
            raise _Fail(WRONG_ANSWER)
    elif op is ast.Mult and not numbers:
        # Sequence repetition, bounded: the operands come from the program.
        sequence, count = (left, right) if type(right) is int else (right, left)
        if type(count) is not int or type(sequence) not in (str, list, tuple, bytes):
            raise _Fail(WRONG_ANSWER)
        if len(sequence) * max(count, 0) > _MAX_SEQUENCE_RESULT:
            raise _Fail(WRONG_ANSWER)
    elif not numbers:
        raise _Fail(WRONG_ANSWER)
    return _BINARY[op](left, right)


def evaluate_check(node: ast.expr, probes: list[dict]) -> object:
    """Evaluate a split assert's check over the reported probe values; raises ``_Fail`` when the test fails."""
    if isinstance(node, ast.Name) and node.id.startswith(PROBE_PREFIX):
        index = int(node.id[len(PROBE_PREFIX) :])
        if index >= len(probes) or not isinstance(probes[index], dict):
            raise _Fail(RUNTIME_ERROR)
        probe = probes[index]
        if "v" in probe:
            try:
                return decode(probe["v"])
            except (ValueError, TypeError, RecursionError):
                raise _Fail(WRONG_ANSWER) from None
        raise _Fail(error_kind(probe.get("e")))
    if isinstance(node, ast.Compare):
        left = evaluate_check(node.left, probes)
        for op, comparator in zip(node.ops, node.comparators, strict=True):
            right = evaluate_check(comparator, probes)
            if not _COMPARE[type(op)](left, right):
                return False
            left = right
        return True
    if isinstance(node, ast.BoolOp):
        value: object = None
        for child in node.values:
            value = evaluate_check(child, probes)
            if isinstance(node.op, ast.And) != bool(value):
                return value
        return value
    if isinstance(node, ast.UnaryOp):
        operand = evaluate_check(node.operand, probes)
        if isinstance(node.op, ast.Not):
            return not operand
        if type(operand) not in (int, float, bool):
            raise _Fail(WRONG_ANSWER)
        return -operand if isinstance(node.op, ast.USub) else +operand
    if isinstance(node, ast.BinOp):
        return _binary(type(node.op), evaluate_check(node.left, probes), evaluate_check(node.right, probes))
    if isinstance(node, ast.List | ast.Tuple | ast.Set):
        items = [evaluate_check(e, probes) for e in node.elts]
        return {ast.List: list, ast.Tuple: tuple, ast.Set: set}[type(node)](items)
    if isinstance(node, ast.Dict):
        return {
            evaluate_check(k, probes): evaluate_check(v, probes)
            for k, v in zip(node.keys, node.values, strict=True)
        }
    if isinstance(node, ast.Call):
        name = ast.unparse(node.func)
        if name == "isinstance":
            types = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
            return isinstance(evaluate_check(node.args[0], probes), tuple(_TYPES[t.id] for t in types))
        args = [evaluate_check(a, probes) for a in node.args]
        kwargs = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
        return _FUNCTIONS[name](*args, **kwargs)
    return ast.literal_eval(node)


def _check_passes(check: ast.expr, probes: list[dict]) -> str:
    try:
        return PASSED if evaluate_check(check, probes) else WRONG_ANSWER
    except _Fail as fail:
        return fail.kind
    # Operand values of the wrong type or shape for the assert's own operations.
    except (TypeError, ValueError, ArithmeticError, RecursionError, AttributeError, KeyError, IndexError):
        return WRONG_ANSWER


# ---- verdicts per test ----


def _run_failure(output: RunOutput) -> str:
    """Why a test that got no report failed."""
    if output.status in (TIMEOUT, OUTPUT_LIMIT):
        return output.status
    return RUNTIME_ERROR


def _module_failure(output: RunOutput) -> str | None:
    for event in output.events:
        if event.get("ev") == "syntax_error":
            return SYNTAX_ERROR
        if event.get("ev") == "module_error":
            return error_kind(event.get("error"))
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


def judge_asserts(suite: AssertTests, output: RunOutput) -> list[str]:
    """One outcome per assert-style test, from the single run that evaluated all the probes."""
    failure = _module_failure(output)
    if failure is not None:
        return [failure] * len(suite.tests)
    outcomes = []
    for report, test in zip(_reports(output, len(suite.tests)), suite.tests, strict=True):
        if not report:
            outcomes.append(_run_failure(output))
        elif len(report) > 1:
            outcomes.append(WRONG_ANSWER)
        elif "p" not in report[0] or not isinstance(report[0]["p"], list):
            outcomes.append(error_kind(report[0].get("e")))
        else:
            kinds = [_check_passes(check, report[0]["p"]) for check in test.checks]
            outcomes.append(next((k for k in kinds if k != PASSED), PASSED))
    return outcomes


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
        return RUNTIME_ERROR
    got = output.stdout.decode("utf-8", errors="replace")
    return PASSED if stdout_matches(got, expected, tolerance) else WRONG_ANSWER

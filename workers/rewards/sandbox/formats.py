"""The ``test_cases`` schema: the shapes of test real datasets use, parsed and checked before anything runs.

``test_cases`` is JSON (text, or an already decoded object) in one of four shapes:

* assert-style (MBPP and the like): ``{"asserts": ["assert f(2) == 4", ...]}``. Each string is one test: any
  Python statements (asserts, loops, comprehensions, helper functions, computed expected values).
* check-function (HumanEval, MBPP+/EvalPlus): ``{"test": "def check(candidate): ...", "entry_point": "f"}``.
  The source defines ``check``; the test is ``check(f)``, with ``f`` the program's function ``entry_point``.
  Both of these shapes take an optional ``"setup"``: code of the dataset's own (imports, helper functions
  such as HumanEval's ``poly``) run before each test, where the program cannot reach it.
* call-based: ``{"fn_name": "f", "inputs": [[2], [3]], "outputs": [4, 9]}``. ``inputs[i]`` is the JSON list of
  positional arguments of call ``i``, ``outputs[i]`` the JSON of its expected return value. ``fn_name`` names a
  top-level function or, LeetCode style, a method of a top-level class ``Solution``.
* stdin/stdout: ``{"inputs": ["1 2\\n", ...], "outputs": ["3\\n", ...]}`` (no ``fn_name``; the APPS /
  LiveCodeBench shape). Each test runs the program afresh with ``inputs[i]`` on stdin.

Expected values never enter the program's interpreter. Call-based and stdin/stdout tests only send it inputs and
are judged by the worker. Assert-style and check-function tests run in a second sandbox, the checker, that asks the
program for each name the test does not define itself and gets plain data back (``relay.py``): every comparison,
expected value and helper runs there, in Python's own semantics, on values the program cannot have tampered with.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass

_FENCED = re.compile(r"```[ \t]*(?P<lang>[A-Za-z0-9_+-]*)[^\n]*\n(?P<code>.*?)```", re.DOTALL)


@dataclass(frozen=True)
class CheckedTests:
    """Assert-style or check-function tests, run by the checker sandbox against the program."""

    #: The source of each test.
    tests: tuple[str, ...]
    #: Check-function tests: the program's function to pass to ``check``; ``None`` for assert-style tests.
    entry_point: str | None = None
    #: The dataset's own code, run in the checker before each test.
    setup: str = ""


@dataclass(frozen=True)
class CallTests:
    fn_name: str
    #: JSON text of each call's argument list (decoded afresh for every call in the sandbox).
    inputs: tuple[str, ...]
    outputs: tuple[object, ...]


@dataclass(frozen=True)
class StdioTests:
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]


TestSuite = CheckedTests | CallTests | StdioTests


def extract_code(response: str) -> str:
    """The last fenced ``python`` block of ``response``; else the last bare fenced block; else all of it."""
    blocks = [(m.group("lang").lower(), m.group("code")) for m in _FENCED.finditer(response)]
    python = [code for lang, code in blocks if lang in ("python", "py", "python3")]
    if python:
        return python[-1]
    bare = [code for lang, code in blocks if not lang]
    if bare:
        return bare[-1]
    return response


def parse_test_cases(test_cases: object) -> TestSuite:
    """Parse a ``test_cases`` field; raises ``ValueError`` saying what is wrong with it."""
    if isinstance(test_cases, str | bytes):
        try:
            test_cases = json.loads(test_cases)
        except json.JSONDecodeError as err:
            raise ValueError(f"test_cases is not JSON: {err}") from None
    if not isinstance(test_cases, dict):
        raise ValueError("test_cases must be a JSON object")
    if "asserts" in test_cases or "test" in test_cases:
        return _checked_tests(test_cases)
    inputs, outputs = test_cases.get("inputs"), test_cases.get("outputs")
    if not isinstance(inputs, list) or not isinstance(outputs, list) or not inputs:
        raise ValueError(
            'test_cases needs "asserts", "test" (with "entry_point"), or non-empty "inputs" and "outputs"'
        )
    if len(inputs) != len(outputs):
        raise ValueError(f"test_cases has {len(inputs)} inputs but {len(outputs)} outputs")
    if "fn_name" in test_cases:
        fn_name = test_cases["fn_name"]
        if not isinstance(fn_name, str) or not fn_name.isidentifier():
            raise ValueError("test_cases.fn_name must be a Python identifier")
        if not all(isinstance(args, list) for args in inputs):
            raise ValueError("test_cases.inputs must hold one JSON list of arguments per call")
        return CallTests(fn_name, tuple(json.dumps(args) for args in inputs), tuple(outputs))
    if not all(isinstance(x, str) for x in inputs + outputs):
        raise ValueError("stdin/stdout test_cases.inputs and outputs must be strings")
    return StdioTests(tuple(inputs), tuple(outputs))


def _checked_tests(test_cases: dict) -> CheckedTests:
    setup = test_cases.get("setup", "")
    if not isinstance(setup, str):
        raise ValueError("test_cases.setup must be a string of Python code")
    _compiles(setup, "test_cases.setup")
    if "asserts" in test_cases:
        asserts = test_cases["asserts"]
        if (
            not isinstance(asserts, list)
            or not asserts
            or not all(isinstance(a, str) and a.strip() for a in asserts)
        ):
            raise ValueError("test_cases.asserts must be a non-empty list of non-empty strings")
        for i, source in enumerate(asserts):
            _compiles(source, f"test_cases.asserts[{i}]")
        return CheckedTests(tuple(asserts), setup=setup)
    source, entry_point = test_cases["test"], test_cases.get("entry_point")
    if not isinstance(source, str):
        raise ValueError("test_cases.test must be a string of Python code defining check(candidate)")
    if not isinstance(entry_point, str) or not entry_point.isidentifier():
        raise ValueError("test_cases.test needs entry_point: the name of the program's function to check")
    tree = _compiles(source, "test_cases.test")
    if not any(isinstance(node, ast.FunctionDef) and node.name == "check" for node in tree.body):
        raise ValueError("test_cases.test must define a top-level function check(candidate)")
    return CheckedTests((source,), entry_point=entry_point, setup=setup)


def _compiles(source: str, where: str) -> ast.Module:
    try:
        tree = ast.parse(source)
        compile(tree, where, "exec")
    except SyntaxError as err:
        line = f": {err.text.strip()!r}" if err.text and err.text.strip() else ""
        raise ValueError(f"{where} is not valid Python: {err.msg} (line {err.lineno}{line})") from None
    return tree

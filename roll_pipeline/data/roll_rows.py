"""ROLL's RLVR data rows to this project's rows (`roll data import`).

ROLL's rows carry ``messages`` as JSON text and, for code, ``case_type`` with ``test_cases`` (JSON text of a list
of cases). Each case type becomes one of the sandbox's test shapes (workers/rewards/sandbox/formats.py):

- ``assert``: ``[{"assert_code": ...}]`` -> ``{"asserts": [...]}``, one test per case;
- ``pytest``: cases holding ``def test_...()`` functions -> asserts that define them and call each (ROLL runs them
  the same way); a function with parameters or a decorator (fixtures, parametrize) needs pytest itself: refused;
- ``check_based``: ``[{"assert_code": "def check(candidate): ...", "entry_point", "import_prefix"}]`` ->
  ``{"test", "entry_point", "setup"}``;
- ``input`` / ``stdin``: ``[{"stdin", "expected_stdout"}]`` -> ``{"inputs", "outputs"}``.

``text`` cases check the response's text, not a program (no sandbox test fits them), and any other case type is
unknown: such rows are refused, each with its line and reason, never dropped silently. Every other column is kept.
"""

from __future__ import annotations

import ast
import json
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class RowRefused(ValueError):
    """A ROLL row with no faithful equivalent here; the message says why."""


@dataclass
class ImportReport:
    """What an import did: rows written and refused per case type (rows without one count as ``none``), and each
    refused row's line and reason."""

    converted: Counter = field(default_factory=Counter)
    refused: Counter = field(default_factory=Counter)
    reasons: list[tuple[int, str]] = field(default_factory=list)


def _json(value: Any, name: str) -> Any:
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except ValueError as err:
        raise RowRefused(f"{name} is not valid JSON ({err})") from None


def _cases(row: dict[str, Any]) -> list[Any]:
    cases = _json(row.get("test_cases"), "test_cases")
    if not isinstance(cases, list) or not cases:
        raise RowRefused("test_cases must be a non-empty list of cases")
    return cases


def _code(case: Any, case_type: str) -> str:
    code = case.get("assert_code") if isinstance(case, dict) else case
    if not isinstance(code, str) or not code.strip():
        raise RowRefused(f"a {case_type} case without assert_code")
    return code


def _pytest_test(code: str) -> str:
    """The case's test functions, defined and called (no pytest needed), or RowRefused."""
    try:
        tree = ast.parse(code)
    except SyntaxError as err:
        raise RowRefused(f"a pytest case does not parse: {err.msg} (line {err.lineno})") from None
    tests = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")]
    if not tests:
        raise RowRefused("a pytest case defines no test_ function")
    for test in tests:
        if test.decorator_list or test.args.args or test.args.posonlyargs or test.args.kwonlyargs:
            raise RowRefused(f"{test.name} takes fixtures or parameters (decorators or arguments): it needs pytest")
    return code.rstrip() + "\n" + "".join(f"{t.name}()\n" for t in tests)


def sandbox_tests_for(case_type: str, row: dict[str, Any]) -> dict[str, Any]:
    """This project's test_cases for a ROLL code row of `case_type` (RowRefused when none fits)."""
    if case_type == "assert":
        return {"asserts": [_code(c, case_type) for c in _cases(row)]}
    if case_type == "pytest":
        return {"asserts": [_pytest_test(_code(c, case_type)) for c in _cases(row)]}
    if case_type == "check_based":
        cases = _cases(row)
        if len(cases) != 1 or not isinstance(cases[0], dict):
            raise RowRefused("a check_based row holds one case (its check function)")
        case = cases[0]
        entry = case.get("entry_point")
        if not isinstance(entry, str) or not entry:
            raise RowRefused("a check_based case needs its entry_point (the function check is called with)")
        return {"test": _code(case, case_type), "entry_point": entry, "setup": case.get("import_prefix") or ""}
    if case_type in ("input", "stdin"):
        cases = _cases(row)
        if not all(isinstance(c, dict) and "stdin" in c and "expected_stdout" in c for c in cases):
            raise RowRefused(f"an {case_type} case needs stdin and expected_stdout")
        return {"inputs": [c["stdin"] for c in cases], "outputs": [c["expected_stdout"] for c in cases]}
    if case_type == "text":
        raise RowRefused("text cases check the response's text, not a program; no sandbox test fits them")
    raise RowRefused(f"unknown case_type {case_type!r} (known: assert, pytest, check_based, input, stdin, text)")


def convert_row(row: dict[str, Any]) -> dict[str, Any]:
    """One ROLL row as this project's row: messages parsed, code tests mapped, the ROLL-only columns dropped."""
    out = {k: v for k, v in row.items() if k not in ("case_type", "test_case_function")}
    if "messages" in row:
        messages = _json(row["messages"], "messages")
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "content" in m for m in messages):
            raise RowRefused("messages must be a list of {role, content}")
        out["messages"] = messages
    elif not row.get("prompt"):
        raise RowRefused("the row has neither messages nor a prompt")
    case_type = row.get("case_type")
    if case_type:
        if row.get("test_case_function"):
            raise RowRefused("test_case_function (a function-call test) has no mapping here yet")
        out["test_cases"] = json.dumps(sandbox_tests_for(str(case_type), row))
    return out


def import_rows(
    rows: Iterable[tuple[int, dict[str, Any]]],
) -> tuple[list[dict[str, Any]], list[tuple[int, dict]], ImportReport]:
    """(converted rows, refused (line, row) pairs, the report), from (line, row) pairs."""
    converted, refused, report = [], [], ImportReport()
    for line, row in rows:
        kind = str(row.get("case_type") or "none")
        try:
            converted.append(convert_row(row))
            report.converted[kind] += 1
        except RowRefused as err:
            refused.append((line, row))
            report.refused[kind] += 1
            report.reasons.append((line, str(err)))
    return converted, refused, report


def read_jsonl(path: Path) -> list[tuple[int, dict[str, Any]]]:
    """(line, row) for each non-empty line of a JSONL file; RowRefused naming the line that is not an object."""
    rows = []
    for number, text in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not text.strip():
            continue
        try:
            row = json.loads(text)
        except ValueError as err:
            raise RowRefused(f"{path}:{number}: not a JSON object ({err})") from None
        if not isinstance(row, dict):
            raise RowRefused(f"{path}:{number}: not a JSON object")
        rows.append((number, row))
    return rows

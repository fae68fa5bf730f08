"""The ``test_cases`` schema, and how each kind of test is split between the sandbox and the worker.

``test_cases`` is JSON (text, or an already decoded object) in one of three shapes:

* assert-style: ``{"asserts": ["assert f(2) == 4", ...]}``. Each string is one test: Python statements ending in
  (or containing) ``assert`` statements, run after the solution in its namespace.
* call-based: ``{"fn_name": "f", "inputs": [[2], [3]], "outputs": [4, 9]}``. ``inputs[i]`` is the JSON list of
  positional arguments of call ``i``, ``outputs[i]`` the JSON of its expected return value. ``fn_name`` names a
  top-level function or, LeetCode style, a method of a top-level class ``Solution``.
* stdin/stdout: ``{"inputs": ["1 2\\n", ...], "outputs": ["3\\n", ...]}`` (no ``fn_name``; the APPS /
  LiveCodeBench shape). Each test runs the program afresh with ``inputs[i]`` on stdin.

Expected values never enter the sandbox. Call-based and stdin/stdout tests only send inputs. An assert is split
(``split_assert``): its comparison structure and its literal operands stay in the worker, and only the other
operands (``f(2)``, ``sorted(g(x))[0]``) go in as expressions whose values come back as data. So for
``assert f(2) == 4`` the sandbox evaluates ``f(2)`` and the worker checks ``value == 4``. The limit of this
scheme: an expected value that the test computes inside Python (``expected = g(2)`` in a setup statement, or
``assert f(2) == reference(2)``) is an expression like any other, so it is evaluated in the sandbox, where the
program could read or overwrite it. Write expected values as literals to keep them out of reach.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass

_FENCED = re.compile(r"```[ \t]*(?P<lang>[A-Za-z0-9_+-]*)[^\n]*\n(?P<code>.*?)```", re.DOTALL)

#: Functions the worker applies itself to operand values; any other call is evaluated in the sandbox.
OUTSIDE_FUNCTIONS = frozenset(
    {
        "abs",
        "all",
        "any",
        "bool",
        "float",
        "frozenset",
        "int",
        "isinstance",
        "len",
        "list",
        "max",
        "min",
        "round",
        "set",
        "sorted",
        "str",
        "sum",
        "tuple",
        "math.isclose",
    }
)
#: Keyword arguments those functions may take (their values must be literals).
OUTSIDE_KEYWORDS = {"sorted": {"reverse"}, "math.isclose": {"rel_tol", "abs_tol"}}
#: Type names ``isinstance`` may test against, outside.
OUTSIDE_TYPES = frozenset(
    {"bool", "bytes", "dict", "float", "frozenset", "int", "list", "set", "str", "tuple"}
)
_COMPARE_OPS = (ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE, ast.In, ast.NotIn, ast.Is, ast.IsNot)
_BIN_OPS = (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod)
_UNARY_OPS = (ast.Not, ast.USub, ast.UAdd)

#: Name prefix that stands for the value of probe ``i`` in a split assert.
PROBE_PREFIX = "__probe_"


@dataclass(frozen=True)
class AssertTest:
    """One assert-style test, split: ``steps`` run in the sandbox, ``checks`` are judged by the worker."""

    #: For the harness: ``{"exec": source}`` (setup statements) or ``{"eval": [expression, ...]}`` (probes).
    steps: tuple[dict, ...]
    #: One expression per assert, whose ``__probe_<i>`` names stand for the i-th probe value of this test.
    checks: tuple[ast.expr, ...]


@dataclass(frozen=True)
class AssertTests:
    tests: tuple[AssertTest, ...]


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


TestSuite = AssertTests | CallTests | StdioTests


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
    if "asserts" in test_cases:
        asserts = test_cases["asserts"]
        if not isinstance(asserts, list) or not asserts or not all(isinstance(a, str) for a in asserts):
            raise ValueError("test_cases.asserts must be a non-empty list of strings")
        return AssertTests(tuple(split_assert(source) for source in asserts))
    inputs, outputs = test_cases.get("inputs"), test_cases.get("outputs")
    if not isinstance(inputs, list) or not isinstance(outputs, list) or not inputs:
        raise ValueError('test_cases needs "asserts", or non-empty "inputs" and "outputs" lists')
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


def split_assert(source: str) -> AssertTest:
    """Split one assert-style test into sandbox steps and worker-side checks (see the module docstring)."""
    try:
        module = ast.parse(source)
    except SyntaxError as err:
        raise ValueError(
            f"assert-style test {source!r} is not valid Python: {err.msg} (line {err.lineno} of the test)"
        ) from None
    steps: list[dict] = []
    checks: list[ast.expr] = []
    setup: list[ast.stmt] = []
    probe_count = 0
    for statement in module.body:
        if not isinstance(statement, ast.Assert):
            setup.append(statement)
            continue
        if setup:
            steps.append({"exec": ast.unparse(ast.Module(body=setup, type_ignores=[]))})
            setup = []
        probes: list[str] = []
        checks.append(_outside(statement.test, probes, probe_count))
        probe_count += len(probes)
        steps.append({"eval": probes})
    if setup:
        steps.append({"exec": ast.unparse(ast.Module(body=setup, type_ignores=[]))})
    return AssertTest(tuple(steps), tuple(checks))


def _is_literal(node: ast.expr) -> bool:
    try:
        ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False
    return True


def _call_name(func: ast.expr) -> str | None:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
        return f"{func.value.id}.{func.attr}"
    return None


def _outside_call(node: ast.Call) -> bool:
    name = _call_name(node.func)
    if name not in OUTSIDE_FUNCTIONS or any(isinstance(a, ast.Starred) for a in node.args):
        return False
    allowed = OUTSIDE_KEYWORDS.get(name, set())
    if not all(k.arg in allowed and _is_literal(k.value) for k in node.keywords):
        return False
    if name == "isinstance":
        if len(node.args) != 2:
            return False
        types = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
        return all(isinstance(t, ast.Name) and t.id in OUTSIDE_TYPES for t in types)
    return True


def _outside(node: ast.expr, probes: list[str], offset: int) -> ast.expr:
    """``node`` with every subexpression the worker cannot evaluate itself replaced by a probe name."""

    def recurse(child: ast.expr) -> ast.expr:
        return _outside(child, probes, offset)

    if _is_literal(node):
        return node
    if isinstance(node, ast.Compare) and all(isinstance(op, _COMPARE_OPS) for op in node.ops):
        return ast.Compare(
            left=recurse(node.left), ops=node.ops, comparators=[recurse(c) for c in node.comparators]
        )
    if isinstance(node, ast.BoolOp):
        return ast.BoolOp(op=node.op, values=[recurse(v) for v in node.values])
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, _UNARY_OPS):
        return ast.UnaryOp(op=node.op, operand=recurse(node.operand))
    if isinstance(node, ast.BinOp) and isinstance(node.op, _BIN_OPS):
        return ast.BinOp(left=recurse(node.left), op=node.op, right=recurse(node.right))
    if isinstance(node, ast.List | ast.Tuple | ast.Set) and not any(
        isinstance(e, ast.Starred) for e in node.elts
    ):
        return type(node)(elts=[recurse(e) for e in node.elts], ctx=ast.Load())
    if isinstance(node, ast.Dict) and None not in node.keys:
        return ast.Dict(keys=[recurse(k) for k in node.keys], values=[recurse(v) for v in node.values])
    if isinstance(node, ast.Call) and _outside_call(node):
        if _call_name(node.func) == "isinstance":
            return ast.Call(func=node.func, args=[recurse(node.args[0]), node.args[1]], keywords=[])
        return ast.Call(func=node.func, args=[recurse(a) for a in node.args], keywords=node.keywords)
    probes.append(ast.unparse(node))
    return ast.Name(id=f"{PROBE_PREFIX}{offset + len(probes) - 1}", ctx=ast.Load())

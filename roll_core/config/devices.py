"""ROLL-style `device_mapping` strings and lists, parsed into GPU indices (without eval)."""

from __future__ import annotations

import ast

MAX_DEVICES = 65536
"""The longest device mapping accepted; a guard against `range(10**9)`-sized strings, far above real pools."""


def parse_device_mapping(value: list[int] | str) -> list[int]:
    """GPU indices from a list, or from ROLL's string forms, parsed without eval.

    Understood: a list or tuple of integers (`[0, 1, 2]`, `0, 1, 2`), `range(a, b[, step])`, `list(...)` of
    either, and `+` between any of them (`list(range(0, 4)) + list(range(8, 12))`). Anything else raises
    ValueError naming the part that was not understood."""
    if not isinstance(value, str):
        return list(value)
    try:
        tree = ast.parse(value.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(
            f"cannot parse {value!r}: write a list of GPU indices or list(range(start, stop))"
        ) from None
    devices = _devices_of(tree.body, value)
    if len(devices) > MAX_DEVICES:
        raise ValueError(f"{value!r} names {len(devices)} GPUs, more than the {MAX_DEVICES} accepted")
    return devices


def _devices_of(node: ast.expr, text: str) -> list[int]:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return [node.value]
    if isinstance(node, ast.List | ast.Tuple):
        return [_int_literal(elt, text) for elt in node.elts]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _devices_of(node.left, text) + _devices_of(node.right, text)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.keywords:
        if node.func.id == "list" and len(node.args) == 1:
            return _devices_of(node.args[0], text)
        if node.func.id == "range" and 1 <= len(node.args) <= 3:
            bounds = [_int_literal(arg, text) for arg in node.args]
            if len(bounds) == 3 and bounds[2] == 0:
                raise ValueError(f"{text!r}: range() step must not be 0")
            span = range(*bounds)
            if len(span) > MAX_DEVICES:
                raise ValueError(f"{text!r} names {len(span)} GPUs, more than the {MAX_DEVICES} accepted")
            return list(span)
    raise ValueError(
        f"{text!r}: {ast.unparse(node)!r} is not understood; write a list of GPU indices, range(a, b), "
        "list(range(a, b)) or a sum of those"
    )


def _int_literal(node: ast.expr, text: str) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    raise ValueError(f"{text!r}: {ast.unparse(node)!r} is not a whole number >= 0")

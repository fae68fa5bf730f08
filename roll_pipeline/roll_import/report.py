"""The import's report (mapped, changed meaning, not supported) and the context every key handler writes through:
each ROLL key it takes ends in exactly one line of the report, and each value it writes lands in the output."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from roll_pipeline.roll_import.hydra_yaml import RollTree, dig


def show(value: Any) -> str:
    """A value as the report prints it (YAML-like: lists in brackets, None as null)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {show(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(show(v) for v in value) + "]"
    return str(value)


@dataclass
class ImportReport:
    mapped: list[tuple[str, str]] = field(default_factory=list)
    """(ROLL key, what it became: `our.key: value`, or `(nothing here: why)` for a key with no effect here)."""
    changed: list[tuple[str, str]] = field(default_factory=list)
    """(ROLL key, the substitution that keeps ROLL's behaviour, or the difference that remains)."""
    unsupported: list[tuple[str, str]] = field(default_factory=list)
    """(ROLL key, why it has no equivalent here)."""

    def render(self) -> str:
        lines = []
        for title, rows, sep in (
            ("mapped", self.mapped, " -> "),
            ("changed meaning", self.changed, " -> "),
            ("not supported", self.unsupported, ": "),
        ):
            lines.append(f"{title} ({len(rows)}):")
            lines.extend(f"  {key}{sep}{what}" for key, what in rows)
        return "\n".join(lines)


class Importer:
    """The ROLL tree being read, the output being written and the report, with one method per kind of outcome."""

    def __init__(self, tree: RollTree) -> None:
        self.src = tree
        self.out: dict[str, Any] = {}
        self.report = ImportReport()
        self.flags: dict[str, Any] = {}
        """What one part of the import tells a later one (e.g. max_len_mask for every domain)."""

    def put(self, ours: str, value: Any) -> None:
        node = self.out
        *parents, last = ours.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value

    def ours(self, ours: str, default: Any = None) -> Any:
        """A value already written to the output (e.g. the group size, for a filter's bound)."""
        return dig(self.out, ours, default)

    def mapped(self, roll: str, ours: str, value: Any, note: str | None = None) -> None:
        """`roll` means what `ours` means: written as is (`note`: what the reader should know, in brackets)."""
        self.src.take(roll)
        self.put(ours, value)
        self.report.mapped.append((roll, f"{ours}: {show(value)}" + (f" ({note})" if note else "")))

    def move(self, roll: str, ours: str, convert: Any = None) -> None:
        """`mapped` when the ROLL config has `roll` (its value through `convert`), nothing otherwise."""
        if self.src.has(roll):
            value = self.src.get(roll)
            self.mapped(roll, ours, value if convert is None else convert(value))

    def part_of(self, roll: str, what: str) -> None:
        """`roll`, where present and not reported yet, went into a value reported under another key: `what` says
        which."""
        if self.src.has(roll) and not self.src.is_taken(roll):
            self.src.take(roll)
            self.report.mapped.append((roll, f"({what})"))

    def default(self, ours: str, value: Any, why: str) -> None:
        """A ROLL default that differs from ours, written so that the run keeps ROLL's behaviour."""
        self.put(ours, value)
        self.report.mapped.append(("(ROLL's default)", f"{ours}: {show(value)} ({why})"))

    def dropped(self, roll: str, why: str) -> None:
        """`roll` has no effect on what a run here trains or measures (a kernel, a log, a default); a key already
        reported (e.g. response_length, read as max_new_tokens) is not reported again."""
        if self.src.has(roll) and not self.src.is_taken(roll):
            self.src.take(roll)
            self.report.mapped.append((roll, f"(nothing here: {why})"))

    def changed(self, roll: str, ours: str | None, value: Any, how: str) -> None:
        """`roll` becomes `ours: value`, which is not the same key under the same name: `how` says what."""
        self.src.take(roll)
        if ours is not None:
            self.put(ours, value)
            self.report.changed.append((roll, f"{ours}: {show(value)}: {how}"))
        else:
            self.report.changed.append((roll, how))

    def refuse(self, roll: str, why: str) -> None:
        self.src.take(roll)
        self.report.unsupported.append((roll, why))

    def falsy_or_refuse(self, roll: str, why_default: str, why_refused: str) -> None:
        """A switch that is a no-op at ROLL's default (false, 0, null, empty) and unsupported otherwise."""
        if not self.src.has(roll):
            return
        if self.src.get(roll):
            self.refuse(roll, why_refused)
        else:
            self.dropped(roll, why_default)

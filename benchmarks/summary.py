"""The pure part of `make bench`: ratios with their spread, and the table and BENCHMARKS.md they are shown in.

Nothing here measures anything: the bench modules hand in the figures of each repetition, and every number in
the output is computed from them.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Spread:
    """Median and range of one figure over the repetitions."""

    median: float
    low: float
    high: float
    n: int

    def __str__(self) -> str:
        return f"{_num(self.median)} [{_num(self.low)}, {_num(self.high)}]"


def spread(values: Sequence[float]) -> Spread:
    if not values:
        raise ValueError("spread of no values")
    return Spread(statistics.median(values), min(values), max(values), len(values))


@dataclass(frozen=True)
class Comparison:
    """One figure measured for ours and for a reference (a peer, a bare loop, a base point), once per repetition;
    repetition i of both was taken in the same run, one right after the other."""

    name: str
    unit: str
    ours_label: str
    ours: tuple[float, ...]
    peer_label: str
    peer: tuple[float, ...]
    higher_is_better: bool | None = False
    """True for rates, False for times; None where neither is better (scaling points): no verdict."""

    def __post_init__(self) -> None:
        if len(self.ours) != len(self.peer) or not self.ours:
            raise ValueError(
                f"{self.name}: {len(self.ours)} figures for ours and {len(self.peer)} for the peer"
            )

    @property
    def ratios(self) -> tuple[float, ...]:
        """ours / peer, per repetition."""
        return tuple(o / p if p else float("inf") for o, p in zip(self.ours, self.peer, strict=True))

    def ratio(self) -> Spread:
        return spread(self.ratios)

    def verdict(self) -> str:
        """How ours compares, from the median ratio: '1.85x slower', '1.20x faster', or '' without a direction."""
        if self.higher_is_better is None:
            return ""
        r = self.ratio().median
        if r == 0 or r == float("inf"):
            return "n/a"
        factor = r if self.higher_is_better else 1 / r
        if abs(factor - 1) < 0.02:
            return "same (within 2%)"
        return f"{factor:.2f}x faster" if factor > 1 else f"{1 / factor:.2f}x slower"


@dataclass(frozen=True)
class Measure:
    """A figure that is no ratio (an accuracy), per label, one value per repetition."""

    name: str
    unit: str
    values: dict[str, tuple[float, ...]]


@dataclass
class Section:
    """One item of the report: its comparisons, its figures, and markdown paragraphs that explain them."""

    title: str
    setup: str = ""
    comparisons: list[Comparison] = field(default_factory=list)
    measures: list[Measure] = field(default_factory=list)
    details: list[str] = field(default_factory=list)
    error: str | None = None
    wall_s: float = 0.0


def _num(x: float) -> str:
    """Three significant figures, without scientific notation for the ranges seen here."""
    if x != x or x in (float("inf"), float("-inf")):
        return str(x)
    magnitude = abs(x)
    if magnitude >= 100:
        return f"{x:.0f}"
    if magnitude >= 10:
        return f"{x:.1f}"
    if magnitude >= 1:
        return f"{x:.2f}"
    return f"{x:.3f}"


def summary_rows(sections: Sequence[Section]) -> list[list[str]]:
    """One row per comparison and measure: item, figure, ours, reference, ratio, verdict."""
    rows = []
    for section in sections:
        item = section.title.split(" ", 1)[0].rstrip(".")
        if section.error:
            rows.append([item, "not measured", section.error.splitlines()[0][:80], "", "", ""])
            continue
        for c in section.comparisons:
            rows.append(
                [
                    item,
                    f"{c.name} ({c.unit})",
                    f"{c.ours_label}: {_num(spread(c.ours).median)}",
                    f"{c.peer_label}: {_num(spread(c.peer).median)}",
                    f"{c.ratio()} n={len(c.ours)}",
                    c.verdict(),
                ]
            )
        for m in section.measures:
            labels = list(m.values)
            cells = [f"{label}: {spread(v)}" for label, v in m.values.items()]
            rows.append(
                [
                    item,
                    f"{m.name} ({m.unit})",
                    cells[0],
                    "; ".join(cells[1:]),
                    f"n={len(m.values[labels[0]])}",
                    "",
                ]
            )
    return rows


HEADER = [
    "item",
    "figure",
    "ours (median)",
    "reference (median)",
    "ratio ours/ref median [min, max]",
    "verdict",
]


def render_table(rows: Sequence[Sequence[str]], header: Sequence[str] = HEADER) -> str:
    """A plain-text table, columns padded to their widest cell."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = [
        "  ".join(str(cell).ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in [header, *rows]
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown_table(rows: Sequence[Sequence[str]], header: Sequence[str]) -> str:
    def cell(x: object) -> str:
        return str(x).replace("|", "\\|")

    lines = ["| " + " | ".join(cell(h) for h in header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def per_repetition_table(c: Comparison) -> str:
    """Markdown: each repetition's two figures and their ratio."""
    rows = [
        [str(i + 1), _num(o), _num(p), f"{r:.3f}"]
        for i, (o, p, r) in enumerate(zip(c.ours, c.peer, c.ratios, strict=True))
    ]
    header = ["repetition", f"{c.ours_label} ({c.unit})", f"{c.peer_label} ({c.unit})", "ratio"]
    return f"{c.name}:\n\n" + markdown_table(rows, header)


def render_markdown(
    sections: Sequence[Section], *, command: str, date: str, machine: str, preamble: str = ""
) -> str:
    """BENCHMARKS.md: how and where it was produced, the summary table, then each item in full."""
    out = [
        "# Benchmarks",
        "",
        f"Written by `{command}` on {date}. Machine: {machine}.",
        "",
        "Every comparison below was measured side by side in that one run: each repetition measures ours and the "
        "reference one right after the other, and the ratio (ours / reference) is taken per repetition; the "
        "tables give its median and [min, max] over the repetitions, with the absolute medians for context. "
        "Nothing in this file is typed in by hand: `python -m benchmarks.run_all` writes all of it.",
    ]
    if preamble:
        out += ["", preamble]
    out += ["", "## Summary", "", markdown_table(summary_rows(sections), HEADER)]
    for section in sections:
        out += ["", f"## {section.title}", ""]
        if section.setup:
            out += [section.setup, ""]
        if section.error:
            out += ["**Not measured.** The run failed:", "", "```", section.error.strip(), "```"]
            continue
        for c in section.comparisons:
            out += [per_repetition_table(c), ""]
        for m in section.measures:
            labels = list(m.values)
            n = len(m.values[labels[0]])
            rows = [[str(i + 1), *(_num(m.values[label][i]) for label in labels)] for i in range(n)]
            out += [f"{m.name} ({m.unit}):", "", markdown_table(rows, ["repetition", *labels]), ""]
        out += [d.rstrip() + "\n" for d in section.details]
        out.append(f"_Section wall time: {section.wall_s:.0f} s._")
    return "\n".join(out).rstrip() + "\n"


def in_turn(repetition: int, ours: Callable[[], T], peer: Callable[[], T]) -> tuple[T, T]:
    """Run both measurements of one repetition, ours first in even repetitions and the peer first in odd ones (so
    that a drift of the machine over the run does not always favour the same side); returns (ours, peer)."""
    if repetition % 2 == 0:
        a = ours()
        return a, peer()
    b = peer()
    return ours(), b


def turn_order(repetition: int, items: Sequence[T]) -> list[T]:
    """The order to measure several points in: as given in even repetitions, reversed in odd ones."""
    return list(items) if repetition % 2 == 0 else list(reversed(items))


def print_section(section: Section) -> None:
    """One benchmark's own report, when its module runs alone: the summary table, then its details."""
    print(render_table(summary_rows([section])))
    print("\n\n".join(section.details))

"""The pure part of `make bench` (benchmarks/summary.py): ratios and their spread, verdicts, the order of paired
measurements, and the table and BENCHMARKS.md built from them. Nothing here is timed."""

from __future__ import annotations

import pytest

from benchmarks.summary import (
    Comparison,
    Measure,
    Section,
    in_turn,
    markdown_table,
    render_markdown,
    render_table,
    spread,
    summary_rows,
    turn_order,
)


def step_time() -> Comparison:
    # ours 3.0, 2.0, 4.5 s/step against the peer's 2.0, 2.0, 3.0: ratios 1.5, 1.0, 1.5
    return Comparison("RL step time", "s/step", "roll", (3.0, 2.0, 4.5), "TRL", (2.0, 2.0, 3.0))


def test_spread_is_median_and_range():
    s = spread([3.0, 1.0, 2.0, 10.0])
    assert (s.median, s.low, s.high, s.n) == (2.5, 1.0, 10.0, 4)
    assert str(spread([0.5, 0.25, 1.0])) == "0.500 [0.250, 1.00]"
    with pytest.raises(ValueError):
        spread([])


def test_ratios_are_per_repetition():
    c = step_time()
    assert c.ratios == (1.5, 1.0, 1.5)
    assert (c.ratio().median, c.ratio().low, c.ratio().high) == (1.5, 1.0, 1.5)


def test_verdict_follows_the_direction_of_the_figure():
    assert step_time().verdict() == "1.50x slower"  # more seconds per step is slower
    faster_time = Comparison("t", "s", "a", (1.0,), "b", (2.0,))
    assert faster_time.verdict() == "2.00x faster"
    rate = Comparison(
        "tokens", "tokens/s", "worker", (50.0, 60.0), "bare", (100.0, 100.0), higher_is_better=True
    )
    assert rate.ratios == (0.5, 0.6)
    assert rate.verdict() == "1.82x slower"  # 1 / median(0.5, 0.6)
    assert Comparison("t", "s", "a", (1.01,), "b", (1.0,)).verdict() == "same (within 2%)"
    assert Comparison("scale", "s", "B=8", (2.0,), "B=4", (1.0,), higher_is_better=None).verdict() == ""


def test_comparison_needs_one_figure_per_repetition_on_each_side():
    with pytest.raises(ValueError, match="2 figures for ours and 1"):
        Comparison("t", "s", "a", (1.0, 2.0), "b", (1.0,))


def test_in_turn_swaps_the_order_every_repetition_but_not_the_result():
    calls = []

    def ours():
        calls.append("ours")
        return "o"

    def peer():
        calls.append("peer")
        return "p"

    assert in_turn(0, ours, peer) == ("o", "p")
    assert in_turn(1, ours, peer) == ("o", "p")
    assert calls == ["ours", "peer", "peer", "ours"]
    assert turn_order(0, [4, 8, 16]) == [4, 8, 16]
    assert turn_order(1, [4, 8, 16]) == [16, 8, 4]


def test_summary_rows_and_text_table():
    accuracy = Measure("accuracy", "share of 32", {"roll": (0.5, 0.625), "TRL": (0.5, 0.5)})
    sections = [
        Section("1. End to end against TRL", comparisons=[step_time()], measures=[accuracy]),
        Section("4. Rewards", error="RuntimeError: bwrap missing\nmore"),
    ]
    rows = summary_rows(sections)
    assert rows[0] == [
        "1",
        "RL step time (s/step)",
        "roll: 3.00",
        "TRL: 2.00",
        "1.50 [1.00, 1.50] n=3",
        "1.50x slower",
    ]
    assert rows[1] == [
        "1",
        "accuracy (share of 32)",
        "roll: 0.562 [0.500, 0.625]",
        "TRL: 0.500 [0.500, 0.500]",
        "n=2",
        "",
    ]
    assert rows[2] == ["4", "not measured", "RuntimeError: bwrap missing", "", "", ""]
    lines = render_table(rows).splitlines()
    assert lines[0].split()[:2] == ["item", "figure"]
    assert set(lines[1]) <= {"-", " "}
    assert lines[2].startswith("1     RL step time (s/step)")
    # every column starts at the same offset on every line
    start = lines[0].index("ours (median)")
    assert lines[2][start:].startswith("roll: 3.00") and lines[3][start:].startswith("roll: 0.562")


def test_markdown_table_escapes_pipes():
    assert markdown_table([["a|b", "1"]], ["x", "y"]) == "| x | y |\n|---|---|\n| a\\|b | 1 |"


def test_render_markdown_has_provenance_summary_and_every_repetition():
    section = Section(
        "1. End to end against TRL",
        setup="Same prompts.",
        comparisons=[step_time()],
        details=["Where the time goes: rollout."],
        wall_s=12.4,
    )
    failed = Section("5. Scaling", error="Traceback ...\nValueError: boom")
    text = render_markdown(
        [section, failed],
        command="python -m benchmarks.run_all --repeats 3",
        date="2026-01-02 03:04 UTC",
        machine="2 CPUs",
        preamble="Total wall time: 1.0 min.",
    )
    assert text.startswith("# Benchmarks\n")
    assert (
        "Written by `python -m benchmarks.run_all --repeats 3` on 2026-01-02 03:04 UTC. Machine: 2 CPUs."
        in text
    )
    assert (
        "| 1 | RL step time (s/step) | roll: 3.00 | TRL: 2.00 | 1.50 [1.00, 1.50] n=3 | 1.50x slower |"
        in text
    )
    assert "| repetition | roll (s/step) | TRL (s/step) | ratio |" in text
    assert "| 3 | 4.50 | 3.00 | 1.500 |" in text
    assert "Where the time goes: rollout." in text
    assert "_Section wall time: 12 s._" in text
    assert "**Not measured.**" in text and "ValueError: boom" in text
    assert text.index("## 1. End to end") < text.index("## 5. Scaling")

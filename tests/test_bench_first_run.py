"""The pure part of benchmarks/first_run.py: the spread of a scope's change over seeds and the count of seeds on
which it was a significant gain. The runs themselves are the example's (minutes each) and are not run here."""

from __future__ import annotations

from benchmarks.first_run import ScopeResult, describe


def result(seed: int, scope: str, change: float, verdict: str) -> ScopeResult:
    return ScopeResult(seed, scope, 0.5, 0.5 + change, change, 0.01 if verdict != "not significant" else 0.5,
                       verdict)


def test_each_scope_gets_its_spread_and_its_count_of_significant_gains():
    results = [
        result(42, "all", 0.08, "better"), result(42, "code", 0.01, "not significant"),
        result(42, "math", 0.10, "better"),
        result(1, "all", 0.06, "better"), result(1, "code", -0.03, "worse"), result(1, "math", 0.07, "better"),
        result(2, "all", -0.01, "not significant"), result(2, "math", 0.02, "not significant"),
    ]
    assert describe(results, [42, 1, 2]) == [
        "all        change over 3 of 3 seeds: min -0.010, median +0.060, max +0.080; a significant gain on 2",
        # a worse verdict is significant but no gain; a domain missing from a run (no prompt in both) counts as
        # a seed it was not measured on
        "code       change over 2 of 3 seeds: min -0.030, median -0.010, max +0.010; a significant gain on 0",
        "math       change over 3 of 3 seeds: min +0.020, median +0.070, max +0.100; a significant gain on 2",
    ]

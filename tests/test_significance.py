"""Per-tag confidence intervals and paired comparisons of validations (roll_pipeline/driver/significance.py), and
`roll report RUN_A RUN_B` on two real MLflow runs."""

from __future__ import annotations

import math

import pytest
from scipy.stats import binomtest

from roll_core.tracking.mlflow_tracker import MlflowTracker
from roll_pipeline.driver.cli import main
from roll_pipeline.driver.report import prompts_file
from roll_pipeline.driver.significance import (
    ALL,
    PromptOutcome,
    compare,
    holm,
    intervals,
    mcnemar_p,
    outcomes_from_table,
    outcomes_table,
    prompt_outcomes,
    validation_significance,
    wilson_interval,
)
from tests.test_tracking import file_store, tracking, val_record  # noqa: F401 - file_store is a fixture


@pytest.mark.parametrize(("k", "n"), [(0, 10), (3, 10), (10, 10), (17, 40), (1, 1), (250, 400)])
def test_wilson_interval_is_scipys(k, n):
    # scipy's own Wilson interval (without continuity correction) is the oracle for whole counts.
    want = binomtest(k, n).proportion_ci(confidence_level=0.95, method="wilson")
    got = wilson_interval(k, n)
    assert got == pytest.approx((want.low, want.high), abs=1e-12)
    assert wilson_interval(k, n, 0.99)[0] <= got[0] and wilson_interval(k, n, 0.99)[1] >= got[1]


def test_wilson_interval_of_nothing_and_of_shares():
    assert all(math.isnan(x) for x in wilson_interval(0, 0))
    # All correct: the upper bound is exactly 1 (computed, 0.9999999999999999 for n = 10), for a count or a sum
    # of shares; none correct: the lower bound is exactly 0.
    assert wilson_interval(10, 10)[1] == 1.0 and wilson_interval(10.0, 10)[1] == 1.0
    assert wilson_interval(0, 10)[0] == 0.0 and wilson_interval(0.0, 10)[0] == 0.0
    # Fractional successes (shares of k responses) sit between the whole counts around them.
    low, high = wilson_interval(3.5, 10)
    assert wilson_interval(3, 10)[0] < low < wilson_interval(4, 10)[0]
    assert wilson_interval(3, 10)[1] < high < wilson_interval(4, 10)[1]


def test_mcnemar_is_the_exact_binomial_test_of_the_discordant_prompts():
    # b=10 solved only before, c=2 only after: 2 * P(X <= 2 | 12, 1/2) = 2 * (1 + 12 + 66) / 4096.
    assert mcnemar_p(10, 2) == pytest.approx(2 * 79 / 4096)
    assert mcnemar_p(2, 10) == mcnemar_p(10, 2)
    assert mcnemar_p(0, 0) == 1.0
    assert mcnemar_p(5, 5) == pytest.approx(1.0)


def test_holm_adjusts_step_down_and_keeps_order():
    adjusted = holm({"a": 0.01, "b": 0.04, "c": 0.03, "d": 0.5})
    assert adjusted == pytest.approx({"a": 0.04, "c": 0.09, "b": 0.09, "d": 0.5})
    assert holm({}) == {}
    assert holm({"x": 0.7, "y": 0.6}) == pytest.approx({"y": 1.0, "x": 1.0})


def test_prompt_outcomes_count_prompts_not_responses_and_leave_masked_out():
    records = [
        val_record("add", 0, True, "5"),
        val_record("add", 0, False, "6"),
        val_record("add", 0, None, "?"),
        val_record("add", 1, None, "?"),  # every response masked: nothing judged
        val_record("list", 0, True, "x", domain="code"),  # the same id in another domain is another prompt
    ]
    assert prompt_outcomes(records) == {
        "math/0": PromptOutcome("add", 1, 2),
        "code/0": PromptOutcome("list", 1, 1),
    }
    assert PromptOutcome("add", 1, 2).solved and not PromptOutcome("add", 1, 3).solved


def test_outcome_tables_round_trip_and_refuse_garbage():
    outcomes = {"math/0": PromptOutcome("add", 1, 2), "code/7": PromptOutcome("list", 0, 1)}
    assert outcomes_from_table(outcomes_table(outcomes)) == outcomes
    with pytest.raises(ValueError, match="per-prompt"):
        outcomes_from_table({"prompt": ["a"], "tag": ["t"]})
    # A prompt with nothing scored (all its responses masked) is left out: it has no share correct.
    table = outcomes_table(outcomes) | {"prompt": ["code/7", "math/0", "math/9"], "tag": ["list", "add", "add"]}
    table |= {"correct": [0, 1, 0], "scored": [1, 2, 0]}
    assert outcomes_from_table(table) == outcomes
    # Columns of different lengths, or counts no validation gives, are not a table to compare against.
    bad_tables = [
        {"prompt": ["a", "b"], "tag": ["t"], "correct": [1], "scored": [1]},
        {"prompt": ["a"], "tag": ["t"], "correct": [0], "scored": [-1]},
        {"prompt": ["a"], "tag": ["t"], "correct": [-1], "scored": [2]},
        {"prompt": ["a"], "tag": ["t"], "correct": [3], "scored": [2]},
    ]
    for bad in bad_tables:
        with pytest.raises(ValueError, match="per-prompt"):
            outcomes_from_table(bad)


def test_results_are_frozen():
    import dataclasses

    change = compare(outcomes_of("add", [True]), outcomes_of("add", [False]))["add"]
    for value, field in [(PromptOutcome("add", 1, 2), "correct"), (intervals(outcomes_of("a", [True]))[ALL], "low")]:
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(value, field, 0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        change.regressed = True


def outcomes_of(tag: str, solved: list[bool], start: int = 0) -> dict[str, PromptOutcome]:
    return {f"math/{start + i}": PromptOutcome(tag, int(s), 1) for i, s in enumerate(solved)}


def test_intervals_are_over_prompts_per_tag_and_all():
    outcomes = outcomes_of("add", [True] * 6 + [False] * 4) | outcomes_of("mul", [True] * 2 + [False] * 8, 100)
    got = intervals(outcomes)
    assert got["add"].accuracy == 0.6 and got["add"].prompts == 10
    assert (got["add"].low, got["add"].high) == pytest.approx(wilson_interval(6, 10))
    assert got[ALL].prompts == 20 and got[ALL].accuracy == pytest.approx(0.4)
    # k = 4 responses per prompt: the interval counts 10 prompts, not 40 responses (wider).
    shares = {f"math/{i}": PromptOutcome("add", 3 if i < 6 else 1, 4) for i in range(10)}
    assert intervals(shares)["add"].high - intervals(shares)["add"].low > (
        wilson_interval(20, 40)[1] - wilson_interval(20, 40)[0]
    )


def test_compare_flags_a_significant_regression_only():
    # add: 30 paired prompts, 14 solved before only, 0 after only: regressed. mul: 3 lost, 2 won: noise.
    # sub: 10 gained: better, not a regression.
    before = (
        outcomes_of("add", [True] * 20 + [False] * 10)
        | outcomes_of("mul", [True] * 3 + [False] * 2 + [True] * 5, 100)
        | outcomes_of("sub", [False] * 12, 200)
    )
    after = (
        outcomes_of("add", [True] * 6 + [False] * 24)
        | outcomes_of("mul", [False] * 3 + [True] * 2 + [True] * 5, 100)
        | outcomes_of("sub", [True] * 10 + [False] * 2, 200)
        | outcomes_of("new", [True], 300)  # not in the earlier validation: not paired
    )
    changes = compare(before, after, alpha=0.05)
    assert set(changes) == {ALL, "add", "mul", "sub"}
    assert changes["add"].regressed and changes["add"].difference == pytest.approx(-14 / 30)
    assert changes["add"].p_value == pytest.approx(mcnemar_p(14, 0))
    assert changes["add"].p_adjusted == pytest.approx(min(1.0, 3 * mcnemar_p(14, 0)))
    assert not changes["mul"].regressed and changes["mul"].p_value == pytest.approx(1.0)
    assert not changes["sub"].regressed and changes["sub"].p_adjusted < 0.05
    assert changes[ALL].paired == 52


def test_the_adjustment_keeps_a_borderline_tag_from_being_flagged_among_many():
    # Alone, 6 lost and 0 won gives p = 1/32 < 0.05; among 4 tags Holm asks for more.
    before = outcomes_of("a", [True] * 6)
    after = outcomes_of("a", [False] * 6)
    assert compare(before, after)["a"].regressed
    for i, tag in enumerate("bcd"):
        before |= outcomes_of(tag, [True] * 6, 100 * (i + 1))
        after |= outcomes_of(tag, [True] * 6, 100 * (i + 1))
    assert not compare(before, after)["a"].regressed


def test_a_p_value_exactly_at_alpha_is_not_a_regression():
    # 6 prompts lost, none won: the exact McNemar p-value is 2 / 64 = 0.03125, a float without rounding.
    before, after = outcomes_of("a", [True] * 6), outcomes_of("a", [False] * 6)
    assert compare(before, after, alpha=0.03125)["a"].p_adjusted == 0.03125
    assert not compare(before, after, alpha=0.03125)["a"].regressed
    assert compare(before, after, alpha=0.0313)["a"].regressed


def test_validation_significance_metrics_and_tags():
    before = outcomes_of("add", [True] * 20)
    after = outcomes_of("add", [False] * 20)
    metrics, tags = validation_significance(after, None)
    assert set(metrics) == {"val_ci/all/low", "val_ci/all/high", "val_ci/add/low", "val_ci/add/high"}
    assert "val_regressed" not in tags and tags["val_ci/add"].startswith("0.000 [0.000, 0.16")
    metrics, tags = validation_significance(after, before)
    assert metrics["val_change/add/regressed"] == 1.0 and metrics["val_change/add/difference"] == -1.0
    assert metrics["val_change/add/paired"] == 20.0
    assert tags["val_regressed"] == "add"
    assert validation_significance(before, before)[1]["val_regressed"] == "none"
    # The default alpha is 0.05: 3 prompts lost and none won (p = 0.25) is not flagged.
    metrics, tags = validation_significance(outcomes_of("add", [False] * 3), outcomes_of("add", [True] * 3))
    assert metrics["val_change/add/p_value"] == 0.25 and metrics["val_change/add/difference"] == -1.0
    assert tags["val_regressed"] == "none" and metrics["val_change/add/regressed"] == 0.0
    # Tags that sort after "all" are named too.
    metrics, tags = validation_significance(outcomes_of("mul", [False] * 20), outcomes_of("mul", [True] * 20))
    assert tags["val_regressed"] == "mul" and metrics["val_change/mul/regressed"] == 1.0


def log_validation(tracker: MlflowTracker, step: int, outcomes: dict[str, PromptOutcome]) -> None:
    acc = intervals(outcomes)
    tracker.log_metrics({f"val_correct/{s}/mean": i.accuracy for s, i in acc.items()}, step)
    tracker.log_dict(outcomes_table(outcomes), prompts_file(step))


def test_report_compares_two_runs_tag_by_tag(tmp_path, file_store, capsys):  # noqa: F811
    runs = {}
    for name, add, mul in [("a", [True] * 20, [True] * 5 + [False] * 5), ("b", [False] * 20, [True] * 6 + [False] * 4)]:
        tracker = MlflowTracker(tracking(file_store), tmp_path / name / "mlflow_spool")
        log_validation(tracker, 0, outcomes_of("add", [True] * 20) | outcomes_of("mul", [False] * 10, 100))
        log_validation(tracker, 5, outcomes_of("add", add) | outcomes_of("mul", mul, 100))
        tracker.finish()
        runs[name] = str(tmp_path / name)
    assert main(["report", runs["a"], runs["b"]]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.splitlines() if line.split() and line.split()[0] in ("add", "mul")}
    assert "last validation at step 5" in out
    assert rows["add"].split()[-2:] == ["B", "worse"]
    assert "1.000 [0.84, 1.00]" in rows["add"] and "0.000 [0.00, 0.16]" in rows["add"]
    assert rows["mul"].split()[-2:] == ["+0.100", "1.000"]  # one prompt won: no flag
    # One run alone: its table, with the interval columns, and its first validation against its last.
    assert main(["report", runs["b"]]) == 0
    out = capsys.readouterr().out
    assert "ci_low" in out and "over the run: step 0 against step 5, paired by prompt" in out
    rows = {line.split()[0]: line for line in out.splitlines()[out.splitlines().index(
        "over the run: step 0 against step 5, paired by prompt"):] if line.split()}
    assert rows["add"].split()[-3:] == ["-1.000", "0.000", "worse"]  # 20 lost, p = 2 * 0.5**20
    assert rows["mul"].split()[-3:] == ["+0.600", "0.031", "better"]  # 6 won: p = 2 * 0.5**6, Holm: x1
    assert rows["math"].split()[-3:] == ["-0.467", "0.009", "worse"]  # both tags: 20 lost and 6 won of 30


def test_report_of_a_run_without_per_prompt_outcomes_says_so(tmp_path, file_store, capsys):  # noqa: F811
    for name in ("a", "b"):
        tracker = MlflowTracker(tracking(file_store), tmp_path / name / "mlflow_spool")
        tracker.log_metrics({"val_correct/all/mean": 0.5}, 3)
        tracker.finish()
    assert main(["report", str(tmp_path / "a"), str(tmp_path / "b")]) == 2
    assert "no per-prompt outcomes" in capsys.readouterr().err
    assert main(["report", str(tmp_path / "a"), str(tmp_path / "b"), "--alpha", "2"]) == 2

"""A run's first validation against its last, per domain and tag (roll_pipeline/driver/run_change.py)."""

from __future__ import annotations

import pytest
from scipy.stats import binomtest

from roll_pipeline.driver.run_change import format_run_change, prompt_domain, run_change
from roll_pipeline.driver.significance import ALL, PromptOutcome, compare


def outcomes_of(tag: str, solved: list[bool], start: int = 0) -> dict[str, PromptOutcome]:
    return {f"math/{start + i}": PromptOutcome(tag, int(s), 1) for i, s in enumerate(solved)}


def code_outcomes(tag: str, solved: list[bool], start: int = 0) -> dict[str, PromptOutcome]:
    return {f"code/{start + i}": PromptOutcome(tag, int(s), 1) for i, s in enumerate(solved)}


def test_run_change_pairs_each_domain_and_each_tag_and_lists_tags_under_their_domain():
    # math: one tag, 12 prompts won and none lost. code: two tags, 4 + 4 won, 1 lost (9 discordant: p = 0.039
    # for the domain), neither tag significant alone (p = 0.125 and 0.375 before Holm).
    first = outcomes_of("add", [False] * 12 + [True] * 8) | code_outcomes("list", [False] * 4 + [True] * 6)
    first |= code_outcomes("string", [False] * 4 + [True] + [False] * 5, 100)
    last = outcomes_of("add", [True] * 20) | code_outcomes("list", [True] * 10)
    last |= code_outcomes("string", [True] * 4 + [False] * 6, 100)
    rows = run_change(first, last)
    assert [(r.kind, r.name) for r in rows] == [
        ("all", ALL), ("domain", "code"), ("tag", "list"), ("tag", "string"), ("domain", "math"), ("tag", "add"),
    ]
    by_name = {r.name: r for r in rows}
    code, math_ = by_name["code"].change, by_name["math"].change
    assert (code.paired, code.only_before, code.only_after) == (20, 1, 8)
    assert code.p_value == pytest.approx(binomtest(1, 9, 0.5).pvalue)
    # Holm over the two domains: math's p (2 * 0.5**12) is the smaller, code's is adjusted by 1.
    assert math_.p_adjusted == pytest.approx(2 * binomtest(0, 12, 0.5).pvalue)
    assert code.p_adjusted == pytest.approx(max(code.p_value, math_.p_adjusted))
    assert by_name["code"].verdict(0.05) == "better" and by_name["math"].verdict(0.05) == "better"
    assert by_name["list"].verdict(0.05) == "not significant"
    assert by_name["string"].verdict(0.05) == "not significant"
    assert by_name["code"].first.accuracy == pytest.approx(0.35) and by_name["code"].last.accuracy == 0.7
    assert by_name["code"].last.prompts == 20
    # The tags' p-values are compare()'s (Holm over the three tags), not adjusted with the domains'.
    assert by_name["list"].change == compare(first, last)["list"]
    lines = format_run_change(rows, 0, 240)
    assert lines[0].split()[:5] == ["domain", "/", "tag", "step", "0"]
    code_line = next(line for line in lines if line.strip().startswith("code "))
    assert code_line.startswith("  code") and code_line.split()[-1] == "better"
    assert "0.350 [0.18, 0.57]" in code_line and "+0.350" in code_line
    assert next(line for line in lines if line.strip().startswith("list ")).endswith("not significant")


def test_run_change_of_a_domain_that_lost_and_of_prompts_judged_once():
    first = code_outcomes("list", [True] * 12) | outcomes_of("add", [True] * 3)
    last = code_outcomes("list", [False] * 12) | outcomes_of("add", [True] * 3, 50)  # no math prompt in both
    rows = {r.name: r for r in run_change(first, last)}
    assert rows["code"].verdict(0.05) == "worse" and rows["code"].change.regressed
    assert rows["math"].change is None and rows["math"].verdict(0.05) == "no prompt in both"
    assert rows["math"].first.prompts == 3 and rows["math"].last.prompts == 3
    line = next(line for line in format_run_change(list(rows.values()), 0, 9) if line.strip().startswith("math"))
    assert line.split()[-6:] == ["-", "-", "no", "prompt", "in", "both"]


def test_a_prompt_key_s_domain_is_what_comes_before_its_first_slash():
    assert prompt_domain("code/humaneval/12") == "code" and prompt_domain("math/3") == "math"


def test_the_table_s_lines_exactly():
    first = outcomes_of("add", [False] * 12 + [True] * 8) | code_outcomes("a-rather-long-tag", [False] * 3)
    last = outcomes_of("add", [True] * 20) | code_outcomes("a-rather-long-tag", [True] * 3, 10)  # none in both
    lines = format_run_change(run_change(first, last), 0, 240)
    assert lines == [
        "domain / tag                         step 0              step 240   change  p_holm  verdict",
        "all                      0.348 [0.19, 0.55]    1.000 [0.86, 1.00]   +0.600   0.000  better",
        "  code                   0.000 [0.00, 0.56]    1.000 [0.44, 1.00]        -       -  no prompt in both",
        "    a-rather-long-tag    0.000 [0.00, 0.56]    1.000 [0.44, 1.00]        -       -  no prompt in both",
        "  math                   0.400 [0.22, 0.61]    1.000 [0.84, 1.00]   +0.600   0.000  better",
        "    add                  0.400 [0.22, 0.61]    1.000 [0.84, 1.00]   +0.600   0.000  better",
        "accuracy [95% Wilson interval over prompts]; change: the share of the prompts judged at both steps that were "
        "solved, last minus first;",
        "p_holm: McNemar's exact test, Holm-adjusted over the domains and, apart, over the tags; significant where "
        "p_holm < 0.05",
    ]
    # A short name: the first column is 14 wide; another alpha and confidence are said.
    lines = format_run_change(run_change(outcomes_of("add", [False]), outcomes_of("add", [True])), 3, 9, 0.1, 0.9)
    assert lines[0] == "domain / tag                  step 3                step 9   change  p_holm  verdict"
    assert lines[1] == "all               0.000 [0.00, 0.79]    1.000 [0.21, 1.00]   +1.000   1.000  not significant"
    assert lines[-2].startswith("accuracy [90% Wilson") and lines[-1].endswith("significant where p_holm < 0.1")


def test_verdicts_at_the_bound_and_the_regressed_flag_of_each_domain():
    # code: 5 lost of 5 discordant (p = 0.0625); math: 6 won of 6 (p = 0.03125): Holm gives code 0.0625, math 0.0625
    first = code_outcomes("list", [True] * 5) | outcomes_of("add", [False] * 6)
    last = code_outcomes("list", [False] * 5) | outcomes_of("add", [True] * 6)
    rows = {r.name: r for r in run_change(first, last)}
    assert rows["code"].change.p_adjusted == pytest.approx(0.0625) == rows["math"].change.p_adjusted
    assert not rows["code"].change.regressed and not rows["math"].change.regressed  # not under the default 0.05
    assert rows["code"].verdict(0.0625) == "not significant"  # at alpha is not under it
    assert rows["code"].verdict(0.07) == "worse" and rows["math"].verdict(0.07) == "better"
    rows = {r.name: r for r in run_change(first, last, alpha=0.07)}
    assert rows["code"].change.regressed and not rows["math"].change.regressed  # a gain never regressed
    # a significant loss next to a domain that lost nothing significant
    first = code_outcomes("list", [True] * 12) | outcomes_of("add", [True, False])
    last = code_outcomes("list", [False] * 12) | outcomes_of("add", [False, True])
    rows = {r.name: r for r in run_change(first, last)}
    assert rows["code"].change.regressed and not rows["math"].change.regressed


def test_rows_are_frozen():
    (row,) = run_change({}, {})[:1]
    with pytest.raises(AttributeError):
        row.name = "other"


def test_the_first_column_fits_the_longest_indented_name():
    twelve = "twelve-chars"  # 12 = 0b1100: as wide as len + 4, not len | 4 or len ^ 4
    lines = format_run_change(run_change(outcomes_of(twelve, [False]), outcomes_of(twelve, [True])), 0, 1)
    assert lines[3].startswith(f"    {twelve}    0.000 [0.00, 0.79]")
    assert lines[0].index("step 0") == 16 + 22 - len("step 0")  # the header pads its first column to 16 too


def test_a_change_whose_p_value_is_exactly_alpha_is_not_a_regression():
    first, last = code_outcomes("list", [True] * 5), code_outcomes("list", [False] * 5)  # p = 0.0625
    (_, code, _) = run_change(first, last, alpha=0.0625)
    assert code.kind == "domain" and code.change.p_adjusted == 0.0625 and not code.change.regressed


def test_a_domain_named_all_is_a_domain_of_its_own():
    first = {f"all/{i}": PromptOutcome("x", 0, 1) for i in range(8)} | outcomes_of("add", [True] * 8)
    last = {f"all/{i}": PromptOutcome("x", 1, 1) for i in range(8)} | outcomes_of("add", [True] * 8)
    rows = [(r.kind, r.name, r.change.only_after) for r in run_change(first, last)]
    assert rows == [("all", ALL, 8), ("domain", "all", 8), ("tag", "x", 8), ("domain", "math", 0), ("tag", "add", 0)]

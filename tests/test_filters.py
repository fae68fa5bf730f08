"""Dynamic-sampling filters: pure functions over scored groups and responses."""

from __future__ import annotations

import pytest

from roll_core.rewards.scored import MASK_ERROR, ScoredSample
from schedulers.filters import (
    GROUP_FILTERS,
    RESPONSE_FILTERS,
    apply_group_filters,
    apply_response_filters,
    check_filters,
    filter_group,
    mean_filter,
    std_filter,
    truncated,
)


def group(*scores, finish="stop"):
    """Scored samples (None: masked) of 3 tokens each."""
    return [
        ScoredSample.masked_as(MASK_ERROR, response_length=3, finish_reason=finish)
        if s is None
        else ScoredSample(score=s, correct=s == 1.0, response_length=3, finish_reason=finish)
        for s in scores
    ]


def response(finish):
    return ScoredSample(score=1.0, correct=True, response_length=3, finish_reason=finish)


def test_std_filter_drops_groups_whose_rewards_are_all_equal():
    assert std_filter(group(1.0, 0.0, 1.0)) is True
    assert std_filter(group(1.0, 1.0, 1.0)) is False
    assert std_filter(group(0.0, 0.0)) is False
    assert std_filter(group(0.5, 0.5, 0.5, 0.5)) is False


def test_std_filter_ignores_masked_samples_and_needs_two_scores():
    assert std_filter(group(1.0, None, None)) is False
    assert std_filter(group(1.0, None, 0.0)) is True
    assert std_filter(group()) is False


def test_std_filter_threshold():
    scores = group(0.0, 0.1)  # population std 0.05
    assert std_filter(scores, min_std=0.04) is True
    assert std_filter(scores, min_std=0.06) is False


def test_the_filters_tolerances_are_exact_boundaries():
    """Each filter's bound, offset by its 1e-12 rounding tolerance, lands exactly on a float here, so the side of the
    comparison it falls on is tested: std_filter keeps a group only when its std is above min_std + 1e-12 (a std
    equal to that is dropped); mean_filter keeps a mean equal to low - 1e-12 or high + 1e-12 (the interval is
    closed, widened by the tolerance)."""
    scores = group(0.0, 1.0)  # population std 0.5 and mean 0.5, both exact
    at = 0.5 - 1e-12
    assert at + 1e-12 == 0.5  # the std is exactly min_std + 1e-12
    assert std_filter(scores, min_std=at) is False
    assert std_filter(scores, min_std=at - 1e-12) is True
    low, high = 0.5 + 1e-12, 0.5 - 1e-12
    assert low - 1e-12 == 0.5 and high + 1e-12 == 0.5  # the mean is exactly on each widened bound
    assert mean_filter(scores, low=low, high=1.0) is True
    assert mean_filter(scores, low=0.0, high=high) is True
    assert mean_filter(scores, low=low + 1e-12, high=1.0) is False
    assert mean_filter(scores, low=0.0, high=high - 1e-12) is False


def test_mean_filter_keeps_groups_inside_the_interval_inclusive():
    assert mean_filter(group(1.0, 0.0), low=0.5, high=0.5) is True
    assert mean_filter(group(1.0, 1.0), low=0.0, high=0.9) is False
    assert mean_filter(group(0.0, 0.0, 1.0, 0.0), low=0.3, high=1.0) is False
    assert mean_filter(group(None, None)) is False


def test_mean_filter_not_inclusive_drops_a_mean_on_either_threshold_as_roll_does():
    """ROLL's mean_filter and difficulty_mask keep a group only strictly inside (threshold_down, threshold_up);
    `inclusive: false` is that rule (`roll config import` writes it)."""
    half = group(1.0, 0.0)  # mean 0.5, exact
    assert mean_filter(half, low=0.5, high=1.0, inclusive=False) is False
    assert mean_filter(half, low=0.0, high=0.5, inclusive=False) is False
    assert mean_filter(half, low=0.5, high=1.0) is True  # the default keeps both
    assert mean_filter(half, low=0.5 - 1e-9, high=0.5 + 1e-9, inclusive=False) is True
    assert mean_filter(group(0.0, 0.0), low=-1.0, high=0.5, inclusive=False) is True
    # the tolerance's exact boundary: a mean equal to low + 1e-12 (or high - 1e-12) is on the threshold: dropped
    low, high = 0.5 - 1e-12, 0.5 + 1e-12
    assert low + 1e-12 == 0.5 and high - 1e-12 == 0.5
    assert mean_filter(half, low=low, high=1.0, inclusive=False) is False
    assert mean_filter(half, low=0.0, high=high, inclusive=False) is False
    assert mean_filter(half, low=low - 1e-12, high=high + 1e-12, inclusive=False) is True


def test_truncated_response_filter():
    assert truncated(response("stop")) is True
    assert truncated(response("length")) is False


def test_apply_group_filters_reports_the_first_filter_that_drops():
    specs = {"std_filter": {}, "mean_filter": {"low": 0.3, "high": 1.0}}
    assert apply_group_filters(group(1.0, 1.0), specs) == "std_filter"
    assert apply_group_filters(group(1.0, 0.0, 0.0, 0.0), specs) == "mean_filter"
    assert apply_group_filters(group(1.0, 0.0), specs) is None
    assert apply_group_filters(group(1.0, 1.0), {}) is None


def test_apply_response_filters_names_the_rejecting_filter():
    records = group(1.0, 0.0) + group(1.0, finish="length")
    assert apply_response_filters(records, {"truncated": {}}) == [None, None, "truncated"]
    assert apply_response_filters(records, {}) == [None, None, None]


def test_check_filters_names_unknown_filters_and_parameters():
    problems = dict(check_filters(GROUP_FILTERS, {"std_filtr": {}, "mean_filter": {"lo": 0.1}, "std_filter": {}}))
    assert "unknown group filter 'std_filtr'" in problems["std_filtr"]
    assert "available: ['mean_filter', 'std_filter']" in problems["std_filtr"]
    assert "takes no parameter 'lo'" in problems["mean_filter.lo"]
    assert "std_filter" not in problems
    assert dict(check_filters(RESPONSE_FILTERS, {"truncated": {}})) == {}


@pytest.mark.parametrize("name", GROUP_FILTERS.names())
def test_every_group_filter_has_a_docstring(name):
    assert GROUP_FILTERS.get(name).__doc__


def test_group_filters_see_only_the_responses_the_response_filters_kept():
    """Two finished right answers and two truncated wrong ones: with the truncated ones out of the loss, the group
    has no spread left and std_filter drops it. Seeing all four, it would keep it."""
    records = group(1.0, 1.0) + group(0.0, 0.0, finish="length")
    assert std_filter(records)  # the whole group has spread
    rejected, dropped_by = filter_group(records, {"truncated": {}}, {"std_filter": {}})
    assert rejected == [None, None, "truncated", "truncated"]
    assert dropped_by == "std_filter"
    # the other way round: the kept responses have spread, the rejected ones alone would not
    records = group(1.0, 0.0) + group(1.0, 1.0, finish="length")
    assert not mean_filter(records, low=0.0, high=0.6)  # the whole group's mean is 0.75
    assert filter_group(records, {"truncated": {}}, {"mean_filter": {"low": 0.0, "high": 0.6}})[1] is None
    # every response rejected: dropped by the response filters; no response filter: all seen
    assert filter_group(group(1.0, 0.0, finish="length"), {"truncated": {}}, {})[1] == "response_filters"
    assert filter_group(group(1.0, 0.0, finish="length"), {}, {"std_filter": {}}) == ([None, None], None)


def test_std_filter_drops_a_single_scored_response_whatever_the_threshold():
    # one score has no spread, even against a threshold below zero
    assert std_filter(group(1.0, None), min_std=-1.0) is False
    assert std_filter(group(1.0, 0.0), min_std=-1.0) is True


def test_mean_filter_defaults_keep_every_mean_in_zero_to_one_and_nothing_outside():
    for scores in [(0.0, 0.0), (1.0, 0.0), (1.0, 1.0)]:
        assert mean_filter(group(*scores)) is True, scores
    assert mean_filter(group(-0.5, -0.5)) is False
    assert mean_filter(group(1.5, 1.5)) is False


def test_truncated_drops_only_length_whatever_the_string_object():
    # finish reasons arrive deserialised from other processes: equal strings, not the same object
    assert truncated(response("".join(["len", "gth"]))) is False
    assert truncated(response("abort")) is True  # vLLM's third reason: not a truncation


def test_check_filters_reports_every_bad_spec_and_accepts_every_real_parameter():
    problems = dict(check_filters(GROUP_FILTERS, {"mean_filter": [0.1], "std_filter": {"min_sd": 0.1}}))
    assert set(problems) == {"mean_filter", "std_filter.min_sd"}
    assert dict(check_filters(GROUP_FILTERS, {"mean_filter": {"low": 0.1, "high": 0.9},
                                              "std_filter": {"min_std": 0.1}})) == {}
    # the group itself is not a parameter
    assert "std_filter.group" in dict(check_filters(GROUP_FILTERS, {"std_filter": {"group": []}}))
    assert "it takes none" in dict(check_filters(RESPONSE_FILTERS, {"truncated": {"x": 1}}))["truncated.x"]


def test_apply_response_filters_names_the_first_of_several_rejecting_filters(monkeypatch):
    monkeypatch.setitem(RESPONSE_FILTERS._items, "short", lambda r: r.response_length > 5)
    records = group(1.0, finish="length")  # response_length 3: both filters reject it
    assert apply_response_filters(records, {"truncated": {}, "short": {}}) == ["truncated"]
    assert apply_response_filters(records, {"short": {}, "truncated": {}}) == ["short"]

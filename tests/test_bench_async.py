"""benchmarks/bench_async.py's model of the GPU case: step times when generation has devices of its own."""

from __future__ import annotations

import pytest

from benchmarks.bench_async import accuracy_at, modelled_step_s


def test_a_steady_run_overlaps_to_the_slower_side_from_one_step_ahead():
    generate, train = [2.0] * 12, [1.0] * 12
    assert modelled_step_s(generate, train, 0) == pytest.approx(3.0)  # one after the other
    for k in (1, 2, 3):
        assert modelled_step_s(generate, train, k) == pytest.approx(2.0)  # generation is the bottleneck


def test_uneven_rollouts_need_more_than_one_step_ahead_to_hide_behind_training():
    """Rollouts of 1 s and 3 s in turn, training 2 s: one step ahead, a 3 s rollout still holds its step up (the
    mean of max(G, T) is 2.5 s); two steps ahead the short ones make room for the long ones (max(mean G, T) = 2)."""
    generate, train = [1.0, 3.0] * 20, [2.0] * 40
    assert modelled_step_s(generate, train, 1) == pytest.approx(2.5, abs=0.05)
    assert modelled_step_s(generate, train, 2) == pytest.approx(2.0)
    assert modelled_step_s(generate, train, 0) == pytest.approx(4.0, abs=0.05)


def test_accuracy_at_equal_wall_time_is_the_last_validation_finished_by_then():
    curve = [(0.0, 0.5), (10.0, 0.6), (20.0, 0.7)]
    assert accuracy_at(curve, 15.0) == 0.6 and accuracy_at(curve, 20.0) == 0.7 and accuracy_at(curve, 0.0) == 0.5

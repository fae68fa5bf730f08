"""Validation and rollout metrics computed from per-sample records."""

from __future__ import annotations

import math

import pytest

from roll_pipeline.validation import rollout_metrics, validation_metrics


def rec(domain, tag, correct, length=4, finish="stop", score=None):
    score = (1.0 if correct else 0.0) if score is None else score
    return {
        "domain": domain, "tag": tag, "correct": correct, "response_length": length,
        "finish_reason": finish, "score": score, "masked": correct is None,
    }


def test_validation_metrics_per_tag_and_overall():
    records = [
        rec("math", "add", True), rec("math", "add", False), rec("math", "mul", True),
        rec("code", "list", False, length=8, finish="length"), rec("code", "list", None),
    ]
    m = validation_metrics(records)
    assert m["val_correct/all/mean"] == pytest.approx(2 / 4)  # the unscored sample is left out
    assert m["val_correct/add/mean"] == 0.5
    assert m["val_correct/mul/mean"] == 1.0
    assert m["val_correct/list/mean"] == 0.0
    assert m["val/math/correct_mean"] == pytest.approx(2 / 3)
    assert m["val/masked_count"] == 1.0
    assert m["val/truncation_rate"] == pytest.approx(1 / 5)
    assert m["val/response_length/mean"] == pytest.approx((4 * 4 + 8) / 5)


def test_rollout_metrics():
    records = [rec("math", "add", True), rec("math", "add", False, score=0.0), rec("math", "add", None, score=0.0)]
    m = rollout_metrics("math", records)
    assert m["reward/math/score"] == 0.5
    assert m["reward/math/std"] == 0.5
    assert m["reward/math/masked"] == 1.0
    assert m["reward/math/correct"] == 0.5


def test_empty_records_give_nan_not_errors():
    assert math.isnan(validation_metrics([])["val_correct/all/mean"])

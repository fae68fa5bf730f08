"""Truncated importance sampling between the inference policy and actor_train's: golden values, mask
invariance, a loop version, and the metrics."""

from __future__ import annotations

import math

import pytest
import torch

from roll_core.algorithms.offpolicy import offpolicy_metrics, truncated_is_weights


def test_golden_weights_are_the_ratio_truncated_at_the_cap():
    old = torch.tensor([[math.log(0.5), math.log(0.9), math.log(0.2)]])
    infer = torch.tensor([[math.log(0.25), math.log(0.9), math.log(0.8)]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    w = truncated_is_weights(old, infer, mask, cap=1.5)
    # 0.5/0.25 = 2 -> 1.5 (truncated); 0.9/0.9 = 1; masked -> 0
    assert w[0].tolist() == pytest.approx([1.5, 1.0, 0.0])


def test_values_under_the_mask_change_nothing():
    g = torch.Generator().manual_seed(0)
    old, infer = torch.randn(4, 6, generator=g), torch.randn(4, 6, generator=g)
    mask = (torch.rand(4, 6, generator=g) > 0.3).float()
    noisy_old = torch.where(mask > 0, old, torch.full_like(old, 50.0))
    noisy_infer = torch.where(mask > 0, infer, torch.full_like(infer, -50.0))
    assert torch.equal(truncated_is_weights(old, infer, mask, 2.0), truncated_is_weights(noisy_old, noisy_infer, mask, 2.0))
    assert offpolicy_metrics(old, infer, mask, 2.0) == pytest.approx(offpolicy_metrics(noisy_old, noisy_infer, mask, 2.0))


def test_vectorised_matches_a_loop():
    g = torch.Generator().manual_seed(1)
    old, infer = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)
    mask = (torch.rand(3, 5, generator=g) > 0.2).float()
    w = truncated_is_weights(old, infer, mask, 2.0)
    ratios = []
    for b in range(3):
        for t in range(5):
            r = math.exp(float(old[b, t] - infer[b, t]))
            assert float(w[b, t]) == pytest.approx(min(r, 2.0) * float(mask[b, t]), rel=1e-6)
            if mask[b, t]:
                ratios.append(r)
    m = offpolicy_metrics(old, infer, mask, 2.0)
    assert m["offpolicy/is_weight_mean"] == pytest.approx(sum(ratios) / len(ratios), rel=1e-6)
    assert m["offpolicy/is_weight_max"] == pytest.approx(max(ratios), rel=1e-6)
    assert m["offpolicy/is_truncated_frac"] == pytest.approx(sum(r > 2.0 for r in ratios) / len(ratios))
    kl = [math.exp(float(o - i)) - float(o - i) - 1 for o, i, k in zip(old.flatten(), infer.flatten(), mask.flatten(), strict=True) if k]
    assert m["offpolicy/kl_infer_old"] == pytest.approx(sum(kl) / len(kl), rel=1e-5)


def test_the_same_policy_gives_weight_one_and_no_kl():
    lp = torch.log(torch.rand(2, 4) * 0.9 + 0.05)
    mask = torch.ones(2, 4)
    assert torch.allclose(truncated_is_weights(lp, lp, mask, 2.0), mask)
    m = offpolicy_metrics(lp, lp, mask, None)
    assert m == {"offpolicy/is_weight_mean": 1.0, "offpolicy/is_weight_max": 1.0,
                 "offpolicy/is_truncated_frac": 0.0, "offpolicy/kl_infer_old": 0.0}
    assert offpolicy_metrics(lp, lp, torch.zeros(2, 4), 2.0) == {}


@pytest.mark.parametrize("log_ratio", [25.0, -25.0])
def test_a_log_ratio_beyond_20_counts_as_20(log_ratio):
    """One valid token whose policies disagree by more than e^20: its weight and metrics are those of +-20
    exactly (a cap above e^20 leaves the weight as it is)."""
    old, infer, mask = torch.tensor([[log_ratio, 0.0]]), torch.zeros(1, 2), torch.tensor([[1.0, 0.0]])
    bound = torch.tensor(math.copysign(20.0, log_ratio)).exp()
    assert truncated_is_weights(old, infer, mask, cap=1e10).tolist() == [[float(bound), 0.0]]
    metrics = offpolicy_metrics(old, infer, mask, cap=1e10)
    assert metrics["offpolicy/is_weight_mean"] == metrics["offpolicy/is_weight_max"] == float(bound)


def test_a_weight_equal_to_the_cap_is_not_counted_as_truncated():
    cap = float(torch.tensor(0.5).exp())  # the float the token's weight comes out as
    old, infer, mask = torch.tensor([[0.5, 0.6]]), torch.zeros(1, 2), torch.ones(1, 2)
    assert offpolicy_metrics(old, infer, mask, cap=cap)["offpolicy/is_truncated_frac"] == 0.5

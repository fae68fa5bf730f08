"""The off-policy corrections between the inference policy and actor_train's: truncated importance weights per
token and per response, rejection per token, per response and by the geometric mean; golden values (verl's among
them), mask invariance, loop versions, and the metrics of what each cut."""

from __future__ import annotations

import math

import pytest
import torch

from roll_core.algorithms.offpolicy import (
    correction_metrics,
    importance_weights,
    level_log_ratios,
    offpolicy_metrics,
    rejection_keep,
    staleness_metrics,
    truncated_is_weights,
)


def token_metrics(old, infer, mask, cap):
    """The metrics of token-level truncation at `cap` (None: no importance weights)."""
    level = None if cap is None else "token"
    return correction_metrics(old, infer, mask, is_level=level, cap=cap or 0.0, rs_level=None, bounds=(0.0, 0.0))


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
    assert token_metrics(old, infer, mask, 2.0) == pytest.approx(token_metrics(noisy_old, noisy_infer, mask, 2.0))


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
    m = token_metrics(old, infer, mask, 2.0)
    assert m["offpolicy/is_weight_mean"] == pytest.approx(sum(ratios) / len(ratios), rel=1e-6)
    assert m["offpolicy/is_weight_max"] == pytest.approx(max(ratios), rel=1e-6)
    assert m["offpolicy/is_truncated_frac"] == pytest.approx(sum(r > 2.0 for r in ratios) / len(ratios))
    kl = [math.exp(float(o - i)) - float(o - i) - 1 for o, i, k in zip(old.flatten(), infer.flatten(), mask.flatten(), strict=True) if k]
    assert m["offpolicy/kl_infer_old"] == pytest.approx(sum(kl) / len(kl), rel=1e-5)


def test_the_same_policy_gives_weight_one_and_no_kl():
    lp = torch.log(torch.rand(2, 4) * 0.9 + 0.05)
    mask = torch.ones(2, 4)
    assert torch.allclose(truncated_is_weights(lp, lp, mask, 2.0), mask)
    m = token_metrics(lp, lp, mask, None)
    assert m == {"offpolicy/is_weight_mean": 1.0, "offpolicy/is_weight_max": 1.0, "offpolicy/kl_infer_old": 0.0,
                 "offpolicy/is_truncated_frac": 0.0, "offpolicy/is_truncated_seq_frac": 0.0}
    assert token_metrics(lp, lp, torch.zeros(2, 4), 2.0) == {}
    assert offpolicy_metrics(lp, lp, torch.zeros(2, 4)) == {}


@pytest.mark.parametrize("log_ratio", [25.0, -25.0])
def test_a_log_ratio_beyond_20_counts_as_20(log_ratio):
    """One valid token whose policies disagree by more than e^20: its weight and metrics are those of +-20
    exactly (a cap above e^20 leaves the weight as it is)."""
    old, infer, mask = torch.tensor([[log_ratio, 0.0]]), torch.zeros(1, 2), torch.tensor([[1.0, 0.0]])
    bound = torch.tensor(math.copysign(20.0, log_ratio)).exp()
    assert truncated_is_weights(old, infer, mask, cap=1e10).tolist() == [[float(bound), 0.0]]
    metrics = token_metrics(old, infer, mask, cap=1e10)
    assert metrics["offpolicy/is_weight_mean"] == metrics["offpolicy/is_weight_max"] == float(bound)


def test_a_weight_equal_to_the_cap_is_not_counted_as_truncated():
    cap = float(torch.tensor(0.5).exp())  # the float the token's weight comes out as
    old, infer, mask = torch.tensor([[0.5, 0.6]]), torch.zeros(1, 2), torch.ones(1, 2)
    assert token_metrics(old, infer, mask, cap=cap)["offpolicy/is_truncated_frac"] == 0.5


# ------------------------------------------------------------------------------------------- levels and rejection


def test_verls_mask_mode_case_gives_verls_numbers():
    """verl's own unit test of token IS with token rejection (tests/trainer/ppo/test_rollout_corr.py, test_mask_mode):
    old log-prob -2 on every token, the rollout's -1 (ratio e^-1 ~ 0.37) and -2.5 (e^0.5 ~ 1.65); cap 2, bounds
    [0.5, 2]. verl: weights ~0.368 and ~1.649 (not zeroed by the rejection), the first response rejected, the second
    kept, half the tokens masked."""
    old = torch.full((2, 5), -2.0)
    infer = torch.tensor([[-1.0] * 5, [-2.5] * 5])
    mask = torch.ones(2, 5)
    weights = importance_weights(old, infer, mask, "token", 2.0)
    assert weights[0].tolist() == pytest.approx([0.368] * 5, abs=0.01)
    assert weights[1].tolist() == pytest.approx([1.649] * 5, abs=0.01)
    assert rejection_keep(old, infer, mask, "token", 0.5, 2.0).tolist() == [[0.0] * 5, [1.0] * 5]
    metrics = correction_metrics(old, infer, mask, is_level="token", cap=2.0, rs_level="token", bounds=(0.5, 2.0))
    assert metrics["offpolicy/rs_rejected_frac"] == 0.5 and metrics["offpolicy/rs_rejected_seq_frac"] == 0.5


def loop_ratio(old, infer, mask, b, level):
    """A response's ratio at `level` (or one token's, level ("token", t)), from Python floats."""
    xs = [float(old[b, t] - infer[b, t]) for t in range(old.shape[1]) if mask[b, t]]
    if isinstance(level, tuple):
        x = float(old[b, level[1]] - infer[b, level[1]])
    elif level == "sequence":
        x = sum(xs)
    else:
        x = sum(xs) / max(len(xs), 1)
    return math.exp(min(max(x, -20.0), 20.0))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_level_matches_a_loop(seed):
    """Importance weights (token, sequence) and rejection (token, sequence, geometric) against a loop over Python
    floats, on log-probs 0.05 apart per token and some responses shifted as a whole, with padding; and the shares
    each cut."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(5, 7, generator=g) * 2
    shift = torch.tensor([[0.0], [0.4], [-0.4], [0.05], [-0.1]])  # responses the policies part on as a whole
    infer = old + torch.randn(5, 7, generator=g) * 0.05 + shift
    lengths = [7, 5, 1, 3, 6]
    mask = torch.tensor([[1.0] * n + [0.0] * (7 - n) for n in lengths])
    cap, lower, upper = 1.3, 0.8, 1.25
    tokens = [(b, t) for b in range(5) for t in range(lengths[b])]
    for level in ("token", "sequence"):
        w = importance_weights(old, infer, mask, level, cap)
        for b in range(5):
            for t in range(7):
                ratio = loop_ratio(old, infer, mask, b, ("token", t) if level == "token" else level)
                expected = min(ratio, cap) if t < lengths[b] else 0.0
                assert float(w[b, t]) == pytest.approx(expected, rel=1e-5), (level, b, t)
        metrics = correction_metrics(old, infer, mask, is_level=level, cap=cap, rs_level=None, bounds=(lower, upper))
        cut = {(b, t) for b, t in tokens if loop_ratio(old, infer, mask, b, ("token", t) if level == "token" else level) > cap}
        assert metrics["offpolicy/is_truncated_frac"] == pytest.approx(len(cut) / len(tokens))
        assert metrics["offpolicy/is_truncated_seq_frac"] == pytest.approx(len({b for b, _ in cut}) / 5)
    for level in ("token", "sequence", "geometric"):
        keep = rejection_keep(old, infer, mask, level, lower, upper)
        rejected = set()
        for b, t in tokens:
            ratio = loop_ratio(old, infer, mask, b, ("token", t) if level == "token" else level)
            assert float(keep[b, t]) == float(lower <= ratio <= upper), (level, b, t, ratio)
            if not lower <= ratio <= upper:
                rejected.add((b, t))
        assert float(keep[mask == 0].abs().sum()) == 0.0
        metrics = correction_metrics(old, infer, mask, is_level=None, cap=cap, rs_level=level, bounds=(lower, upper))
        assert metrics["offpolicy/rs_rejected_frac"] == pytest.approx(len(rejected) / len(tokens))
        assert metrics["offpolicy/rs_rejected_seq_frac"] == pytest.approx(len({b for b, _ in rejected}) / 5)
        assert metrics["offpolicy/is_truncated_frac"] == 0.0  # no importance weights asked for
    # these draws cut something at every level, so each comparison above saw both outcomes
    for level in ("token", "sequence", "geometric"):
        assert 0 < float(rejection_keep(old, infer, mask, level, lower, upper).sum()) < float(mask.sum()), level


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_values_under_the_mask_change_no_level(level):
    g = torch.Generator().manual_seed(3)
    old, infer = torch.randn(4, 6, generator=g), torch.randn(4, 6, generator=g)
    mask = (torch.rand(4, 6, generator=g) > 0.3).float()
    noisy_old = torch.where(mask > 0, old, torch.full_like(old, float("inf")))
    noisy_infer = torch.where(mask > 0, infer, torch.full_like(infer, float("nan")))
    assert torch.equal(level_log_ratios(old, infer, mask, level), level_log_ratios(noisy_old, noisy_infer, mask, level))
    assert torch.equal(rejection_keep(old, infer, mask, level, 0.5, 2.0), rejection_keep(noisy_old, noisy_infer, mask, level, 0.5, 2.0))


def test_a_long_response_s_product_is_bounded_at_e20_and_its_geometric_mean_is_not_the_product():
    """30 tokens each e^1 more likely under pi_old: the product e^30 is bounded to e^20 (a weight that cannot
    overflow), the geometric mean is e^1; the bounds of the rejection are inclusive."""
    old, infer, mask = torch.ones(1, 30), torch.zeros(1, 30), torch.ones(1, 30)
    assert float(level_log_ratios(old, infer, mask, "sequence")) == 20.0
    assert float(level_log_ratios(old, infer, mask, "geometric")) == pytest.approx(1.0)
    assert importance_weights(old, infer, mask, "sequence", 1e10)[0, 0] == torch.tensor(20.0).exp()
    e1 = float(torch.tensor(1.0).exp())
    assert rejection_keep(old, infer, mask, "geometric", 0.5, e1).sum() == 30  # exactly at the upper bound: kept
    assert rejection_keep(old, infer, mask, "geometric", e1, 10.0).sum() == 30  # exactly at the lower bound: kept
    assert rejection_keep(old, infer, mask, "geometric", e1 * 1.0001, 10.0).sum() == 0


@pytest.mark.parametrize("level", ["seq", "zzz", "sz", "a", "tokens"])
def test_a_level_that_is_not_one_of_the_three_is_an_error(level):
    with pytest.raises(ValueError, match=f"unknown off-policy correction level {level!r}"):
        level_log_ratios(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), level)


def test_levels_read_from_a_config_are_strings_equal_to_the_names_not_the_same_objects():
    """A level comes from YAML as a string of its own (not the interned literal): compared by value."""
    old, infer, mask = torch.tensor([[0.5, 0.25]]), torch.zeros(1, 2), torch.ones(1, 2)
    for name, expected in (("token", [[0.5, 0.25]]), ("sequence", [[0.75]]), ("geometric", [[0.375]])):
        level = "".join(list(name))  # a new str object
        assert level_log_ratios(old, infer, mask, level).tolist() == expected


def test_a_response_with_no_valid_token_has_log_ratio_0_at_every_level():
    old, infer = torch.tensor([[1.0, 2.0], [0.5, 3.0]]), torch.zeros(2, 2)
    mask = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    assert level_log_ratios(old, infer, mask, "geometric").tolist() == [[1.5], [0.0]]
    assert level_log_ratios(old, infer, mask, "sequence").tolist() == [[3.0], [0.0]]
    assert rejection_keep(old, infer, mask, "geometric", 0.1, 10.0).tolist() == [[1.0, 1.0], [0.0, 0.0]]


def test_staleness_counts_each_token_from_the_version_that_sampled_it():
    """Step with 7 updates so far: row 0 sampled wholly by version 5 (age 2), row 1 by 5 then, after a sync
    landed, by 6 (a partial rollout), row 2 by 6 with its last column padding (version 3 there, not counted)."""
    versions = torch.tensor([[5, 5, 5], [5, 6, 6], [6, 6, 3]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    metrics = staleness_metrics(7, versions, mask, generated_with=5)
    ages = [2, 2, 2, 2, 1, 1, 1, 1]
    assert metrics == {
        "offpolicy/staleness": pytest.approx(sum(ages) / len(ages)),
        "offpolicy/staleness_min": 1.0,
        "offpolicy/staleness_max": 2.0,
        "offpolicy/partial_frac": pytest.approx(1 / 3),
    }


def test_staleness_without_versions_or_tokens_is_the_rollout_s_version():
    mask = torch.ones(2, 3)
    expected = {"offpolicy/staleness": 3.0, "offpolicy/staleness_min": 3.0, "offpolicy/staleness_max": 3.0,
                "offpolicy/partial_frac": 0.0}
    assert staleness_metrics(5, None, mask, generated_with=2) == expected
    assert staleness_metrics(5, torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3), generated_with=2) == expected


def test_a_response_without_tokens_is_not_counted_as_partial():
    versions = torch.tensor([[1, 2], [4, 4]])
    mask = torch.tensor([[0.0, 0.0], [1.0, 1.0]])
    assert staleness_metrics(4, versions, mask, generated_with=0)["offpolicy/partial_frac"] == 0.0


def test_staleness_is_the_difference_of_versions():
    """Updates so far minus the version: 8 - 3 = 5 and 8 - 4 = 4 (a remainder or an exclusive or gives 2, 0, 11, 12)."""
    metrics = staleness_metrics(8, torch.tensor([[3, 4]]), torch.ones(1, 2), generated_with=0)
    assert (metrics["offpolicy/staleness_min"], metrics["offpolicy/staleness_max"]) == (4.0, 5.0)
    assert metrics["offpolicy/staleness"] == 4.5

"""Advantages, policy losses, KL, value loss and loss aggregation: golden values worked out by hand, invariance to
values under mask == 0, a plain loop version against the vectorised one, and the same gradient whether a batch goes
through whole or in micro-batches."""

from __future__ import annotations

import math

import pytest
import torch

from roll_core.algorithms import (
    ADVANTAGES,
    KL_CONTROLLERS,
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    POLICY_LOSSES,
    aggregate_loss,
    batch_normalizer,
)
from roll_core.algorithms.advantages import (
    advantage_metrics,
    discounted_returns,
    group_statistics,
    masked_whiten,
    place_at_last_token,
    postprocess_advantages,
)
from roll_core.algorithms.kl import kl_penalty_rewards
from roll_core.algorithms.value import clipped_value_loss
from roll_core.registry import Registry

grpo = ADVANTAGES.get("grpo")
gae = ADVANTAGES.get("gae")
ppo_clip = POLICY_LOSSES.get("ppo_clip")
MODES = LOSS_AGGREGATIONS.names()


def test_registries_hold_what_the_issue_asks_for():
    assert set(ADVANTAGES.names()) == {
        "gae", "grpo", "dr_grpo", "rloo", "reinforce", "reinforce_plus_plus", "reinforce_plus_plus_baseline"
    }
    assert set(POLICY_LOSSES.names()) == {"ppo_clip", "gspo", "topr", "cispo"}
    assert {"k1", "k2", "k3", "abs", "mse", "low_var_kl"} == set(KL_ESTIMATORS.names())
    assert set(MODES) == {"token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"}
    assert set(KL_CONTROLLERS.names()) == {"fixed", "adaptive"}


def test_registry_refuses_duplicates_and_lists_names():
    reg = Registry("thing")
    reg.register("a")(lambda: 1)
    with pytest.raises(ValueError, match="thing 'a' is already registered"):
        reg.register("a")(lambda: 2)
    with pytest.raises(ValueError, match=r"unknown thing 'b'; available: \['a'\]"):
        reg.get("b")


def test_place_at_last_token():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]], dtype=torch.float)
    out = place_at_last_token(torch.tensor([2.0, 3.0, 4.0]), mask)
    assert out.tolist() == [[0, 2, 0], [0, 0, 3], [0, 0, 0]]
    # a multi-turn response: holes where a tool wrote; the reward goes to the last token the model sampled
    holes = torch.tensor([[1, 0, 0, 1, 1, 0], [1, 1, 0, 0, 0, 0], [0, 0, 1, 0, 1, 0]], dtype=torch.float)
    out = place_at_last_token(torch.tensor([2.0, 3.0, 4.0]), holes)
    assert out.tolist() == [[0, 0, 0, 0, 2, 0], [0, 3, 0, 0, 0, 0], [0, 0, 0, 0, 4, 0]]
    assert place_at_last_token(torch.tensor([1.0]), torch.zeros(1, 0)).shape == (1, 0)


# ------------------------------------------------------------------------------------------- advantages: golden


def test_grpo_golden_values():
    mask = torch.ones(5, 2)
    rewards = place_at_last_token(torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0]), mask)
    adv, ret = grpo(rewards, mask, torch.tensor([0, 0, 0, 0, 1]))
    expected = 0.5 / math.sqrt(1 / 3)  # group mean 0.5, unbiased std sqrt(1/3)
    assert adv[:4, 0].tolist() == pytest.approx([expected, -expected, -expected, expected], rel=1e-5)
    assert adv[4].tolist() == [0.0, 0.0]  # a group of one has nothing to compare against
    assert torch.equal(adv, ret)


def test_grpo_leaves_masked_samples_out_of_group_statistics():
    mask = torch.ones(4, 1)
    rewards = place_at_last_token(torch.tensor([1.0, 0.0, 123.0, 0.0]), mask)
    in_loss = torch.tensor([1.0, 1.0, 0.0, 1.0])
    adv, _ = grpo(rewards, mask, torch.zeros(4, dtype=torch.long), in_loss=in_loss)
    # group of 3 valid: [1, 0, 0], mean 1/3, std sqrt(1/3)
    std = math.sqrt(((2 / 3) ** 2 + 2 * (1 / 3) ** 2) / 2)
    assert adv[:, 0].tolist() == pytest.approx([(2 / 3) / std, -(1 / 3) / std, 0.0, -(1 / 3) / std], rel=1e-5)


def test_dr_grpo_golden_values():
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [1.0, 1.0], [1.0, 1.0]])
    rewards = place_at_last_token(torch.tensor([1.0, 0.0, 0.0, 1.0, 5.0]), mask)
    adv, ret = ADVANTAGES.get("dr_grpo")(rewards, mask, torch.tensor([0, 0, 0, 0, 1]))
    # group mean 0.5, no division by the std; the group of one gets 0
    assert adv.tolist() == [[0.5, 0.5], [-0.5, 0.0], [-0.5, -0.5], [0.5, 0.5], [0.0, 0.0]]
    assert torch.equal(adv, ret)


def test_rloo_golden_values():
    mask = torch.ones(4, 1)
    rewards = place_at_last_token(torch.tensor([1.0, 0.0, 0.0, 7.0]), mask)
    adv, _ = ADVANTAGES.get("rloo")(rewards, mask, torch.tensor([0, 0, 0, 1]))
    # baseline of each = mean of the other two: 1 - 0 = 1, 0 - 0.5 = -0.5, 0 - 0.5 = -0.5; group of one: 0
    assert adv[:, 0].tolist() == pytest.approx([1.0, -0.5, -0.5, 0.0])


def test_reinforce_plus_plus_golden_values():
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    rewards = torch.tensor([[0.1, 0.0, 1.0], [0.0, -1.0, 9.0]])  # 9.0 sits on padding and must not count
    adv, ret = ADVANTAGES.get("reinforce_plus_plus")(rewards, mask, gamma=0.5)
    # returns: row 0: [0.1 + 0.5 * 0.5, 0 + 0.5 * 1, 1] = [0.35, 0.5, 1.0]; row 1: [-0.5, -1.0]
    assert ret.tolist() == [pytest.approx([0.35, 0.5, 1.0]), pytest.approx([-0.5, -1.0, 0.0])]
    tokens = [0.35, 0.5, 1.0, -0.5, -1.0]
    mean = sum(tokens) / 5
    std = math.sqrt(sum((x - mean) ** 2 for x in tokens) / 4)
    expected = [[(x - mean) / std for x in tokens[:3]], [(x - mean) / std for x in tokens[3:]] + [0.0]]
    assert adv.tolist() == [pytest.approx(expected[0], rel=1e-5), pytest.approx(expected[1], rel=1e-5)]


def test_reinforce_golden_values_are_the_discounted_returns_unwhitened():
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    rewards = torch.tensor([[0.1, 0.0, 1.0], [0.0, -1.0, 9.0], [0.0, 2.0, 0.0]])  # 9.0 sits on padding
    adv, ret = ADVANTAGES.get("reinforce")(rewards, mask, in_loss=torch.tensor([1.0, 1.0, 0.0]), gamma=0.5)
    # row 0: [0.1 + 0.5 * 0.5, 0 + 0.5 * 1, 1]; row 1: [-0.5, -1.0]; row 2 is out of the loss: zero
    expected = [pytest.approx([0.35, 0.5, 1.0]), pytest.approx([-0.5, -1.0, 0.0]), [0.0, 0.0, 0.0]]
    assert adv.tolist() == expected
    assert ret.tolist() == expected


def test_reinforce_on_group_normalised_rewards_is_grpo():
    """ROLL's grpo is its reinforce on rewards normalised by the group's mean and unbiased std (+1e-6): with
    gamma 1 that is exactly this project's grpo, which `roll config import` relies on."""
    from roll_core.algorithms.shaping import normalize_rewards

    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [1.0, 1.0], [1.0, 0.0]])
    scores = torch.tensor([1.0, 0.0, 0.5, 1.0, 0.25])
    groups = torch.tensor([0, 0, 0, 1, 1])
    valid = torch.ones(5)
    normalised = normalize_rewards(scores, groups, valid, "group", "group", None)
    via_reinforce, _ = ADVANTAGES.get("reinforce")(place_at_last_token(normalised, mask), mask, gamma=1.0)
    direct, _ = grpo(place_at_last_token(scores, mask), mask, groups)
    assert torch.allclose(via_reinforce, direct, atol=1e-6)


def test_reinforce_plus_plus_baseline_golden_values():
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 0.0], [1.0, 0.0]])
    rewards = place_at_last_token(torch.tensor([1.0, 0.0, 1.0, 1.0]), mask)
    adv, _ = ADVANTAGES.get("reinforce_plus_plus_baseline")(rewards, mask, torch.tensor([0, 0, 1, 1]))
    # centred: [0.5, -0.5, 0, 0]; over the 5 valid tokens [0.5, 0.5, -0.5, 0, 0]: mean 0.1, var 0.7 / 4
    std = math.sqrt(0.7 / 4)
    expected = [[0.4 / std, 0.4 / std], [-0.6 / std, 0.0], [-0.1 / std, 0.0], [-0.1 / std, 0.0]]
    for got, want in zip(adv.tolist(), expected, strict=True):
        assert got == pytest.approx(want, rel=1e-5)


def test_gae_golden_values():
    mask = torch.tensor([[1.0, 1.0, 1.0]])
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.5, 0.5]])
    adv, ret = gae(rewards, mask, values=values, gamma=1.0, lambd=0.5)
    # deltas: [0, 0, 0.5]; A2 = 0.5, A1 = 0.25, A0 = 0.125
    assert adv.tolist() == [[pytest.approx(0.125), pytest.approx(0.25), pytest.approx(0.5)]]
    assert ret.tolist() == [[pytest.approx(0.625), pytest.approx(0.75), pytest.approx(1.0)]]
    adv1, _ = gae(rewards, mask, values=values, gamma=1.0, lambd=1.0)
    assert adv1.tolist() == [[pytest.approx(0.5)] * 3]


def test_masked_whiten_of_one_token_and_of_none_is_zero():
    """One valid token is its own mean and has no spread: 0, not the token scaled by 1 / sqrt(eps) or NaN."""
    assert masked_whiten(torch.tensor([[5.0, 7.0]]), torch.tensor([[1.0, 0.0]])).tolist() == [[0.0, 0.0]]
    assert masked_whiten(torch.tensor([[5.0, 7.0]]), torch.zeros(1, 2)).tolist() == [[0.0, 0.0]]


def test_masked_whiten_and_postprocess_golden_values():
    values = torch.tensor([[1.0, 3.0, 100.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    # mean 2, unbiased var 2
    assert masked_whiten(values, mask).tolist() == [[pytest.approx(-1 / math.sqrt(2)), pytest.approx(1 / math.sqrt(2)), 0.0]]
    clipped = postprocess_advantages(torch.tensor([[-3.0, 0.5, 2.0]]), torch.ones(1, 3), whiten=False, clip=1.0)
    assert clipped.tolist() == [[-1.0, 0.5, 1.0]]
    both = postprocess_advantages(values, mask, whiten=True, clip=0.5)
    assert both.tolist() == [[-0.5, 0.5, 0.0]]


# ------------------------------------------------------------------------------------------- advantages: loops


def _group_members(i, group_ids, valid):
    return [j for j in range(len(group_ids)) if group_ids[j] == group_ids[i] and valid[j]]


def grpo_loop(scores, group_ids, valid, eps=1e-6):
    out = []
    for i in range(len(scores)):
        members = [scores[j] for j in _group_members(i, group_ids, valid)]
        if not valid[i] or len(members) < 2:
            out.append(0.0)
            continue
        mean = sum(members) / len(members)
        std = math.sqrt(sum((m - mean) ** 2 for m in members) / (len(members) - 1))
        out.append((scores[i] - mean) / (std + eps))
    return out


def dr_grpo_loop(scores, group_ids, valid):
    out = []
    for i in range(len(scores)):
        members = [scores[j] for j in _group_members(i, group_ids, valid)]
        out.append(scores[i] - sum(members) / len(members) if valid[i] and len(members) > 1 else 0.0)
    return out


def rloo_loop(scores, group_ids, valid):
    out = []
    for i in range(len(scores)):
        others = [scores[j] for j in _group_members(i, group_ids, valid) if j != i]
        out.append(scores[i] - sum(others) / len(others) if valid[i] and others else 0.0)
    return out


def whiten_loop(rows, lengths, valid):
    flat = [x for row, n, v in zip(rows, lengths, valid, strict=True) if v for x in row[:n]]
    mean = sum(flat) / len(flat)
    var = sum((x - mean) ** 2 for x in flat) / (len(flat) - 1)
    return [[(x - mean) / math.sqrt(var + 1e-8) if v and t < n else 0.0 for t, x in enumerate(row)]
            for row, n, v in zip(rows, lengths, valid, strict=True)]


def rf_loop(rewards, lengths, valid, gamma):
    returns = []
    for row, n in zip(rewards, lengths, strict=True):
        ret = [0.0] * len(row)
        running = 0.0
        for t in reversed(range(n)):
            running = row[t] + gamma * running
            ret[t] = running
        returns.append(ret)
    return whiten_loop(returns, lengths, valid)


def rf_baseline_loop(scores, group_ids, valid, lengths, width):
    centred = []
    for i in range(len(scores)):
        members = [scores[j] for j in _group_members(i, group_ids, valid)]
        c = scores[i] - sum(members) / len(members) if valid[i] else 0.0
        centred.append([c] * width)
    return whiten_loop(centred, lengths, valid)


def random_batch(seed, n=24, width=7, groups=6):
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(n, generator=gen)
    group_ids = torch.randint(0, groups, (n,), generator=gen)
    lengths = torch.randint(1, width + 1, (n,), generator=gen)
    mask = (torch.arange(width) < lengths.unsqueeze(-1)).float()
    in_loss = (torch.rand(n, generator=gen) > 0.2).float()
    return scores, group_ids, lengths, mask, in_loss, gen


@pytest.mark.parametrize("seed", [0, 1])
def test_outcome_estimators_match_loop_versions(seed):
    scores, group_ids, lengths, mask, in_loss, _ = random_batch(seed)
    rewards = place_at_last_token(scores, mask)
    s, g, v = scores.tolist(), group_ids.tolist(), [bool(x) for x in in_loss.tolist()]
    for name, loop in (("grpo", grpo_loop), ("dr_grpo", dr_grpo_loop), ("rloo", rloo_loop)):
        adv, _ = ADVANTAGES.get(name)(rewards, mask, group_ids, in_loss=in_loss)
        expected = torch.tensor(loop(s, g, v)).unsqueeze(-1) * mask
        assert torch.allclose(adv, expected, atol=1e-5), name
    adv, _ = ADVANTAGES.get("reinforce_plus_plus_baseline")(rewards, mask, group_ids, in_loss=in_loss)
    expected = torch.tensor(rf_baseline_loop(s, g, v, lengths.tolist(), mask.shape[1]))
    assert torch.allclose(adv, expected, atol=1e-5)


def test_reinforce_plus_plus_matches_loop_version():
    _, _, lengths, mask, in_loss, gen = random_batch(3)
    rewards = torch.randn(mask.shape, generator=gen) * mask  # token-level rewards, e.g. with a KL penalty
    adv, _ = ADVANTAGES.get("reinforce_plus_plus")(rewards, mask, in_loss=in_loss, gamma=0.9)
    expected = rf_loop(rewards.tolist(), lengths.tolist(), [bool(x) for x in in_loss.tolist()], 0.9)
    assert torch.allclose(adv, torch.tensor(expected), atol=1e-5)


def gae_loop(rewards, values, length, gamma, lambd):
    adv = [0.0] * len(rewards)
    last = 0.0
    for t in reversed(range(length)):
        next_v = values[t + 1] if t + 1 < length else 0.0
        delta = rewards[t] + gamma * next_v - values[t]
        last = delta + gamma * lambd * last
        adv[t] = last
    return adv


def test_gae_matches_loop_version():
    gen = torch.Generator().manual_seed(1)
    lengths = [5, 3, 1, 6]
    mask = torch.tensor([[1.0] * n + [0.0] * (6 - n) for n in lengths])
    rewards = torch.randn(4, 6, generator=gen) * mask
    values = torch.randn(4, 6, generator=gen)  # values on padding too: they must not count
    adv, ret = gae(rewards, mask, values=values, gamma=0.9, lambd=0.8)
    for i, n in enumerate(lengths):
        expected = gae_loop(rewards[i].tolist(), values[i].tolist(), n, 0.9, 0.8)
        assert adv[i].tolist() == pytest.approx(expected, abs=1e-5)
        # the critic's targets: advantage + value on the response's tokens, exactly 0 on its padding
        assert ret[i, :n].tolist() == pytest.approx((adv[i, :n] + values[i, :n]).tolist(), abs=1e-6)
        assert ret[i, n:].tolist() == [0.0] * (6 - n)


@pytest.mark.parametrize("name", ADVANTAGES.names())
def test_estimators_ignore_values_under_the_masks(name):
    """Noise on padded tokens, and any rewards and values of samples with in_loss 0, change nothing."""
    scores, group_ids, _, mask, in_loss, gen = random_batch(4)
    rewards = place_at_last_token(scores, mask)
    values = torch.randn(mask.shape, generator=gen) * mask
    fn = ADVANTAGES.get(name)
    kwargs = {"group_ids": group_ids, "in_loss": in_loss, "gamma": 0.9, "lambd": 0.8}
    adv, _ = fn(token_level_rewards=rewards, response_mask=mask, values=values, **kwargs)
    noise = (1 - mask * in_loss.unsqueeze(-1)) * torch.randn(mask.shape, generator=gen) * 100
    adv_noisy, _ = fn(token_level_rewards=rewards + noise, response_mask=mask, values=values + noise, **kwargs)
    keep = mask * in_loss.unsqueeze(-1)
    assert torch.allclose(adv * keep, adv_noisy * keep, atol=1e-5)
    assert torch.equal(adv_noisy * (1 - mask), torch.zeros_like(adv))  # nothing leaks onto padding
    assert adv.abs().sum() > 0
    # the returns (the critic's targets) too: the same on kept tokens, exactly 0 on padding
    _, ret = fn(token_level_rewards=rewards, response_mask=mask, values=values, **kwargs)
    _, ret_noisy = fn(token_level_rewards=rewards + noise, response_mask=mask, values=values + noise, **kwargs)
    assert torch.allclose(ret * keep, ret_noisy * keep, atol=1e-5)
    assert torch.equal(ret_noisy * (1 - mask), torch.zeros_like(ret)), name


# ------------------------------------------------------------------------------------------- policy losses


def test_ppo_clip_golden_values():
    old = torch.zeros(1, 4)
    new = torch.tensor([[0.5, 0.5, -0.5, 0.0]])
    adv = torch.tensor([[1.0, -1.0, 1.0, 2.0]])
    loss, diag = ppo_clip(new, old, adv, torch.ones(1, 4), clip_low=0.2, clip_high=0.2)
    r_hi, r_lo = math.exp(0.5), math.exp(-0.5)
    assert loss.tolist() == [[pytest.approx(-1.2), pytest.approx(r_hi), pytest.approx(-r_lo), pytest.approx(-2.0)]]
    assert diag["clipped"].tolist() == [[1.0, 0.0, 0.0, 0.0]]
    assert diag["approx_kl"].tolist() == [[-0.5, -0.5, 0.5, 0.0]]


def test_ppo_clip_higher_uses_separate_ranges():
    old = torch.zeros(1, 2)
    new = torch.tensor([[0.3, -0.3]])  # ratios 1.35 and 0.74
    adv = torch.tensor([[1.0, -1.0]])
    loss, diag = ppo_clip(new, old, adv, torch.ones(1, 2), clip_low=0.2, clip_high=0.28)
    # A > 0: min(1.35, 1.28) = 1.28; A < 0: -min(-0.74, -0.8) = 0.8
    assert loss.tolist() == [[pytest.approx(-1.28), pytest.approx(0.8)]]
    assert diag["clipped"].tolist() == [[1.0, 1.0]]


def test_dual_clip_caps_the_loss_of_negative_advantages():
    old = torch.zeros(1, 3)
    new = torch.tensor([[1.5, 1.5, 0.1]])  # ratios 4.48, 4.48, 1.105
    adv = torch.tensor([[-1.0, 1.0, -2.0]])
    loss, diag = ppo_clip(new, old, adv, torch.ones(1, 3), clip_low=0.2, clip_high=0.2, dual_clip_c=3.0)
    # A = -1: max(4.48, 1.2) = 4.48 > 3 * 1 -> 3; A = +1: -1.2 (untouched); A = -2: max(2.21, 2.0) = 2.21 < 6
    assert loss.tolist() == [[pytest.approx(3.0), pytest.approx(-1.2), pytest.approx(2 * math.exp(0.1))]]
    assert diag["dual_clipped"].tolist() == [[1.0, 0.0, 0.0]]
    undual, _ = ppo_clip(new, old, adv, torch.ones(1, 3), clip_low=0.2, clip_high=0.2)
    assert float(undual[0, 0]) == pytest.approx(math.exp(1.5))



def test_a_loss_exactly_at_the_dual_clip_cap_is_not_dual_clipped():
    """At a tie (loss = -c A exactly) nothing is capped: the token is not counted in dual_clipfrac and keeps its
    gradient, as a ratio exactly at a PPO clip bound is not counted in clipfrac (the diagnostics count tokens
    whose loss the clip changed). Here r = e^ln3 = 3 exactly in float32, A = -1, c = 3."""
    new = torch.tensor([[math.log(3.0), math.log(3.0)]], requires_grad=True)
    assert float(new[0, 0].exp()) == 3.0
    adv = torch.tensor([[-1.0, -1.0]])
    loss, diag = ppo_clip(new, torch.tensor([[0.0, -0.1]]), adv, torch.ones(1, 2), clip_low=0.2, clip_high=0.2,
                          dual_clip_c=3.0)
    assert diag["dual_clipped"].tolist() == [[0.0, 1.0]]  # the second token: r = 3 e^0.1, above the cap
    loss.sum().backward()
    assert float(loss[0, 0]) == 3.0 and float(new.grad[0, 0]) == pytest.approx(3.0)

def test_gspo_uses_the_sequence_ratio_and_its_gradient():
    old = torch.zeros(2, 3)
    new = torch.tensor([[0.1, 0.3, 7.0], [0.1, 0.3, 7.0]], requires_grad=True)  # 7.0 is padding
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    adv = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])
    loss, diag = POLICY_LOSSES.get("gspo")(new, old, adv, mask, clip_low=0.2, clip_high=0.2)
    s = math.exp(0.2)  # geometric mean of e^0.1 and e^0.3
    # A > 0: min(s, 1.2) -> clipped at 1.2 (no gradient); A < 0: max(s, 1.2) = s
    assert (loss * mask).tolist() == [[pytest.approx(-1.2), pytest.approx(-1.2), 0.0], [pytest.approx(s), pytest.approx(s), 0.0]]
    assert diag["clipped"].tolist() == [[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]]
    aggregate_loss(loss, mask, "seq-mean-token-mean").backward()
    # the sequence objective -A * s(theta) / 2 responses has d/dlogp_t = -A * s / |y| / 2 = s / 4 on row 1
    assert new.grad.tolist() == [[0.0, 0.0, 0.0], [pytest.approx(s / 4), pytest.approx(s / 4), 0.0]]


def test_cispo_keeps_a_gradient_through_a_clipped_weight():
    old = torch.zeros(1, 3)
    new = torch.tensor([[0.5, -0.05, -0.9]], requires_grad=True)  # ratios 1.65, 0.95, 0.41
    adv = torch.tensor([[1.0, 1.0, -2.0]])
    loss, diag = POLICY_LOSSES.get("cispo")(new, old, adv, torch.ones(1, 3), clip_low=1.0, clip_high=0.28)
    weights = [1.28, math.exp(-0.05), math.exp(-0.9)]
    assert loss.tolist() == [[pytest.approx(-weights[0] * 0.5), pytest.approx(weights[1] * 0.05), pytest.approx(-weights[2] * 2 * 0.9)]]
    assert diag["clipped"].tolist() == [[1.0, 0.0, 0.0]]
    loss.sum().backward()
    # d/dlogp of -sg(w) * A * logp = -w * A: PPO would give the clipped first token no gradient at all
    assert new.grad.tolist() == [[pytest.approx(-1.28), pytest.approx(-weights[1]), pytest.approx(2 * weights[2])]]


def test_topr_tapers_only_negative_samples_by_their_sequence_ratio():
    old = torch.zeros(3, 2)
    new = torch.tensor([[0.4, 0.4], [0.4, 0.4], [-0.3, -0.4]], requires_grad=True)
    mask = torch.ones(3, 2)
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0], [-1.0, -1.0]])
    loss, diag = POLICY_LOSSES.get("topr")(new, old, adv, mask)
    loss.sum().backward()
    # positive: plain REINFORCE, gradient -A = -1; negative with pi/mu = e^0.8 > 1: weight 1, gradient +1;
    # negative with pi/mu = e^-0.7: weight e^-0.7
    taper = math.exp(-0.7)
    assert new.grad.tolist() == [[-1.0, -1.0], [1.0, 1.0], [pytest.approx(taper), pytest.approx(taper)]]
    assert loss[2].tolist() == [pytest.approx(taper * -0.3), pytest.approx(taper * -0.4)]
    assert diag["clipped"].tolist() == [[0.0, 0.0], [1.0, 1.0], [0.0, 0.0]]


def ppo_loop(lp, old, a, lo, hi, c):
    r = math.exp(lp - old)
    loss = max(-a * r, -a * min(max(r, 1 - lo), 1 + hi))
    return min(loss, -a * c) if c is not None and a < 0 else loss


def seq_log_ratio(lp_row, old_row, m_row):
    n = sum(m_row)
    return sum((x - y) for x, y, m in zip(lp_row, old_row, m_row, strict=True) if m) / max(n, 1)


def policy_loss_loop(name, lp, old, adv, mask, lo, hi, c):
    out = []
    for i in range(len(lp)):
        row = []
        s_log = seq_log_ratio(lp[i], old[i], mask[i])
        total_log = s_log * max(sum(mask[i]), 1)
        for t in range(len(lp[i])):
            a, r = adv[i][t], math.exp(lp[i][t] - old[i][t])
            if name == "ppo_clip":
                row.append(ppo_loop(lp[i][t], old[i][t], a, lo, hi, c))
            elif name == "gspo":
                s = math.exp(s_log)
                row.append(max(-a * s, -a * min(max(s, 1 - lo), 1 + hi)))
            elif name == "cispo":
                row.append(-min(max(r, 1 - lo), 1 + hi) * a * lp[i][t])
            else:  # topr
                w = min(math.exp(total_log), 1.0) if a < 0 else 1.0
                row.append(-w * a * lp[i][t])
        out.append(row)
    return out


def random_policy_inputs(seed, n=6, width=5):
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(n, width, generator=gen) * 3
    new = old + torch.randn(n, width, generator=gen) * 0.3
    adv = torch.randn(n, width, generator=gen)
    lengths = torch.randint(1, width + 1, (n,), generator=gen)
    mask = (torch.arange(width) < lengths.unsqueeze(-1)).float()
    return new, old, adv, mask, gen


@pytest.mark.parametrize("name", POLICY_LOSSES.names())
def test_policy_losses_match_loop_versions(name):
    new, old, adv, mask, _ = random_policy_inputs(5)
    kwargs = {"clip_low": 0.2, "clip_high": 0.28, "dual_clip_c": 3.0}
    loss, _ = POLICY_LOSSES.get(name)(new, old, adv, mask, **kwargs)
    expected = policy_loss_loop(name, new.tolist(), old.tolist(), adv.tolist(), mask.tolist(), 0.2, 0.28, 3.0)
    assert torch.allclose(loss * mask, torch.tensor(expected) * mask, atol=1e-5)


@pytest.mark.parametrize("name", POLICY_LOSSES.names())
def test_policy_losses_ignore_values_under_the_mask(name):
    new, old, adv, mask, gen = random_policy_inputs(6)
    fn = POLICY_LOSSES.get(name)

    def run(noise_scale):
        noise = (1 - mask) * torch.randn(mask.shape, generator=gen) * noise_scale
        lp = (new + noise).requires_grad_(True)
        loss, diag = fn(lp, old + noise, adv + noise, mask, clip_low=0.2, clip_high=0.28, dual_clip_c=3.0)
        total = aggregate_loss(loss, mask, "seq-mean-token-mean")
        total.backward()
        return float(total.detach()), lp.grad * mask, {k: v * mask for k, v in diag.items()}

    total, grad, diag = run(0.0)
    total_noisy, grad_noisy, diag_noisy = run(5.0)
    assert total_noisy == pytest.approx(total, rel=1e-6)
    assert torch.allclose(grad, grad_noisy, atol=1e-6)
    assert all(torch.allclose(diag[k], diag_noisy[k]) for k in diag)


def test_on_policy_gradients_agree_across_losses():
    """At ratio 1 (the first pass over fresh samples) ppo_clip, cispo and gspo give the REINFORCE gradient -A."""
    _, old, adv, mask, _ = random_policy_inputs(7)
    grads = {}
    for name in ("ppo_clip", "cispo"):
        lp = old.clone().requires_grad_(True)
        loss, _ = POLICY_LOSSES.get(name)(lp, old, adv, mask, clip_low=0.2, clip_high=0.2)
        aggregate_loss(loss, mask, "token-mean").backward()
        grads[name] = lp.grad
    assert torch.allclose(grads["ppo_clip"], -adv * mask / mask.sum(), atol=1e-6)
    assert torch.allclose(grads["cispo"], grads["ppo_clip"], atol=1e-6)


# ------------------------------------------------------------------------------------------- KL


def test_kl_estimators_golden_values():
    logp, ref = torch.tensor([0.0, -1.0, -2.0]), torch.tensor([-1.0, -1.0, -1.0])
    assert KL_ESTIMATORS.get("k1")(logp, ref).tolist() == [1.0, 0.0, -1.0]
    assert KL_ESTIMATORS.get("abs")(logp, ref).tolist() == [1.0, 0.0, 1.0]
    assert KL_ESTIMATORS.get("k2")(logp, ref).tolist() == [0.5, 0.0, 0.5]
    # k3 = e^(q-p) - (q-p) - 1: q - p = -1 -> e^-1 + 1 - 1; q - p = 1 -> e - 2
    assert KL_ESTIMATORS.get("k3")(logp, ref).tolist() == [pytest.approx(math.exp(-1)), 0.0, pytest.approx(math.e - 2)]
    assert KL_ESTIMATORS.get("mse") is KL_ESTIMATORS.get("k2")
    assert KL_ESTIMATORS.get("low_var_kl") is KL_ESTIMATORS.get("k3")


def test_kl_estimators_match_loop_versions():
    gen = torch.Generator().manual_seed(8)
    logp, ref = -torch.rand(4, 5, generator=gen) * 4, -torch.rand(4, 5, generator=gen) * 4
    loops = {
        "k1": lambda p, q: p - q,
        "abs": lambda p, q: abs(p - q),
        "k2": lambda p, q: 0.5 * (p - q) ** 2,
        "k3": lambda p, q: min(math.exp(q - p) - (q - p) - 1, 10.0),  # bounded (kl_k3)
    }
    for name, f in loops.items():
        expected = [[f(p, q) for p, q in zip(rp, rq, strict=True)] for rp, rq in zip(logp.tolist(), ref.tolist(), strict=True)]
        assert torch.allclose(KL_ESTIMATORS.get(name)(logp, ref), torch.tensor(expected), atol=1e-5), name


def test_kl_penalty_rewards_golden_values_and_mask():
    rewards = torch.tensor([[0.0, 1.0, 5.0], [0.0, 0.0, 0.0]])
    logp = torch.tensor([[-1.0, -0.5, 9.0], [-2.0, 0.0, 0.0]])
    ref = torch.tensor([[-1.5, -1.0, -9.0], [-1.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    out, per_sample = kl_penalty_rewards(rewards, logp, ref, mask, coef=0.1, estimator="k1")
    # k1 = [0.5, 0.5, (masked)] and [-1]: rewards - 0.1 * k1
    assert out.tolist() == [[pytest.approx(-0.05), pytest.approx(0.95), 0.0], [pytest.approx(0.1), 0.0, 0.0]]
    assert per_sample.tolist() == [pytest.approx(0.5), pytest.approx(-1.0)]
    # a response with no valid token (left out of the loss) has no KL, not 0 / 0
    _, per_sample = kl_penalty_rewards(rewards, logp, ref, torch.zeros(2, 3), coef=0.1, estimator="k1")
    assert per_sample.tolist() == [0.0, 0.0]


def test_kl_controllers():
    fixed = KL_CONTROLLERS.get("fixed")(kl_coef=0.1, target_kl=None, horizon=100)
    fixed.update(50.0, n_steps=10)
    assert fixed.value == 0.1
    adaptive = KL_CONTROLLERS.get("adaptive")(kl_coef=0.1, target_kl=0.5, horizon=100)
    adaptive.update(2.0, n_steps=10)  # error 2 / 0.5 - 1 clipped to +0.2: * (1 + 0.2 * 10 / 100)
    assert adaptive.value == pytest.approx(0.102)
    adaptive.update(0.525, n_steps=10)  # error 0.525 / 0.5 - 1 = 0.05: * 1.005
    assert adaptive.value == pytest.approx(0.102 * 1.005)
    adaptive.update(0.0, n_steps=100)  # error clipped to -0.2: * 0.8
    assert adaptive.value == pytest.approx(0.102 * 1.005 * 0.8)
    restored = KL_CONTROLLERS.get("adaptive")(kl_coef=0.5, target_kl=0.5, horizon=100)
    restored.load_state_dict(adaptive.state_dict())
    assert restored.value == adaptive.value


# ------------------------------------------------------------------------------------------- value loss


def test_clipped_value_loss_golden_values():
    values = torch.tensor([[1.0, 1.0, 0.2]])
    old = torch.tensor([[0.5, 0.9, 0.5]])
    returns = torch.tensor([[2.0, 0.0, 0.0]])
    loss, clipped = clipped_value_loss(values, old, returns, clip=0.2)
    # 1: v moved 0.5 > 0.2 -> bounded 0.7, (0.7 - 2)^2 = 1.69 > 1; 2: within range, 1; 3: bounded 0.3, 0.09 > 0.04
    assert loss.tolist() == [[pytest.approx(0.845), pytest.approx(0.5), pytest.approx(0.045)]]
    assert clipped.tolist() == [[1.0, 0.0, 1.0]]
    # moved away from the return by more than the clip: the bounded estimate is the closer one, the unclipped term
    # the larger, so it is not counted as clipped
    loss, clipped = clipped_value_loss(torch.tensor([[3.0]]), torch.tensor([[0.0]]), torch.tensor([[0.0]]), clip=0.2)
    assert loss.tolist() == [[pytest.approx(4.5)]] and clipped.tolist() == [[0.0]]
    # within the clip v_old + (v - v_old) rounds to v's neighbour now and then: not clipped (measured: 4 of 1000
    # such tokens were counted before the estimate's move was checked)
    g = torch.Generator().manual_seed(0)
    v = torch.randn(1000, generator=g)
    near = v + 0.1 * torch.randn(1000, generator=g)
    _, rounding = clipped_value_loss(v, near, torch.randn(1000, generator=g), clip=0.5)
    assert rounding.sum() == 0 and ((near + (v - near)) != v).any()
    # one such token (found by search): v - v_old = 0.2518 within the clip, and v_old + (v - v_old) rounds to a
    # value farther from the return than v; not clipped, whatever v + v_old or v / v_old are (both above the clip),
    # nor when the clip is exactly v - v_old
    v, near, zero = torch.tensor([[0.2838287055492401]]), torch.tensor([[0.032070621848106384]]), torch.zeros(1, 1)
    assert (near + (v - near) - zero).square() > (v - zero).square()
    for clip in (0.3, float((v - near).item())):
        assert clipped_value_loss(v, near, zero, clip=clip)[1].item() == 0.0, clip
    # moved past the clip, the return halfway between the estimate and its bound: the two terms tie, and a tie is
    # not clipped
    _, tie = clipped_value_loss(torch.tensor([[1.0]]), torch.tensor([[0.0]]), torch.tensor([[0.75]]), clip=0.5)
    assert tie.item() == 0.0
    plain, none_clipped = clipped_value_loss(values, old, returns, clip=None)
    assert plain.tolist() == [[pytest.approx(0.5), pytest.approx(0.5), pytest.approx(0.02)]]
    assert none_clipped.sum() == 0


def test_clipped_value_loss_matches_loop_version():
    gen = torch.Generator().manual_seed(9)
    v, old, ret = (torch.randn(3, 4, generator=gen) for _ in range(3))
    loss, _ = clipped_value_loss(v, old, ret, clip=0.3)
    expected = [
        [0.5 * max((a - r) ** 2, (o + min(max(a - o, -0.3), 0.3) - r) ** 2) for a, o, r in zip(ra, ro, rr, strict=True)]
        for ra, ro, rr in zip(v.tolist(), old.tolist(), ret.tolist(), strict=True)
    ]
    assert torch.allclose(loss, torch.tensor(expected), atol=1e-6)


# ------------------------------------------------------------------------------------------- aggregation


def test_aggregation_golden_values():
    loss = torch.tensor([[1.0, 2.0, 99.0], [3.0, 99.0, 99.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert float(aggregate_loss(loss, mask, "token-mean")) == pytest.approx(2.0)  # (1+2+3)/3
    assert float(aggregate_loss(loss, mask, "seq-mean-token-mean")) == pytest.approx(2.25)  # (1.5+3)/2
    assert float(aggregate_loss(loss, mask, "seq-mean-token-sum")) == pytest.approx(3.0)  # (3+3)/2
    assert float(aggregate_loss(loss, mask, "seq-mean-token-sum-norm", scale=4)) == pytest.approx(0.75)  # (3/4+3/4)/2
    assert float(aggregate_loss(loss, mask, "seq-mean-token-sum-norm")) == pytest.approx(1.0)  # scale: width 3
    assert batch_normalizer(mask, "token-mean") == 3.0
    assert all(batch_normalizer(mask, m) == 2.0 for m in MODES if m != "token-mean")


@pytest.mark.parametrize("mode", MODES)
def test_aggregation_of_one_token_and_of_nothing(mode):
    """The count divides as it is down to 1 (one token, one response: its own loss), and a batch with nothing in
    the loss gives 0, not 0 / 0."""
    loss = torch.tensor([[3.0, 7.0], [5.0, 11.0]])
    one = torch.tensor([[1.0, 0.0], [0.0, 0.0]])
    want = 3.0 / (2 if mode == "seq-mean-token-sum-norm" else 1)
    assert float(aggregate_loss(loss, one, mode, scale=2)) == pytest.approx(want)
    assert float(aggregate_loss(loss, one, mode, batch_normalizer(one, mode), scale=2)) == pytest.approx(want)
    nothing = aggregate_loss(loss, torch.zeros(2, 2), mode, scale=2)
    assert float(nothing) == 0.0
    assert batch_normalizer(torch.zeros(2, 2), mode) == 0.0


def loop_aggregate(loss, mask, mode, scale):
    if mode == "token-mean":
        vals = [loss[i][t] for i in range(len(loss)) for t in range(len(loss[i])) if mask[i][t]]
        return sum(vals) / len(vals)
    seqs = []
    for i in range(len(loss)):
        vals = [loss[i][t] for t in range(len(loss[i])) if mask[i][t]]
        if vals:
            per_seq = {"seq-mean-token-mean": sum(vals) / len(vals), "seq-mean-token-sum": sum(vals)}
            per_seq["seq-mean-token-sum-norm"] = sum(vals) / scale
            seqs.append(per_seq[mode])
    return sum(seqs) / len(seqs)


@pytest.mark.parametrize("mode", MODES)
def test_aggregation_matches_loop_and_ignores_masked_values(mode):
    gen = torch.Generator().manual_seed(2)
    loss = torch.randn(6, 5, generator=gen)
    mask = (torch.rand(6, 5, generator=gen) > 0.4).float()
    mask[0] = 0  # a response with no valid token
    got = float(aggregate_loss(loss, mask, mode, scale=8))
    assert got == pytest.approx(loop_aggregate(loss.tolist(), mask.tolist(), mode, 8), rel=1e-5)
    noisy = loss + (1 - mask) * 1e3
    assert float(aggregate_loss(noisy, mask, mode, scale=8)) == pytest.approx(got, rel=1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_micro_batches_give_the_same_gradient(mode):
    gen = torch.Generator().manual_seed(3)
    weights = torch.randn(8, 6, generator=gen)
    mask = (torch.rand(8, 6, generator=gen) > 0.3).float()
    mask[5] = 0
    param = torch.randn(6, requires_grad=True)

    def per_token(rows):
        return (weights[rows] * param).square()

    whole = aggregate_loss(per_token(slice(None)), mask, mode, scale=6)
    (grad_whole,) = torch.autograd.grad(whole, param)
    norm = batch_normalizer(mask, mode)
    grad_micro = torch.zeros(6)
    for start in range(0, 8, 3):
        rows = slice(start, start + 3)
        (g,) = torch.autograd.grad(aggregate_loss(per_token(rows), mask[rows], mode, norm, scale=6), param)
        grad_micro += g
    assert torch.allclose(grad_whole, grad_micro, atol=1e-6)
    # without the whole-batch normaliser the micro-batch gradients would not add up (the test can fail)
    naive = sum(torch.autograd.grad(aggregate_loss(per_token(slice(s, s + 3)), mask[s : s + 3], mode, scale=6), param)[0]
                for s in range(0, 8, 3))
    assert not torch.allclose(grad_whole, naive, atol=1e-4)


def test_group_statistics_of_a_single_sample_and_of_an_empty_group_are_finite():
    """A group with one valid sample has no spread (std 0, not 0/0), and one with no valid sample has mean, std
    and count 0: normalisations divide by these, so a NaN here would reach the loss."""
    values = torch.tensor([2.0, 4.0, 6.0, 5.0, 7.0, 9.0])
    groups = torch.tensor([0, 0, 0, 1, 2, 2])
    valid = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 0.0])
    mean, std, count = group_statistics(values, groups, valid)
    assert mean.tolist() == [4.0, 4.0, 4.0, 5.0, 0.0, 0.0]
    assert std.tolist() == [2.0, 2.0, 2.0, 0.0, 0.0, 0.0]
    assert count.tolist() == [3.0, 3.0, 3.0, 1.0, 0.0, 0.0]


def test_postprocess_advantages_by_default_only_masks():
    values = torch.tensor([[3.0, -2.0, 5.0], [1.0, 7.0, -4.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert torch.equal(postprocess_advantages(values, mask), values * mask)


def test_discounted_returns_are_zero_on_padding():
    rewards = torch.tensor([[1.0, 2.0, 3.0], [5.0, 7.0, 9.0]])  # rewards on padding are never read
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    # gamma 0.5: row 0 from the end 3, 2 + 1.5, 1 + 1.75; row 1 ends at its second token
    assert discounted_returns(rewards, mask, 0.5).tolist() == [[2.75, 3.5, 3.0], [8.5, 7.0, 0.0]]



def test_advantage_metrics_per_domain_over_the_tokens_in_the_loss():
    """advantages/<domain>/{mean,std,abs_max} over each domain's tokens in the loss and over all of them: masked
    tokens (advantage 0 there) are left out, a domain with no token in the loss reports nothing (and the domains
    after it still report), one token has std 0 (torch's unbiased std of one value would be nan), two have their
    sample std."""
    advantages = torch.tensor([[1.0, 3.0], [0.0, 0.0], [2.0, 0.0], [-2.0, 0.0], [0.5, -0.5]])
    mask = torch.tensor([[1.0, 1.0], [0.0, 0.0], [1.0, 0.0], [1.0, 0.0], [1.0, 1.0]])
    metrics = advantage_metrics(advantages, mask, ["math", "code", "judge", "math", "open"])
    scopes = ("all", "math", "judge", "open")
    assert set(metrics) == {f"advantages/{d}/{s}" for d in scopes for s in ("mean", "std", "abs_max")}
    # math: 1, 3, -2; judge: 2; open: 0.5, -0.5; all: the six (sample standard deviations)
    assert metrics["advantages/math/mean"] == pytest.approx(2 / 3)
    assert metrics["advantages/math/std"] == pytest.approx(math.sqrt((1 / 9 + 49 / 9 + 64 / 9) / 2))
    assert metrics["advantages/math/abs_max"] == 3.0
    assert (metrics["advantages/judge/mean"], metrics["advantages/judge/std"], metrics["advantages/judge/abs_max"]) == (
        2.0,
        0.0,
        2.0,
    )
    assert metrics["advantages/open/std"] == pytest.approx(math.sqrt(0.5))
    assert metrics["advantages/all/mean"] == pytest.approx(2 / 3)
    assert metrics["advantages/all/std"] == pytest.approx(math.sqrt(570 / 36 / 5))
    assert metrics["advantages/all/abs_max"] == 3.0

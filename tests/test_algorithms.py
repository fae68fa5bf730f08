"""Advantages, policy loss, KL and loss aggregation: golden values, mask invariance, loop == vectorised,
and the same gradient whether a batch goes through whole or in micro-batches."""

from __future__ import annotations

import math

import pytest
import torch

from roll_pipeline.algorithms import (
    ADVANTAGES,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    aggregate_loss,
    batch_normalizer,
)
from roll_pipeline.algorithms.advantages import place_at_last_token
from roll_pipeline.algorithms.registry import Registry

grpo = ADVANTAGES.get("grpo")
gae = ADVANTAGES.get("gae")
ppo_clip = POLICY_LOSSES.get("ppo_clip")


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
    sample_mask = torch.tensor([1.0, 1.0, 0.0, 1.0])
    adv, _ = grpo(rewards, mask, torch.zeros(4, dtype=torch.long), sample_mask=sample_mask)
    # group of 3 valid: [1, 0, 0], mean 1/3, std sqrt(1/3)
    std = math.sqrt(((2 / 3) ** 2 + 2 * (1 / 3) ** 2) / 2)
    assert adv[:, 0].tolist() == pytest.approx([(2 / 3) / std, -(1 / 3) / std, 0.0, -(1 / 3) / std], rel=1e-5)


def grpo_loop(scores, group_ids, eps=1e-6):
    out = []
    for i, g in enumerate(group_ids):
        members = [scores[j] for j in range(len(scores)) if group_ids[j] == g]
        mean = sum(members) / len(members)
        if len(members) < 2:
            out.append(0.0)
            continue
        std = math.sqrt(sum((m - mean) ** 2 for m in members) / (len(members) - 1))
        out.append((scores[i] - mean) / (std + eps))
    return out


def test_grpo_matches_loop_version():
    gen = torch.Generator().manual_seed(0)
    scores = torch.rand(24, generator=gen)
    group_ids = torch.randint(0, 6, (24,), generator=gen)
    lengths = torch.randint(1, 8, (24,), generator=gen)
    mask = (torch.arange(7) < lengths.unsqueeze(-1)).float()
    adv, _ = grpo(place_at_last_token(scores, mask), mask, group_ids)
    expected = torch.tensor(grpo_loop(scores.tolist(), group_ids.tolist())).unsqueeze(-1) * mask
    assert torch.allclose(adv, expected, atol=1e-5)


def test_grpo_ignores_values_under_the_mask():
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 0]], dtype=torch.float)
    rewards = place_at_last_token(torch.tensor([1.0, 0.0, 0.5]), mask)
    noisy = rewards + (1 - mask) * torch.randn_like(rewards) * 100
    ids = torch.zeros(3, dtype=torch.long)
    assert torch.equal(grpo(rewards, mask, ids)[0], grpo(noisy, mask, ids)[0])


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


def gae_loop(rewards, values, length, gamma, lambd):
    adv = [0.0] * len(rewards)
    last = 0.0
    for t in reversed(range(length)):
        next_v = values[t + 1] if t + 1 < length else 0.0
        delta = rewards[t] + gamma * next_v - values[t]
        last = delta + gamma * lambd * last
        adv[t] = last
    return adv


def test_gae_matches_loop_and_ignores_padding():
    gen = torch.Generator().manual_seed(1)
    lengths = [5, 3, 1, 6]
    mask = torch.tensor([[1.0] * n + [0.0] * (6 - n) for n in lengths])
    rewards = torch.randn(4, 6, generator=gen) * mask
    values = torch.randn(4, 6, generator=gen) * mask
    adv, _ = gae(rewards, mask, values=values, gamma=0.9, lambd=0.8)
    for i, n in enumerate(lengths):
        expected = gae_loop(rewards[i].tolist(), values[i].tolist(), n, 0.9, 0.8)
        assert adv[i].tolist() == pytest.approx(expected, abs=1e-5)
    noise = (1 - mask) * torch.randn(4, 6, generator=gen) * 50
    adv_noisy, _ = gae(rewards + noise, mask, values=values + noise, gamma=0.9, lambd=0.8)
    assert torch.allclose(adv, adv_noisy)


def test_ppo_clip_golden_values():
    old = torch.zeros(1, 4)
    new = torch.tensor([[0.5, 0.5, -0.5, 0.0]])
    adv = torch.tensor([[1.0, -1.0, 1.0, 2.0]])
    loss, diag = ppo_clip(new, old, adv, torch.ones(1, 4), clip=0.2)
    r_hi, r_lo = math.exp(0.5), math.exp(-0.5)
    assert loss.tolist() == [[pytest.approx(-1.2), pytest.approx(r_hi), pytest.approx(-r_lo), pytest.approx(-2.0)]]
    assert diag["clipped"].tolist() == [[1.0, 0.0, 0.0, 0.0]]


def test_kl_estimators_golden_values():
    logp, ref = torch.tensor([0.0, -1.0]), torch.tensor([-1.0, -1.0])
    assert KL_ESTIMATORS.get("k1")(logp, ref).tolist() == [1.0, 0.0]
    assert KL_ESTIMATORS.get("k2")(logp, ref).tolist() == [0.5, 0.0]
    assert KL_ESTIMATORS.get("k3")(logp, ref).tolist() == [pytest.approx(math.exp(-1) + 1 - 1), 0.0]


def test_aggregation_golden_values():
    loss = torch.tensor([[1.0, 2.0, 99.0], [3.0, 99.0, 99.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert float(aggregate_loss(loss, mask, "token-mean")) == pytest.approx(2.0)  # (1+2+3)/3
    assert float(aggregate_loss(loss, mask, "seq-mean-token-mean")) == pytest.approx(2.25)  # (1.5+3)/2


def loop_aggregate(loss, mask, mode):
    if mode == "token-mean":
        vals = [loss[i][t] for i in range(len(loss)) for t in range(len(loss[i])) if mask[i][t]]
        return sum(vals) / len(vals)
    seqs = []
    for i in range(len(loss)):
        vals = [loss[i][t] for t in range(len(loss[i])) if mask[i][t]]
        if vals:
            seqs.append(sum(vals) / len(vals))
    return sum(seqs) / len(seqs)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_aggregation_matches_loop_and_ignores_masked_values(mode):
    gen = torch.Generator().manual_seed(2)
    loss = torch.randn(6, 5, generator=gen)
    mask = (torch.rand(6, 5, generator=gen) > 0.4).float()
    mask[0] = 0  # a response with no valid token
    got = float(aggregate_loss(loss, mask, mode))
    assert got == pytest.approx(loop_aggregate(loss.tolist(), mask.tolist(), mode), rel=1e-5)
    noisy = loss + (1 - mask) * 1e3
    assert float(aggregate_loss(noisy, mask, mode)) == pytest.approx(got, rel=1e-6)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_micro_batches_give_the_same_gradient(mode):
    gen = torch.Generator().manual_seed(3)
    weights = torch.randn(8, 6, generator=gen)
    mask = (torch.rand(8, 6, generator=gen) > 0.3).float()
    param = torch.randn(6, requires_grad=True)

    def per_token(rows):
        return (weights[rows] * param).square()

    whole = aggregate_loss(per_token(slice(None)), mask, mode)
    (grad_whole,) = torch.autograd.grad(whole, param)
    norm = batch_normalizer(mask, mode)
    grad_micro = torch.zeros(6)
    for start in range(0, 8, 3):
        rows = slice(start, start + 3)
        (g,) = torch.autograd.grad(aggregate_loss(per_token(rows), mask[rows], mode, norm), param)
        grad_micro += g
    assert torch.allclose(grad_whole, grad_micro, atol=1e-6)

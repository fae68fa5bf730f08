"""Reward shaping and loss-side sample masks: golden values worked out by hand, invariance to masked samples, loop
versions (the scheduler's own mean_filter among them) against the vectorised ones, and per-domain statistics."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from roll_core.algorithms import REWARD_NORMS
from roll_core.algorithms.shaping import (
    DomainRewardMoments,
    RunningMoments,
    difficulty_mask,
    length_mask,
    normalize_rewards,
    overlong_penalty,
    shape_scores,
)
from roll_core.config.shaping import (
    DifficultyMaskConfig,
    LengthMaskConfig,
    OverlongPenaltyConfig,
    RewardShapingConfig,
)
from roll_core.rewards.scored import ScoredSample
from schedulers.filters import mean_filter


def test_registry_has_the_three_normalisations():
    assert REWARD_NORMS.names() == ["batch", "group", "running"]


def test_running_moments_in_chunks_equal_the_moments_of_everything():
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(50, generator=gen) * 3 + 1
    running = RunningMoments()
    for chunk in (values[:7], values[7:8], values[8:8], values[8:31], values[31:]):
        running.update(chunk)
    assert running.count == 50
    assert running.mean == pytest.approx(statistics.fmean(values.tolist()), rel=1e-9)
    assert running.std == pytest.approx(statistics.stdev(values.tolist()), rel=1e-9)


def test_running_moments_golden_and_state_round_trip():
    running = RunningMoments()
    running.update(torch.tensor([1.0, 3.0]))
    running.update(torch.tensor([5.0]))
    assert (running.count, running.mean, running.std) == (3, pytest.approx(3.0), pytest.approx(2.0))
    moments = DomainRewardMoments()
    moments["math"].update(torch.tensor([1.0, 3.0]))
    moments["code"].update(torch.tensor([10.0]))
    restored = DomainRewardMoments()
    restored.load_state_dict(moments.state_dict())
    assert restored.state_dict() == moments.state_dict()
    assert restored["math"].mean == 2.0 and restored["code"].mean == 10.0


def test_normalize_rewards_golden_values():
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 4.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1])
    valid = torch.ones(6)
    running = RunningMoments()
    running.update(torch.tensor([0.0, 2.0]))  # mean 1, std sqrt(2)
    by_group = normalize_rewards(scores, groups, valid, "group", "group", running, eps=0.0)
    s0, s1 = math.sqrt(1 / 3), math.sqrt(2)  # unbiased stds of [1,0,0,1] and [2,4]
    assert by_group.tolist() == pytest.approx([0.5 / s0, -0.5 / s0, -0.5 / s0, 0.5 / s0, -1 / s1, 1 / s1])
    centred = normalize_rewards(scores, groups, valid, "batch", None, running)
    assert centred.tolist() == pytest.approx([x - 8 / 6 for x in scores.tolist()])
    by_running = normalize_rewards(scores, groups, valid, "running", "running", running, eps=0.0)
    assert by_running.tolist() == pytest.approx([(x - 1) / math.sqrt(2) for x in scores.tolist()])
    assert torch.equal(normalize_rewards(scores, groups, valid, None, None, running), scores)


@pytest.mark.parametrize("kind", ["group", "batch"])
def test_normalize_rewards_matches_loop_and_ignores_masked_samples(kind):
    gen = torch.Generator().manual_seed(1)
    scores = torch.rand(20, generator=gen)
    groups = torch.randint(0, 4, (20,), generator=gen)
    valid = (torch.rand(20, generator=gen) > 0.25).float()
    got = normalize_rewards(scores, groups, valid, kind, kind, RunningMoments())
    for i in range(20):
        pool = [j for j in range(20) if valid[j] and (kind == "batch" or groups[j] == groups[i])]
        vals = [float(scores[j]) for j in pool]
        std = statistics.stdev(vals) if len(vals) > 1 else 0.0
        want = (float(scores[i]) - statistics.fmean(vals)) / (std + 1e-6) if valid[i] else 0.0
        assert float(got[i]) == pytest.approx(want, rel=1e-4, abs=1e-5)
    noisy = scores + (1 - valid) * 1000
    assert torch.allclose(normalize_rewards(noisy, groups, valid, kind, kind, RunningMoments()), got)


def test_overlong_penalty_golden_values():
    lengths = torch.tensor([10, 24, 26, 28, 32])
    # max 32, buffer 8: free up to 24, then -1/8 per token, -1 at 32
    assert overlong_penalty(lengths, 32, 8).tolist() == [0.0, 0.0, -0.25, -0.5, -1.0]
    assert overlong_penalty(lengths, 32, 8, penalty_factor=0.5).tolist() == [0.0, 0.0, -0.125, -0.25, -0.5]


def test_overlong_penalty_matches_dapo_formula_in_a_loop():
    lmax, cache = 20, 6
    lengths = torch.arange(0, 25)

    def dapo(n):  # Yu et al. 2025, eq. 13
        if n <= lmax - cache:
            return 0.0
        if n <= lmax:
            return ((lmax - cache) - n) / cache
        return -1.0

    assert overlong_penalty(lengths, lmax, cache).tolist() == pytest.approx([dapo(n) for n in range(25)])


def test_difficulty_mask_golden_values():
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 9.0])
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    valid = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0])  # the 9.0 is masked: group 3's mean is 1
    keep = difficulty_mask(scores, groups, valid, low=0.1, high=0.9)
    assert keep.tolist() == [0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]


def test_difficulty_mask_agrees_with_the_schedulers_mean_filter():
    gen = torch.Generator().manual_seed(2)
    scores = (torch.rand(40, generator=gen) > 0.5).float()
    groups = torch.arange(10).repeat_interleave(4)
    valid = (torch.rand(40, generator=gen) > 0.2).float()
    valid[:4] = 0  # a group with no scored response
    keep = difficulty_mask(scores, groups, valid, low=0.25, high=0.75)
    for g in range(10):
        records = [
            ScoredSample(score=float(scores[i]), correct=bool(scores[i])) if valid[i] else ScoredSample.masked_as("error")
            for i in range(4 * g, 4 * g + 4)
        ]
        expected = mean_filter(records, low=0.25, high=0.75)
        assert keep[4 * g : 4 * g + 4].tolist() == [float(expected)] * 4, g


def test_length_mask_golden_values():
    lengths = torch.tensor([3, 10, 11, 30])
    correct = torch.tensor([False, False, True, False])
    assert length_mask(lengths, 10).tolist() == [1.0, 1.0, 0.0, 0.0]
    assert length_mask(lengths, 10, correct, only_incorrect=True).tolist() == [1.0, 1.0, 1.0, 0.0]


def make_batch():
    # math: two groups of 3 (lengths up to 8); code: one group of 2
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.5, 0.0])
    domains = ["math"] * 6 + ["code"] * 2
    groups = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2])
    in_loss = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    lengths = torch.tensor([2, 8, 4, 3, 3, 3, 7, 8])
    response_mask = (torch.arange(8) < lengths.unsqueeze(-1)).float()
    correct = [True, False, False, True, True, True, False, False]
    return scores, domains, groups, in_loss, response_mask, correct


def test_shape_scores_golden_values_in_order():
    """Masks on the raw scores, then the overlong penalty, then group normalisation, scaling and clipping."""
    scores, domains, groups, in_loss, response_mask, correct = make_batch()
    cfg = RewardShapingConfig(
        norm_mean_type="group",
        reward_scale=2.0,
        reward_clip=1.5,
        overlong_penalty=OverlongPenaltyConfig(buffer_len=4),
        difficulty_mask=DifficultyMaskConfig(low=0.1, high=0.9),
    )
    moments = DomainRewardMoments()
    shaped, mask, metrics = shape_scores(scores, domains, groups, in_loss, response_mask, correct, cfg, moments, 8)
    # difficulty: math group 1 is all right (mean 1) -> masked; group 0 (mean 1/3) and code (0.25) stay.
    assert mask.tolist() == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 1.0]
    # overlong (max 8, buffer 4): length 8 -> -1, 7 -> -0.75, else 0; group 0: [1, -1, 0] mean 0 -> *2 -> [2,-2,0]
    # clipped to 1.5; code: [0.5 - 0.75, -1] = [-0.25, -1], mean -0.625 -> [0.375, -0.375] * 2 = [0.75, -0.75]
    assert shaped.tolist() == pytest.approx([1.5, -1.5, 0.0, 0.0, 0.0, 0.0, 0.75, -0.75])
    assert metrics["reward_shaping/math/masked_difficulty"] == 3.0
    assert metrics["reward_shaping/math/samples_in_loss"] == 3.0
    assert metrics["reward_shaping/math/clip_frac"] == pytest.approx(2 / 3)
    assert metrics["reward_shaping/code/overlong_penalty"] == pytest.approx(-0.875)
    # the running moments saw the penalised scores of the samples in the loss, per domain
    assert moments["math"].count == 3 and moments["math"].mean == pytest.approx(0.0)
    assert moments["code"].count == 2 and moments["code"].mean == pytest.approx(-0.625)


def test_shape_scores_keeps_domains_apart():
    scores, domains, groups, in_loss, response_mask, correct = make_batch()
    cfg = RewardShapingConfig(norm_mean_type="batch", norm_std_type="batch")
    mixed, _, _ = shape_scores(scores, domains, groups, in_loss, response_mask, correct, cfg, DomainRewardMoments(), 8)
    alone, _, _ = shape_scores(
        scores[:6], domains[:6], groups[:6], in_loss[:6], response_mask[:6], correct[:6], cfg, DomainRewardMoments(), 8
    )
    assert torch.allclose(mixed[:6], alone)
    code = scores[6:]
    assert mixed[6:].tolist() == pytest.approx(((code - code.mean()) / (code.std() + 1e-6)).tolist())


def test_shape_scores_ignores_masked_samples_and_applies_the_length_mask():
    scores, domains, groups, in_loss, response_mask, correct = make_batch()
    in_loss = in_loss.clone()
    in_loss[1] = 0.0  # e.g. the reward worker timed out
    cfg = RewardShapingConfig(
        norm_mean_type="group", norm_std_type="group", length_mask=LengthMaskConfig(max_tokens=7, only_incorrect=True)
    )
    shaped, mask, metrics = shape_scores(
        scores, domains, groups, in_loss, response_mask, correct, cfg, DomainRewardMoments(), 8
    )
    noisy_scores = scores.clone()
    noisy_scores[1] = 50.0
    shaped_noisy, _, _ = shape_scores(
        noisy_scores, domains, groups, in_loss, response_mask, correct, cfg, DomainRewardMoments(), 8
    )
    assert torch.equal(shaped, shaped_noisy)
    # code sample 7 is wrong and 8 tokens long -> masked; sample 1 stays masked
    assert mask.tolist() == [1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0]
    assert metrics["reward_shaping/code/masked_length"] == 1.0
    assert shaped[1] == 0.0 and shaped[7] == 0.0


def test_shape_scores_takes_the_difficulty_masks_inclusive_flag():
    scores, domains, groups, in_loss, response_mask, correct = make_batch()  # group means 1/3, 1, 0.25
    masks = {}
    for inclusive in (True, False):
        cfg = RewardShapingConfig(difficulty_mask=DifficultyMaskConfig(low=0.25, high=1.0, inclusive=inclusive))
        _, masks[inclusive], _ = shape_scores(
            scores, domains, groups, in_loss, response_mask, correct, cfg, DomainRewardMoments(), 8
        )
    assert masks[True].tolist() == [1.0] * 8
    assert masks[False].tolist() == [1.0] * 3 + [0.0] * 5


def test_default_shaping_changes_nothing():
    scores, domains, groups, in_loss, response_mask, correct = make_batch()
    in_loss = in_loss.clone()
    in_loss[2] = 0.0
    shaped, mask, _ = shape_scores(
        scores, domains, groups, in_loss, response_mask, correct, RewardShapingConfig(), DomainRewardMoments(), 8
    )
    assert torch.equal(shaped, scores * in_loss)
    assert torch.equal(mask, in_loss)


def test_fresh_running_moments_are_zero_and_one_value_has_no_spread():
    running = RunningMoments()
    assert running.state_dict() == {"count": 0, "mean": 0.0, "m2": 0.0}
    assert running.std == 0.0
    running.update(torch.tensor([]))
    assert running.state_dict() == {"count": 0, "mean": 0.0, "m2": 0.0}
    running.update(torch.tensor([5.0]))
    assert (running.count, running.mean, running.std) == (1, 5.0, 0.0)


def test_difficulty_mask_bounds_are_inclusive_and_a_group_without_a_valid_sample_is_masked():
    # group means over valid samples: 0.25, 0.75, 0 (one valid sample), 1, none valid, 0.125
    scores = torch.tensor([1.0, 0, 0, 0, 1, 1, 1, 0, 0, 1, 1, 1, 0.5, 0.5, 1, 0, 0, 0, 0, 0, 0, 0])
    groups = torch.tensor([0] * 4 + [1] * 4 + [2] * 2 + [3] * 2 + [4] * 2 + [5] * 8)
    valid = torch.tensor([1.0] * 8 + [1, 0] + [1, 1] + [0, 0] + [1] * 8)
    keep = difficulty_mask(scores, groups, valid, low=0.25, high=0.75)
    assert keep.tolist() == [1.0] * 8 + [0.0] * 14
    keep = difficulty_mask(scores, groups, valid, low=0.0, high=1.0)
    assert keep.tolist() == [1.0] * 12 + [0.0] * 2 + [1.0] * 8
    keep = difficulty_mask(scores, groups, valid, low=0.0, high=0.0)  # only groups that got everything wrong
    assert keep.tolist() == [0.0] * 8 + [1.0] * 2 + [0.0] * 12


def test_difficulty_mask_not_inclusive_masks_a_group_mean_on_a_bound():
    """ROLL's difficulty_mask keeps (low < mean < high); `inclusive: false` is that rule."""
    scores = torch.tensor([1.0, 0, 0, 0, 1, 1, 1, 0, 1, 0])  # group means 0.25, 0.75, 0.5
    groups = torch.tensor([0] * 4 + [1] * 4 + [2] * 2)
    valid = torch.ones(10)
    keep = difficulty_mask(scores, groups, valid, low=0.25, high=0.75, inclusive=False)
    assert keep.tolist() == [0.0] * 8 + [1.0] * 2
    keep = difficulty_mask(scores, groups, valid, low=0.2, high=0.8, inclusive=False)
    assert keep.tolist() == [1.0] * 10
    # at 0, where the 1e-12 tolerance is representable in float32: a mean of 0 is on either bound, masked
    wrong = torch.tensor([0.0, 0.0, 1.0, 0.0])
    two = torch.tensor([0, 0, 1, 1])
    assert difficulty_mask(wrong, two, torch.ones(4), low=0.0, high=1.0, inclusive=False).tolist() == [0, 0, 1, 1]
    assert difficulty_mask(wrong, two, torch.ones(4), low=-1.0, high=0.0, inclusive=False).tolist() == [0] * 4
    assert difficulty_mask(wrong, two, torch.ones(4), low=-1.0, high=0.6, inclusive=False).tolist() == [1, 1, 1, 1]


def test_length_mask_spares_correct_responses_only_when_asked():
    lengths = torch.tensor([3, 11, 11])
    correct = torch.tensor([False, True, False])
    assert length_mask(lengths, 10, correct).tolist() == [1.0, 0.0, 0.0]
    assert length_mask(lengths, 10, correct, only_incorrect=False).tolist() == [1.0, 0.0, 0.0]
    assert length_mask(lengths, 10, correct, only_incorrect=True).tolist() == [1.0, 1.0, 0.0]


def shape_one_domain(scores, groups, in_loss, lengths, correct, cfg, max_length=8, domain="math"):
    lengths = torch.tensor(lengths)
    response_mask = (torch.arange(max(lengths.max().item(), 1)) < lengths.unsqueeze(-1)).float()
    moments = DomainRewardMoments()
    shaped, mask, metrics = shape_scores(
        torch.tensor(scores), [domain] * len(scores), torch.tensor(groups), torch.tensor(in_loss),
        response_mask, correct, cfg, moments, max_length,
    )
    return shaped, mask, {k.rsplit("/", 1)[1]: v for k, v in metrics.items()}, moments[domain]


def test_shaping_metrics_count_and_average_over_the_samples_left_in_the_loss():
    cfg = RewardShapingConfig(
        reward_scale=2.0,
        reward_clip=1.0,
        overlong_penalty=OverlongPenaltyConfig(buffer_len=4),
        difficulty_mask=DifficultyMaskConfig(low=0.0, high=0.9),
        length_mask=LengthMaskConfig(max_tokens=6),
    )
    shaped, mask, metrics, running = shape_one_domain(
        scores=[1.0, 1, 1, 0, 0, 0, 1, 0],
        groups=[0, 0, 1, 1, 2, 2, 3, 3],
        in_loss=[1.0, 1, 1, 1, 1, 0, 1, 1],
        lengths=[2, 8, 6, 7, 3, 8, 5, 3],
        correct=[True, True, True, False, False, False, True, False],
        cfg=cfg,
    )
    # difficulty: group 0 (mean 1 > 0.9) leaves the loss, 2 samples; sample 5 was out already
    assert metrics["masked_difficulty"] == 2.0
    # length > 6 among the samples still in: sample 3 (7 tokens); samples 1 and 5 (8) were out already
    assert metrics["masked_length"] == 1.0
    assert mask.tolist() == [0.0, 0, 1, 0, 1, 0, 1, 1]
    assert metrics["samples_in_loss"] == 4.0
    # penalties (max 8, buffer 4) of the 4 samples in the loss: -0.5, 0, -0.25, 0
    assert metrics["overlong_penalty"] == pytest.approx(-0.75 / 4)
    # penalised scores in the loss: 0.5, 0, 0.75, 0 -> the running moments; x2: 1.0 (at the clip, kept), 1.5
    assert (running.count, running.mean) == (4, pytest.approx(1.25 / 4))
    assert metrics["running_mean"] == pytest.approx(1.25 / 4)
    assert metrics["clip_frac"] == 0.25
    assert shaped.tolist() == [0.0, 0, 1, 0, 0, 0, 1, 0]
    assert metrics["score_mean"] == 0.5


def test_shaping_metrics_with_one_sample_and_with_none_in_the_loss():
    cfg = RewardShapingConfig(reward_clip=0.1, overlong_penalty=OverlongPenaltyConfig(buffer_len=4))
    shaped, _, metrics, _ = shape_one_domain([0.5, 1.0], [0, 0], [1.0, 0.0], [8, 8], [False, True], cfg)
    assert shaped.tolist() == pytest.approx([-0.1, 0.0])
    assert (metrics["overlong_penalty"], metrics["clip_frac"]) == (-1.0, 1.0)
    assert metrics["score_mean"] == pytest.approx(-0.1)
    shaped, _, metrics, running = shape_one_domain([0.5, 1.0], [0, 0], [0.0, 0.0], [8, 8], [False, True], cfg)
    assert shaped.tolist() == [0.0, 0.0]
    names = ("overlong_penalty", "clip_frac", "score_mean", "samples_in_loss")
    assert {k: metrics[k] for k in names} == dict.fromkeys(names, 0.0)
    assert (running.count, metrics["running_mean"], metrics["running_std"]) == (0, 0.0, 0.0)


def test_domain_names_read_from_data_are_matched_by_value():
    scores, domains, groups, in_loss, response_mask, correct = make_batch()
    cfg = RewardShapingConfig(norm_mean_type="batch", norm_std_type="batch")
    fresh = ["".join(d) for d in domains]  # new string objects, as decoded from a dataset or a Ray message
    batch = (groups, in_loss, response_mask, correct, cfg)
    expected, _, _ = shape_scores(scores, domains, *batch, DomainRewardMoments(), 8)
    got, _, _ = shape_scores(scores, fresh, *batch, DomainRewardMoments(), 8)
    assert torch.equal(got, expected)

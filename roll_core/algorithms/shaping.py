"""Reward shaping and loss-side sample masks, per domain, on the (B,) scores of the reward workers.

The scheduler's filters (schedulers/filters.py) act earlier and differently: a group filter drops a group and draws
another prompt in its place, a response filter masks one response before the group filters look. The masks here
keep the batch as it is and only take samples out of the loss: `difficulty_mask` has `mean_filter`'s meaning
(a group whose mean score lies outside [low, high]), `length_mask` masks long responses. Truncated responses are
masked by the scheduler's `truncated` response filter (rewards.<domain>.response_filters), not here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from roll_core.algorithms.advantages import group_statistics
from roll_core.registry import REWARD_NORMS, register_reward_norm

if TYPE_CHECKING:
    from roll_core.config.shaping import RewardShapingConfig


class RunningMoments:
    """Mean and unbiased standard deviation of every value seen so far, updated a batch at a time (Chan et al.'s
    parallel combination, so the result equals the moments of all values at once)."""

    def __init__(self) -> None:
        self.count = 0
        self.mean = 0.0
        self.m2 = 0.0
        """Sum of squared deviations from the mean."""

    def update(self, values: torch.Tensor) -> None:
        n = int(values.numel())
        if n == 0:
            return
        batch_mean = float(values.double().mean())
        batch_m2 = float((values.double() - batch_mean).square().sum())
        total = self.count + n
        delta = batch_mean - self.mean
        self.m2 += batch_m2 + delta * delta * self.count * n / total
        self.mean += delta * n / total
        self.count = total

    @property
    def std(self) -> float:
        return math.sqrt(self.m2 / (self.count - 1)) if self.count > 1 else 0.0

    def state_dict(self) -> dict[str, float]:
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.count, self.mean, self.m2 = int(state["count"]), float(state["mean"]), float(state["m2"])


class DomainRewardMoments:
    """Running moments of the (overlong-penalised) scores, one per domain; checkpointable state of the run."""

    def __init__(self) -> None:
        self.moments: dict[str, RunningMoments] = {}

    def __getitem__(self, domain: str) -> RunningMoments:
        return self.moments.setdefault(domain, RunningMoments())

    def state_dict(self) -> dict[str, dict[str, float]]:
        return {domain: m.state_dict() for domain, m in self.moments.items()}

    def load_state_dict(self, state: dict[str, dict[str, float]]) -> None:
        self.moments = {}
        for domain, moments in state.items():
            self[domain].load_state_dict(moments)


# Each normalisation is (scores, group_ids, valid, running) -> (mean, std), both (B,), over the valid samples.


@register_reward_norm("group")
def group_norm(
    scores: torch.Tensor, group_ids: torch.Tensor, valid: torch.Tensor, running: RunningMoments
) -> tuple[torch.Tensor, torch.Tensor]:
    """Moments of the sample's prompt group (unbiased std)."""
    mean, std, _ = group_statistics(scores, group_ids, valid)
    return mean, std


@register_reward_norm("batch")
def batch_norm(
    scores: torch.Tensor, group_ids: torch.Tensor, valid: torch.Tensor, running: RunningMoments
) -> tuple[torch.Tensor, torch.Tensor]:
    """Moments of the domain's part of the batch (unbiased std)."""
    mean, std, _ = group_statistics(scores, torch.zeros_like(group_ids), valid)
    return mean, std


@register_reward_norm("running")
def running_norm(
    scores: torch.Tensor, group_ids: torch.Tensor, valid: torch.Tensor, running: RunningMoments
) -> tuple[torch.Tensor, torch.Tensor]:
    """The domain's running moments over every step so far, this one included."""
    return torch.full_like(scores, running.mean), torch.full_like(scores, running.std)


def normalize_rewards(
    scores: torch.Tensor,
    group_ids: torch.Tensor,
    valid: torch.Tensor,
    mean_type: str | None,
    std_type: str | None,
    running: RunningMoments,
    eps: float = 1e-6,
) -> torch.Tensor:
    """(scores - mean) / (std + eps), mean and std each from the named normalisation (None: no centring, no
    division); zero where `valid` is 0."""
    mean = REWARD_NORMS.get(mean_type)(scores, group_ids, valid, running)[0] if mean_type else 0.0
    out = scores - mean
    if std_type:
        out = out / (REWARD_NORMS.get(std_type)(scores, group_ids, valid, running)[1] + eps)
    return out * valid


def overlong_penalty(lengths: torch.Tensor, max_length: int, buffer_len: int, penalty_factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al., arXiv:2503.14476, eq. 13), (B,) and <= 0: 0 up to
    max_length - buffer_len tokens, then falling linearly to -penalty_factor at max_length (and beyond)."""
    excess = (lengths.to(torch.float32) - (max_length - buffer_len)) / buffer_len
    return -penalty_factor * excess.clamp(0.0, 1.0)


def difficulty_mask(
    scores: torch.Tensor,
    group_ids: torch.Tensor,
    valid: torch.Tensor,
    low: float,
    high: float,
    inclusive: bool = True,
) -> torch.Tensor:
    """(B,) 1 where the sample's group mean score over its valid samples lies in [low, high] (or strictly between
    them where not `inclusive`: ROLL's rule; schedulers/filters.py `mean_filter`'s), 0 elsewhere and in groups
    with no valid sample."""
    mean, _, count = group_statistics(scores, group_ids, valid)
    if inclusive:
        inside = (mean >= low - 1e-12) & (mean <= high + 1e-12)
    else:
        inside = (mean > low + 1e-12) & (mean < high - 1e-12)
    keep = (count > 0) & inside
    return keep.to(scores.dtype)


def length_mask(
    lengths: torch.Tensor, max_tokens: int, correct: torch.Tensor | None = None, only_incorrect: bool = False
) -> torch.Tensor:
    """(B,) 0 for responses longer than `max_tokens` tokens; with `only_incorrect`, only for those not judged correct
    (ROLL's error_max_len_clip: long wrong answers are usually rambling, long right ones are kept)."""
    keep = lengths <= max_tokens
    if only_incorrect and correct is not None:
        keep = keep | correct.bool()
    return keep.to(torch.float32)


def shape_domain(
    scores: torch.Tensor,
    group_ids: torch.Tensor,
    in_loss: torch.Tensor,
    lengths: torch.Tensor,
    correct: torch.Tensor,
    cfg: RewardShapingConfig,
    running: RunningMoments,
    max_length: int,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """One domain's shaping, all (B,): the sample masks on the raw scores, then the overlong penalty, the running
    moments' update, normalisation, scaling and clipping, in that order. Returns the shaped scores (0 where
    masked), the new sample mask and metrics."""
    keep = in_loss.clone()
    metrics: dict[str, float] = {}
    if cfg.difficulty_mask is not None:
        dm = cfg.difficulty_mask
        by_difficulty = difficulty_mask(scores, group_ids, keep, dm.low, dm.high, dm.inclusive)
        metrics["masked_difficulty"] = float((keep * (1 - by_difficulty)).sum())
        keep = keep * by_difficulty
    if cfg.length_mask is not None:
        by_length = length_mask(lengths, cfg.length_mask.max_tokens, correct, cfg.length_mask.only_incorrect)
        metrics["masked_length"] = float((keep * (1 - by_length)).sum())
        keep = keep * by_length
    shaped = scores.clone()
    n_valid = float(keep.sum())
    if cfg.overlong_penalty is not None:
        o = cfg.overlong_penalty
        penalty = overlong_penalty(lengths, max_length, o.buffer_len, o.penalty_factor)
        shaped = shaped + penalty
        metrics["overlong_penalty"] = float((penalty * keep).sum()) / max(n_valid, 1.0)
    running.update(shaped[keep > 0])
    shaped = normalize_rewards(shaped, group_ids, keep, cfg.norm_mean_type, cfg.norm_std_type, running)
    shaped = shaped * cfg.reward_scale
    if cfg.reward_clip is not None:
        metrics["clip_frac"] = float(((shaped.abs() > cfg.reward_clip) * keep).sum()) / max(n_valid, 1.0)
        shaped = shaped.clamp(-cfg.reward_clip, cfg.reward_clip)
    shaped = shaped * keep
    metrics |= {
        "score_mean": float(shaped.sum()) / max(n_valid, 1.0),
        "running_mean": running.mean,
        "running_std": running.std,
        "samples_in_loss": n_valid,
    }
    return shaped, keep, metrics


def shape_scores(
    scores: torch.Tensor,
    domains: Sequence[str],
    group_ids: torch.Tensor,
    in_loss: torch.Tensor,
    response_mask: torch.Tensor,
    correct: Sequence[bool | None],
    cfg: RewardShapingConfig | Mapping[str, RewardShapingConfig],
    moments: DomainRewardMoments,
    max_length: int,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """`shape_domain` on each domain's samples of the batch (statistics never mix domains), with `cfg`, or each
    domain's own config when `cfg` maps domains to configs. Returns the shaped scores (B,), the sample mask (B,)
    and metrics named reward_shaping/<domain>/<name>."""
    shaped = torch.zeros_like(scores)
    mask = torch.zeros_like(in_loss)
    lengths = response_mask.sum(1)
    correct_t = torch.tensor([bool(c) for c in correct])
    metrics: dict[str, Any] = {}
    for domain in dict.fromkeys(domains):
        idx = torch.tensor([i for i, d in enumerate(domains) if d == domain], dtype=torch.long)
        s, m, domain_metrics = shape_domain(
            scores[idx], group_ids[idx], in_loss[idx], lengths[idx], correct_t[idx],
            cfg[domain] if isinstance(cfg, Mapping) else cfg, moments[domain], max_length,
        )
        shaped[idx], mask[idx] = s, m
        metrics |= {f"reward_shaping/{domain}/{k}": v for k, v in domain_metrics.items()}
    return shaped, mask, metrics

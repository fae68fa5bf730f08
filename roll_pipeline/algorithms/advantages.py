"""Advantage estimators, each (batch tensors) -> (advantages, returns), all (B, R) and zero under the mask."""

from __future__ import annotations

import torch

from roll_pipeline.algorithms.registry import register_advantage


def place_at_last_token(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """(B,) scores -> (B, R) rewards that are zero except at each response's last valid token."""
    rewards = torch.zeros_like(response_mask, dtype=scores.dtype)
    lengths = response_mask.sum(-1).long()
    has_tokens = lengths > 0
    rows = torch.arange(len(scores))[has_tokens]
    rewards[rows, lengths[has_tokens] - 1] = scores[has_tokens]
    return rewards


@register_advantage("grpo")
def grpo_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: torch.Tensor,
    sample_mask: torch.Tensor | None = None,
    eps: float = 1e-6,
    **_: object,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-relative advantages (Shao et al., DeepSeekMath, arXiv:2402.03300).

    Each response's return is its summed reward; its advantage is (return - group mean) / (group std + eps),
    with the unbiased std over the group's samples whose `sample_mask` is 1, broadcast over its valid tokens.
    A group of one valid sample gets advantage 0.
    """
    valid = torch.ones_like(group_ids, dtype=token_level_rewards.dtype) if sample_mask is None else sample_mask
    returns = (token_level_rewards * response_mask).sum(-1)
    _, inverse = torch.unique(group_ids, return_inverse=True)
    n_groups = int(inverse.max()) + 1 if len(inverse) else 0
    count = torch.zeros(n_groups, dtype=returns.dtype).index_add_(0, inverse, valid)
    total = torch.zeros(n_groups, dtype=returns.dtype).index_add_(0, inverse, returns * valid)
    mean = total / count.clamp(min=1.0)
    sq = torch.zeros(n_groups, dtype=returns.dtype).index_add_(0, inverse, (returns - mean[inverse]).square() * valid)
    std = (sq / (count - 1.0).clamp(min=1.0)).sqrt()
    scaled = (returns - mean[inverse]) / (std[inverse] + eps)
    scaled = torch.where(count[inverse] > 1, scaled, torch.zeros_like(scaled)) * valid
    advantages = scaled.unsqueeze(-1) * response_mask
    return advantages, advantages.clone()


@register_advantage("gae")
def gae_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    values: torch.Tensor,
    gamma: float = 1.0,
    lambd: float = 0.95,
    **_: object,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al., arXiv:1506.02438) over each response's valid tokens.

    The value after a response's last valid token is 0 (the episode ends there). Returns are advantages + values.
    """
    rewards = token_level_rewards * response_mask
    vals = values * response_mask
    advantages = torch.zeros_like(rewards)
    next_adv = torch.zeros(rewards.shape[0], dtype=rewards.dtype)
    next_value = torch.zeros(rewards.shape[0], dtype=rewards.dtype)
    for t in reversed(range(rewards.shape[1])):
        m = response_mask[:, t]
        delta = rewards[:, t] + gamma * next_value - vals[:, t]
        adv = delta + gamma * lambd * next_adv
        # a padded position passes the running values through unchanged, so padding never leaks into advantages
        next_adv = torch.where(m > 0, adv, next_adv)
        next_value = torch.where(m > 0, vals[:, t], next_value)
        advantages[:, t] = adv * m
    returns = (advantages + vals) * response_mask
    return advantages, returns

"""The critic's loss, per token; the critic aggregates it with `aggregate_loss` like the policy loss."""

from __future__ import annotations

import torch


def clipped_value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped value loss (Schulman et al., arXiv:1707.06347; the clipping is from OpenAI baselines' PPO2),
    all (B, R): 0.5 * max((v - R)^2, (v_old + clip(v - v_old, -c, c) - R)^2), so one update cannot move a value
    estimate more than c away from the one that computed the advantages. `clip` None: plain 0.5 * (v - R)^2.

    Returns the per-token loss and `clipped` (1 where the estimate moved more than c and the clipped term was the
    larger one: within c, v_old + (v - v_old) is v up to its last bit, and that rounding must not count).
    """
    unclipped = (values - returns).square()
    if clip is None:
        return 0.5 * unclipped, torch.zeros_like(unclipped)
    bounded = old_values + (values - old_values).clamp(-clip, clip)
    clipped = (bounded - returns).square()
    moved = (values - old_values).abs() > clip
    return 0.5 * torch.maximum(unclipped, clipped), (moved & (clipped > unclipped)).to(values.dtype)

"""Policy-gradient losses, per token; the caller aggregates them with `aggregate_loss`."""

from __future__ import annotations

import torch

from roll_pipeline.algorithms.registry import register_policy_loss


@register_policy_loss("ppo_clip")
def ppo_clip_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip: float = 0.2,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped surrogate (Schulman et al., arXiv:1707.06347), all (B, R).

    Returns the per-token loss -min(r A, clip(r, 1-eps, 1+eps) A) and per-token diagnostics: `clipped` (1 where
    the clipped term was chosen) and `approx_kl` (k1 between old and current policy).
    """
    log_ratio = (log_probs - old_log_probs).clamp(-20.0, 20.0)
    ratio = log_ratio.exp()
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - clip, 1.0 + clip) * advantages
    loss = -torch.minimum(unclipped, clipped)
    diagnostics = {
        "clipped": (clipped < unclipped).to(log_probs.dtype) * mask,
        "approx_kl": (-log_ratio) * mask,
    }
    return loss, diagnostics

"""How far a batch is from the policy it trains, and the truncated importance-sampling correction for it.

A batch is sampled by actor_infer's policy mu (older weights in an async run, or the same weights computed by a
different engine) and trained as if it came from actor_train's policy pi_old before the update. The per-token
importance weight pi_old(a) / mu(a) corrects the policy gradient for the difference; truncating it at a cap
(TIS: Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL training"; the truncation
follows Espeholt et al., IMPALA, arXiv:1802.01561) bounds its variance.
"""

from __future__ import annotations

import torch

from roll_core.algorithms.kl import kl_k3


def truncated_is_weights(
    old_log_probs: torch.Tensor, infer_log_probs: torch.Tensor, mask: torch.Tensor, cap: float
) -> torch.Tensor:
    """min(exp(old_log_probs - infer_log_probs), cap) per token, 0 where mask is 0; all (B, R). The log-ratio
    is clamped to [-20, 20] so a token one policy finds impossible cannot overflow."""
    ratio = (old_log_probs - infer_log_probs).clamp(-20.0, 20.0).exp()
    return ratio.clamp(max=cap) * mask


def offpolicy_metrics(
    old_log_probs: torch.Tensor, infer_log_probs: torch.Tensor, mask: torch.Tensor, cap: float | None
) -> dict[str, float]:
    """Over the tokens where mask is 1: the mean and max importance weight before truncation, the share of tokens
    the cap truncates (0 without a cap), and KL(mu || pi_old) estimated with k3 from mu's samples."""
    valid = mask.bool()
    if not bool(valid.any()):
        return {}
    log_ratio = (old_log_probs - infer_log_probs).clamp(-20.0, 20.0)[valid]
    ratio = log_ratio.exp()
    return {
        "offpolicy/is_weight_mean": float(ratio.mean()),
        "offpolicy/is_weight_max": float(ratio.max()),
        "offpolicy/is_truncated_frac": float((ratio > cap).float().mean()) if cap is not None else 0.0,
        "offpolicy/kl_infer_old": float(kl_k3(infer_log_probs, old_log_probs)[valid].mean()),
    }

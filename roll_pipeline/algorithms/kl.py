"""Per-token estimators of KL(policy || reference) from sampled tokens (Schulman, "Approximating KL", 2020)."""

from __future__ import annotations

import torch

from roll_pipeline.algorithms.registry import register_kl


@register_kl("k1")
def kl_k1(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    """log p - log q: unbiased, high variance, can be negative."""
    return log_probs - ref_log_probs


@register_kl("k2")
def kl_k2(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    """(log p - log q)^2 / 2: biased, low variance, never negative."""
    return 0.5 * (log_probs - ref_log_probs).square()


@register_kl("k3")
def kl_k3(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    """exp(log q - log p) - (log q - log p) - 1: unbiased and never negative (GRPO's choice).

    The log-ratio is clamped to [-20, 20] so a token the reference finds impossible cannot overflow.
    """
    log_ratio = (ref_log_probs - log_probs).clamp(-20.0, 20.0)
    return log_ratio.exp() - log_ratio - 1.0

"""KL(policy || reference) per token from sampled tokens, the token-level KL reward penalty, and the controllers of
its coefficient.

Estimators follow Schulman, "Approximating KL Divergence" (2020, http://joschu.net/blog/kl-approx.html); each
takes (log_probs, ref_log_probs), both (B, R), and returns (B, R). verl's and ROLL's names are aliases: `mse` is
k2, `low_var_kl` is k3.
"""

from __future__ import annotations

from typing import Any

import torch

from roll_core.registry import KL_ESTIMATORS, register_kl, register_kl_controller

# The largest per-token k3 estimate (kl_k3).
K3_MAX = 10.0


@register_kl("k1")
def kl_k1(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    """log p - log q: unbiased, high variance, can be negative."""
    return log_probs - ref_log_probs


@register_kl("abs")
def kl_abs(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    """|log p - log q|: biased upwards, never negative (ROLL's and verl's `abs`)."""
    return (log_probs - ref_log_probs).abs()


@register_kl("k2")
@register_kl("mse")
def kl_k2(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    """(log p - log q)^2 / 2: biased, low variance, never negative; its gradient is that of the true KL."""
    return 0.5 * (log_probs - ref_log_probs).square()


@register_kl("k3")
@register_kl("low_var_kl")
def kl_k3(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    """exp(log q - log p) - (log q - log p) - 1: unbiased and never negative (GRPO's choice).

    Bounded by K3_MAX per token. Unbounded, a token the policy finds far less likely than the reference (log q -
    log p = 20) adds e^20 = 5e8 to the loss with a gradient growing like e^(log q - log p), and one such token
    swamps the batch's update. The estimate is clamped to [0, K3_MAX] (verl clamps it the same way), so such a
    token's term is constant and gives no gradient; the log-ratio is also clamped to [-20, 20] first so that exp
    cannot overflow.
    """
    log_ratio = (ref_log_probs - log_probs).clamp(-20.0, 20.0)
    return (log_ratio.exp() - log_ratio - 1.0).clamp(max=K3_MAX)


def kl_penalty_rewards(
    token_level_rewards: torch.Tensor,
    log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    mask: torch.Tensor,
    coef: float,
    estimator: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """KL as a token-level reward penalty (Ziegler et al., arXiv:1909.08593; InstructGPT, arXiv:2203.02155):
    rewards - coef * KL_t on every valid token. Returns the new rewards (B, R) and each response's mean per-token
    KL (B,), the quantity the adaptive controller tracks; both zero under the mask."""
    kl = KL_ESTIMATORS.get(estimator)(log_probs, ref_log_probs) * mask
    per_sample = kl.sum(1) / mask.sum(1).clamp(min=1.0)
    return (token_level_rewards - coef * kl) * mask, per_sample


@register_kl_controller("fixed")
class FixedKLController:
    """A constant coefficient."""

    def __init__(self, kl_coef: float, **_: Any) -> None:
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        """Nothing to adapt."""

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


@register_kl_controller("adaptive")
class AdaptiveKLController(FixedKLController):
    """Ziegler et al., "Fine-Tuning Language Models from Human Preferences" (arXiv:1909.08593), section 2.2: after
    each batch, coef *= 1 + clip(KL / target - 1, -0.2, 0.2) * n_steps / horizon, so the coefficient rises while the
    measured KL is above `target_kl` and falls while it is below."""

    def __init__(self, kl_coef: float, target_kl: float, horizon: int, **_: Any) -> None:
        super().__init__(kl_coef)
        self.target = target_kl
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

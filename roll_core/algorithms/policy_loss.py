"""Policy-gradient losses, per token; the caller aggregates them with `aggregate_loss`.

Every loss takes `(log_probs, old_log_probs, advantages, mask)`, all (B, R), and the keyword arguments
`clip_low`, `clip_high` (the ratio is kept in [1 - clip_low, 1 + clip_high]; no default: the config's pg_clip*
decide, and each loss's docstring gives its paper's values) and `dual_clip_c` (None: off); each uses what it
needs. It returns the per-token loss (B, R) and per-token diagnostics (B, R), zero under the mask:
`clipped` (1 where clipping changed the token's term), `approx_kl` (k1 between the old and current policy).
"""

from __future__ import annotations

import torch

from roll_core.registry import register_policy_loss

MAX_LOG_RATIO = 20.0
# GSPO's cap on a sequence's log-ratio (gspo_loss).
GSPO_MAX_LOG_RATIO = 10.0


def _log_ratio(log_probs: torch.Tensor, old_log_probs: torch.Tensor) -> torch.Tensor:
    return (log_probs - old_log_probs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)


def _diagnostics(clipped: torch.Tensor, log_ratio: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"clipped": clipped.to(log_ratio.dtype) * mask, "approx_kl": (-log_ratio).detach() * mask}


@register_policy_loss("ppo_clip")
def ppo_clip_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip_c: float | None = None,
    **_: object,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped surrogate (Schulman et al., arXiv:1707.06347): -min(r A, clip(r, 1-clip_low, 1+clip_high) A).

    Separate low and high ranges are DAPO's clip-higher (Yu et al., arXiv:2503.14476: 0.2 / 0.28 keeps
    low-probability tokens able to grow). `dual_clip_c` (> 1) is dual-clip PPO (Ye et al., arXiv:1912.09729): for
    A < 0 the loss is also capped at -c A, so a huge ratio on a bad token cannot blow the update up; the extra
    diagnostic `dual_clipped` marks those tokens.
    """
    log_ratio = _log_ratio(log_probs, old_log_probs)
    ratio = log_ratio.exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    diagnostics = _diagnostics(clipped > unclipped, log_ratio, mask)
    if dual_clip_c is not None:
        capped = -advantages * dual_clip_c
        dual = (advantages < 0) & (loss > capped)
        loss = torch.where(dual, capped, loss)
        diagnostics["dual_clipped"] = dual.to(loss.dtype) * mask
    return loss, diagnostics


@register_policy_loss("gspo")
def gspo_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
    **_: object,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Group Sequence Policy Optimisation (Zheng et al., arXiv:2507.18071): PPO's clip on the sequence-level ratio
    s = (pi(y|x) / pi_old(y|x)) ** (1 / |y|), the geometric mean of the token ratios.

    Per token the ratio is sg[s] * pi_t / sg[pi_t], whose value is s and whose gradient is s * grad log pi_t, so
    with loss_agg_mode seq-mean-token-mean (the paper's) the gradient is exactly that of the sequence objective.
    The paper's clip ranges are tiny (3e-4 / 4e-4) because s is a per-token geometric mean.

    log s is the mean of the raw token log-ratios: clamping each token first (as the token-level losses do) would
    make s other than the geometric mean whenever one token moved far, e.g. a token at -50 among 9 at 0 gives
    s = e^-5, and clamped to -20 it would give e^-2, so the sequence would count as closer to the old policy than
    it is. Only the sequence's log-ratio is capped, at GSPO_MAX_LOG_RATIO, so that exp cannot overflow (verl caps
    it the same way); below, exp(log s) goes to 0 and needs no bound.
    """
    log_ratio = _log_ratio(log_probs, old_log_probs)
    raw = torch.where(mask.bool(), log_probs - old_log_probs, torch.zeros_like(log_probs))
    seq_log_ratio = raw.sum(1) / mask.sum(1).clamp(min=1.0)
    token_log_ratio = (log_probs - log_probs.detach() + seq_log_ratio.detach().unsqueeze(1)).clamp(
        max=GSPO_MAX_LOG_RATIO
    )
    ratio = token_log_ratio.exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    return loss, _diagnostics(clipped > unclipped, log_ratio, mask)


@register_policy_loss("cispo")
def cispo_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
    **_: object,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO (MiniMax-M1, arXiv:2506.13585): -sg(clip(r, 1-clip_low, 1+clip_high)) A log pi.

    The importance weight is clipped and detached instead of the update: every token keeps a gradient (PPO drops
    the clipped ones), only its weight is bounded. The paper clips only from above (clip_low 1.0 leaves r >= 0
    as it is). On-policy (r = 1) the gradient equals PPO's.
    """
    log_ratio = _log_ratio(log_probs, old_log_probs)
    ratio = log_ratio.exp()
    weight = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = -weight.detach() * advantages * log_probs
    return loss, _diagnostics(weight != ratio, log_ratio, mask)


@register_policy_loss("topr")
def topr_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    **_: object,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Tapered Off-Policy REINFORCE (Le Roux et al., arXiv:2503.14286, eq. 8): tokens with A >= 0 get the plain
    REINFORCE term -A log pi (no importance weight, like supervised learning on good samples); tokens with A < 0
    get it weighted by the sequence's importance ratio pi(y|x) / pi_old(y|x) clipped to [0, 1] and detached, so
    pushing down a bad sample the policy has already moved away from fades out. `clipped` marks negative tokens
    whose sequence ratio was above 1.
    """
    log_ratio = _log_ratio(log_probs, old_log_probs)
    seq_log_ratio = (log_ratio * mask).sum(1, keepdim=True).clamp(max=0.0)
    weight = torch.where(advantages < 0, seq_log_ratio.exp().detach(), torch.ones_like(advantages))
    loss = -weight * advantages * log_probs
    raw_seq = (log_ratio * mask).sum(1, keepdim=True)
    return loss, _diagnostics((advantages < 0) & (raw_seq > 0), log_ratio, mask)

"""How far a batch is from the policy it trains, and the corrections for it: importance weights and rejection.

A batch is sampled by actor_infer's policy mu (older weights in an async run, or the same weights computed by a
different engine) and trained as if it came from actor_train's policy pi_old before the update. The per-token
ratio pi_old(a) / mu(a) says how far apart they are on each sampled token. Two corrections use it, each at a level:

- importance weights multiply each token's policy-gradient term: per token, truncated at a cap (TIS: Yao et al.
  2025, "Your efficient RL framework secretly brings you off-policy RL training"; the truncation follows
  Espeholt et al., IMPALA, arXiv:1802.01561), or per response, the product of its tokens' ratios (the unbiased
  sequence-level weight), truncated the same way;
- rejection takes tokens, or whole responses, out of the loss where the ratio (per token, the product over the
  response, or its geometric mean: exp of the mean log-ratio) lies outside [lower, upper] (Liu, Li et al. 2025,
  "When Speed Kills Stability"; verl's rollout correction has the same three levels).

Every log-ratio, at every level, is bounded to [-20, 20] before exp, so that a token one policy finds impossible
cannot overflow.
"""

from __future__ import annotations

import torch

from roll_core.algorithms.kl import kl_k3

LOG_RATIO_BOUND = 20.0


def level_log_ratios(
    old_log_probs: torch.Tensor, infer_log_probs: torch.Tensor, mask: torch.Tensor, level: str
) -> torch.Tensor:
    """log(pi_old / mu) at `level`, bounded to [-20, 20]: (B, R) per token for `token`; (B, 1) per response for
    `sequence` (the sum over its tokens where mask is 1) and `geometric` (their mean). Values under mask 0 count
    for nothing, whatever they are."""
    log_ratio = torch.where(mask > 0, old_log_probs - infer_log_probs, torch.zeros_like(old_log_probs))
    if level == "token":
        out = log_ratio
    elif level == "sequence":
        out = log_ratio.sum(-1, keepdim=True)
    elif level == "geometric":
        out = log_ratio.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)
    else:
        raise ValueError(f"unknown off-policy correction level {level!r}: token, sequence or geometric")
    return out.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)


def importance_weights(
    old_log_probs: torch.Tensor, infer_log_probs: torch.Tensor, mask: torch.Tensor, level: str, cap: float
) -> torch.Tensor:
    """(B, R): the ratio at `level` (token or sequence; a response's weight on each of its tokens) truncated at
    `cap`, 0 where mask is 0."""
    ratio = level_log_ratios(old_log_probs, infer_log_probs, mask, level).exp()
    return ratio.clamp(max=cap).expand_as(mask) * mask


def truncated_is_weights(
    old_log_probs: torch.Tensor, infer_log_probs: torch.Tensor, mask: torch.Tensor, cap: float
) -> torch.Tensor:
    """min(exp(old_log_probs - infer_log_probs), cap) per token, 0 where mask is 0; all (B, R)."""
    return importance_weights(old_log_probs, infer_log_probs, mask, "token", cap)


def rejection_keep(
    old_log_probs: torch.Tensor, infer_log_probs: torch.Tensor, mask: torch.Tensor, level: str, lower: float,
    upper: float,
) -> torch.Tensor:
    """(B, R) in {0, 1}: 1 where the token (level `token`) or its response (`sequence`, `geometric`) has a ratio
    within [lower, upper], bounds included; 0 elsewhere and where mask is 0."""
    ratio = level_log_ratios(old_log_probs, infer_log_probs, mask, level).exp()
    keep = ((ratio >= lower) & (ratio <= upper)).to(mask.dtype)
    return keep.expand_as(mask) * mask


def offpolicy_metrics(
    old_log_probs: torch.Tensor, infer_log_probs: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """Over the tokens where mask is 1: the mean and max per-token ratio, and KL(mu || pi_old) estimated with k3
    from mu's samples. Empty when no token is valid."""
    valid = mask.bool()
    if not bool(valid.any()):
        return {}
    ratio = level_log_ratios(old_log_probs, infer_log_probs, mask, "token")[valid].exp()
    return {
        "offpolicy/is_weight_mean": float(ratio.mean()),
        "offpolicy/is_weight_max": float(ratio.max()),
        "offpolicy/kl_infer_old": float(kl_k3(infer_log_probs, old_log_probs)[valid].mean()),
    }


def correction_metrics(
    old_log_probs: torch.Tensor,
    infer_log_probs: torch.Tensor,
    mask: torch.Tensor,
    *,
    is_level: str | None,
    cap: float,
    rs_level: str | None,
    bounds: tuple[float, float],
) -> dict[str, float]:
    """offpolicy_metrics, and what each correction cut, over the valid tokens and over the responses with one:
    `offpolicy/is_truncated_frac` and `is_truncated_seq_frac` (weights the cap truncated: tokens, and responses
    with one; 0 without importance weights), `rs_rejected_frac` and `rs_rejected_seq_frac` (tokens rejected, and
    responses with one; only with rejection)."""
    metrics = offpolicy_metrics(old_log_probs, infer_log_probs, mask)
    if not metrics:
        return metrics
    valid = mask.bool()
    responses = valid.any(-1)

    def shares(cut: torch.Tensor) -> tuple[float, float]:
        cut = cut & valid
        return float(cut[valid].float().mean()), float(cut.any(-1)[responses].float().mean())

    truncated = (0.0, 0.0)
    if is_level is not None:
        ratio = level_log_ratios(old_log_probs, infer_log_probs, mask, is_level).exp().expand_as(mask)
        truncated = shares(ratio > cap)
    metrics["offpolicy/is_truncated_frac"], metrics["offpolicy/is_truncated_seq_frac"] = truncated
    if rs_level is not None:
        keep = rejection_keep(old_log_probs, infer_log_probs, mask, rs_level, *bounds)
        metrics["offpolicy/rs_rejected_frac"], metrics["offpolicy/rs_rejected_seq_frac"] = shares(keep == 0)
    return metrics


def staleness_metrics(
    trained_version: int, token_versions: torch.Tensor | None, mask: torch.Tensor, generated_with: int
) -> dict[str, float]:
    """How many updates old the batch is when this step trains on it (`trained_version` updates so far):
    offpolicy/staleness (the mean over the tokens where mask is 1), staleness_min and staleness_max, each token
    counted from the weights version that sampled it (`token_versions`, (B, R)); and offpolicy/partial_frac, the
    share of responses whose tokens came from more than one version (a weight sync landed while they generated).
    Without token_versions, or without a token under mask, every token counts as sampled by `generated_with`."""
    on = mask > 0
    if token_versions is None or not bool(on.any()):
        age = float(trained_version - generated_with)
        return {"offpolicy/staleness": age, "offpolicy/staleness_min": age, "offpolicy/staleness_max": age,
                "offpolicy/partial_frac": 0.0}
    ages = (trained_version - token_versions[on]).double()
    big = torch.iinfo(torch.long).max
    newest = torch.where(on, token_versions, torch.full_like(token_versions, -big)).amax(1)
    oldest = torch.where(on, token_versions, torch.full_like(token_versions, big)).amin(1)
    rows = on.any(1)
    partial = (newest[rows] != oldest[rows]).double().mean()
    return {
        "offpolicy/staleness": float(ages.mean()),
        "offpolicy/staleness_min": float(ages.min()),
        "offpolicy/staleness_max": float(ages.max()),
        "offpolicy/partial_frac": float(partial),
    }

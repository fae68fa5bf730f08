"""Reducing a (B, R) per-token loss to a scalar under a response mask."""

from __future__ import annotations

import torch

from roll_pipeline.algorithms.registry import LOSS_AGGREGATIONS, register_aggregation


@register_aggregation("token-mean")
def token_mean(loss: torch.Tensor, mask: torch.Tensor, num_tokens: float | None = None) -> torch.Tensor:
    """Sum over all valid tokens divided by their count (DAPO, arXiv:2503.14476): long responses weigh more.

    `num_tokens`: the count over the whole batch when `loss` is one micro-batch of it, so that accumulating
    micro-batch losses gives the same gradient as one pass over the batch.
    """
    denom = mask.sum() if num_tokens is None else torch.as_tensor(num_tokens, dtype=loss.dtype)
    return (loss * mask).sum() / denom.clamp(min=1.0)


@register_aggregation("seq-mean-token-mean")
def seq_mean_token_mean(loss: torch.Tensor, mask: torch.Tensor, num_seqs: float | None = None) -> torch.Tensor:
    """Mean over tokens within each response, then mean over responses (GRPO, arXiv:2402.03300).

    Responses with no valid token are left out. `num_seqs`: the count of responses over the whole batch when
    `loss` is one micro-batch of it.
    """
    per_seq_tokens = mask.sum(-1)
    seq_loss = (loss * mask).sum(-1) / per_seq_tokens.clamp(min=1.0)
    valid = (per_seq_tokens > 0).to(loss.dtype)
    denom = valid.sum() if num_seqs is None else torch.as_tensor(num_seqs, dtype=loss.dtype)
    return (seq_loss * valid).sum() / denom.clamp(min=1.0)


def aggregate_loss(loss: torch.Tensor, mask: torch.Tensor, mode: str, batch_norm: float | None = None) -> torch.Tensor:
    """Reduce `loss` (B, R) under `mask` (B, R) with the named mode; `batch_norm` is that mode's whole-batch count."""
    return LOSS_AGGREGATIONS.get(mode)(loss, mask, batch_norm)


def batch_normalizer(mask: torch.Tensor, mode: str) -> float:
    """The whole-batch count that `aggregate_loss` divides by for `mode` (tokens or responses)."""
    if mode == "token-mean":
        return float(mask.sum())
    return float((mask.sum(-1) > 0).sum())

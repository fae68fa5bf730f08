"""Reducing a (B, R) per-token loss (rows: responses, axis 1: their tokens) to a scalar under a response mask.

Every mode divides by a count over the whole mini-batch (`norm`: tokens or responses, see `batch_normalizer`), so
that when a mini-batch goes through in micro-batches with gradient accumulation, the summed micro-batch losses have
the gradient of one pass over the whole mini-batch. Without `norm`, the count is the one of `mask` itself.
"""

from __future__ import annotations

import torch

from roll_core.registry import (
    LOSS_AGGREGATIONS,
    LOSS_NORMALIZERS,
    register_aggregation,
    register_loss_normalizer,
)


def count_tokens(mask: torch.Tensor) -> float:
    return float(mask.sum())


def count_sequences(mask: torch.Tensor) -> float:
    """Responses (rows) with at least one valid token."""
    return float(mask.any(1).sum())


def _denominator(norm: float | None, counted: float, like: torch.Tensor) -> torch.Tensor:
    value = counted if norm is None else norm
    return torch.as_tensor(max(value, 1.0), dtype=like.dtype)


@register_aggregation("token-mean")
def token_mean(loss: torch.Tensor, mask: torch.Tensor, norm: float | None = None, **_: object) -> torch.Tensor:
    """Sum over all valid tokens divided by their count (DAPO, arXiv:2503.14476): long responses weigh more."""
    return (loss * mask).sum() / _denominator(norm, count_tokens(mask), loss)


def _seq_mean(total: torch.Tensor, mask: torch.Tensor, norm: float | None) -> torch.Tensor:
    """`total`, the sum of the responses' losses, over the responses that count. A response with no valid token
    adds 0 to `total` (its tokens are all masked), so it is left out."""
    return total / _denominator(norm, count_sequences(mask), total)


@register_aggregation("seq-mean-token-mean")
def seq_mean_token_mean(loss: torch.Tensor, mask: torch.Tensor, norm: float | None = None, **_: object) -> torch.Tensor:
    """Mean over tokens within each response, then mean over responses (GRPO, arXiv:2402.03300): every response
    weighs the same. Responses with no valid token are left out."""
    seq_loss = (loss * mask).sum(1) / mask.sum(1).clamp(min=1.0)
    return _seq_mean(seq_loss.sum(), mask, norm)


@register_aggregation("seq-mean-token-sum")
def seq_mean_token_sum(loss: torch.Tensor, mask: torch.Tensor, norm: float | None = None, **_: object) -> torch.Tensor:
    """Sum over tokens within each response, then mean over responses: a response weighs by its length, and the
    loss grows with the length of the responses (no per-token normalisation at all)."""
    return _seq_mean((loss * mask).sum(), mask, norm)


@register_aggregation("seq-mean-token-sum-norm")
def seq_mean_token_sum_norm(
    loss: torch.Tensor, mask: torch.Tensor, norm: float | None = None, *, scale: float | None = None, **_: object
) -> torch.Tensor:
    """Dr. GRPO's unbiased form (Liu et al., "Understanding R1-Zero-Like Training", arXiv:2503.20783): the token sum
    of each response divided by one constant `scale` (the generation budget, so it never depends on the batch),
    then the mean over responses. None: the padded width of `loss`, which is constant only if the caller pads to
    the budget; the pipeline passes the budget."""
    divisor = float(loss.shape[1] if scale is None else scale)
    return _seq_mean((loss * mask).sum() / divisor, mask, norm)


register_loss_normalizer("token-mean")(count_tokens)
for _mode in ("seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"):
    register_loss_normalizer(_mode)(count_sequences)


def aggregate_loss(
    loss: torch.Tensor, mask: torch.Tensor, mode: str, batch_norm: float | None = None, scale: float | None = None
) -> torch.Tensor:
    """Reduce `loss` (B, R) under `mask` (B, R) with the named mode; `batch_norm` is that mode's whole-batch count
    (`batch_normalizer`), `scale` the constant of seq-mean-token-sum-norm."""
    return LOSS_AGGREGATIONS.get(mode)(loss, mask, batch_norm, scale=scale)


def batch_normalizer(mask: torch.Tensor, mode: str) -> float:
    """The whole-batch count that `aggregate_loss` divides by for `mode` (tokens or responses)."""
    return LOSS_NORMALIZERS.get(mode)(mask)

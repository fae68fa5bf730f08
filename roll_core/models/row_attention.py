"""sdpa attention row by row for packed sequences (`ROW_ATTENTION`, a transformers attention implementation).

With sequence packing (forward.packed_sequence) a micro-batch's rows are one row of their tokens, positions
restarting at each row. transformers' sdpa keeps attention inside each row with a block-diagonal mask, but computes
the scores of the whole packed row against itself: (sum of lengths)^2 per head, most of it masked, where padded rows
cost rows x longest^2. FlashAttention's variable-length kernel skips what is masked; this does the same on any
device with sdpa itself: one causal sdpa call per packed row, cut where the positions restart (sum of length^2).
Measured on the CPU (docs/micro-batches.md): packing through sdpa's mask was slower than padded micro-batches cut by
a token budget; row by row it is faster.

Everything else (padded batches, a cache, a single row) is sdpa as transformers runs it, with grouped-query heads
left grouped on the CPU (grouped_sdpa.py): the mask function gives no mask only for one packed row without padding
or cache, and the attention splits only that."""

from __future__ import annotations

import torch

from roll_core.models import grouped_sdpa

ROW_ATTENTION = "sdpa_by_row"


def register() -> str:
    """Register ROW_ATTENTION with transformers (once per process; a model loads with it by that name)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ROW_ATTENTION, row_attention)
    AttentionMaskInterface.register(ROW_ATTENTION, row_mask)
    return ROW_ATTENTION


def kernel_for(kernel: str | None, packed: bool) -> str | None:
    """The attention implementation a model loads with: `kernel` as named (None: transformers' default), except for
    sdpa, named or the default: packed rows run it row by row (ROW_ATTENTION, registered here), and on a machine
    without CUDA it keeps grouped-query heads grouped (grouped_sdpa.py; ROW_ATTENTION does too, on the CPU)."""
    if kernel not in (None, "sdpa"):
        return kernel
    if packed:
        return register()
    if not torch.cuda.is_available():
        return grouped_sdpa.register()
    return kernel


def row_mask(*, batch_size: int, q_length: int, kv_length: int, q_offset, kv_offset, attention_mask, config=None,
             **kwargs) -> torch.Tensor | None:
    """sdpa's mask, but none for one row without padding or cache (packed rows: `row_attention` splits them; with a
    cache the keys outnumber the queries) in a model whose layers all attend to every earlier token (a sliding window
    or chunk lives in the mask)."""
    from transformers.masking_utils import sdpa_mask

    windowed = set(getattr(config, "layer_types", None) or ()) - {"full_attention"}
    if batch_size == 1 and attention_mask is None and q_length == kv_length and not windowed:
        return None
    return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                     kv_offset=kv_offset, attention_mask=attention_mask, config=config, **kwargs)


def row_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, **kwargs) -> tuple[torch.Tensor, None]:
    """sdpa over each packed row on its own where there is one row and no mask (`row_mask`), else sdpa itself.
    query, key, value: (batch, heads, tokens, head size); returns (batch, tokens, heads, head size)."""
    sdpa = grouped_sdpa.grouped_sdpa
    one_row = attention_mask is None and query.shape[0] == 1 and query.shape[2] == key.shape[2]
    if not one_row:
        return sdpa(module, query, key, value, attention_mask, **kwargs)
    position_ids = kwargs.get("position_ids")
    if position_ids is None:
        raise RuntimeError(
            f"{ROW_ATTENTION}: {type(module).__name__} does not pass position_ids to its attention, so packed rows "
            "cannot be told apart; set model_args.attn_implementation to sdpa or flash_attention_2"
        )
    starts = (position_ids.reshape(-1) == 0).nonzero().flatten().tolist()
    if len(starts) <= 1 or starts[0] != 0:  # one sequence: causal attention over all of it
        return sdpa(module, query, key, value, None, **kwargs)
    ends = [*starts[1:], query.shape[2]]
    parts = [
        sdpa(module, query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], None, **kwargs)[0]
        for a, b in zip(starts, ends, strict=True)
    ]
    return torch.cat(parts, dim=1), None

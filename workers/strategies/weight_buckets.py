"""Weights cut into buckets of bounded size, in order: what one message of a weight sync into vLLM carries (vLLM's
RPC buffers a message whole, and the gloo transport's two sides cut one stream the same way). Used by the rpc sync
into vLLM (workers/strategies/vllm_infer.py) and by gloo_transfer.py, which vLLM's worker processes import: torch
only."""

from __future__ import annotations

from collections.abc import Iterable

import torch

#: Default bound on the bytes of one bucket sent through collective_rpc (vLLM's RPC buffers a message whole).
DEFAULT_BUCKET_BYTES = 256 * 2**20


def bucket_slices(sizes: list[int], max_bytes: int) -> list[slice]:
    """Consecutive index ranges of `sizes` (bytes per tensor) holding at most `max_bytes` each; a tensor larger than
    the bound is a bucket of its own (it cannot be split without vLLM knowing how). The gloo transport's two sides
    cut one stream with it from the same metadata."""
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    out, start, total = [], 0, 0
    for i, size in enumerate(sizes):
        if i > start and total + size > max_bytes:
            out.append(slice(start, i))
            start, total = i, 0
        total += size
    if start < len(sizes):
        out.append(slice(start, len(sizes)))
    return out


def weight_buckets(
    items: Iterable[tuple[str, torch.Tensor]], max_bytes: int = DEFAULT_BUCKET_BYTES
) -> list[list[tuple[str, torch.Tensor]]]:
    """(name, tensor) pairs in order, grouped into lists of at most `max_bytes` of tensor data each
    (`bucket_slices`)."""
    items = list(items)
    return [items[part] for part in bucket_slices([t.numel() * t.element_size() for _, t in items], max_bytes)]

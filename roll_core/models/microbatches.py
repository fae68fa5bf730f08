"""Micro-batches cut by a token budget instead of a row count (ROLL's dynamic batching, verl's dynamic batch size):
rows sorted longest first and gathered while the micro-batch, padded to its own longest prompt and response, holds
at most `max_tokens` tokens; each micro-batch keeps only the padding its own rows need. With long-tailed lengths
the short rows no longer run padded to the longest row of the batch."""

from __future__ import annotations

from collections.abc import Callable

import torch

from roll_core.batch import TENSOR_KEYS, Batch, sequence_mask
from roll_core.models.forward import batched_log_probs, batched_values
from roll_core.models.sampling import SamplingDistribution

#: The 2-D tensor keys by the dimension they span: left-padded prompt columns or right-padded response columns.
PROMPT_KEYS = frozenset(k for k, shape in TENSOR_KEYS.items() if shape.startswith("(B, P)"))
RESPONSE_KEYS = frozenset(k for k, shape in TENSOR_KEYS.items() if shape.startswith("(B, R)"))


def row_lengths(batch: Batch) -> tuple[list[int], list[int]]:
    """Each row's prompt tokens and response tokens (up to its last token in the sequence the model reads)."""
    prompt = batch["prompt_mask"].long().sum(-1)
    seq = sequence_mask(batch) > 0
    width = seq.shape[1]
    last = width - seq.flip(-1).long().argmax(-1)  # one past the last token read, where the row has any
    response = torch.where(seq.any(-1), last, torch.zeros_like(last))
    return prompt.tolist(), response.tolist()


def token_budget_plan(prompt_lens: list[int], response_lens: list[int], max_tokens: int) -> list[list[int]]:
    """The row indices of each micro-batch: rows longest first (prompt and response together; ties in row order),
    each micro-batch taking the next row while (its rows) x (its longest prompt + its longest response) stays
    within `max_tokens`. A row longer than the budget alone is a micro-batch of its own."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    order = sorted(range(len(prompt_lens)), key=lambda i: -(prompt_lens[i] + response_lens[i]))
    plan: list[list[int]] = []
    rows: list[int] = []
    longest_prompt = longest_response = 0
    for i in order:
        p, r = max(longest_prompt, prompt_lens[i]), max(longest_response, response_lens[i])
        if rows and (len(rows) + 1) * (p + r) > max_tokens:
            plan.append(rows)
            rows, p, r = [], prompt_lens[i], response_lens[i]
        rows.append(i)
        longest_prompt, longest_response = p, r
    if rows:
        plan.append(rows)
    return plan


def over_budget(prompt_lens: list[int], response_lens: list[int], max_tokens: int) -> int:
    """How many rows are longer than the budget (each ran as a micro-batch of its own)."""
    return sum(p + r > max_tokens for p, r in zip(prompt_lens, response_lens, strict=True))


def trimmed(batch: Batch, prompt_len: int, response_len: int) -> Batch:
    """The batch with only the last `prompt_len` prompt columns and the first `response_len` response columns."""
    tensors = {}
    for key, value in batch.tensors.items():
        if key in PROMPT_KEYS:
            value = value[:, value.shape[1] - prompt_len :]
        elif key in RESPONSE_KEYS:
            value = value[:, :response_len]
        tensors[key] = value
    return Batch(tensors, dict(batch.meta))


def by_token_budget(
    batch: Batch, max_tokens: int, run: Callable[[Batch], torch.Tensor]
) -> torch.Tensor:
    """`run` (a (b, r) per-response-token result, e.g. log-probs) over the micro-batches of `token_budget_plan`,
    each trimmed to its own rows' lengths; the results put back in the batch's row order and response width, zero
    past each micro-batch's width."""
    prompt_lens, response_lens = row_lengths(batch)
    width = batch["response_ids"].shape[1]
    out: torch.Tensor | None = None
    for rows in token_budget_plan(prompt_lens, response_lens, max_tokens):
        p = max(max(prompt_lens[i] for i in rows), 1)
        r = max(max(response_lens[i] for i in rows), 1)
        part = run(trimmed(batch.select(rows), p, r))
        if out is None:
            out = part.new_zeros((len(batch), width))
        out[torch.as_tensor(rows, device=out.device), : part.shape[1]] = part
    if out is None:
        raise ValueError("an empty batch has no micro-batches")
    return out


def log_probs_in_micro_batches(
    model: torch.nn.Module, batch: Batch, micro_batch_size: int, sampling: SamplingDistribution,
    max_tokens: int | None = None,
) -> torch.Tensor:
    """forward.batched_log_probs, `micro_batch_size` rows at a time, or with `max_tokens` in the micro-batches of
    `token_budget_plan`."""
    if max_tokens is None:
        return batched_log_probs(model, batch, micro_batch_size, sampling)
    return by_token_budget(batch, max_tokens, lambda micro: batched_log_probs(model, micro, len(micro), sampling))


def values_in_micro_batches(
    model: torch.nn.Module, batch: Batch, micro_batch_size: int, max_tokens: int | None = None
) -> torch.Tensor:
    """forward.batched_values, `micro_batch_size` rows at a time, or with `max_tokens` in the micro-batches of
    `token_budget_plan`."""
    if max_tokens is None:
        return batched_values(model, batch, micro_batch_size)
    return by_token_budget(batch, max_tokens, lambda micro: batched_values(model, micro, len(micro)))

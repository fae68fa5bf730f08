"""Micro-batches cut by a token budget instead of a row count (ROLL's dynamic batching, verl's dynamic batch size):
rows sorted longest first (or a prompt's rows kept together, where that runs fewer tokens) and gathered while the
micro-batch, padded to its own longest prompt and response, holds at most `max_tokens` tokens; each micro-batch
keeps only the padding its own rows need. With long-tailed lengths the short rows no longer run padded to the
longest row of the batch. docs/micro-batches.md says what is cut where and what was measured."""

from __future__ import annotations

from collections.abc import Callable

import torch

from roll_core.batch import TENSOR_KEYS, Batch, sequence_mask
from roll_core.models.forward import SHARE_FROM, batched_log_probs, batched_values, can_share_prompts
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


def prompt_groups(batch: Batch) -> list[int]:
    """Each row's prompt, numbered by first appearance: rows with equal prompt ids and mask share a number (a
    group's responses do)."""
    rows = torch.cat([batch["prompt_ids"], batch["prompt_mask"].long()], dim=1)
    _, inverse = torch.unique(rows, dim=0, return_inverse=True)
    first: dict[int, int] = {}
    return [first.setdefault(g, len(first)) for g in inverse.tolist()]


def rounded(length: int, multiple: int) -> int:
    """`length` rounded up to a multiple of `multiple`."""
    return -(-length // multiple) * multiple


def token_budget_plan(
    prompt_lens: list[int], response_lens: list[int], max_tokens: int, at_least: int = 1,
    groups: list[int] | None = None, packed: bool = False, round_to: int = 1,
) -> list[list[int]]:
    """The row indices of each micro-batch: rows longest first (prompt and response together; ties in row order),
    each micro-batch taking the next row while (its rows) x (its longest prompt + its longest response, rounded up
    to a multiple of `round_to`: `cut` pads it so) stays within `max_tokens`; with `packed` (its rows run packed
    into one, no padding: forward.packed_sequence), while the sum of its rows' lengths does. A row longer than the
    budget alone is a micro-batch of its own.

    `groups` (`prompt_groups`): the rows of one prompt are kept next to each other, longest first, the groups
    ordered by their longest row, so that a micro-batch holds whole groups where the budget allows and runs each of
    their prompts once (forward.response_logits shares a prompt among its rows).

    `at_least`: then the micro-batch of the most rows (the first of them) is halved, its longer rows first, until
    there are that many (data-parallel ranks must run as many forwards and backwards as each other: ZeRO-2 and -3
    reduce and gather at every one). A part of a micro-batch stays within its budget."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if not 1 <= at_least <= max(len(prompt_lens), 1):
        raise ValueError(f"cannot cut {len(prompt_lens)} rows into at least {at_least} micro-batches")
    length = [p + r for p, r in zip(prompt_lens, response_lens, strict=True)]
    if groups is None:
        order = sorted(range(len(length)), key=lambda i: -length[i])
    else:
        longest: dict[int, int] = {}
        for i, g in enumerate(groups):
            longest[g] = max(longest.get(g, 0), length[i])
        order = sorted(range(len(length)), key=lambda i: (-longest[groups[i]], groups[i], -length[i]))
    plan: list[list[int]] = []
    rows: list[int] = []
    longest_prompt = longest_response = tokens = 0
    for i in order:
        p, r = max(longest_prompt, prompt_lens[i]), max(longest_response, response_lens[i])
        if rows and (tokens + length[i] if packed else (len(rows) + 1) * rounded(p + r, round_to)) > max_tokens:
            plan.append(rows)
            rows, p, r, tokens = [], prompt_lens[i], response_lens[i], 0
        rows.append(i)
        longest_prompt, longest_response, tokens = p, r, tokens + length[i]
    if rows:
        plan.append(rows)
    while len(plan) < at_least:
        k = max(range(len(plan)), key=lambda j: len(plan[j]))  # max keeps the first of equals
        half = (len(plan[k]) + 1) // 2
        plan[k : k + 1] = [plan[k][:half], plan[k][half:]]
    return plan


def tokens_run(
    plan: list[list[int]], prompt_lens: list[int], response_lens: list[int], groups: list[int], round_to: int = 1
) -> int:
    """The tokens the forwards of `plan` run: each micro-batch's rows x its longest response (with the columns
    that round its width up to a multiple of `round_to`), and its longest prompt once per distinct prompt where its
    rows share prompts (forward.shared_prompts: SHARE_FROM rows a prompt or more), else once per row."""
    total = 0
    for rows in plan:
        prompt = max(prompt_lens[i] for i in rows)
        response = rounded(prompt + max(response_lens[i] for i in rows), round_to) - prompt
        distinct = len({groups[i] for i in rows})
        prompts_run = distinct if distinct * SHARE_FROM <= len(rows) else len(rows)
        total += prompts_run * prompt + len(rows) * response
    return total


def budget_plan(
    prompt_lens: list[int], response_lens: list[int], max_tokens: int, groups: list[int] | None,
    at_least: int = 1, packed: bool = False, round_to: int = 1,
) -> list[list[int]]:
    """`token_budget_plan` with a prompt's rows together and with rows by length alone, whichever runs fewer
    tokens (`tokens_run`); by length alone where the forward does not share prompts (`groups` None) and where it
    packs the rows (`packed`: no padding to save, and packed rows each run their own prompt). Measured
    (benchmarks/bench_microbatches.py): with prompts as long as the responses, rows by length alone pad least and
    train fastest; with prompts several times longer, a prompt run once for its rows saves more than the padding
    costs. `round_to`: each padded micro-batch's width rounded up to a multiple of it (token_budget_plan)."""
    by_length = token_budget_plan(prompt_lens, response_lens, max_tokens, at_least, packed=packed, round_to=round_to)
    if groups is None or packed:
        return by_length
    together = token_budget_plan(prompt_lens, response_lens, max_tokens, at_least, groups, round_to=round_to)
    fewer = tokens_run(together, prompt_lens, response_lens, groups, round_to) < tokens_run(
        by_length, prompt_lens, response_lens, groups, round_to
    )
    return together if fewer else by_length


def over_budget(prompt_lens: list[int], response_lens: list[int], max_tokens: int) -> int:
    """How many rows are longer than the budget (each ran as a micro-batch of its own)."""
    return sum(p + r > max_tokens for p, r in zip(prompt_lens, response_lens, strict=True))


def trimmed(batch: Batch, prompt_len: int, response_len: int) -> Batch:
    """The batch with only the last `prompt_len` prompt columns and the first `response_len` response columns
    (zeros appended past the batch's own response columns: padding, masked)."""
    tensors = {}
    for key, value in batch.tensors.items():
        if key in PROMPT_KEYS:
            value = value[:, value.shape[1] - prompt_len :]
        elif key in RESPONSE_KEYS:
            value = value[:, :response_len]
            if value.shape[1] < response_len:
                extra = value.new_zeros((value.shape[0], response_len - value.shape[1], *value.shape[2:]))
                value = torch.cat([value, extra], dim=1)
        tensors[key] = value
    return Batch(tensors, dict(batch.meta))


def cut(
    batch: Batch, plan: list[list[int]], lengths: tuple[list[int], list[int]] | None = None, round_to: int = 1
) -> list[Batch]:
    """The micro-batches of `plan` (row indices into `batch`), each trimmed to its own rows' longest prompt and
    response (at least one column each), then given response columns (padding) until its width is a multiple of
    `round_to` (ROLL's sequence_length_round); `lengths`: `row_lengths(batch)`, where the caller has them."""
    prompt_lens, response_lens = lengths or row_lengths(batch)
    micro_batches = []
    for rows in plan:
        prompt = max(max(prompt_lens[i] for i in rows), 1)
        response = max(max(response_lens[i] for i in rows), 1)
        micro_batches.append(trimmed(batch.select(rows), prompt, rounded(prompt + response, round_to) - prompt))
    return micro_batches


def padding(micro_batches: list[Batch], packed: bool = False) -> tuple[int, int]:
    """The tokens the micro-batches' rows read and the tokens their forwards run, padding included (each
    micro-batch is its rows x (prompt columns + response columns); with `packed`, only the tokens read)."""
    read = run = 0
    for micro in micro_batches:
        prompt_lens, response_lens = row_lengths(micro)
        read += sum(prompt_lens) + sum(response_lens)
        run += len(micro) * (micro["prompt_ids"].shape[1] + micro["response_ids"].shape[1])
    return read, read if packed else run


def by_token_budget(
    batch: Batch, max_tokens: int, run: Callable[[Batch], torch.Tensor], shares_prompts: bool = False,
    packed: bool = False, round_to: int = 1,
) -> torch.Tensor:
    """`run` (a (b, r) per-response-token result, e.g. log-probs) over the micro-batches of `budget_plan` (with
    `shares_prompts`, where `run` runs a prompt once for its rows; with `packed`, where it packs them), each
    trimmed to its own rows' lengths (its width rounded up to a multiple of `round_to`); the results put back in
    the batch's row order and response width, zero past each micro-batch's width."""
    lengths = row_lengths(batch)
    groups = prompt_groups(batch) if shares_prompts else None
    plan = budget_plan(*lengths, max_tokens, groups, packed=packed, round_to=round_to)
    if not plan:
        raise ValueError("an empty batch has no micro-batches")
    out: torch.Tensor | None = None
    for rows, micro in zip(plan, cut(batch, plan, lengths, round_to), strict=True):
        part = run(micro)
        if out is None:
            out = part.new_zeros((len(batch), batch["response_ids"].shape[1]))
        width = min(part.shape[1], out.shape[1])  # rounding's padding columns may run past the batch's
        out[torch.as_tensor(rows, device=out.device), :width] = part[:, :width]
    return out


def log_probs_in_micro_batches(
    model: torch.nn.Module, batch: Batch, micro_batch_size: int, sampling: SamplingDistribution,
    max_tokens: int | None = None, packed: bool = False, round_to: int = 1,
) -> torch.Tensor:
    """forward.batched_log_probs, `micro_batch_size` rows at a time, or with `max_tokens` in the micro-batches of
    `budget_plan` (the model shares prompts where forward.can_share_prompts says so; each micro-batch's width
    rounded up to a multiple of `round_to`); with `packed`, each micro-batch's rows packed into one."""
    if max_tokens is None:
        return batched_log_probs(model, batch, micro_batch_size, sampling, packed)
    return by_token_budget(
        batch, max_tokens, lambda micro: batched_log_probs(model, micro, len(micro), sampling, packed),
        can_share_prompts(model), packed, round_to,
    )


def values_in_micro_batches(
    model: torch.nn.Module, batch: Batch, micro_batch_size: int, max_tokens: int | None = None,
    packed: bool = False, round_to: int = 1,
) -> torch.Tensor:
    """forward.batched_values, `micro_batch_size` rows at a time, or with `max_tokens` in the micro-batches of
    `budget_plan` by length alone (the value model does not share prompts; each micro-batch's width rounded up to a
    multiple of `round_to`); with `packed`, each micro-batch's rows packed into one."""
    if max_tokens is None:
        return batched_values(model, batch, micro_batch_size, packed)
    return by_token_budget(
        batch, max_tokens, lambda micro: batched_values(model, micro, len(micro), packed), packed=packed,
        round_to=round_to,
    )

"""Forward passes over (prompt, response) pairs: per-token log-probs, entropies and values of the response."""

from __future__ import annotations

import inspect

import torch

from roll_core.batch import Batch, sequence_mask
from roll_core.models.sampling import SamplingDistribution


def concat_prompt_response(batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """input_ids, attention_mask and position_ids (B, P + R) for a left-padded prompt and right-padded response.

    Position ids count only real tokens, so a left-padded prompt gets the positions it would have alone, as in
    generation.
    """
    input_ids = torch.cat([batch["prompt_ids"], batch["response_ids"]], dim=1)
    attention_mask = torch.cat([batch["prompt_mask"].long(), sequence_mask(batch).long()], dim=1)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return input_ids, attention_mask, position_ids


def response_logits(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """(B, R, V) logits that predict each response token.

    Where the model takes `logits_to_keep` (Hugging Face causal LMs do), only the last R + 1 positions go through
    the output layer: the prompt's logits, (B, P, V) floats that nothing uses (gigabytes with a 150k vocabulary and
    long prompts), are never made. Where rows share prompts (a group's responses do), each prompt goes through the
    model once (`response_logits_sharing_prompts`)."""
    shared = shared_prompts(batch) if can_share_prompts(model) else None
    if shared is not None:
        return response_logits_sharing_prompts(model, batch, *shared)
    input_ids, attention_mask, position_ids = concat_prompt_response(batch)
    response_len = batch["response_ids"].shape[1]
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
    if takes_logits_to_keep(model):
        return model(**inputs, logits_to_keep=response_len + 1).logits[:, :-1, :]
    return model(**inputs).logits[:, -response_len - 1 : -1, :]


#: Rows per distinct prompt from which a batch's prompts are run once each (below it, one forward over all rows).
SHARE_FROM = 2.0


def shared_prompts(batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The distinct prompts of `batch` (ids and mask, (U, P) each) and each row's index among them (B,), when rows
    share prompts enough (`SHARE_FROM` rows per prompt or more); else None."""
    prompt_ids, prompt_mask = batch["prompt_ids"], batch["prompt_mask"].long()
    if prompt_ids.device.type == "meta":
        return None  # shapes without values (device-placement checks): nothing to compare
    rows = torch.cat([prompt_ids, prompt_mask], dim=1)
    distinct, inverse = torch.unique(rows, dim=0, return_inverse=True)
    if distinct.shape[0] * SHARE_FROM > rows.shape[0]:
        return None
    width = prompt_ids.shape[1]
    return distinct[:, :width], distinct[:, width:], inverse


def can_share_prompts(model: torch.nn.Module) -> bool:
    """Whether the model can run a prompt once and continue from its key/value cache: a Hugging Face causal LM
    that takes `logits_to_keep`, without gradient checkpointing (which turns the cache off in training)."""
    inner = getattr(model, "module", model)
    if hasattr(type(inner), "is_activation_checkpointing"):  # transformers >= 5.x's name
        checkpointing = inner.is_activation_checkpointing
    else:
        checkpointing = getattr(inner, "is_gradient_checkpointing", False)
    return takes_logits_to_keep(model) and not checkpointing


def response_logits_sharing_prompts(
    model: torch.nn.Module, batch: Batch, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, inverse: torch.Tensor
) -> torch.Tensor:
    """`response_logits` with each distinct prompt run once: its forward gives the logits of the first response
    token and a key/value cache, which is copied to the prompt's rows (`inverse`) before the responses run on top
    of it. Causal attention makes a prompt's states independent of what follows, so the logits are those of the
    full forward (equal up to rounding: tests/test_forward_sharing.py); in training the gradients of each prompt's
    rows flow back into its one forward and add up there, as they would over its copies."""
    positions = (prompt_mask.cumsum(-1) - 1).clamp(min=0)
    out = model(
        input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=positions, use_cache=True, logits_to_keep=1
    )
    first = out.logits[:, -1:, :].index_select(0, inverse)
    response_ids = batch["response_ids"]
    if response_ids.shape[1] == 1:
        return first
    cache = out.past_key_values
    cache.batch_select_indices(inverse)
    mask = torch.cat([batch["prompt_mask"].long(), sequence_mask(batch).long()], dim=1)
    width = prompt_ids.shape[1]
    rest = model(
        input_ids=response_ids[:, :-1],
        attention_mask=mask[:, :-1],
        position_ids=(mask.cumsum(-1) - 1).clamp(min=0)[:, width:-1],
        past_key_values=cache,
        use_cache=True,
    ).logits
    return torch.cat([first, rest], dim=1)


def takes_logits_to_keep(model: torch.nn.Module) -> bool:
    inner = getattr(model, "module", model)  # a DeepSpeed engine holds the model as .module
    return "logits_to_keep" in inspect.signature(inner.forward).parameters


FULL_SOFTMAX = SamplingDistribution()
"""Temperature 1, nothing truncated."""


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of a model's (first) parameters: where the inputs of its forward must be."""
    inner = getattr(model, "module", model)
    return next(inner.parameters()).device


def log_probs_from_logits(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    sampling: SamplingDistribution = FULL_SOFTMAX,
    with_entropy: bool = False,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (B, R) of `tokens` under the sampling distribution (temperature, top-k, top-p; see
    roll_core/models/sampling.py), so that they are those of the policy that sampled, and optionally the
    entropies (B, R) of that distribution (computed outside the autograd graph with `entropy_grad=False`)."""
    return sampling.log_probs(logits, tokens, with_entropy=with_entropy, entropy_grad=entropy_grad)


def packed_sequence(batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows of `batch` packed into one row of the tokens they read, no padding (sequence packing): input_ids
    and position_ids (1, T), each row's positions counting from 0 again; then, in row-major order, the index in T
    of the token whose output predicts each response token the rows read (the token before it), and the (B, R)
    mask of where those response tokens stand.

    Positions that restart tell transformers where a row begins: with no attention mask and no cache it keeps each
    token's attention inside its own row (a block-diagonal causal mask for sdpa and eager attention, the
    variable-length kernel for FlashAttention), so every row's outputs are those of its padded forward."""
    input_ids, attention_mask, position_ids = concat_prompt_response(batch)
    read = attention_mask.bool()
    index = read.flatten().cumsum(0).view_as(read) - 1  # each read token's place in the packed row
    width = batch["prompt_ids"].shape[1]
    predicted = read[:, width:] & read[:, width - 1 : -1]
    return input_ids[read][None], position_ids[read][None], index[:, width - 1 : -1][predicted], predicted


def packed_forward(model: torch.nn.Module, batch: Batch, logits: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's outputs (K, ...) at the K tokens that predict the response tokens the rows read, from one
    forward over the rows packed (`packed_sequence`), and the (B, R) mask of those response tokens. `logits`: a
    causal LM that takes `logits_to_keep` puts only those K positions through its output layer.

    The forward runs without a cache: transformers finds packed rows only where there is none (a causal LM makes
    one by default outside training), and the rows would otherwise attend to each other."""
    input_ids, position_ids, before, predicted = packed_sequence(batch)
    inputs = {"input_ids": input_ids, "position_ids": position_ids, "use_cache": False}
    if logits and takes_logits_to_keep(model):
        return model(**inputs, logits_to_keep=before).logits[0], predicted
    return model(**inputs).logits[0, before], predicted


def spread(values: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    """(B, R): `values` (K,) at the K places of `where` in row-major order, 0 elsewhere (differentiable)."""
    return values.new_zeros(where.shape).masked_scatter(where, values)


def response_log_probs(
    model: torch.nn.Module,
    batch: Batch,
    sampling: SamplingDistribution = FULL_SOFTMAX,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    packed: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (B, R) of the response tokens under `sampling`, and optionally their entropies (see
    `log_probs_from_logits`): from a forward over the padded rows (`response_logits`, which may run a shared prompt
    once), or with `packed` over the rows packed into one (`packed_forward`; 0 at the columns a row does not
    read)."""
    tokens = batch["response_ids"]
    if not packed:
        return log_probs_from_logits(response_logits(model, batch), tokens, sampling, with_entropy, entropy_grad)
    logits, predicted = packed_forward(model, batch)
    log_probs, entropy = log_probs_from_logits(logits[None], tokens[predicted][None], sampling, with_entropy,
                                               entropy_grad)
    return spread(log_probs[0], predicted), None if entropy is None else spread(entropy[0], predicted)


@torch.no_grad()
def batched_log_probs(
    model: torch.nn.Module, batch: Batch, micro_batch_size: int, sampling: SamplingDistribution, packed: bool = False
) -> torch.Tensor:
    """(B, R) response log-probs without gradient, computed `micro_batch_size` samples at a time (with `packed`,
    each micro-batch's rows packed into one) on the model's device; the result is on the batch's device."""
    device, home = model_device(model), batch["response_mask"].device
    parts = []
    for micro in batch.split(micro_batch_size):
        micro = micro.to(device)
        parts.append(response_log_probs(model, micro, sampling, packed=packed)[0].to(home))
    return torch.cat(parts) * batch["response_mask"]


@torch.no_grad()
def batched_values(model: torch.nn.Module, batch: Batch, micro_batch_size: int, packed: bool = False) -> torch.Tensor:
    """(B, R) value estimates without gradient, `micro_batch_size` samples at a time (with `packed`, each
    micro-batch's rows packed into one) on the model's device; the result is on the batch's device."""
    device, home = model_device(model), batch["response_mask"].device
    parts = [response_values(model, m.to(device), packed).to(home) for m in batch.split(micro_batch_size)]
    return torch.cat(parts) * batch["response_mask"]


def response_values(model: torch.nn.Module, batch: Batch, packed: bool = False) -> torch.Tensor:
    """(B, R) value estimates from a token-classification model with one label, at the state before each token;
    with `packed` from one forward over the rows packed (0 at the columns a row does not read)."""
    if packed:
        values, predicted = packed_forward(model, batch, logits=False)
        return spread(values[:, 0].float(), predicted)
    input_ids, attention_mask, position_ids = concat_prompt_response(batch)
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    response_len = batch["response_ids"].shape[1]
    return out[:, -response_len - 1 : -1, 0].float()

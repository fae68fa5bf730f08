"""Forward passes over (prompt, response) pairs: per-token log-probs, entropies and values of the response."""

from __future__ import annotations

import inspect

import torch

from roll_pipeline.batch import Batch


def concat_prompt_response(batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """input_ids, attention_mask and position_ids (B, P + R) for a left-padded prompt and right-padded response.

    Position ids count only real tokens, so a left-padded prompt gets the positions it would have alone, as in
    generation.
    """
    input_ids = torch.cat([batch["prompt_ids"], batch["response_ids"]], dim=1)
    attention_mask = torch.cat([batch["prompt_mask"].long(), batch["response_mask"].long()], dim=1)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return input_ids, attention_mask, position_ids


def response_logits(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """(B, R, V) logits that predict each response token.

    Where the model takes `logits_to_keep` (Hugging Face causal LMs do), only the last R + 1 positions go through
    the output layer: the prompt's logits, (B, P, V) floats that nothing uses (gigabytes with a 150k vocabulary and
    long prompts), are never made."""
    input_ids, attention_mask, position_ids = concat_prompt_response(batch)
    response_len = batch["response_ids"].shape[1]
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
    if takes_logits_to_keep(model):
        return model(**inputs, logits_to_keep=response_len + 1).logits[:, :-1, :]
    return model(**inputs).logits[:, -response_len - 1 : -1, :]


def takes_logits_to_keep(model: torch.nn.Module) -> bool:
    inner = getattr(model, "module", model)  # a DeepSpeed engine holds the model as .module
    return "logits_to_keep" in inspect.signature(inner.forward).parameters


def log_probs_from_logits(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (B, R) of `tokens` under softmax(logits / temperature), and optionally the entropies (B, R).

    The temperature is the sampling temperature, so the log-probs are those of the policy that sampled. With
    `entropy_grad=False` the entropies are computed outside the autograd graph (for logging only): the graph then
    keeps no (B, R, vocabulary) product for the backward pass.
    """
    logp_all = torch.log_softmax(logits.float() / temperature, dim=-1)
    log_probs = logp_all.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    entropy = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropy = -(logp_all.exp() * logp_all).sum(-1)
    return log_probs, entropy


@torch.no_grad()
def batched_log_probs(model: torch.nn.Module, batch: Batch, micro_batch_size: int, temperature: float) -> torch.Tensor:
    """(B, R) response log-probs without gradient, computed `micro_batch_size` samples at a time."""
    parts = []
    for micro in batch.split(micro_batch_size):
        logits = response_logits(model, micro)
        parts.append(log_probs_from_logits(logits, micro["response_ids"], temperature)[0])
    return torch.cat(parts) * batch["response_mask"]


def response_values(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """(B, R) value estimates from a token-classification model with one label, at the state before each token."""
    input_ids, attention_mask, position_ids = concat_prompt_response(batch)
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    response_len = batch["response_ids"].shape[1]
    return out[:, -response_len - 1 : -1, 0].float()

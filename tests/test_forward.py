"""Response logits and log-probs over left-padded prompts and right-padded responses, on the embedded model."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from roll_pipeline.batch import Batch
from roll_pipeline.models.forward import batched_log_probs, concat_prompt_response, response_logits


def pair_batch() -> Batch:
    g = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(5, 400, (3, 7), generator=g)
    prompt_mask = torch.ones(3, 7)
    prompt_mask[0, :3] = 0  # left padding
    prompt_ids[0, :3] = 0
    response_ids = torch.randint(5, 400, (3, 5), generator=g)
    response_mask = torch.ones(3, 5)
    response_mask[1, 3:] = 0  # right padding
    return Batch(
        {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "response_ids": response_ids, "response_mask": response_mask}
    )


class NoLogitsToKeep(torch.nn.Module):
    """A causal LM whose forward has no `logits_to_keep` (a user's own model class)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, position_ids):
        return self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)


def test_response_logits_are_the_full_forwards_logits_at_the_positions_before_each_response_token(tiny_model):
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model)).eval()
    batch = pair_batch()
    input_ids, attention_mask, position_ids = concat_prompt_response(batch)
    with torch.no_grad():
        full = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
        kept = response_logits(model, batch)
        fallback = response_logits(NoLogitsToKeep(model), batch)
    assert kept.shape == (3, 5, model.config.vocab_size)
    # position P - 1 + j predicts response token j
    torch.testing.assert_close(kept, full[:, 6:11, :], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fallback, full[:, 6:11, :], rtol=0, atol=0)


def test_batched_log_probs_do_not_depend_on_the_micro_batch_and_zero_the_padding(tiny_model):
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model)).eval()
    batch = pair_batch()
    whole = batched_log_probs(model, batch, micro_batch_size=3, temperature=1.0)
    one_by_one = batched_log_probs(model, batch, micro_batch_size=1, temperature=1.0)
    torch.testing.assert_close(whole, one_by_one, rtol=1e-5, atol=1e-5)
    assert (whole[1, 3:] == 0).all() and (whole[1, :3] < 0).all()

"""Rows that share a prompt run it once (roll_core/models/forward.py): the same logits, log-probs and gradients as
one forward over every row, within float rounding."""

from __future__ import annotations

import functools

import pytest
import torch
from transformers import AutoModelForCausalLM

from roll_core.batch import Batch
from roll_core.models import forward
from roll_core.models.forward import response_logits, shared_prompts

PAD = 0


def grouped_batch(group: int = 4, seed: int = 0) -> Batch:
    """Three prompts of different lengths (left-padded to one width), each with `group` responses of different
    lengths (right-padded), the rows of each prompt scattered through the batch as a shuffled batch has them."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(5, 200, (n,), generator=gen) for n in (7, 4, 9)]
    width = max(len(p) for p in prompts)
    rows = []
    for p in prompts:
        for _ in range(group):
            rows.append((p, torch.randint(5, 200, (int(torch.randint(1, 6, (1,), generator=gen)),), generator=gen)))
    order = torch.randperm(len(rows), generator=gen)
    rows = [rows[i] for i in order]
    resp_width = max(len(r) for _, r in rows)
    prompt_ids = torch.full((len(rows), width), PAD)
    prompt_mask = torch.zeros(len(rows), width)
    response_ids = torch.full((len(rows), resp_width), PAD)
    response_mask = torch.zeros(len(rows), resp_width)
    for i, (p, r) in enumerate(rows):
        prompt_ids[i, width - len(p) :] = p
        prompt_mask[i, width - len(p) :] = 1
        response_ids[i, : len(r)] = r
        response_mask[i, : len(r)] = 1
    return Batch(
        {
            "prompt_ids": prompt_ids,
            "prompt_mask": prompt_mask,
            "response_ids": response_ids,
            "response_mask": response_mask,
        }
    )


@pytest.fixture(scope="module")
def model(tiny_model):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)


def unshared(model, batch: Batch, monkeypatch) -> torch.Tensor:
    with monkeypatch.context() as m:
        m.setattr(forward, "shared_prompts", lambda _batch: None)
        return response_logits(model, batch)


def masked(logits: torch.Tensor, batch: Batch) -> torch.Tensor:
    return logits * batch["response_mask"].unsqueeze(-1)


def test_the_distinct_prompts_are_found_wherever_their_rows_are():
    batch = grouped_batch()
    prompt_ids, prompt_mask, inverse = shared_prompts(batch)
    assert prompt_ids.shape[0] == 3
    assert torch.equal(prompt_ids[inverse], batch["prompt_ids"])
    assert torch.equal(prompt_mask[inverse], batch["prompt_mask"].long())
    # One row per prompt: nothing to share, one forward over all rows.
    assert shared_prompts(grouped_batch(group=1)) is None


def test_sharing_gives_the_logits_of_one_forward_over_every_row(model, monkeypatch):
    model.eval()
    for seed in range(3):
        batch = grouped_batch(seed=seed)
        with torch.no_grad():
            shared = response_logits(model, batch)
            full = unshared(model, batch, monkeypatch)
        assert shared.shape == full.shape
        # Rows' real response positions; padding positions predict nothing the loss reads.
        assert torch.allclose(masked(shared, batch), masked(full, batch), atol=1e-4, rtol=1e-4)


def test_sharing_gives_the_gradients_of_one_forward_over_every_row(model, monkeypatch):
    model.train()
    batch = grouped_batch(seed=5)
    weights = torch.randn(batch["response_ids"].shape + (model.config.vocab_size,), generator=torch.Generator().manual_seed(1))
    grads = []
    for share in (True, False):
        model.zero_grad()
        logits = response_logits(model, batch) if share else unshared(model, batch, monkeypatch)
        (masked(logits, batch) * weights).sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    model.zero_grad()
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 0
    for name in grads[0]:
        scale = grads[1][name].abs().max().clamp(min=1e-6)
        assert (grads[0][name] - grads[1][name]).abs().max() / scale < 1e-4, name


def test_gradient_checkpointing_turns_sharing_off(model):
    model.gradient_checkpointing_enable()
    try:
        assert not forward.can_share_prompts(model)
    finally:
        model.gradient_checkpointing_disable()
    assert forward.can_share_prompts(model)


def forward_batch_sizes(model, batch: Batch, monkeypatch) -> list[int]:
    """The batch size of each forward the model runs for `response_logits(model, batch)`."""
    sizes: list[int] = []
    real = type(model).forward

    @functools.wraps(real)  # the same signature: whether it takes logits_to_keep is read from it
    def counted(self, *args, **kwargs):
        sizes.append(kwargs["input_ids"].shape[0])
        return real(self, *args, **kwargs)

    with monkeypatch.context() as m, torch.no_grad():
        m.setattr(type(model), "forward", counted)
        response_logits(model, batch)
    return sizes


def test_each_prompt_goes_through_the_model_once(model, monkeypatch):
    model.eval()
    # 3 prompts x 4 rows: the prompts' forward (3 rows), then the responses on its cache (12).
    assert forward_batch_sizes(model, grouped_batch(group=4), monkeypatch) == [3, 12]
    # 2 rows per prompt is SHARE_FROM: still shared.
    assert forward_batch_sizes(model, grouped_batch(group=2), monkeypatch) == [3, 6]
    # One prompt in two rows.
    two = grouped_batch(group=2).select([0, 1, 2, 3, 4, 5])
    one_prompt = two.select([i for i in range(6) if torch.equal(two["prompt_ids"][i], two["prompt_ids"][0])])
    assert len(one_prompt) == 2 and forward_batch_sizes(model, one_prompt, monkeypatch) == [1, 2]
    # One row per prompt: one forward over every row.
    assert forward_batch_sizes(model, grouped_batch(group=1), monkeypatch) == [3]


@pytest.mark.parametrize("width", [1, 2])
def test_sharing_gives_the_same_logits_for_responses_of_one_and_two_tokens(model, monkeypatch, width):
    model.eval()
    batch = grouped_batch(seed=2)
    batch = batch.update(
        {"response_ids": batch["response_ids"][:, :width], "response_mask": torch.ones(len(batch), width)}
    )
    with torch.no_grad():
        shared = response_logits(model, batch)
        full = unshared(model, batch, monkeypatch)
    assert shared.shape == full.shape == (len(batch), width, model.config.vocab_size)
    assert torch.allclose(shared, full, atol=1e-4, rtol=1e-4)


def test_a_batch_of_shapes_alone_shares_nothing():
    # Device-placement checks run on the meta device: no values to compare prompts by.
    assert shared_prompts(grouped_batch().to("meta")) is None


def test_a_model_without_a_checkpointing_flag_can_share():
    class PlainLM(torch.nn.Module):
        def forward(self, input_ids, attention_mask=None, position_ids=None, logits_to_keep=0):
            raise NotImplementedError

    assert forward.can_share_prompts(PlainLM())


def test_sharing_on_absolute_positions(tiny_model, tmp_path, monkeypatch):
    """GPT-2's learned position embeddings take no negative index and show a shifted row: left padding must get
    position 0 and real tokens the positions they have alone, on the prompts' forward and on the responses'."""
    from tests.test_forward import absolute_position_model

    gpt2 = AutoModelForCausalLM.from_pretrained(absolute_position_model(tiny_model, tmp_path / "gpt2")).eval()
    assert forward.can_share_prompts(gpt2)
    batch = grouped_batch(seed=3)
    assert forward_batch_sizes(gpt2, batch, monkeypatch) == [3, 12]
    with torch.no_grad():
        shared = response_logits(gpt2, batch)
        full = unshared(gpt2, batch, monkeypatch)
    assert torch.allclose(masked(shared, batch), masked(full, batch), atol=1e-4, rtol=1e-4)

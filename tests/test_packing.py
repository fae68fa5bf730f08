"""Sequence packing (use_sequence_packing; roll_core/models/forward.py `packed_sequence`): a micro-batch's rows run
as one row of the tokens they read, positions restarting per row, and give the per-token log-probs, entropies and
values of their padded forward, on the embedded model, with a multi-turn row's tool tokens, rows that share a
prompt and LoRA adapters; through transformers' sdpa (a block-diagonal mask) and through sdpa row by row
(roll_core/models/row_attention.py, what a packing section loads), which elsewhere is sdpa itself. The train step's loss and gradients packed: tests/test_microbatch_gradients.py; on
DeepSpeed ZeRO-3: tests/test_zero.py."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

from roll_core.batch import Batch
from roll_core.models.forward import (
    FULL_SOFTMAX,
    batched_log_probs,
    batched_values,
    packed_sequence,
    response_log_probs,
)
from roll_core.models.grouped_sdpa import GROUPED_SDPA
from roll_core.models.microbatches import log_probs_in_micro_batches, padding, row_lengths, token_budget_plan
from roll_core.models.row_attention import ROW_ATTENTION, register
from roll_core.models.sampling import SamplingDistribution
from tests.test_microbatches import long_tailed_batch, two_long_prompts

KERNELS = ["sdpa", ROW_ATTENTION]


def causal_lm(path, kernel: str) -> torch.nn.Module:
    register()
    return AutoModelForCausalLM.from_pretrained(str(path), attn_implementation=kernel).eval()

# Measured 2026-12-07 (Intel Xeon, torch's 2 threads, twice, the same each time; long_tailed_batch seeds 0-4, each
# also with a shared prompt, full softmax and temperature 0.7 with top-k 50): packed against padded forwards of the
# embedded tiny-qwen2 in float32 differ by at most 8.1e-6 in a log-prob, 4.5e-6 in an entropy and 4.2e-7 in a value
# through sdpa row by row, and 3.8e-6, 2.9e-6 and 1.2e-7 through sdpa's block-diagonal mask (each kernel rounds
# otherwise than sdpa over padded rows). 5x room.
ATOL = 4e-5


def one_group_shares_a_prompt(batch: Batch) -> Batch:
    """`batch` with rows 0-3 given row 0's prompt (a group's responses), so that the padded forward runs it once."""
    prompt_ids, prompt_mask = batch["prompt_ids"].clone(), batch["prompt_mask"].clone()
    prompt_ids[1:4], prompt_mask[1:4] = prompt_ids[0], prompt_mask[0]
    return batch.update({"prompt_ids": prompt_ids, "prompt_mask": prompt_mask})


def forward_shapes(model: torch.nn.Module) -> tuple[list, object]:
    """The (input_ids shape, whether a cache was asked for, how many outputs logits_to_keep kept or None) of each
    forward of `model`, and the hook to remove."""
    seen: list = []

    def record(_, args, kwargs):
        keep = kwargs.get("logits_to_keep")
        kept = None if keep is None else len(keep) if isinstance(keep, torch.Tensor) else keep
        seen.append((tuple(kwargs["input_ids"].shape), kwargs.get("use_cache"), kept))

    return seen, model.register_forward_pre_hook(record, with_kwargs=True)


def test_a_packed_row_holds_the_tokens_read_with_positions_restarting_at_each_row():
    batch = long_tailed_batch(rows=6, seed=4)
    input_ids, position_ids, before, predicted = packed_sequence(batch)
    prompt_lens, response_lens = row_lengths(batch)
    lengths = [p + r for p, r in zip(prompt_lens, response_lens, strict=True)]
    assert input_ids.shape == position_ids.shape == (1, sum(lengths))
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    for i, (start, p, r) in enumerate(zip(starts, prompt_lens, response_lens, strict=True)):
        assert position_ids[0, start : start + p + r].tolist() == list(range(p + r))
        row = input_ids[0, start : start + p + r].tolist()
        assert row[:p] == batch["prompt_ids"][i, -p:].tolist() and row[p:] == batch["response_ids"][i, :r].tolist()
        # each response token read is predicted by the token before it: the prompt's last, then its own row's
        assert predicted[i].nonzero().flatten().tolist() == list(range(r))
    assert before.tolist() == [start + p - 1 + j for start, p, r in zip(starts, prompt_lens, response_lens, strict=True)
                               for j in range(r)]
    assert padding(batch.split(3), packed=True) == (sum(lengths), sum(lengths))
    assert padding(batch.split(3))[1] > sum(lengths)  # padded unless asked


def test_the_budget_of_packed_micro_batches_counts_the_tokens_read():
    prompt, response = [5, 5, 5, 2, 9], [10, 40, 2, 3, 1]  # lengths 15, 45, 7, 5, 10
    assert token_budget_plan(prompt, response, 60, packed=True) == [[1, 0], [4, 2, 3]]
    assert token_budget_plan(prompt, response, 60) == [[1], [0, 4, 2], [3]]  # padded: rows x (longest prompt + response)
    assert token_budget_plan(prompt, response, 20, packed=True) == [[1], [0], [4, 2], [3]]
    # exactly at the budget, and one token over it, in the first micro-batch and in one after a cut
    assert token_budget_plan(prompt, response, 59, packed=True) == [[1], [0, 4, 2, 3]]
    assert token_budget_plan(prompt, response, 17, packed=True) == [[1], [0], [4, 2], [3]]
    assert token_budget_plan(prompt, response, 16, packed=True) == [[1], [0], [4], [2, 3]]


def test_packed_micro_batches_are_cut_by_the_tokens_read_and_by_length_alone():
    """by_token_budget's micro-batches packed, as `run` sees them, over two_long_prompts' rows: rows by length, as
    many as their tokens read fit, although the forward shares prompts (a packed row carries each row's own
    prompt; padded, each prompt's rows would go together)."""
    from roll_core.models.microbatches import budget_plan, by_token_budget, prompt_groups

    batch = two_long_prompts()
    seen: list[tuple[int, int]] = []

    def run(micro: Batch) -> torch.Tensor:
        seen.append((len(set(micro["prompt_ids"][:, 0].tolist())), sum(map(sum, row_lengths(micro)))))
        return torch.zeros(len(micro), micro["response_ids"].shape[1])

    by_token_budget(batch, 600, run, shares_prompts=True, packed=True)
    assert seen == [(2, 600), (2, 440)]  # the four rows of 150 tokens, then the four of 110
    lengths, groups = row_lengths(batch), prompt_groups(batch)
    assert budget_plan(*lengths, 600, groups, packed=True) == token_budget_plan(*lengths, 600, packed=True)
    assert budget_plan(*lengths, 600, groups) != budget_plan(*lengths, 600, groups, packed=True)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("seed", [0, 2])
def test_packed_log_probs_and_entropies_equal_padded_ones(tiny_model, seed, kernel):
    """Rows of long-tailed lengths (one with tool tokens, four sharing a prompt, which the padded forward runs once)
    give the same log-probs and entropies packed, in one forward of one row without a cache."""
    model = causal_lm(tiny_model, kernel)
    batch = one_group_shares_a_prompt(long_tailed_batch(seed=seed))
    sampling = SamplingDistribution(temperature=0.7, top_k=50)
    mask = batch["response_mask"] > 0
    with torch.no_grad():
        padded, padded_entropy = response_log_probs(model, batch, sampling, with_entropy=True)
        seen, hook = forward_shapes(model)
        try:
            packed, packed_entropy = response_log_probs(model, batch, sampling, with_entropy=True, packed=True)
        finally:
            hook.remove()
    read = sum(sum(lengths) for lengths in row_lengths(batch))
    predicted = int(packed_sequence(batch)[3].sum())  # the output layer runs only where it predicts a response token
    assert seen == [((1, read), False, predicted)] and predicted < read
    torch.testing.assert_close(packed[mask], padded[mask], rtol=0, atol=ATOL)
    torch.testing.assert_close(packed_entropy[mask], padded_entropy[mask], rtol=0, atol=ATOL)
    assert (packed[mask] < 0).all() and (packed_entropy[mask] > 0).all()
    assert response_log_probs(model, batch, packed=True)[1] is None  # entropies only when asked
    few = batch.select(torch.tensor([0, 5]))
    assert response_log_probs(model, few, with_entropy=True, packed=True)[1].requires_grad  # a bonus trains them
    # in micro-batches, by rows and by a token budget, as the log-prob passes run them (padded unless asked)
    seen, hook = forward_shapes(model)
    try:
        fixed = batched_log_probs(model, batch, 4, FULL_SOFTMAX)
    finally:
        hook.remove()
    assert max(shape[0] for shape, *_ in seen) == 4
    for packed_rows in (batched_log_probs(model, batch, 5, FULL_SOFTMAX, packed=True),
                        log_probs_in_micro_batches(model, batch, 4, FULL_SOFTMAX, max_tokens=60, packed=True)):
        torch.testing.assert_close(packed_rows, fixed, rtol=0, atol=ATOL)


@pytest.mark.parametrize("kernel", KERNELS)
def test_packed_values_equal_padded_ones(tiny_model, kernel):
    register()
    torch.manual_seed(0)  # the value head is fresh
    model = AutoModelForTokenClassification.from_pretrained(str(tiny_model), num_labels=1,
                                                            attn_implementation=kernel).eval()
    batch = one_group_shares_a_prompt(long_tailed_batch(seed=1))
    seen, hook = forward_shapes(model)
    try:
        padded = batched_values(model, batch, micro_batch_size=12)
        packed = batched_values(model, batch, micro_batch_size=12, packed=True)
    finally:
        hook.remove()
    assert [(shape[0], kept) for shape, _, kept in seen] == [(12, None), (1, None)]  # padded unless asked
    torch.testing.assert_close(packed, padded, rtol=0, atol=ATOL)
    assert (packed[batch["response_mask"] == 0] == 0).all() and packed.abs().max() > 0.01


def test_packed_rows_through_lora_adapters_and_with_the_adapter_off_equal_padded_ones(tiny_model):
    from roll_core.config.clusters import LoraArgs
    from workers.strategies.lora import with_lora

    torch.manual_seed(0)
    model = with_lora(causal_lm(tiny_model, ROW_ATTENTION), LoraArgs(rank=4, alpha=8)).eval()
    for name, p in model.named_parameters():  # lora_B starts at 0: give the adapters an effect
        if "lora_B" in name:
            p.data.normal_(0, 0.5)
    batch = long_tailed_batch(seed=3)
    mask = batch["response_mask"] > 0
    with torch.no_grad():
        adapted = batched_log_probs(model, batch, 12, FULL_SOFTMAX)
        torch.testing.assert_close(batched_log_probs(model, batch, 12, FULL_SOFTMAX, packed=True), adapted,
                                   rtol=0, atol=ATOL)
        with model.disable_adapter():
            base = batched_log_probs(model, batch, 12, FULL_SOFTMAX)
            torch.testing.assert_close(batched_log_probs(model, batch, 12, FULL_SOFTMAX, packed=True), base,
                                       rtol=0, atol=ATOL)
    assert (adapted - base)[mask].abs().max() > 0.01, "the adapters change the log-probs"


def test_row_attention_is_sdpa_itself_on_padded_rows_a_shared_prompt_and_generation(tiny_model):
    """Where nothing is packed, the row-by-row kernel hands sdpa the very same call: bit-equal log-probs over padded
    rows (a single left-padded row too), over rows sharing a prompt (run once, then continued from a cache), and
    the same greedy generation."""
    sdpa, rows = causal_lm(tiny_model, "sdpa"), causal_lm(tiny_model, ROW_ATTENTION)
    batch = one_group_shares_a_prompt(long_tailed_batch(seed=5))
    with torch.no_grad():
        for part in (batch, batch.select(torch.tensor([2])), batch.select(torch.tensor([0, 1, 2, 3]))):
            assert torch.equal(response_log_probs(rows, part)[0], response_log_probs(sdpa, part)[0])
        prompt = {"input_ids": batch["prompt_ids"][:2], "attention_mask": batch["prompt_mask"][:2]}
        generated = [m.generate(**prompt, max_new_tokens=8, do_sample=False, pad_token_id=0) for m in (sdpa, rows)]
    assert torch.equal(*generated)


def test_a_section_that_packs_loads_its_model_with_row_attention(tiny_model):
    from roll_core.config import ModelArgs
    from workers.strategies.loading import load_causal_lm, load_value_model

    args = ModelArgs(model_name_or_path=str(tiny_model))
    assert load_causal_lm(args).config._attn_implementation == GROUPED_SDPA  # sdpa's, grouped heads kept (no CUDA)
    assert load_causal_lm(args, packed=True).config._attn_implementation == ROW_ATTENTION
    assert load_value_model(args, packed=True).config._attn_implementation == ROW_ATTENTION
    eager = ModelArgs(model_name_or_path=str(tiny_model), attn_implementation="eager")
    assert load_causal_lm(eager, packed=True).config._attn_implementation == "eager"  # a named kernel stays


def test_packed_rows_take_row_attention_only_in_place_of_sdpa(monkeypatch):
    """One choice for every loader (the policy, the critic, the reward model): sdpa, named or transformers' default,
    becomes ROW_ATTENTION for packed rows, and GROUPED_SDPA for padded rows on a machine without CUDA; any other
    named kernel stays, and so does sdpa for padded rows where CUDA is."""
    from roll_core.models.row_attention import kernel_for

    assert kernel_for(None, packed=True) == ROW_ATTENTION
    assert kernel_for("sdpa", packed=True) == ROW_ATTENTION
    for kernel in ("eager", "flash_attention_2"):
        assert kernel_for(kernel, packed=True) == kernel
        assert kernel_for(kernel, packed=False) == kernel
    assert kernel_for(None, packed=False) == kernel_for("sdpa", packed=False) == GROUPED_SDPA
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for kernel in (None, "sdpa", "eager"):
        assert kernel_for(kernel, packed=False) == kernel
    assert kernel_for(None, packed=True) == ROW_ATTENTION


class Attention(torch.nn.Module):
    """What sdpa_attention_forward reads of a model's attention module."""

    is_causal = True
    num_key_value_groups = 1


def qkv(tokens: int, batch: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(tokens)
    return [torch.randn(batch, 2, tokens, 8, generator=g) for _ in range(3)]


def sdpa_calls(monkeypatch) -> list[int]:
    """The query lengths of each torch sdpa call from here on."""
    calls: list[int] = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def counted(query, *args, **kwargs):
        calls.append(query.shape[2])
        return sdpa(query, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counted)
    return calls


def causal(query, key, value) -> torch.Tensor:
    """(batch, tokens, heads, size): plain causal attention."""
    return torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True).transpose(1, 2)


def test_row_attention_runs_each_packed_row_alone_and_anything_else_as_sdpa(monkeypatch):
    from roll_core.models.row_attention import row_attention

    q, k, v = qkv(9)
    expected = torch.cat([causal(q[:, :, :4], k[:, :, :4], v[:, :, :4]),
                          causal(q[:, :, 4:], k[:, :, 4:], v[:, :, 4:])], dim=1)
    calls = sdpa_calls(monkeypatch)
    out, _ = row_attention(Attention(), q, k, v, None, position_ids=torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4]]))
    assert calls == [4, 5]
    torch.testing.assert_close(out, expected)
    for positions in ([[0, 1, 2, 3, 4, 5, 6, 7, 8]],  # one row
                      [[5, 6, 0, 1, 2, 0, 1, 2, 3]],  # not packed by forward.packed_sequence: no split
                      [[5, 6, 7, 8, 9, 10, 11, 12, 13]]):
        calls.clear()
        out, _ = row_attention(Attention(), q, k, v, None, position_ids=torch.tensor(positions))
        assert calls == [9], positions
        torch.testing.assert_close(out, causal(q, k, v))
    q2, k2, v2 = qkv(5, batch=2)  # two unpadded rows: sdpa gives no mask, and nothing is split
    calls.clear()
    out, _ = row_attention(Attention(), q2, k2, v2, None, position_ids=torch.arange(5).repeat(2, 1))
    assert calls == [5]
    torch.testing.assert_close(out, causal(q2, k2, v2))
    with pytest.raises(RuntimeError, match="does not pass position_ids"):
        row_attention(Attention(), q, k, v, None)


def test_row_mask_leaves_out_only_the_mask_of_one_packed_row():
    from types import SimpleNamespace

    from roll_core.models.row_attention import row_mask

    full = SimpleNamespace(layer_types=["full_attention"] * 2)
    one = {"batch_size": 1, "q_length": 6, "kv_length": 6, "q_offset": 0, "kv_offset": 0, "attention_mask": None}
    assert row_mask(**one, config=full) is None
    assert row_mask(**one) is None  # a config without layer types
    masked = [
        {"batch_size": 2, "attention_mask": torch.tensor([[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]]).bool()},
        {"attention_mask": torch.tensor([[0, 1, 1, 1, 1, 1]]).bool()},
        {"q_length": 2, "q_offset": 4},  # a continuation from a cache
    ]
    for change in masked:
        mask = row_mask(**(one | change), config=full)
        assert mask is not None and not mask.all(), change
    windowed = SimpleNamespace(layer_types=["full_attention", "sliding_attention"], sliding_window=2)
    assert row_mask(**one, config=windowed, local_size=2) is not None


def test_row_mask_drops_the_block_diagonal_mask_transformers_makes_for_one_packed_row():
    """transformers asks for a packed row's mask with its rows told apart (the mask function it builds from the
    position ids, no causal skip): sdpa's mask is then block-diagonal; row_mask gives none for one row (row_attention
    splits it) and sdpa's mask for two, or for a model with windowed layers."""
    from types import SimpleNamespace

    from transformers.masking_utils import (
        and_masks,
        causal_mask_function,
        packed_sequence_mask_function,
        sdpa_mask,
    )

    from roll_core.models.row_attention import row_mask

    def packed(rows: int, tokens: int) -> dict:
        rows_of = (torch.arange(tokens) >= tokens // 3).long().repeat(rows, 1)  # two packed rows in each
        return {"batch_size": rows, "q_length": tokens, "kv_length": tokens, "q_offset": 0, "kv_offset": 0,
                "attention_mask": None, "allow_is_causal_skip": False,
                "mask_function": and_masks(causal_mask_function, packed_sequence_mask_function(rows_of))}

    full = SimpleNamespace(layer_types=["full_attention"])
    one = packed(1, 6)
    block = sdpa_mask(**one)
    assert block is not None and not block[0, 0, 3, :2].any()  # what the mask would be: rows kept apart
    assert row_mask(**one, config=full) is None and row_mask(**one) is None
    # lengths equal but not the same int object (a long packed row): still equal
    assert row_mask(**packed(1, 600) | {"q_length": int("600"), "kv_length": int("600")}, config=full) is None
    assert torch.equal(row_mask(**packed(2, 6), config=full), sdpa_mask(**packed(2, 6)))
    windowed = SimpleNamespace(layer_types=["full_attention", "sliding_attention"], sliding_window=2)
    assert torch.equal(row_mask(**one, config=windowed), block)

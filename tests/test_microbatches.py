"""Micro-batches cut by a token budget (roll_core/models/microbatches.py): the plan, and log-probs and values equal
to those of fixed-size micro-batches on the embedded model, over rows with long-tailed lengths."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

from roll_core.batch import Batch
from roll_core.config import ConfigError
from roll_core.models.forward import FULL_SOFTMAX, SHARE_FROM, batched_log_probs, batched_values
from roll_core.models.microbatches import (
    budget_plan,
    by_token_budget,
    cut,
    log_probs_in_micro_batches,
    over_budget,
    prompt_groups,
    row_lengths,
    token_budget_plan,
    tokens_run,
    trimmed,
    values_in_micro_batches,
)
from roll_pipeline.driver.names import load_run_config
from tests.conftest import EXAMPLES


def padded_size(rows: list[int], prompt: list[int], response: list[int]) -> int:
    return len(rows) * (max(prompt[i] for i in rows) + max(response[i] for i in rows))


@pytest.mark.parametrize("seed", range(20))
def test_every_row_runs_once_and_no_micro_batch_passes_the_budget_but_a_long_row_alone(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 40)
    prompt = [rng.randint(1, 60) for _ in range(n)]
    response = [int(rng.paretovariate(1.2) * 4) for _ in range(n)]  # long-tailed, some empty
    budget = rng.choice([16, 64, 200, 1000])
    plan = token_budget_plan(prompt, response, budget)
    assert sorted(i for rows in plan for i in rows) == list(range(n))
    for rows in plan:
        assert padded_size(rows, prompt, response) <= budget or len(rows) == 1
    alone = [rows for rows in plan if padded_size(rows, prompt, response) > budget]
    assert len(alone) == over_budget(prompt, response, budget)
    # greedy: the first row of the next micro-batch would have taken this one past the budget
    for rows, after in itertools.pairwise(plan):
        assert padded_size([*rows, after[0]], prompt, response) > budget
    # by prompt groups: every group's rows next to each other, the same properties
    groups = [rng.randrange(max(n // 4, 1)) for _ in range(n)]
    grouped = token_budget_plan(prompt, response, budget, groups=groups)
    order = [i for rows in grouped for i in rows]
    assert sorted(order) == list(range(n))
    runs = [g for g, _ in itertools.groupby(groups[i] for i in order)]
    assert len(runs) == len(set(groups)), "a group's rows are not together"
    assert all(padded_size(rows, prompt, response) <= budget or len(rows) == 1 for rows in grouped)
    # at least k micro-batches (as many as another rank runs): still within the budget, every row once
    k = rng.randint(1, n)
    more = token_budget_plan(prompt, response, budget, at_least=k, groups=groups)
    assert len(more) >= k and sorted(i for rows in more for i in rows) == list(range(n))
    assert all(padded_size(rows, prompt, response) <= budget or len(rows) == 1 for rows in more)


def test_rows_go_longest_first_and_a_short_tail_shares_a_micro_batch():
    #            0   1  2  3   4
    prompt = [10, 10, 10, 10, 10]
    response = [2, 90, 3, 40, 1]
    assert token_budget_plan(prompt, response, 100) == [[1], [3, 2], [0, 4]]
    assert token_budget_plan(prompt, response, 1000) == [[1, 3, 2, 0, 4]]
    assert token_budget_plan(prompt, response, 50) == [[1], [3], [2, 0, 4]]
    assert over_budget(prompt, response, 50) == 1
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        token_budget_plan(prompt, response, 0)
    with pytest.raises(ValueError, match="cannot cut 5 rows into at least 6 micro-batches"):
        token_budget_plan(prompt, response, 100, at_least=6)


def test_a_prompts_rows_stay_together_and_groups_go_by_their_longest_row():
    #            0   1   2   3   4   5
    prompt = [10, 10, 10, 10, 10, 10]
    response = [2, 90, 3, 40, 1, 5]
    groups = [0, 1, 0, 1, 2, 2]  # group 1's longest is 100, group 0's 13, group 2's 15
    assert token_budget_plan(prompt, response, 1000, groups=groups) == [[1, 3, 5, 4, 2, 0]]
    # the order is a prompt's rows together; the cuts are where the budget falls (row 5 fits beside row 3)
    assert token_budget_plan(prompt, response, 100, groups=groups) == [[1], [3, 5], [4, 2, 0]]
    # another rank runs 4: the micro-batch of most rows is halved, its longer rows first
    assert token_budget_plan(prompt, response, 100, at_least=4, groups=groups) == [[1], [3, 5], [4, 2], [0]]


def test_the_plan_that_runs_fewer_tokens_wins_a_prompt_run_once_against_the_padding():
    groups = [0, 0, 0, 0, 1, 1, 1, 1]
    response = [50, 10, 50, 10, 50, 10, 50, 10]
    long_prompts, short_prompts = [100] * 8, [10] * 8
    # by length: [[0, 2, 4, 6], [1, 3, 5, 7]], two prompts of two rows in each, each prompt run once per micro-batch
    # (2 x 100 + 4 x 50) + (2 x 100 + 4 x 10) = 640; together: [[0, 2, 1, 3], [4, 6, 5, 7]], one prompt in each,
    # 2 x (100 + 4 x 50) = 600
    by_length, together = [[0, 2, 4, 6], [1, 3, 5, 7]], [[0, 2, 1, 3], [4, 6, 5, 7]]
    assert token_budget_plan(long_prompts, response, 600) == by_length
    assert token_budget_plan(long_prompts, response, 600, groups=groups) == together
    assert tokens_run(by_length, long_prompts, response, groups) == 640
    assert tokens_run(together, long_prompts, response, groups) == 600
    assert budget_plan(long_prompts, response, 600, groups) == together
    # short prompts (rows of 60 tokens, 4 in a budget of 240): the same two plans, by length runs 280 tokens,
    # together 420
    assert token_budget_plan(short_prompts, response, 240, groups=groups) == together
    assert tokens_run(by_length, short_prompts, response, groups) == 280
    assert tokens_run(together, short_prompts, response, groups) == 420
    assert budget_plan(short_prompts, response, 240, groups) == by_length
    # a forward that does not share prompts (the critic's): by length, whatever the prompts
    assert budget_plan(long_prompts, response, 600, None) == by_length
    # fewer than SHARE_FROM rows a prompt: every row runs its prompt
    assert tokens_run([[0, 4, 1]], long_prompts, response, groups) == 3 * 100 + 3 * 50


def test_the_plans_edges():
    # a budget of one token: every row alone; as many micro-batches as rows may be asked for, not more, not 0
    assert token_budget_plan([1, 1], [0, 0], 1) == [[0], [1]]
    assert token_budget_plan([3, 1, 2], [0, 0, 0], 100, at_least=3) == [[0], [2], [1]]
    for rows, at_least in ((1, 2), (3, 0)):
        with pytest.raises(ValueError, match="cannot cut"):
            token_budget_plan([1] * rows, [1] * rows, 100, at_least=at_least)
    # rows without response tokens fill the budget exactly: no column counted that is not there
    assert token_budget_plan([2, 2], [0, 0], 4) == [[0, 1]]
    # the order is by prompt + response: 5 + 2 before 3 + 3
    assert token_budget_plan([3, 5], [3, 2], 100) == [[1, 0]]
    with pytest.raises(ValueError):
        token_budget_plan([1, 2], [1], 100)
    with pytest.raises(ValueError):
        over_budget([1, 2], [1], 100)
    # tokens_run: one prompt of two rows runs once; three prompts of two rows each run once each
    assert tokens_run([[0, 1]], [100, 100], [5, 5], [0, 0]) == 100 + 2 * 5
    assert tokens_run([[0, 1, 2, 3, 4, 5]], [100] * 6, [5] * 6, [0, 0, 1, 1, 2, 2]) == 3 * 100 + 6 * 5


def test_a_rounded_width_is_what_the_budget_counts_and_what_cut_pads_to():
    # two rows of 3 + 2 tokens: 10 tokens padded as they are, 16 rounded up to widths of 8
    assert token_budget_plan([3, 3], [2, 2], 10) == [[0, 1]]
    assert token_budget_plan([3, 3], [2, 2], 10, round_to=8) == [[0], [1]]
    assert token_budget_plan([3, 3], [2, 2], 16, round_to=8) == [[0, 1]]
    assert token_budget_plan([3, 3], [2, 2], 10, packed=True, round_to=8) == [[0, 1]]  # packed: nothing to round
    # tokens_run counts the rounding's response columns: 2 x (8 - 3), the prompt once
    assert SHARE_FROM <= 2 and tokens_run([[0, 1]], [3, 3], [2, 2], [0, 0], round_to=8) == 3 + 2 * 5
    assert budget_plan([3, 3], [2, 2], 10, [0, 0], round_to=8) == [[0], [1]]
    batch = Batch({
        "prompt_ids": torch.tensor([[0, 0, 7], [0, 6, 7]]),
        "prompt_mask": torch.tensor([[0, 0, 1], [0, 1, 1]]),
        "response_ids": torch.tensor([[5, 0, 0], [5, 5, 5]]),
        "response_mask": torch.tensor([[1.0, 0, 0], [1, 1, 1]]),
        "advantages": torch.tensor([[0.5, 0, 0], [1.0, 2, 3]]),
    })
    small, wide = cut(batch, [[0], [1]], round_to=4)
    assert (small["prompt_ids"].shape[1], small["response_ids"].shape[1]) == (1, 3)  # 1 + 1 up to 4
    assert (wide["prompt_ids"].shape[1], wide["response_ids"].shape[1]) == (2, 6)  # 2 + 3 up to 8, past the batch's 3
    assert wide["response_mask"][0].tolist() == [1, 1, 1, 0, 0, 0] and wide["advantages"][0, 3:].eq(0).all()
    assert row_lengths(wide) == ([2], [3])
    assert cut(batch, [[0, 1]], round_to=1)[0]["response_ids"].shape[1] == 3
    # no rounding unless asked: an odd width stays odd in the plan, the cut and a budgeted pass
    assert budget_plan([3, 3], [2, 2], 10, None) == [[0, 1]]
    assert cut(batch, [[1]])[0]["response_ids"].shape[1] == 3  # 2 + 3 columns
    widths: list[int] = []
    by_token_budget(batch, 100, lambda m: widths.append(m["prompt_ids"].shape[1] + m["response_ids"].shape[1])
                    or torch.zeros(len(m), m["response_ids"].shape[1]))
    assert widths == [5]


def test_cut_trims_each_micro_batch_and_keeps_a_column_where_its_rows_have_none():
    batch = Batch({
        "prompt_ids": torch.tensor([[0, 0, 7], [0, 6, 7], [0, 0, 0]]),
        "prompt_mask": torch.tensor([[0, 0, 1], [0, 1, 1], [0, 0, 0]]),
        "response_ids": torch.tensor([[5, 0, 0], [5, 5, 0], [0, 0, 0]]),
        "response_mask": torch.tensor([[1.0, 0, 0], [1, 1, 0], [0, 0, 0]]),
    })
    shapes = [(m["prompt_ids"].shape[1], m["response_ids"].shape[1]) for m in cut(batch, [[0], [1], [2]])]
    assert shapes == [(1, 1), (2, 2), (1, 1)]


def two_long_prompts() -> Batch:
    """Two prompts of 100 tokens (ids 7 and 8), four responses each, of 50 and 10 tokens in turn."""
    prompt_ids = torch.cat([torch.full((4, 100), 7), torch.full((4, 100), 8)])
    response_mask = torch.zeros(8, 50)
    for i, r in enumerate([50, 10] * 4):
        response_mask[i, :r] = 1
    return Batch({"prompt_ids": prompt_ids, "prompt_mask": torch.ones(8, 100, dtype=torch.long),
                  "response_ids": response_mask.long() * 5, "response_mask": response_mask})


def test_a_forward_that_shares_prompts_gets_a_prompts_rows_together_where_that_runs_fewer_tokens():
    """by_token_budget's micro-batches, as `run` sees them: the plan of test_the_plan_that_runs_fewer_tokens_...
    with long prompts (two_long_prompts)."""
    batch = two_long_prompts()
    seen: list[int] = []

    def run(micro: Batch) -> torch.Tensor:
        seen.append(len(set(micro["prompt_ids"][:, 0].tolist())))  # distinct prompts in the micro-batch
        return torch.zeros(len(micro), micro["response_ids"].shape[1])

    by_token_budget(batch, 600, run, shares_prompts=True)
    assert seen == [1, 1]  # each prompt's four rows together
    seen.clear()
    by_token_budget(batch, 600, run)  # by length: the long responses of both prompts, then the short ones
    assert seen == [2, 2]


def test_prompt_groups_number_equal_prompts_by_first_appearance():
    batch = Batch({
        "prompt_ids": torch.tensor([[0, 7, 8], [5, 7, 8], [0, 7, 8], [0, 0, 8], [5, 7, 8]]),
        "prompt_mask": torch.tensor([[0, 1, 1], [1, 1, 1], [0, 1, 1], [0, 0, 1], [1, 1, 1]]),
    })
    assert prompt_groups(batch) == [0, 1, 0, 2, 1]


def long_tailed_batch(rows: int = 12, seed: int = 0) -> Batch:
    """Left-padded prompts of 2-9 tokens and right-padded responses of 1-40 (most short, a few long); one row has
    tool tokens after its sampled ones (a multi-turn trajectory's), which the model reads."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    p_lens = [rng.randint(2, 9) for _ in range(rows)]
    r_lens = [min(40, 1 + int(rng.paretovariate(1.0) * 2)) for _ in range(rows)]
    r_lens[3] = 40
    width_p, width_r = max(p_lens), max(r_lens) + 3
    prompt_ids = torch.zeros(rows, width_p, dtype=torch.long)
    prompt_mask = torch.zeros(rows, width_p, dtype=torch.long)
    response_ids = torch.zeros(rows, width_r, dtype=torch.long)
    response_mask = torch.zeros(rows, width_r)
    for i, (p, r) in enumerate(zip(p_lens, r_lens, strict=True)):
        prompt_ids[i, width_p - p :] = torch.randint(5, 400, (p,), generator=g)
        prompt_mask[i, width_p - p :] = 1
        response_ids[i, :r] = torch.randint(5, 400, (r,), generator=g)
        response_mask[i, :r] = 1
    tool_mask = torch.zeros(rows, width_r)
    # row 5: 2 sampled tokens, 4 a tool wrote (read, not sampled), 3 sampled again
    response_ids[5], response_mask[5] = 0, 0
    response_ids[5, :9] = torch.randint(5, 400, (9,), generator=g)
    response_mask[5, :2] = response_mask[5, 6:9] = 1
    tool_mask[5, 2:6] = 1
    return Batch({"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "response_ids": response_ids,
                  "response_mask": response_mask, "tool_mask": tool_mask})


def test_row_lengths_count_the_tokens_read_and_trimming_keeps_them():
    batch = long_tailed_batch()
    prompt, response = row_lengths(batch)
    assert prompt == batch["prompt_mask"].sum(-1).tolist()
    assert response[5] == 9 and response[3] == 40
    assert max(response) == 40 < batch["response_ids"].shape[1]  # the batch's last 3 columns are padding only
    cut = trimmed(batch, max(prompt), max(response))
    assert cut["prompt_ids"].shape[1] == max(prompt) and cut["response_ids"].shape[1] == 40
    for key in ("prompt_mask", "response_mask", "tool_mask"):
        assert cut[key].sum() == batch[key].sum(), key


# Measured 2026-12-06 (AMD EPYC Zen 4, torch's 2 threads; /tmp/measure_mb.py of that session: seeds 0-4 of
# long_tailed_batch, budgets 60, 150 and 10,000 for log-probs, 60, 100 and 10,000 for values) on the embedded
# tiny-qwen2 in float32: the largest difference from fixed micro-batches of 4 rows was 3.8e-6 for the log-probs
# and 4.2e-7 for the values. The computations are deterministic on one machine; another processor's kernels round
# otherwise (the prompt's left padding changes the attention's shapes, and with them the rounding): 5x room.
ATOL = 2e-5


@pytest.mark.parametrize("budget", [60, 150, 10_000])
def test_log_probs_by_token_budget_equal_fixed_micro_batches(tiny_model, budget):
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model)).eval()
    batch = long_tailed_batch()
    fixed = batched_log_probs(model, batch, micro_batch_size=4, sampling=FULL_SOFTMAX)
    budgeted = log_probs_in_micro_batches(model, batch, micro_batch_size=4, sampling=FULL_SOFTMAX, max_tokens=budget)
    assert budgeted.shape == fixed.shape
    torch.testing.assert_close(budgeted, fixed, rtol=0, atol=ATOL)
    mask = batch["response_mask"] > 0
    assert (budgeted[~mask] == 0).all() and (budgeted[mask] < 0).all()


def test_values_by_token_budget_equal_fixed_micro_batches(tiny_model):
    torch.manual_seed(0)
    model = AutoModelForTokenClassification.from_pretrained(str(tiny_model), num_labels=1).eval()
    batch = long_tailed_batch(seed=1)
    fixed = batched_values(model, batch, micro_batch_size=4)
    budgeted = values_in_micro_batches(model, batch, micro_batch_size=4, max_tokens=100)
    torch.testing.assert_close(budgeted, fixed, rtol=0, atol=ATOL)
    assert (budgeted[batch["response_mask"] == 0] == 0).all()


def test_a_budget_under_one_row_is_refused_at_load_naming_the_key_and_the_row():
    overrides = ["critic.infer_max_tokens_per_microbatch=100", "data.prompt_length=128",
                 "actor_infer.generating_args.max_new_tokens=32"]
    with pytest.raises(ConfigError) as info:
        load_run_config(EXAMPLES / "ppo_gae.yaml", overrides)
    assert ("critic.infer_max_tokens_per_microbatch: 100 tokens cannot hold one row: data.prompt_length + "
            "actor_infer.generating_args.max_new_tokens = 128 + 32 = 160 tokens") in str(info.value)
    cfg = load_run_config(EXAMPLES / "ppo_gae.yaml", [*overrides[1:], "critic.infer_max_tokens_per_microbatch=160"])
    assert cfg.config.critic.infer_max_tokens_per_microbatch == 160
    with pytest.raises(ConfigError) as info:  # rounded up, the row no longer fits
        load_run_config(EXAMPLES / "ppo_gae.yaml", [*overrides[1:], "critic.training_args.max_tokens_per_microbatch=160",
                                                     "critic.training_args.sequence_length_round=128"])
    assert ("critic.training_args.max_tokens_per_microbatch: 160 tokens cannot hold one row: data.prompt_length + "
            "actor_infer.generating_args.max_new_tokens = 128 + 32 = 160 tokens, 256 rounded up") in str(info.value)


@pytest.mark.parametrize(("overrides", "message"), [
    (["critic.infer_sequence_length_round=8"],
     "critic.infer_sequence_length_round: rounds the micro-batches of a token budget: set "
     "infer_max_tokens_per_microbatch, or 1"),
    (["critic.training_args.sequence_length_round=0"],
     "critic.training_args.sequence_length_round: must be >= 1 (1: no rounding), got 0"),
    (["critic.training_args.max_tokens_per_microbatch=4096", "critic.training_args.sequence_length_round=8",
      "critic.use_sequence_packing=true"],
     "critic.training_args.sequence_length_round: use_sequence_packing runs no padding to round: set 1"),
    (["reference.infer_max_tokens_per_microbatch=4096", "reference.infer_sequence_length_round=8",
      "reference.use_sequence_packing=true"],
     "reference.infer_sequence_length_round: use_sequence_packing runs no padding to round: set 1"),
])
def test_a_rounding_without_padding_to_round_is_refused_naming_the_key(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_run_config(EXAMPLES / "ppo_gae.yaml", overrides)
    assert message in str(info.value)


@pytest.mark.parametrize(("packed", "round_to"), [(False, 1), (True, 1), (False, 32)])
def test_the_reference_cuts_its_log_prob_pass_by_the_configured_budget(packed, round_to):
    """The section's keys reach the worker's forward passes: each micro-batch the model sees is no wider than its
    own rows need (with use_sequence_packing: one row of the tokens read; with infer_sequence_length_round, that
    rounded up to a multiple) and holds at most the budget's tokens, and the log-probs are those of fixed
    micro-batches."""
    from workers.reference import ReferenceWorker

    budget = 160  # one row of the example's data.prompt_length + max_new_tokens, overridden to 128 + 32 below
    cfg = load_run_config(EXAMPLES / "grpo.yaml", [
        f"reference.use_sequence_packing={packed}", f"reference.infer_sequence_length_round={round_to}",
        f"reference.infer_max_tokens_per_microbatch={budget}", "data.prompt_length=128",
        "actor_infer.generating_args.max_new_tokens=32", f"reference.torch_threads={torch.get_num_threads()}",
    ]).config
    worker = ReferenceWorker(pipeline_config=cfg, name="reference", rank=0, world_size=1)
    model = worker.strategy.model
    seen: list[tuple[int, int]] = []
    hook = model.register_forward_pre_hook(lambda _, args, kwargs: seen.append(tuple(kwargs["input_ids"].shape)),
                                           with_kwargs=True)
    batch = long_tailed_batch(rows=24, seed=2)
    try:
        budgeted = worker.compute_log_probs(batch)
    finally:
        hook.remove()
    fixed = batched_log_probs(model, batch, cfg.reference.infer_batch_size, worker.sampling)
    torch.testing.assert_close(budgeted, fixed, rtol=0, atol=ATOL)
    full = batch["prompt_ids"].shape[1] + batch["response_ids"].shape[1]
    assert len(seen) > 1 and all(rows * width <= budget or rows == 1 for rows, width in seen), seen
    assert all(rows == 1 for rows, _ in seen) == packed, seen
    if packed:  # every token read once, none of the padding
        assert sum(width for _, width in seen) == sum(map(sum, row_lengths(batch))) > 2 * budget, seen
    else:
        assert min(width for _, width in seen) < full, seen
        assert all(width % round_to == 0 for _, width in seen), seen
        if round_to > 1:
            unrounded = log_probs_in_micro_batches(model, batch, 4, worker.sampling, max_tokens=budget)
            assert {width for _, width in seen} != {m["prompt_ids"].shape[1] + m["response_ids"].shape[1]
                                                   for m in cut(batch, budget_plan(*row_lengths(batch), budget, None))}
            torch.testing.assert_close(budgeted, unrounded, rtol=0, atol=ATOL)

"""The training loop actor_train and critic share (workers/training.py), with a stand-in strategy: the split into
epochs, mini-batches and micro-batches, each micro-batch on the strategy's device, and the metrics' averages."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from roll_core.batch import Batch
from roll_core.config import load_config
from tests.conftest import EXAMPLES
from workers.training import TrainedWorker


class StandInStrategy:
    """What the loop calls on a DeepSpeed strategy, recorded; its device is the meta device, so a micro-batch
    left on the CPU shows."""

    device = torch.device("meta")

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.module = torch.nn.Linear(1, 1)

    def backward(self, loss: torch.Tensor) -> None:
        self.calls.append("backward")

    def set_boundary(self, last: bool) -> None:
        self.calls.append("last" if last else "more")

    def step(self) -> None:
        self.calls.append("step")

    def grad_norm(self) -> float:
        self.calls.append("grad_norm")
        return 2.0

    def reload(self) -> None:
        """Nothing was offloaded (tests/test_offload.py covers the moves)."""


class CountingWorker(TrainedWorker):
    section_name = "actor_train"
    metric_prefix = "test"

    def __init__(self, cfg) -> None:
        super().__init__(pipeline_config=cfg, total_optimizer_steps=1, name="test", rank=0, world_size=1)
        self.strategy = StandInStrategy()
        self.seen: list[tuple[int, str, float, float]] = []
        self.shapes: list[tuple[tuple[int, ...], tuple[int, ...]]] = []

    def objective(self, micro, norm, token_norm):
        self.seen.append((len(micro), micro["response_mask"].device.type, norm, token_norm))
        self.shapes.append((tuple(micro["prompt_ids"].shape), tuple(micro["response_ids"].shape)))
        return torch.zeros((), device="meta"), {"size": float(len(micro))}


def rows(response_mask: torch.Tensor, in_loss: torch.Tensor, prompt_mask: torch.Tensor | None = None) -> Batch:
    """A batch of the keys the loop reads: prompts of two tokens unless `prompt_mask` says otherwise."""
    n = len(response_mask)
    prompt_mask = torch.ones(n, 2) if prompt_mask is None else prompt_mask
    return Batch({
        "prompt_ids": torch.ones(prompt_mask.shape, dtype=torch.long), "prompt_mask": prompt_mask,
        "response_ids": torch.ones(response_mask.shape, dtype=torch.long), "response_mask": response_mask,
        "in_loss": in_loss,
    })


def test_the_loop_runs_every_epoch_minibatch_and_micro_batch_on_the_strategys_device():
    overrides = [
        "ppo_epochs=2",
        "actor_train.training_args.per_device_train_batch_size=4",
        "actor_train.training_args.gradient_accumulation_steps=2",
        "loss_agg_mode=token-mean",
    ]
    worker = CountingWorker(load_config(EXAMPLES / "math_code.yaml", overrides).config)
    mask = torch.ones(16, 3)
    mask[:, 2] = 0  # two tokens per response
    metrics = worker.train_loop(rows(mask, torch.ones(16)))
    # 2 epochs x 2 mini-batches of 8 x 2 micro-batches of 4
    assert [n for n, *_ in worker.seen] == [4] * 8
    assert {device for _, device, *_ in worker.seen} == {"meta"}
    assert {(norm, token_norm) for *_, norm, token_norm in worker.seen} == {(16.0, 16.0)}  # tokens per mini-batch
    calls = worker.strategy.calls
    assert calls == ["more", "backward", "step", "last", "backward", "step", "grad_norm"] * 4
    # micro-batch metrics summed within a mini-batch, then averaged over the 4 mini-batches; fixed micro-batches
    # run each row padded to the batch's widths: 4 of 2 + 3 columns read, 1 padding
    assert metrics == pytest.approx({"test/size": 8.0, "test/grad_norm": 2.0, "test/optimizer_steps_skipped": 0.0,
                                     "test/minibatches_trained": 4.0, "test/pad_frac": 0.2})


def test_a_minibatch_with_no_sample_in_the_loss_takes_no_optimizer_step():
    """AdamW on zero gradients still moves the weights (momentum, weight decay): a mini-batch whose every sample
    is masked is skipped, and counted."""
    overrides = ["actor_train.training_args.per_device_train_batch_size=4",
                 "actor_train.training_args.gradient_accumulation_steps=2"]
    worker = CountingWorker(load_config(EXAMPLES / "math_code.yaml", overrides).config)
    in_loss = torch.ones(16)
    in_loss[8:] = 0  # the second mini-batch of 8 is all masked
    metrics = worker.train_loop(rows(torch.ones(16, 3), in_loss))
    assert worker.strategy.calls == ["more", "backward", "step", "last", "backward", "step", "grad_norm"]
    assert metrics == {"test/size": 4.0 * 2, "test/grad_norm": 2.0, "test/optimizer_steps_skipped": 1.0,
                       "test/minibatches_trained": 1.0, "test/pad_frac": 0.0}
    worker.strategy.calls.clear()
    everything_masked = worker.train_loop(rows(torch.ones(16, 3), torch.zeros(16)))
    assert worker.strategy.calls == []
    assert everything_masked == {"test/optimizer_steps_skipped": 2.0, "test/minibatches_trained": 0.0}


def long_tailed(n: int = 8) -> Batch:
    """Rows of prompt i % 3 + 1 tokens and response 2 + 3 * (i % 4) tokens (widths 3 and 11), each row its own
    prompt."""
    prompt_mask = torch.zeros(n, 3)
    response_mask = torch.zeros(n, 11)
    for i in range(n):
        prompt_mask[i, 3 - (i % 3 + 1):] = 1
        response_mask[i, : 2 + 3 * (i % 4)] = 1
    batch = rows(response_mask, torch.ones(n), prompt_mask)
    return batch.update({"prompt_ids": batch["prompt_ids"] * torch.arange(1, n + 1).unsqueeze(1)})  # 8 prompts


def test_a_token_budget_cuts_each_minibatch_by_its_rows_lengths_and_steps_once_after_the_last():
    overrides = [
        "actor_train.training_args.per_device_train_batch_size=4",
        "actor_train.training_args.gradient_accumulation_steps=2",
        "actor_train.training_args.max_tokens_per_microbatch=24",
        "loss_agg_mode=token-mean",
        "data.prompt_length=3",  # the load check: the budget holds one row of 3 + 11
        "actor_infer.generating_args.max_new_tokens=11",
    ]
    worker = CountingWorker(load_config(EXAMPLES / "math_code.yaml", overrides).config)
    metrics = worker.train_loop(long_tailed(8))
    # one mini-batch of 8 rows, (prompt, response) tokens (1, 2), (2, 5), (3, 8), (1, 11), (2, 2), (3, 5), (1, 8),
    # (2, 11): longest first, each micro-batch padded to its own widths within 24 tokens
    assert [n for n, *_ in worker.seen] == [1, 1, 2, 3, 1]  # rows [7], [3], [2, 6], [5, 1, 4], [0]
    assert worker.shapes == [((1, 2), (1, 11)), ((1, 1), (1, 11)), ((2, 3), (2, 8)), ((3, 3), (3, 5)),
                             ((1, 1), (1, 2))]
    assert {(norm, token_norm) for *_, norm, token_norm in worker.seen} == {(52.0, 52.0)}  # the whole mini-batch's
    assert worker.strategy.calls == ["more", "backward", "step"] * 4 + ["last", "backward", "step", "grad_norm"]
    read = 15 + 52  # prompt and response tokens
    assert metrics["test/pad_frac"] == pytest.approx(1 - read / (13 + 12 + 22 + 24 + 3))
    assert metrics["test/pad_frac"] < 1 - read / (8 * (3 + 11)), "less padding than fixed micro-batches"
    assert metrics["test/rows_over_token_budget"] == 0.0


def test_a_rank_cuts_as_many_micro_batches_as_the_rank_that_needs_most(monkeypatch):
    """ZeRO-2 and -3 reduce or gather at every backward: every rank must run as many (tests/test_zero.py runs two
    real ranks); here the other rank's count comes from a stand-in for the all-reduce."""
    import workers.training

    overrides = [
        "actor_train.training_args.per_device_train_batch_size=4",
        "actor_train.training_args.gradient_accumulation_steps=2",
        "actor_train.training_args.max_tokens_per_microbatch=200",  # all 8 rows in one micro-batch alone
        "loss_agg_mode=token-mean",
    ]
    worker = CountingWorker(load_config(EXAMPLES / "math_code.yaml", overrides).config)
    worker.train_loop(long_tailed(8))
    assert [n for n, *_ in worker.seen] == [8]
    monkeypatch.setattr(workers.training, "most_across_ranks", lambda n, *_: max(n, 3))
    worker.seen.clear()
    worker.train_loop(long_tailed(8))
    assert [n for n, *_ in worker.seen] == [2, 2, 4]  # the largest halved, the first of equals, until 3


def test_a_row_longer_than_the_budget_runs_alone_and_is_counted():
    overrides = [
        "actor_train.training_args.per_device_train_batch_size=4",
        "actor_train.training_args.gradient_accumulation_steps=2",
    ]
    cfg = load_config(EXAMPLES / "math_code.yaml", overrides).config
    # the load check refuses a budget under data.prompt_length + max_new_tokens; a multi-turn row can pass it
    cfg = replace(cfg, actor_train=replace(cfg.actor_train, training_args=replace(
        cfg.actor_train.training_args, max_tokens_per_microbatch=12)))
    worker = CountingWorker(cfg)
    metrics = worker.train_loop(long_tailed(8))
    assert [n for n, *_ in worker.seen] == [1, 1, 1, 1, 1, 1, 2]
    assert metrics["test/rows_over_token_budget"] == 1.0  # row 7: 13 tokens (row 3's 12 fit)


@pytest.mark.parametrize("shares", [False, True])
def test_only_a_forward_that_shares_prompts_gets_a_prompts_rows_together(shares):
    """Two prompts of 100 tokens with four responses each, budget 600: a prompt's rows together where the objective
    runs a shared prompt once (actor_train's causal LM), rows by length where it does not (the critic's value
    model, whose forward would run every row's prompt: together would pad more for nothing)."""
    from tests.test_microbatches import two_long_prompts

    class Sharing(CountingWorker):
        shares_prompts = shares

    overrides = [
        "actor_train.training_args.per_device_train_batch_size=4",
        "actor_train.training_args.gradient_accumulation_steps=2",
        "actor_train.training_args.max_tokens_per_microbatch=600",
        "data.prompt_length=100",
        "actor_infer.generating_args.max_new_tokens=50",
    ]
    worker = Sharing(load_config(EXAMPLES / "math_code.yaml", overrides).config)
    worker.strategy.device = torch.device("cpu")  # the prompts' values are read
    seen: list[int] = []
    worker.objective = lambda micro, norm, token_norm: (
        seen.append(len(set(micro["prompt_ids"][:, 0].tolist()))) or torch.zeros((), device="meta"), {}
    )
    worker.train_loop(two_long_prompts().update({"in_loss": torch.ones(8)}))
    assert seen == ([1, 1] if shares else [2, 2])  # distinct prompts in each micro-batch

"""The training loop actor_train and critic share (workers/training.py), with a stand-in strategy: the split into
epochs, mini-batches and micro-batches, each micro-batch on the strategy's device, and the metrics' averages."""

from __future__ import annotations

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

    def objective(self, micro, norm, token_norm):
        self.seen.append((len(micro), micro["response_mask"].device.type, norm, token_norm))
        return torch.zeros((), device="meta"), {"size": float(len(micro))}


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
    batch = Batch({"response_mask": mask, "in_loss": torch.ones(16)})
    metrics = worker.train_loop(batch)
    # 2 epochs x 2 mini-batches of 8 x 2 micro-batches of 4
    assert [n for n, *_ in worker.seen] == [4] * 8
    assert {device for _, device, *_ in worker.seen} == {"meta"}
    assert {(norm, token_norm) for *_, norm, token_norm in worker.seen} == {(16.0, 16.0)}  # tokens per mini-batch
    calls = worker.strategy.calls
    assert calls == (["backward", "step"] * 2 + ["grad_norm"]) * 4
    # micro-batch metrics summed within a mini-batch, then averaged over the 4 mini-batches
    assert metrics == {"test/size": 8.0, "test/grad_norm": 2.0, "test/optimizer_steps_skipped": 0.0,
                       "test/minibatches_trained": 4.0}


def test_a_minibatch_with_no_sample_in_the_loss_takes_no_optimizer_step():
    """AdamW on zero gradients still moves the weights (momentum, weight decay): a mini-batch whose every sample
    is masked is skipped, and counted."""
    overrides = ["actor_train.training_args.per_device_train_batch_size=4",
                 "actor_train.training_args.gradient_accumulation_steps=2"]
    worker = CountingWorker(load_config(EXAMPLES / "math_code.yaml", overrides).config)
    in_loss = torch.ones(16)
    in_loss[8:] = 0  # the second mini-batch of 8 is all masked
    metrics = worker.train_loop(Batch({"response_mask": torch.ones(16, 3), "in_loss": in_loss}))
    assert worker.strategy.calls == ["backward", "step"] * 2 + ["grad_norm"]
    assert metrics == {"test/size": 4.0 * 2, "test/grad_norm": 2.0, "test/optimizer_steps_skipped": 1.0,
                       "test/minibatches_trained": 1.0}
    worker.strategy.calls.clear()
    everything_masked = worker.train_loop(Batch({"response_mask": torch.ones(16, 3), "in_loss": torch.zeros(16)}))
    assert worker.strategy.calls == []
    assert everything_masked == {"test/optimizer_steps_skipped": 2.0, "test/minibatches_trained": 0.0}

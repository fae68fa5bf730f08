"""The training loop that actor_train and critic share: epochs over a step's batch, mini-batches (one optimizer
step each), micro-batches (one forward and backward each, moved to the strategy's device). Each worker supplies
only its objective: the loss of one micro-batch and the metrics it reports."""

from __future__ import annotations

import os
from collections import defaultdict

import torch
import torch.distributed as dist
from torch import nn

from roll_core.algorithms import batch_normalizer
from roll_core.batch import Batch, loss_mask
from roll_core.config import PipelineConfig
from roll_core.models.microbatches import budget_plan, cut, over_budget, padding, prompt_groups, row_lengths
from workers.base import Worker
from workers.strategies.deepspeed_train import DeepSpeedTrainStrategy


def global_normalizers(
    mask: torch.Tensor, modes: tuple[str, ...], world_size: int, device: torch.device | str = "cpu"
) -> list[float]:
    """For each mode, the mini-batch's token (or response) count over all ranks, divided by the world size; one
    all-reduce for all of them, of a float64 tensor on the training `device` (NCCL takes only CUDA tensors; both
    NCCL and gloo reduce float64).

    DeepSpeed averages gradients over ranks, so dividing each rank's sum by global_count / world_size makes the
    averaged gradient that of the global mean.
    """
    counts = torch.tensor([batch_normalizer(mask, mode) for mode in modes], dtype=torch.float64)
    if world_size > 1 and dist.is_initialized():
        counts = counts.to(device)
        dist.all_reduce(counts)
    return [c / world_size for c in counts.tolist()]


def most_across_ranks(n: int, world_size: int, device: torch.device | str = "cpu") -> int:
    """The largest `n` of any rank (one all-reduce; `n` itself on one rank)."""
    if world_size == 1 or not dist.is_initialized():
        return n
    most = torch.tensor([n], dtype=torch.int64, device=device)
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    return int(most.item())


def loss_scale(cfg: PipelineConfig) -> float:
    """seq-mean-token-sum-norm's constant: loss_scale_factor, else the generation budget."""
    return float(cfg.loss_scale_factor or cfg.actor_infer.generating_args.max_new_tokens)


class TrainedWorker(Worker):
    """A worker whose model DeepSpeed trains (actor_train, critic): its set-up, the training loop, checkpoints.

    A subclass names its config section (`section_name`) and its metrics' prefix (`metric_prefix`), and gives
    `model()` (the model to train) and `objective()` (one micro-batch's loss and metrics); `per_minibatch()` may
    add metrics read once per optimizer step."""

    section_name = ""
    metric_prefix = ""

    def __init__(self, *, pipeline_config: PipelineConfig, total_optimizer_steps: int, **kwargs) -> None:
        section = getattr(pipeline_config, self.section_name)
        super().__init__(seed=pipeline_config.seed, torch_threads=section.torch_threads, **kwargs)
        self.cfg = pipeline_config
        self.section = section
        self.total_optimizer_steps = total_optimizer_steps
        self.strategy: DeepSpeedTrainStrategy | None = None

    def model(self) -> nn.Module:
        raise NotImplementedError

    def objective(self, micro: Batch, norm: float, token_norm: float) -> tuple[torch.Tensor, dict[str, float]]:
        """The loss of one micro-batch (already divided by its mini-batch's normaliser `norm`) and its metrics
        (`token_norm`: the mini-batch's token count, for token means)."""
        raise NotImplementedError

    @property
    def shares_prompts(self) -> bool:
        """Whether the objective's forward runs a prompt once for the rows that share it (actor_train's causal LM;
        not the critic's value model)."""
        return False

    def per_minibatch(self) -> dict[str, float]:
        """Metrics read after each optimizer step."""
        return {"grad_norm": self.strategy.grad_norm()}

    def initialize(self) -> None:
        if "MASTER_ADDR" not in os.environ:
            self.set_distributed_env(*self.address())
        self.strategy = DeepSpeedTrainStrategy(
            self.section, self.model(), self.total_optimizer_steps, self.section_name
        )

    def offload_states(self) -> None:
        """Weights, gradients and optimizer states to CPU memory while actor_infer generates (section
        `offload_states`); every call that needs them reloads them first."""
        if self.section.offload_states:
            self.strategy.offload()

    def on_device(self) -> None:
        """The states back on the device, where offload_states left them in CPU memory."""
        self.strategy.reload()

    def train_loop(self, batch: Batch) -> dict[str, float]:
        """`ppo_epochs` passes over the batch in mini-batches of `training_args.minibatch_size`; the metrics
        averaged over the mini-batches that were trained, named `<metric_prefix>/<name>`, with the share of the
        forwards' tokens that were padding (`pad_frac`) and the rows longer than a token budget
        (`rows_over_token_budget`).

        A mini-batch none of whose samples is in the loss on any rank (every one masked) is skipped: no forward,
        no backward and no optimizer step, since AdamW would still move the weights on zero gradients (its
        momentum and weight decay) and the learning-rate schedule would advance. `optimizer_steps_skipped` counts
        them; a step whose every mini-batch was skipped reports only that count (and `minibatches_trained` 0), no
        loss."""
        ta = self.section.training_args
        self.on_device()
        self.strategy.module.train()
        sums: dict[str, float] = defaultdict(float)
        minibatches = skipped = over = read = run = 0
        for _ in range(self.cfg.ppo_epochs):
            for minibatch in batch.split(ta.minibatch_size):
                modes = (self.cfg.loss_agg_mode, "token-mean")  # the loss's count, the diagnostics' count
                norm, token_norm = global_normalizers(
                    loss_mask(minibatch), modes, self.world_size, self.strategy.device
                )
                if token_norm == 0:  # the same on every rank: the count is global
                    skipped += 1
                    continue
                micro_batches, longer = self.micro_batches(minibatch)
                tokens_read, tokens_run = padding(micro_batches, self.section.use_sequence_packing)
                over, read, run = over + longer, read + tokens_read, run + tokens_run
                for i, micro in enumerate(micro_batches):
                    # the optimizer steps after the mini-batch's last micro-batch, however many there are
                    self.strategy.set_boundary(i == len(micro_batches) - 1)
                    loss, parts = self.objective(micro.to(self.strategy.device), norm, token_norm)
                    self.strategy.backward(loss)
                    self.strategy.step()
                    for k, v in parts.items():
                        sums[k] += float(v)
                for k, v in self.per_minibatch().items():
                    sums[k] += v
                minibatches += 1
        metrics = {f"{self.metric_prefix}/{k}": v / minibatches for k, v in sums.items()}
        metrics[f"{self.metric_prefix}/optimizer_steps_skipped"] = float(skipped)
        metrics[f"{self.metric_prefix}/minibatches_trained"] = float(minibatches)
        if run:
            metrics[f"{self.metric_prefix}/pad_frac"] = 1.0 - read / run
        if ta.max_tokens_per_microbatch is not None:
            metrics[f"{self.metric_prefix}/rows_over_token_budget"] = float(over)
        return metrics

    def micro_batches(self, minibatch: Batch) -> tuple[list[Batch], int]:
        """The mini-batch's micro-batches, and how many rows ran alone for being longer than the token budget:
        per_device_train_batch_size rows at a time, or with training_args.max_tokens_per_microbatch those of
        `budget_plan` (a prompt's rows together where that runs fewer tokens), as many on this rank as on the rank
        that needs most. With use_sequence_packing the objective packs each micro-batch's rows into one, and the
        budget counts the tokens they read; training_args.sequence_length_round pads each padded micro-batch's width
        up to a multiple of it."""
        ta, packed = self.section.training_args, self.section.use_sequence_packing
        budget, round_to = ta.max_tokens_per_microbatch, ta.sequence_length_round
        if budget is None:
            return minibatch.split(ta.per_device_train_batch_size), 0
        lengths = row_lengths(minibatch)
        groups = prompt_groups(minibatch) if self.shares_prompts and not packed else None
        plan = budget_plan(*lengths, budget, groups, packed=packed, round_to=round_to)
        most = most_across_ranks(len(plan), self.world_size, self.strategy.device)
        if most > len(plan):
            plan = budget_plan(*lengths, budget, groups, at_least=most, packed=packed, round_to=round_to)
        return cut(minibatch, plan, lengths, round_to), over_budget(*lengths, budget)

    def save_checkpoint(self, path: str, client_state: dict) -> None:
        self.on_device()
        self.strategy.save(path, client_state)

    def load_checkpoint(self, path: str) -> dict:
        """Weights, optimizer and LR schedule states and RNG states, as `save_checkpoint` wrote them."""
        self.on_device()
        return self.strategy.load(path)

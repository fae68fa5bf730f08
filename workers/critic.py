"""critic: the value model used by GAE, trained with the clipped value loss."""

from __future__ import annotations

import os
from collections import defaultdict

import torch

from roll_pipeline.algorithms import aggregate_loss
from roll_pipeline.algorithms.value import clipped_value_loss
from roll_pipeline.batch import Batch
from roll_pipeline.config import PipelineConfig
from roll_pipeline.models.forward import response_values
from workers.actor_train import global_normalizers, loss_mask, loss_scale
from workers.base import Worker
from workers.strategies.deepspeed_train import DeepSpeedTrainStrategy
from workers.strategies.loading import load_value_model


class CriticWorker(Worker):
    def __init__(self, *, pipeline_config: PipelineConfig, total_optimizer_steps: int, **kwargs) -> None:
        section = pipeline_config.critic
        super().__init__(seed=pipeline_config.seed, torch_threads=section.torch_threads, **kwargs)
        self.cfg = pipeline_config
        self.section = section
        self.total_optimizer_steps = total_optimizer_steps
        self.strategy: DeepSpeedTrainStrategy | None = None

    def initialize(self) -> None:
        if "MASTER_ADDR" not in os.environ:
            self.set_distributed_env(*self.address())
        self.strategy = DeepSpeedTrainStrategy(self.section, load_value_model(self.section.model_args), self.total_optimizer_steps)

    @torch.no_grad()
    def compute_values(self, batch: Batch) -> torch.Tensor:
        batch.require("prompt_ids", "prompt_mask", "response_ids", "response_mask", where="critic.compute_values")
        self.strategy.module.eval()
        parts = [response_values(self.strategy.module, m) for m in batch.split(self.section.infer_batch_size)]
        return torch.cat(parts) * batch["response_mask"]

    def train_step(self, batch: Batch) -> dict[str, float]:
        batch.require("values", "returns", "response_mask", "sample_mask", where="critic.train_step")
        ta = self.section.training_args
        self.strategy.module.train()
        sums: dict[str, float] = defaultdict(float)
        n = 0
        for _ in range(self.cfg.ppo_epochs):
            for minibatch in batch.split(ta.per_device_train_batch_size * ta.gradient_accumulation_steps):
                modes = (self.cfg.loss_agg_mode, "token-mean")  # the loss's count, value_clipfrac's count
                norm, token_norm = global_normalizers(loss_mask(minibatch), modes, self.world_size)
                for micro in minibatch.split(ta.per_device_train_batch_size):
                    values = response_values(self.strategy.engine, micro)
                    per_token, clipped = clipped_value_loss(
                        values, micro["values"], micro["returns"], self.section.value_clip
                    )
                    mask, scale = loss_mask(micro), loss_scale(self.cfg)
                    loss = aggregate_loss(per_token, mask, self.cfg.loss_agg_mode, norm, scale)
                    self.strategy.backward(loss)
                    self.strategy.step()
                    sums["value_loss"] += float(loss.detach())
                    # a fraction of tokens in every mode (see policy_objective)
                    sums["value_clipfrac"] += float(aggregate_loss(clipped, mask, "token-mean", token_norm))
                sums["grad_norm"] += self.strategy.grad_norm()
                n += 1
        return {f"critic/{k}": v / n for k, v in sums.items()}

    def save_checkpoint(self, path: str, client_state: dict) -> None:
        self.strategy.save(path, client_state)

    def load_checkpoint(self, path: str) -> dict:
        return self.strategy.load(path)

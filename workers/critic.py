"""critic: the value model used by GAE, trained with the clipped value loss."""

from __future__ import annotations

import torch
from torch import nn

from roll_core.algorithms import aggregate_loss
from roll_core.algorithms.value import clipped_value_loss
from roll_core.batch import Batch, loss_mask
from roll_core.config import PipelineConfig
from roll_core.models.forward import response_values
from roll_core.models.microbatches import values_in_micro_batches
from workers.strategies.loading import load_value_model
from workers.strategies.lora import TOKEN_CLS, with_lora
from workers.training import TrainedWorker, loss_scale


def value_objective(
    values: torch.Tensor, micro: Batch, cfg: PipelineConfig, value_clip: float | None, norm: float, token_norm: float
) -> tuple[torch.Tensor, dict[str, float]]:
    """One micro-batch's critic loss (already divided by the mini-batch normaliser `norm`): the clipped value loss
    of `values` (B, R) against the batch's returns, around the values that computed the advantages, aggregated
    with loss_agg_mode. `value_clipfrac` is a fraction of tokens in every mode, divided by `token_norm` (the
    mini-batch's token count; see actor_train.policy_objective)."""
    per_token, clipped = clipped_value_loss(values, micro["values"], micro["returns"], value_clip)
    mask = loss_mask(micro)
    loss = aggregate_loss(per_token, mask, cfg.loss_agg_mode, norm, loss_scale(cfg))
    clipfrac = aggregate_loss(clipped, mask, "token-mean", token_norm)
    return loss, {"value_loss": float(loss.detach()), "value_clipfrac": float(clipfrac)}


class CriticWorker(TrainedWorker):
    section_name = "critic"
    metric_prefix = "critic"

    def model(self) -> nn.Module:
        model = load_value_model(self.section.model_args, self.section.use_sequence_packing)
        # With LoRA the fresh value head trains whole, beside the adapters (peft keeps a token classifier's head
        # trainable).
        return model if self.section.lora is None else with_lora(model, self.section.lora, TOKEN_CLS)

    def compute_values(self, batch: Batch) -> torch.Tensor:
        batch.require("prompt_ids", "prompt_mask", "response_ids", "response_mask", where="critic.compute_values")
        self.on_device()
        self.strategy.module.eval()
        s = self.section
        return values_in_micro_batches(
            self.strategy.module, batch, s.infer_batch_size, s.infer_max_tokens_per_microbatch, s.use_sequence_packing,
            s.infer_sequence_length_round,
        )

    def train_step(self, batch: Batch) -> dict[str, float]:
        batch.require("values", "returns", "response_mask", "in_loss", where="critic.train_step")
        return self.train_loop(batch)

    def objective(self, micro: Batch, norm: float, token_norm: float) -> tuple[torch.Tensor, dict[str, float]]:
        values = response_values(self.strategy.engine, micro, self.section.use_sequence_packing)
        return value_objective(values, micro, self.cfg, self.section.value_clip, norm, token_norm)

"""actor_train: the policy being trained (PPO-style updates on DeepSpeed)."""

from __future__ import annotations

import os

import torch
from torch import nn

from roll_core.algorithms import KL_ESTIMATORS, POLICY_LOSSES, aggregate_loss
from roll_core.batch import Batch, loss_mask
from roll_core.config import PipelineConfig
from roll_core.models.forward import can_share_prompts, response_log_probs
from roll_core.models.microbatches import log_probs_in_micro_batches
from roll_core.models.sampling import SamplingDistribution
from workers.base import release_free_memory
from workers.inference.weight_wire import PackedWeights, pack
from workers.strategies.loading import load_causal_lm
from workers.strategies.lora import adapter_state, save_lora, with_lora
from workers.training import TrainedWorker, loss_scale

# A train step's freed activations are handed back to the OS at most this often: each release makes the next step
# fault those pages in again (see release_free_memory).
RELEASE_INTERVAL_S = 10.0

NEEDS = ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "advantages", "in_loss")


def policy_objective(
    log_probs: torch.Tensor,
    entropy: torch.Tensor,
    micro: Batch,
    cfg: PipelineConfig,
    norm: float,
    token_norm: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The scalar loss of one micro-batch (already divided by the mini-batch normaliser `norm`) and its parts: the
    policy loss, minus the entropy bonus, plus the KL loss, each aggregated with loss_agg_mode.

    The diagnostics (`entropy`, `clipfrac`, `approx_kl`, `dual_clipfrac`) are token means in every mode, divided
    by `token_norm`, the mini-batch's token count (None: this micro-batch's), so that a fraction stays a fraction:
    aggregated like the loss, under seq-mean-token-sum a "clipfrac" would be clipped tokens per response."""
    mask = loss_mask(micro)
    clip_low, clip_high = cfg.clip_range

    def aggregate(per_token: torch.Tensor) -> torch.Tensor:
        return aggregate_loss(per_token, mask, cfg.loss_agg_mode, norm, loss_scale(cfg))

    def token_mean(per_token: torch.Tensor) -> torch.Tensor:
        return aggregate_loss(per_token.detach(), mask, "token-mean", token_norm)

    pg, diag = POLICY_LOSSES.get(cfg.policy_loss)(
        log_probs,
        micro["old_log_probs"],
        micro["advantages"],
        mask,
        clip_low=clip_low,
        clip_high=clip_high,
        dual_clip_c=cfg.dual_clip_c,
    )
    if "infer_is_weights" in micro:  # off-policy correction for the policy that sampled the batch
        pg = pg * micro["infer_is_weights"]
    pg_loss = aggregate(pg)
    loss = pg_loss
    parts = {"pg_loss": pg_loss.detach(), "entropy": token_mean(entropy)}
    parts |= {k.replace("clipped", "clipfrac"): token_mean(v) for k, v in diag.items()}
    if cfg.use_kl_loss:
        kl = KL_ESTIMATORS.get(cfg.kl_estimator)(log_probs, micro["ref_log_probs"])
        kl_loss = aggregate(kl)
        loss = loss + cfg.kl_loss_coef * kl_loss
        parts["kl_loss"] = kl_loss.detach()
    if cfg.entropy_loss_coef:
        loss = loss - cfg.entropy_loss_coef * aggregate(entropy)
    return loss, parts


class ActorTrainWorker(TrainedWorker):
    section_name = "actor_train"
    metric_prefix = "actor"

    sender = None
    """The weight-transfer engines to actor_infer (`send_weights`), once opened."""

    def model(self) -> nn.Module:
        model = load_causal_lm(self.section.model_args, self.section.use_sequence_packing)
        return model if self.section.lora is None else with_lora(model, self.section.lora)

    @property
    def sampling(self) -> SamplingDistribution:
        """The distribution actor_infer samples from: the log-probs of the ratio are taken under it."""
        return SamplingDistribution.of(self.cfg.actor_infer.generating_args)

    def compute_log_probs(self, batch: Batch) -> torch.Tensor:
        batch.require("prompt_ids", "prompt_mask", "response_ids", "response_mask", where="actor_train.compute_log_probs")
        self.on_device()
        self.strategy.module.eval()
        return self.log_probs_without_gradient(self.strategy.module, batch)

    def log_probs_without_gradient(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """The model's log-probs of the batch's responses, cut into micro-batches as this section says (rows at a
        time or a token budget, padded or packed)."""
        s = self.section
        return log_probs_in_micro_batches(
            model, batch, s.infer_batch_size, self.sampling, s.infer_max_tokens_per_microbatch, s.use_sequence_packing,
            s.infer_sequence_length_round,
        )

    def compute_ref_log_probs(self, batch: Batch) -> torch.Tensor:
        """The reference's log-probs where the policy trains LoRA adapters: the base model is the reference, so they
        are this model's with its adapter disabled (no reference cluster, no second copy of the weights)."""
        batch.require(
            "prompt_ids", "prompt_mask", "response_ids", "response_mask", where="actor_train.compute_ref_log_probs"
        )
        if self.section.lora is None:
            raise RuntimeError("actor_train trains full weights: the reference has a cluster of its own")
        self.on_device()
        model = self.strategy.module
        model.eval()
        with model.disable_adapter():
            return self.log_probs_without_gradient(model, batch)

    def train_step(self, batch: Batch) -> dict[str, float]:
        """ppo_epochs passes over this rank's shard in mini-batches; returns averaged metrics."""
        own_old = self.cfg.update_gives_old_log_probs
        needs = (*NEEDS, *(() if own_old else ("old_log_probs",)), *(("ref_log_probs",) if self.cfg.use_kl_loss else ()))
        batch.require(*needs, where="actor_train.train_step")
        minibatch_size = self.section.training_args.minibatch_size
        if own_old and "old_log_probs" not in batch and len(batch) > minibatch_size:
            batch = self.with_old_log_probs_after_the_first_minibatch(batch, minibatch_size)
        metrics = self.train_loop(batch)
        release_free_memory(RELEASE_INTERVAL_S)  # the step's activations and gradients are freed by now
        return metrics

    def with_old_log_probs_after_the_first_minibatch(self, batch: Batch, minibatch_size: int) -> Batch:
        """One pass over the batch (ppo_epochs 1) in several mini-batches, nothing before the update reading the
        old log-probs (cfg.update_gives_old_log_probs): before the first optimizer step, the policy's log-probs of
        the samples after the first mini-batch, without gradient, as the driver's separate pass would give them;
        the first mini-batch's rows are marked (`own_old_log_probs`) to take their own forward's, detached, when
        the update runs it. That saves the first mini-batch's forward and a round trip of the batch."""
        rest = batch.select(torch.arange(minibatch_size, len(batch)))
        rest_old = self.compute_log_probs(rest)
        first = torch.zeros(minibatch_size, *rest_old.shape[1:], dtype=rest_old.dtype)
        own = torch.zeros(len(batch))
        own[:minibatch_size] = 1.0
        return batch.update({"old_log_probs": torch.cat([first, rest_old]), "own_old_log_probs": own})

    def objective(self, micro: Batch, norm: float, token_norm: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        log_probs, entropy = response_log_probs(
            self.strategy.engine,
            micro,
            self.sampling,
            with_entropy=True,
            entropy_grad=self.cfg.entropy_loss_coef != 0,  # otherwise the entropy is only logged
            packed=self.section.use_sequence_packing,
        )
        if "old_log_probs" not in micro:  # one optimizer step: the policy now is the old one
            micro = micro.update({"old_log_probs": log_probs.detach()})
        elif "own_old_log_probs" in micro:  # the first mini-batch's rows: the policy now is the old one
            own = micro["own_old_log_probs"].bool().unsqueeze(-1)
            micro = micro.update({"old_log_probs": torch.where(own, log_probs.detach(), micro["old_log_probs"])})
        return policy_objective(log_probs, entropy, micro, self.cfg, norm, token_norm)

    @property
    def shares_prompts(self) -> bool:
        return can_share_prompts(self.strategy.engine)

    def per_minibatch(self) -> dict[str, float]:
        return super().per_minibatch() | {"lr": self.strategy.lr()}

    def get_weights(self, packed: bool = False) -> dict[str, torch.Tensor] | PackedWeights:
        """The full weights from rank 0 (with LoRA: the adapters only, since the base never changes). Under ZeRO-3
        every rank must take part in gathering them, and the other ranks return nothing, so that waiting on them
        moves no copy of the weights. `packed`: as the rpc weight sync sends them (workers/inference/weight_wire.py,
        which actor_infer's `update_weights` unpacks)."""
        self.on_device()
        if self.section.lora is not None:
            weights = adapter_state(self.strategy.module) if self.rank == 0 else {}
        else:
            weights = self.strategy.state_dict_for_inference()  # every rank: a collective under ZeRO-3
        if self.rank != 0:
            return {}
        return pack(weights) if packed else weights

    def send_weights(self, infer_workers: list, version: int) -> None:
        """The weights to every actor_infer worker by vLLM's weight-transfer API (actor_infer's strategy_config
        weight_transport nccl, ipc or gloo; workers/strategies/vllm_transfer.py), which then hold them as
        `version`. Every rank takes part (ZeRO-3 gathers); rank 0 sends. The transfer groups open at the first
        call."""
        from workers.base import node_ip
        from workers.strategies.vllm_transfer import TrainerSource, WeightSender

        self.on_device()
        infer = self.cfg.actor_infer
        if self.sender is None:
            tie = bool(getattr(self.strategy.module.config, "tie_word_embeddings", False))
            source = TrainerSource(self.strategy, tie)
            self.sender = WeightSender(infer.weight_transport, self.rank, source, infer.weight_bucket_bytes, node_ip())
        self.sender.send(infer_workers, int(infer.strategy_args.strategy_config.get("tensor_parallel_size", 1)), version)

    def save_checkpoint(self, path: str, client_state: dict) -> None:
        """DeepSpeed's checkpoint and RNG states (every rank), and the weights as a Hugging Face folder (rank 0; a
        model `from_pretrained` loads, e.g. for `roll serve`)."""
        self.on_device()
        self.strategy.save(path, client_state)
        if self.section.lora is not None:  # ZeRO 0-2: rank 0 holds every weight
            if self.rank == 0:
                save_lora(self.strategy.module, path)
            return
        # Under ZeRO-3 each rank holds a shard: every rank takes part in gathering the whole weights.
        weights = self.strategy.state_dict_for_inference() if self.strategy.zero_stage == 3 else None
        if self.rank == 0:
            self.strategy.module.save_pretrained(os.path.join(path, "hf_model"), state_dict=weights)
        del weights
        release_free_memory()  # the save's buffers

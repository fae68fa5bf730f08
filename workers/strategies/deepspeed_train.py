"""Training with DeepSpeed: the engine, optimizer and LR schedule of actor_train and critic."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from roll_core.config import ActorTrainConfig
from workers.devices import worker_device
from workers.strategies.loading import DTYPES

logger = logging.getLogger(__name__)

_SCHEDULERS = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}


def deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def deepspeed_config(config: ActorTrainConfig) -> dict[str, Any]:
    ta = config.training_args
    ds: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": ta.per_device_train_batch_size,
        "gradient_accumulation_steps": ta.gradient_accumulation_steps,
        "gradient_clipping": ta.max_grad_norm,
        "zero_optimization": {"stage": 0},
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    if config.model_args.dtype == "bfloat16":
        ds["bf16"] = {"enabled": True}
    elif config.model_args.dtype == "float16":
        ds["fp16"] = {"enabled": True}
    return deep_merge(ds, config.strategy_args.strategy_config)


class DeepSpeedTrainStrategy:
    """Wraps a model in a DeepSpeed engine; the worker drives forward/backward/step through `engine`."""

    def __init__(
        self, config: ActorTrainConfig, model: torch.nn.Module, total_optimizer_steps: int, name: str = "actor_train"
    ) -> None:
        import deepspeed  # heavy; imported only where training happens

        ta = config.training_args
        if config.model_args.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        model.to(DTYPES[config.model_args.dtype])
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(
            params, lr=ta.learning_rate, betas=(ta.adam_beta1, ta.adam_beta2), eps=ta.adam_epsilon,
            weight_decay=ta.weight_decay,
        )
        from transformers import get_scheduler

        scheduler = get_scheduler(
            _SCHEDULERS[ta.lr_scheduler_type],
            optimizer,
            num_warmup_steps=ta.warmup_steps,
            num_training_steps=max(total_optimizer_steps, 1),
        )
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        deepspeed.init_distributed(dist_backend=backend)
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, config=deepspeed_config(config)
        )
        self.device = torch.device(self.engine.device)
        self.offloaded = False
        expected = worker_device(config, name)
        if self.device != expected:
            raise RuntimeError(
                f"{name}: DeepSpeed placed the model on {self.device}, but the worker's placement gives {expected} "
                "(workers/devices.py); check DS_ACCELERATOR and CUDA_VISIBLE_DEVICES on this node"
            )

    def offload(self) -> None:
        """Weights, gradients and optimizer states to CPU memory (DeepSpeed's offload_states; the config check
        asks for ZeRO stage 1-3); nothing to move on the CPU."""
        if self.device.type != "cpu" and not self.offloaded:
            self.engine.offload_states()
            torch.cuda.empty_cache()
            self.offloaded = True

    def reload(self) -> None:
        if self.offloaded:
            self.engine.reload_states()
            self.offloaded = False

    @property
    def module(self) -> torch.nn.Module:
        return self.engine.module

    def backward(self, loss: torch.Tensor) -> None:
        # losses arrive already normalised over the whole mini-batch, so no extra division by accumulation steps
        self.engine.backward(loss, scale_wrt_gas=False)

    def set_boundary(self, last: bool) -> None:
        """Whether the next backward and step end the mini-batch (reduce the gradients and step the optimizer):
        the loop says so instead of DeepSpeed counting gradient_accumulation_steps micro-batches, since a token
        budget cuts a mini-batch into as many as its rows' lengths need."""
        self.engine.set_gradient_accumulation_boundary(last)

    def step(self) -> None:
        self.engine.step()

    def grad_norm(self) -> float:
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    @property
    def zero_stage(self) -> int:
        return int(self.engine.zero_optimization_stage())

    def state_dict_for_inference(self) -> dict[str, torch.Tensor]:
        """Full weights on CPU, for actor_infer. ZeRO stages 0-2 keep whole parameters on every rank; under
        stage 3 each rank holds a shard, so every rank must call this together (`inference_items`)."""
        # No copy of CPU parameters: Ray serialises the result as this call returns, before any update.
        return {name: tensor.to("cpu") for name, tensor in self.inference_items()}

    def inference_items(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, full tensor) of every parameter and persistent buffer, where they live (a GPU tensor stays on
        the GPU), one module at a time. Under ZeRO-3 each module's parameters are gathered (every rank must
        iterate together: the gather is a collective) and copied out of the gathered storage, which the next
        module's gather replaces; under stages 0-2 the parameters themselves, detached."""
        stage3 = self.zero_stage == 3
        if stage3:
            import deepspeed
        # Per-module, non-recursive listing keeps tied weights under every name they have (lm_head and embedding).
        for prefix, module in self.module.named_modules():
            own = list(module.named_parameters(recurse=False))
            if stage3:
                with deepspeed.zero.GatheredParameters([p for _, p in own], modifier_rank=None):
                    copies = [(name, param.detach().clone()) for name, param in own]
                yield from ((_dotted(prefix, name), tensor) for name, tensor in copies)
            else:
                yield from ((_dotted(prefix, name), param.detach()) for name, param in own)
            for name, buf in module.named_buffers(recurse=False):
                if name not in module._non_persistent_buffers_set:
                    yield _dotted(prefix, name), buf.detach().clone() if stage3 else buf.detach()

    def inference_metadata(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """(name, dtype, full shape) of what `inference_items` yields, in its order, without gathering anything."""
        out = []
        for prefix, module in self.module.named_modules():
            for name, param in module.named_parameters(recurse=False):
                out.append((_dotted(prefix, name), param.dtype, tuple(getattr(param, "ds_shape", param.shape))))
            for name, buf in module.named_buffers(recurse=False):
                if name not in module._non_persistent_buffers_set:
                    out.append((_dotted(prefix, name), buf.dtype, tuple(buf.shape)))
        return out

    def save(self, path: str, client_state: dict[str, Any]) -> None:
        """DeepSpeed's checkpoint (weights, optimizer, LR schedule; every rank writes its shards) plus this rank's
        RNG states, which DeepSpeed does not keep."""
        from workers.base import rng_states

        self.engine.save_checkpoint(path, tag="engine", client_state=client_state)
        torch.save(rng_states(), os.path.join(path, f"rng_rank{dist.get_rank() if dist.is_initialized() else 0}.pt"))

    def load(self, path: str) -> dict[str, Any]:
        """Restore what `save` wrote, in place; returns the client state saved with it."""
        from workers.base import load_rng_states

        loaded, client_state = self.engine.load_checkpoint(
            path, tag="engine", load_optimizer_states=True, load_lr_scheduler_states=True
        )
        if loaded is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint (tag 'engine') under {path}")
        rank = dist.get_rank() if dist.is_initialized() else 0
        # RNG states hold NumPy arrays and Python tuples: not loadable with weights_only.
        load_rng_states(torch.load(os.path.join(path, f"rng_rank{rank}.pt"), weights_only=False))
        return client_state or {}


def _dotted(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name

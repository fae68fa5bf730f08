"""Weight sync into a running vLLM engine through vLLM's supported interface.

vLLM runs its model in worker processes of its own and talks to them with a msgpack RPC that refuses functions
(a closure sent through `LLM.apply_model` dies with "Object of type function is not serializable"). So the loading
code lives in the workers themselves: `WeightSyncExtension` is given to vLLM as `worker_extension_cls`, which
mixes it into every worker class, and the engine calls its method by name through `LLM.collective_rpc`.

What travels through that RPC is one bucket of bounded size at a time, as safetensors bytes (`pack_bucket`):
msgpack carries bytes as they are, and safetensors names every tensor with its dtype and shape, so nothing is
pickled and neither side holds a second copy of the whole model. (vLLM's msgpack decoder rebuilds a tensor only
where a type hint says one is expected, which a collective_rpc argument has not: a bare tensor arrives as a list.)

This module is imported inside vLLM's worker processes: it must not import anything of the pipeline's that vLLM
workers cannot load (Ray actors, the config). Importing it also registers this project's backends of vLLM's
weight-transfer API (`register_transfer_backends`), which is how vLLM's workers find them.
"""

from __future__ import annotations

import torch


def register_transfer_backends() -> None:
    """Name this project's weight-transfer backends in vLLM's factories: gloo (gloo_transfer.py, both sides) and
    the workers' side of ipc (ipc_transfer.py; actor_train uses vLLM's IPC trainer engine). Idempotent; nothing to
    do where vLLM is absent."""
    try:
        from vllm.distributed.weight_transfer.factory import (
            WeightTransferEngineFactory,
            WeightTransferTrainerFactory,
        )
    except ImportError:  # no vLLM here: its strategy says so when it is built
        return
    from workers.strategies import gloo_transfer, ipc_transfer

    for factory, name, cls in (
        (WeightTransferEngineFactory, gloo_transfer.BACKEND, gloo_transfer.GlooWeightTransferEngine),
        (WeightTransferTrainerFactory, gloo_transfer.BACKEND, gloo_transfer.GlooTrainerWeightTransferEngine),
        (WeightTransferEngineFactory, ipc_transfer.BACKEND, ipc_transfer.IPCHandleEngine),
    ):
        if name not in factory._registry:
            factory.register_engine(name, cls)

#: Prefixes that wrappers add to parameter names (DeepSpeed/DDP `module.`, torch.compile `_orig_mod.`).
_WRAPPER_PREFIXES = ("module.", "_orig_mod.")


def vllm_weight_name(name: str, tie_word_embeddings: bool) -> str | None:
    """The name vLLM's `model.load_weights` takes for one of actor_train's tensors, or None for one it must not
    get. vLLM's model classes take checkpoint (HF) names and fuse q/k/v and gate/up projections themselves, so
    names are kept but for wrapper prefixes. A tied lm_head is skipped: vLLM shares it with the embedding and
    would reject it. Rotary caches (`rotary_emb.inv_freq`) are buffers vLLM computes itself and are skipped too."""
    for prefix in _WRAPPER_PREFIXES:
        while name.startswith(prefix):
            name = name[len(prefix) :]
    if (tie_word_embeddings and name == "lm_head.weight") or name.endswith("rotary_emb.inv_freq"):
        return None
    return name


def pack_bucket(bucket: list[tuple[str, torch.Tensor]]) -> bytes:
    """One bucket as safetensors bytes. safetensors refuses two names on one storage (tied weights), so a tensor
    whose storage an earlier one of the bucket uses is copied out."""
    from safetensors.torch import save

    tensors: dict[str, torch.Tensor] = {}
    storages: set[int] = set()
    for name, tensor in bucket:
        tensor = tensor.detach().to("cpu").contiguous()
        storage = tensor.untyped_storage().data_ptr()
        if storage in storages:
            tensor = tensor.clone()
        storages.add(tensor.untyped_storage().data_ptr())
        tensors[name] = tensor
    return save(tensors)


def unpack_bucket(data: bytes) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of `pack_bucket`'s bytes."""
    from safetensors.torch import load

    return list(load(bytes(data)).items())


def tied_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The layers with a post-load step whose weight is one parameter with an earlier layer's (a tied lm_head,
    whose weight is the embedding's). vLLM's layerwise reload runs that step for the layer the weight was loaded
    through only (the embedding, which comes first); the CPU build's lm_head packs its weight for its kernel in
    that step, so without running it again the head would go on computing with the weights of the first load.
    The first layer of each tied group is left out: its step has run, and a second run could redo a
    quantization."""
    owners: dict[int, list[torch.nn.Module]] = {}
    for layer in model.modules():
        weight = layer._parameters.get("weight")
        if weight is not None and weight.numel() and getattr(layer, "quant_method", None) is not None:
            owners.setdefault(id(weight), []).append(layer)
    return [layer for layers in owners.values() for layer in layers[1:]]


def reprocess_tied_layers(model: torch.nn.Module) -> None:
    """Run the post-load step of the tied layers (`tied_layers`) after a layerwise reload."""
    for layer in tied_layers(model):
        layer.quant_method.process_weights_after_loading(layer)


class WeightSyncExtension:
    """Methods added to vLLM's worker (`LLM(worker_extension_cls=...)`), called with `collective_rpc(name)`.

    One sync is `roll_begin_weight_update`, `roll_load_weights` per bucket, then `roll_finish_weight_update`:
    vLLM's layerwise reload (what its own IPC and NCCL weight-transfer engines use), which takes checkpoint-format
    tensors and runs each layer's post-load processing again once all its tensors arrived. A plain
    `model.load_weights` is not enough: vLLM's CPU build repacks linear weights for its kernels after loading
    and leaves the checkpoint-shaped parameters empty. The method names carry a `roll_` prefix: vLLM refuses an
    extension whose names clash with the worker's."""

    def roll_begin_weight_update(self) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        with set_current_vllm_config(self.vllm_config):
            initialize_layerwise_reload(self.get_model())

    def roll_load_weights(self, packed: bytes) -> int:
        """Load one bucket (`pack_bucket`'s bytes) of Hugging Face-named tensors into this worker's model (vLLM's
        own `load_weights` fuses q/k/v and gate/up and shards for tensor parallelism). Returns how many tensors
        it loaded."""
        from vllm.config import set_current_vllm_config

        named = unpack_bucket(packed)
        with set_current_vllm_config(self.vllm_config):
            self.get_model().load_weights(weights=iter(named))
        return len(named)

    def roll_finish_weight_update(self) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        model = self.get_model()
        with set_current_vllm_config(self.vllm_config):
            finalize_layerwise_reload(model, self.vllm_config.model_config)
        self.roll_reprocess_tied_layers()

    def roll_reprocess_tied_layers(self) -> None:
        """After an update by vLLM's weight-transfer API (whose finish runs the layerwise reload's alone)."""
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(self.vllm_config):
            reprocess_tied_layers(self.get_model())


register_transfer_backends()  # vLLM's workers import this module (the extension) before they build a transfer engine

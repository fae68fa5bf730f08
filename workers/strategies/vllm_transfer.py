"""actor_train's side of a weight sync by vLLM's weight-transfer API (actor_infer's strategy_config
weight_transport nccl, ipc or gloo): actor_train sends its weights to each actor_infer worker's vLLM workers
itself, with vLLM's trainer engines (`nccl`, `ipc`) or this project's CPU one (gloo_transfer.py).

Each actor_infer worker is one vLLM engine; with a process group (nccl, gloo) each has its own (actor_train's
rank 0 is rank 0 of it, the engine's tensor-parallel workers the rest) and the engines are synced one after the
other (`WeightSender`). Every actor_train rank takes part in each sync (under ZeRO-3 the parameters are gathered by
all of them, and CUDA IPC gathers every rank's handles); rank 0 alone drives the engines, through the actor_infer
workers' `transfer_*` methods (`InferWorkerClient`, vLLM's VLLMWeightSyncClient protocol), which hold generation
still for the length of the update.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

from roll_core.config.clusters import WEIGHT_TRANSPORTS
from workers.strategies.ipc_transfer import encode_update_info
from workers.strategies.vllm_weights import register_transfer_backends, vllm_weight_name


class TrainerSource(WeightSource):
    """actor_train's weights under the names vLLM loads (`vllm_weight_name`), where they live: GPU tensors are
    sent from the GPU. `strategy` gives `inference_metadata()` and `inference_items()` (DeepSpeedTrainStrategy)."""

    def __init__(self, strategy: Any, tie_word_embeddings: bool) -> None:
        self.strategy, self.tie = strategy, tie_word_embeddings

    def metadata(self) -> list[ParamMeta]:
        return [
            ParamMeta(vllm_name, dtype, tuple(shape))
            for name, dtype, shape in self.strategy.inference_metadata()
            if (vllm_name := vllm_weight_name(name, self.tie)) is not None
        ]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self.strategy.inference_items():  # every item: a ZeRO-3 gather is per module
            if (vllm_name := vllm_weight_name(name, self.tie)) is not None:
                yield vllm_name, tensor


class InferWorkerClient:
    """vLLM's VLLMWeightSyncClient over actor_infer workers (Ray actor handles): each call goes to all of them
    at once and returns when every one has done it."""

    def __init__(self, handles: list[Any]) -> None:
        self.handles = handles
        self.version = 0
        """The version the next sync brings (the workers keep it as their weights version)."""

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._call("transfer_init", init_info)

    def start_weight_update(self) -> None:
        self._call("transfer_start", self.version)

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        if isinstance(update_info, list):
            update_info = [encode_update_info(info) for info in update_info]
        else:
            update_info = encode_update_info(update_info)
        self._call("transfer_update", update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._call("transfer_finish")

    def _call(self, method: str, *args: Any) -> None:
        import ray

        ray.get([getattr(handle, method).remote(*args) for handle in self.handles])


def free_port() -> int:
    """A TCP port free on this node now, for a transfer group's rendezvous."""
    with socket.socket() as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


def trainer_init_info(
    transport: str, rank: int, address: str, port: int, engine_workers: int, bucket_bytes: int
) -> Any:
    """vLLM's trainer init info for `transport`: the group is actor_train's sender and the engine's workers."""
    world = 1 + engine_workers
    if transport == "nccl":
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        return NCCLTrainerInitInfo(
            master_address=address, master_port=port, world_size=world, packed_buffer_size_bytes=bucket_bytes, rank=rank
        )
    if transport == "ipc":
        from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

        return IPCTrainerInitInfo(packed=True, packed_buffer_size_bytes=bucket_bytes, rank=rank)
    if transport == "gloo":
        from workers.strategies.gloo_transfer import GlooTrainerInitInfo

        return GlooTrainerInitInfo(
            master_address=address, master_port=port, world_size=world, bucket_bytes=bucket_bytes, rank=rank
        )
    raise ValueError(f"weight_transport {transport!r} has no trainer engine (one of {list(WEIGHT_TRANSPORTS)[1:]})")


class WeightSender:
    """The trainer engines, opened at the first sync and kept for the run. A process group (nccl, gloo) cannot hold
    two engines' workers (vLLM numbers each engine's workers from 0), so each actor_infer worker gets a group of its
    own and the syncs go one after the other; CUDA IPC has no group: one engine hands every actor_infer worker the
    handles of all trainer ranks' GPUs at once, and each vLLM worker opens those of its own GPU."""

    def __init__(self, transport: str, rank: int, source: WeightSource, bucket_bytes: int, address: str) -> None:
        register_transfer_backends()
        self.transport, self.rank, self.source, self.bucket_bytes, self.address = (
            transport, rank, source, bucket_bytes, address,
        )
        self.engines: list[tuple[InferWorkerClient, Any]] = []
        self.handles: list[Any] = []

    def send(self, handles: list[Any], engine_workers: int, version: int) -> None:
        """The weights to every actor_infer worker in `handles`, each then holding them as `version`."""
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        if not self.engines:
            self.handles = list(handles)
            for group in [handles] if self.transport == "ipc" else [[handle] for handle in handles]:
                client = InferWorkerClient(group)
                info = trainer_init_info(
                    self.transport, self.rank, self.address, free_port(), engine_workers, self.bucket_bytes
                )
                engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=self.source)
                self.engines.append((client, engine))
        if list(handles) != self.handles:
            raise RuntimeError("weight transfer: actor_infer's workers changed since the transfer groups were opened")
        for client, engine in self.engines:
            client.version = version
            engine.send_weights()

    def close(self) -> None:
        for _, engine in self.engines:
            engine.shutdown()
        self.engines = []

"""A CPU weight-transfer backend for vLLM's weight-transfer API: a gloo process group between actor_train's rank 0
and the vLLM workers, weights broadcast in buckets of bounded size.

On GPUs the pipeline uses vLLM's own backends (`nccl` between separate GPUs, `ipc` on shared ones, both vLLM's
code); they need CUDA. This one is the same protocol on CPU (`weight_transport: gloo`): the trainer engine opens
the group with the workers (`init_weight_transfer_engine`), then each sync is `start_weight_update`, one
`update_weights` that receives while the trainer broadcasts, and `finish_weight_update` (vLLM's layerwise reload
around the loads). CI runs the whole path on vLLM's CPU build with it; only the engine class differs on a GPU.

Both halves are registered with vLLM's factories under `BACKEND` by vllm_weights.py, which vLLM's workers import
(it holds the worker extension) before they build the engine a `weight_transfer_config` names.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

import torch
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    WeightSource,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from workers.strategies.weight_buckets import bucket_slices

BACKEND = "roll_gloo"
TIMEOUT = datetime.timedelta(minutes=10)
"""How long a rendezvous or a broadcast waits for the other side."""


def _nbytes(dtype: torch.dtype, shape: list[int]) -> int:
    return int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()


def _group(address: str, port: int, rank: int, world_size: int) -> Any:
    from torch.distributed import ProcessGroupGloo, TCPStore

    store = TCPStore(address, port, world_size, is_master=rank == 0, timeout=TIMEOUT, wait_for_workers=False)
    return ProcessGroupGloo(store, rank, world_size, TIMEOUT)


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    bucket_bytes: int


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    """The vLLM worker's side: joins the group, receives each bucket as one flat byte tensor and loads its tensors
    with the model's `load_weights` (checkpoint names; vLLM fuses and shards them)."""

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.group = None
        self.bucket_bytes = 0

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        rank = self.parallel_config.rank + init_info.rank_offset
        self.group = _group(init_info.master_address, init_info.master_port, rank, init_info.world_size)
        self.bucket_bytes = init_info.bucket_bytes

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # vLLM's base class synchronizes the accelerator here, which raises where there is none (a CPU worker);
        # a gloo broadcast has completed when its wait() returns.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("gloo weight transfer: init_weight_transfer_engine was not called")
        dtypes = [getattr(torch, name) for name in update_info.dtype_names]
        sizes = [_nbytes(d, s) for d, s in zip(dtypes, update_info.shapes, strict=True)]
        for part in bucket_slices(sizes, self.bucket_bytes):
            flat = torch.empty(sum(sizes[part]), dtype=torch.uint8)
            self.group.broadcast(flat, 0).wait()
            named, offset = [], 0
            for name, dtype, shape, size in zip(
                update_info.names[part], dtypes[part], update_info.shapes[part], sizes[part], strict=True
            ):
                named.append((name, flat[offset : offset + size].view(dtype).reshape(shape)))
                offset += size
            self.model.load_weights(weights=iter(named))

    def shutdown(self) -> None:
        self.group = None


@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):
    backend: ClassVar[str] = BACKEND
    master_address: str
    master_port: int
    world_size: int
    bucket_bytes: int


class GlooTrainerWeightTransferEngine(TrainerWeightTransferEngine[GlooTrainerInitInfo]):
    """actor_train's side: rank 0 opens the group (rank 0 of it) while the workers join, and broadcasts each bucket
    while the workers' `update_weights` receives; other trainer ranks only iterate the source (a ZeRO-3 gather is
    a collective among them)."""

    init_info_cls = GlooTrainerInitInfo

    def __init__(self, *, bucket_bytes: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.bucket_bytes = bucket_bytes
        self.group = None

    @classmethod
    def trainer_init(cls, init_info: GlooTrainerInitInfo, *, client: Any, source: WeightSource | None = None):
        if source is None:
            raise ValueError("gloo weight transfer needs a WeightSource")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender, bucket_bytes=init_info.bucket_bytes)
        if not engine.is_sender:
            return engine
        worker_info = GlooInitInfo(
            init_info.master_address, init_info.master_port, 1, init_info.world_size, init_info.bucket_bytes
        )
        with ThreadPoolExecutor(max_workers=1) as pool:  # both sides block in the rendezvous until all have joined
            joined = pool.submit(client.init_weight_transfer_engine, asdict(worker_info))
            engine.group = _group(init_info.master_address, init_info.master_port, 0, init_info.world_size)
            joined.result()
        return engine

    def send_weights(self) -> None:
        source = self.source
        meta = source.metadata()
        if not self.is_sender:
            for _ in source:
                pass
            return
        info = GlooUpdateInfo(
            [m.name for m in meta], [str(m.dtype).split(".")[-1] for m in meta], [list(m.shape) for m in meta]
        )
        sizes = [_nbytes(m.dtype, list(m.shape)) for m in meta]
        self.client.start_weight_update()
        pool = ThreadPoolExecutor(max_workers=1)
        try:
            received = pool.submit(self.client.update_weights, asdict(info))
            stream = iter(source)
            pairs = _checked(stream, meta)
            for part in bucket_slices(sizes, self.bucket_bytes):
                tensors = [next(pairs)[1] for _ in range(part.stop - part.start)]
                flat = torch.cat([t.detach().contiguous().view(-1).view(torch.uint8) for t in tensors])
                self.group.broadcast(flat, 0).wait()
            if (extra := next(stream, None)) is not None:
                raise ValueError(f"weight source yields {extra[0]!r} beyond its metadata's {len(meta)} tensors")
            received.result()
        finally:
            pool.shutdown(wait=False)  # a worker stuck in a broadcast that never comes must not hang this one too
        self.client.finish_weight_update()

    def shutdown(self) -> None:
        self.group = None


def _checked(pairs: Iterator[tuple[str, torch.Tensor]], meta: list[Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """The source's pairs, each checked against the metadata the workers cut their buckets by."""
    for expected in meta:
        name, tensor = next(pairs)
        if name != expected.name or tensor.dtype != expected.dtype or tuple(tensor.shape) != tuple(expected.shape):
            raise ValueError(
                f"weight source yields {name!r} {tensor.dtype} {tuple(tensor.shape)} where its metadata says "
                f"{expected.name!r} {expected.dtype} {tuple(expected.shape)}"
            )
        yield name, tensor

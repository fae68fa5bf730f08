"""Where a worker computes: the one rule every strategy follows.

A worker that its cluster section gives GPUs (`num_gpus_per_worker` > 0 or a `device_mapping`) computes on its
first visible GPU: Ray sets CUDA_VISIBLE_DEVICES to the GPUs it reserved for the actor, so that GPU is cuda:0 in
the worker's process (a worker with several GPUs, vLLM with tensor parallelism, hands the rest to its engine). Any
other worker computes on the CPU. Tensors travel between workers on the CPU (Ray serialises them); each strategy
moves what enters a forward to its device and what it returns back to the CPU.
"""

from __future__ import annotations

import os

import torch

from roll_core.config import ClusterConfig

LOGICAL_GPUS = "ROLL_LOGICAL_GPUS"
"""Set to 1 where Ray's GPUs are logical resources on a host without any (the placement tests on CPU machines):
a worker given one computes on the CPU instead of stopping."""


class NoGPUError(RuntimeError):
    """A cluster section asks for GPUs where torch sees none."""


def wants_gpu(section: ClusterConfig) -> bool:
    return section.num_gpus_per_worker > 0 or section.device_mapping is not None


def worker_device(section: ClusterConfig, name: str = "worker") -> torch.device:
    """The device of a worker of `section` in this process (see the module's docstring)."""
    asked = f"num_gpus_per_worker={section.num_gpus_per_worker}, device_mapping={section.device_mapping!r}"
    return _device(wants_gpu(section), name, asked, "set num_gpus_per_worker: 0 and no device_mapping")


def gpu_or_cpu(num_gpus: float, name: str = "worker") -> torch.device:
    """The device of a worker that asked Ray for `num_gpus` GPUs (a reward worker's num_gpus_per_worker)."""
    return _device(num_gpus > 0, name, f"num_gpus_per_worker={num_gpus}", "set num_gpus_per_worker: 0")


def _device(gpu: bool, name: str, asked: str, instead: str) -> torch.device:
    if not gpu or os.environ.get(LOGICAL_GPUS) == "1":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise NoGPUError(
            f"{name}: its config section asks for GPUs ({asked}) but torch sees no CUDA device in this process "
            f"(torch {torch.__version__}, CUDA build: {torch.version.cuda is not None}); install a CUDA build of "
            f"torch on the GPU nodes, or {instead} to run on the CPU"
        )
    return torch.device("cuda", 0)

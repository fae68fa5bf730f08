"""System metrics added to every step: resident memory of the driver and of every worker process, and where a
worker sees a CUDA device, its GPU memory."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

logger = logging.getLogger(__name__)

_MB = 1024 * 1024


def process_rss_bytes(_actor: Any = None) -> int:
    """Resident set size of this process; takes (and ignores) the actor when run by __ray_call__."""
    import psutil

    return psutil.Process().memory_info().rss


def process_gpu_bytes(_actor: Any = None) -> dict[str, int]:
    """This process's GPU memory where torch sees a CUDA device ({} elsewhere): what torch's caching allocator
    holds here (`reserved`) and its peak (`peak_reserved`), and what the whole device has in use by every process
    (`device_used`: total minus free, which counts vLLM's engine processes and the other colocated workers)."""
    import torch

    if not torch.cuda.is_available():
        return {}
    free, total = torch.cuda.mem_get_info()
    return {
        "reserved": torch.cuda.memory_reserved(),
        "peak_reserved": torch.cuda.max_memory_reserved(),
        "device_used": total - free,
    }


def process_memory(_actor: Any = None) -> tuple[int, dict[str, int]]:
    """(resident set size, GPU memory as `process_gpu_bytes` gives it) of this process."""
    return process_rss_bytes(), process_gpu_bytes()


def memory_metrics(names: Sequence[str], values: Sequence[tuple[int, dict[str, int]]]) -> dict[str, float]:
    """Per group (`names[i]` is the group of `values[i]`): `memory/<group>_rss_mb` summed over its processes; where
    they see a GPU, `memory/<group>_gpu_reserved_mb` and `_gpu_peak_reserved_mb` summed too, and
    `memory/gpu_device_used_mb`, the most any worker's device has in use."""
    metrics: dict[str, float] = {}
    for name, (rss, gpu) in zip(names, values, strict=True):
        metrics[f"memory/{name}_rss_mb"] = metrics.get(f"memory/{name}_rss_mb", 0.0) + rss / _MB
        for key in ("reserved", "peak_reserved"):
            if key in gpu:
                metric = f"memory/{name}_gpu_{key}_mb"
                metrics[metric] = metrics.get(metric, 0.0) + gpu[key] / _MB
        if "device_used" in gpu:
            metrics["memory/gpu_device_used_mb"] = max(
                metrics.get("memory/gpu_device_used_mb", 0.0), gpu["device_used"] / _MB
            )
    return metrics


class MemoryProbe:
    """`memory/<group>_rss_mb` (summed over the group's processes), `memory/driver_rss_mb` and
    `memory/total_rss_mb`, and the GPU figures of `memory_metrics` where workers see a CUDA device; each worker
    measures itself, so workers on other nodes are measured too."""

    def __init__(self, groups: Mapping[str, Sequence[Any]], timeout_s: float = 30.0) -> None:
        self.groups = {name: list(actors) for name, actors in groups.items()}
        self.timeout_s = timeout_s

    def __call__(self) -> dict[str, float]:
        import ray

        metrics = {"memory/driver_rss_mb": process_rss_bytes() / _MB}
        names = [name for name, actors in self.groups.items() for _ in actors]
        refs = [a.__ray_call__.remote(process_memory) for actors in self.groups.values() for a in actors]
        try:
            values = ray.get(refs, timeout=self.timeout_s)
        except ray.exceptions.RayError as exc:  # a timeout included
            logger.warning("worker memory not measured this step: %s", exc)
            return metrics
        metrics |= memory_metrics(names, values)
        metrics["memory/total_rss_mb"] = sum(v for k, v in metrics.items() if k.endswith("_rss_mb"))
        return metrics

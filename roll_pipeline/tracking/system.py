"""System metrics added to every step: resident memory of the driver and of every worker process."""

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


class MemoryProbe:
    """`memory/<group>_rss_mb` (summed over the group's processes), `memory/driver_rss_mb` and
    `memory/total_rss_mb`; each worker measures itself, so workers on other nodes are measured too."""

    def __init__(self, groups: Mapping[str, Sequence[Any]], timeout_s: float = 30.0) -> None:
        self.groups = {name: list(actors) for name, actors in groups.items()}
        self.timeout_s = timeout_s

    def __call__(self) -> dict[str, float]:
        import ray

        metrics = {"memory/driver_rss_mb": process_rss_bytes() / _MB}
        names = [name for name, actors in self.groups.items() for _ in actors]
        refs = [a.__ray_call__.remote(process_rss_bytes) for actors in self.groups.values() for a in actors]
        try:
            values = ray.get(refs, timeout=self.timeout_s)
        except ray.exceptions.RayError as exc:  # a timeout included
            logger.warning("worker memory not measured this step: %s", exc)
            return metrics
        for name, rss in zip(names, values, strict=True):
            key = f"memory/{name}_rss_mb"
            metrics[key] = metrics.get(key, 0.0) + rss / _MB
        metrics["memory/total_rss_mb"] = sum(metrics.values())
        return metrics

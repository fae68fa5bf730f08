"""A Cluster: a named group of Ray actors running one worker class, addressed as one."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import ray

from roll_pipeline.batch import Batch

logger = logging.getLogger(__name__)


class Cluster:
    """`world_size` Ray actors of `worker_cls`; rank r gets `worker_kwargs` plus, with `pass_rank`, its name,
    rank and the world size (workers that need no process group, such as reward workers, do without).
    `max_concurrency` > 1 makes each a threaded actor that serves that many calls at once."""

    def __init__(
        self,
        name: str,
        worker_cls: type,
        *,
        world_size: int,
        num_cpus: float,
        num_gpus: float,
        worker_kwargs: dict[str, Any],
        env_vars: dict[str, str] | None = None,
        pass_rank: bool = True,
        max_concurrency: int | None = None,
    ) -> None:
        self.name = name
        self.world_size = world_size
        remote_cls = ray.remote(worker_cls)
        options: dict[str, Any] = {"num_cpus": num_cpus, "num_gpus": num_gpus}
        if env_vars:
            options["runtime_env"] = {"env_vars": env_vars}
        if max_concurrency:
            options["max_concurrency"] = max_concurrency
        self.workers = [
            remote_cls.options(**options).remote(
                **({"name": name, "rank": rank, "world_size": world_size} if pass_rank else {}), **worker_kwargs
            )
            for rank in range(world_size)
        ]

    def call(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call `method` on every worker with the same arguments; wait for and return all results."""
        return ray.get(self.call_async(method, *args, **kwargs))

    def call_async(self, method: str, *args: Any, **kwargs: Any) -> list[ray.ObjectRef]:
        return [getattr(w, method).remote(*args, **kwargs) for w in self.workers]

    def call_rank0(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return ray.get(getattr(self.workers[0], method).remote(*args, **kwargs))

    def dispatch(self, method: str, batch: Batch, *args: Any, **kwargs: Any) -> list[Any]:
        """Split `batch` into one contiguous shard per rank, call `method(shard, ...)`, return results in rank order."""
        return ray.get(self.call_async_dispatch(method, batch, *args, **kwargs))

    def call_async_dispatch(self, method: str, batch: Batch, *args: Any, **kwargs: Any) -> list[ray.ObjectRef]:
        shards = batch.chunk(self.world_size)
        return [getattr(w, method).remote(s, *args, **kwargs) for w, s in zip(self.workers, shards, strict=True)]

    def dispatch_items(self, method: str, items: Sequence[Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Like `dispatch` for a list: shards the list, concatenates the per-rank result lists in order."""
        n = len(items)
        bounds = [round(i * n / self.world_size) for i in range(self.world_size + 1)]
        refs = [
            getattr(w, method).remote(list(items[bounds[r] : bounds[r + 1]]), *args, **kwargs)
            for r, w in enumerate(self.workers)
        ]
        return [x for part in ray.get(refs) for x in part]

    def init_process_group(self) -> None:
        """Point every rank at rank 0's address so torch.distributed can rendezvous there."""
        addr, port = self.call_rank0("address")
        self.call("set_distributed_env", addr, port)

    def shutdown(self) -> None:
        for w in self.workers:
            ray.kill(w)
        self.workers = []

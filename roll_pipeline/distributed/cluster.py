"""A Cluster: a named group of Ray actors running one worker class, addressed as one."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import ray

from roll_core.batch import Batch
from roll_pipeline.distributed.waiting import DEFAULT_RPC_TIMEOUT_S, wait_for

logger = logging.getLogger(__name__)


class Cluster:
    """`world_size` Ray actors of `worker_cls`; rank r gets `worker_kwargs` plus, with `pass_rank`, its name,
    rank and the world size (workers that need no process group, such as reward workers, do without).
    `max_concurrency` > 1 makes each a threaded actor that serves that many calls at once. `max_restarts` and
    `max_task_retries` are Ray's: how often a dead worker is restarted and its in-flight calls re-sent."""

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
        placement: str = "default",
        placement_timeout_s: float = 120.0,
        device_slots: Sequence[dict[str, Any]] | None = None,
        max_restarts: int = 0,
        max_task_retries: int = 0,
        rpc_timeout_s: float | None = DEFAULT_RPC_TIMEOUT_S,
        resources: dict[str, float] | None = None,
    ) -> None:
        """`device_slots`: per rank, the Ray options of a device-mapped worker from `DevicePool.worker_options`
        (its bundle of the shared GPU pool, its share of that GPU, its CPUs, extra env vars); they replace
        num_cpus, num_gpus and placement. `resources`: custom Ray resources each worker asks for."""
        self.name = name
        self.world_size = world_size
        self.rpc_timeout_s = rpc_timeout_s
        remote_cls = ray.remote(worker_cls)
        if device_slots is not None and len(device_slots) != world_size:
            raise ValueError(f"{name}: {len(device_slots)} device slots for world_size {world_size}")
        self.placement_group = None
        if placement != "default" and device_slots is None:
            self.placement_group = reserve_bundles(
                name, world_size, num_cpus, num_gpus, placement, placement_timeout_s
            )
        self.workers = []
        for rank in range(world_size):
            options: dict[str, Any] = {"num_cpus": num_cpus, "num_gpus": num_gpus}
            if resources:
                options["resources"] = dict(resources)
            if max_concurrency:
                options["max_concurrency"] = max_concurrency
            if max_restarts:
                # Ray restarts a dead worker (same arguments) and, with max_task_retries, sends its in-flight
                # calls again: only for workers whose calls are safe to repeat.
                options |= {"max_restarts": max_restarts, "max_task_retries": max_task_retries}
            rank_env = dict(env_vars or {})
            if self.placement_group is not None:
                from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

                options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    self.placement_group, placement_group_bundle_index=rank
                )
            if device_slots is not None:
                slot = dict(device_slots[rank])
                rank_env.update(slot.pop("env_vars", {}))
                options.update(slot)
            if rank_env:
                options["runtime_env"] = {"env_vars": rank_env}
            self.workers.append(
                remote_cls.options(**options).remote(
                    **({"name": name, "rank": rank, "world_size": world_size} if pass_rank else {}),
                    **worker_kwargs,
                )
            )

    def call(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call `method` on every worker with the same arguments; wait for and return all results."""
        return self.wait(self.call_async(method, *args, **kwargs), method)

    def wait(self, refs: list[ray.ObjectRef], method: str) -> list[Any]:
        """The results of one call per rank (`refs` in rank order), within the cluster's rpc_timeout_s."""
        return wait_for(refs, self.call_names(method, len(refs)), self.rpc_timeout_s)

    def call_names(self, method: str, count: int | None = None) -> list[str]:
        """`<cluster>[<rank>].<method>` for the first `count` ranks (all by default), as errors name them."""
        return [f"{self.name}[{rank}].{method}" for rank in range(self.world_size if count is None else count)]

    def call_async(self, method: str, *args: Any, **kwargs: Any) -> list[ray.ObjectRef]:
        return [getattr(w, method).remote(*args, **kwargs) for w in self.workers]

    def call_rank0(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self.wait([getattr(self.workers[0], method).remote(*args, **kwargs)], method)[0]

    def dispatch(self, method: str, batch: Batch, *args: Any, **kwargs: Any) -> list[Any]:
        """Split `batch` into one contiguous shard per rank, call `method(shard, ...)`, return results in rank order."""
        return self.wait(self.call_async_dispatch(method, batch, *args, **kwargs), method)

    def call_async_dispatch(
        self, method: str, batch: Batch, *args: Any, **kwargs: Any
    ) -> list[ray.ObjectRef]:
        shards = batch.chunk(self.world_size)
        return [
            getattr(w, method).remote(s, *args, **kwargs) for w, s in zip(self.workers, shards, strict=True)
        ]

    def init_process_group(self) -> None:
        """Point every rank at rank 0's address so torch.distributed can rendezvous there."""
        addr, port = self.call_rank0("address")
        self.call("set_distributed_env", addr, port)

    def ready_calls(self) -> tuple[list[ray.ObjectRef], list[str]]:
        """A `ready` call per worker and their names: each answers once Ray placed the worker and it started."""
        return [w.__ray_ready__.remote() for w in self.workers], self.call_names("start")

    def node_ids(self) -> list[str]:
        """The Ray node each worker runs on, in rank order."""
        return self.wait(
            [w.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id()) for w in self.workers],
            "node_id",
        )

    def shutdown(self) -> None:
        for w in self.workers:
            ray.kill(w)
        self.workers = []
        if self.placement_group is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.placement_group)
            self.placement_group = None


def reserve_bundles(
    name: str, world_size: int, num_cpus: float, num_gpus: float, placement: str, timeout_s: float
):
    """A placement group of one bundle per worker; raises a clear error if Ray cannot place it in time."""
    from ray.util.placement_group import placement_group, remove_placement_group

    bundle: dict[str, float] = {"CPU": max(num_cpus, 0.01)}  # Ray refuses empty bundles
    if num_gpus:
        bundle["GPU"] = num_gpus
    group = placement_group(
        [dict(bundle) for _ in range(world_size)], strategy=placement.upper(), name=f"roll-{name}"
    )
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(group)
        raise RuntimeError(
            f"{name}: could not place {world_size} worker(s) of {bundle} with placement {placement!r} within "
            f"{timeout_s:.0f} s; the Ray cluster has {ray.cluster_resources()} over {len(ray.nodes())} node(s)"
        )
    return group

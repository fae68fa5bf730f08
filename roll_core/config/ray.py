"""The `ray` section: the Ray cluster a run starts or joins.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class RayConfig:
    address: str | None = None
    """An existing Ray cluster to join (else RAY_ADDRESS; else a local cluster is started)."""
    num_cpus: int | None = None
    """Logical CPUs of a local cluster. None: enough for every worker's num_cpus_per_worker; the stages run
    one after another, so over-subscribing the logical count does not over-subscribe the cores."""
    num_gpus_per_node: int = 8
    """GPUs per node of the pool that the clusters' device_mapping indices number (ROLL's num_gpus_per_node):
    index i is on node i // num_gpus_per_node. Unused without device mappings."""
    worker_restarts: int = 3
    """Times Ray restarts a dead actor_infer, reference or reward worker; the calls it had in flight are sent
    again (actor_infer gets the current weights first). A reward worker that stays dead has its samples masked
    (reward/<domain>/masked_worker_lost). actor_train and critic hold the training state and are not restarted:
    their death stops the run, which `roll run --resume` continues from the last checkpoint."""
    scheduler_num_cpus: float = 0.05
    """CPUs each domain's scheduler (a coordinating actor: it sends requests and collects results) asks Ray for:
    a fraction, so that it is counted where it runs without holding back a worker's CPU."""
    actor_start_timeout_s: float = 600.0
    """The longest the driver waits for every actor of the run to be placed and started (its model loaded) before
    the run stops with an error naming each one still waiting and what the cluster has free."""
    rpc_timeout_s: float | None = 3600.0
    """The longest the driver waits on any call to a worker (a step's rollout, a training step, a weight sync,
    a checkpoint) before the run stops with an error naming each worker that did not answer; None: no bound."""

    def validate(self) -> Iterator[tuple[str, str]]:
        if self.rpc_timeout_s is not None and self.rpc_timeout_s <= 0:
            yield "rpc_timeout_s", f"must be > 0 (or null for no bound), got {self.rpc_timeout_s}"
        if self.num_gpus_per_node < 1:
            yield "num_gpus_per_node", "must be >= 1"
        if self.worker_restarts < 0:
            yield "worker_restarts", "must be >= 0"
        if not 0 <= self.scheduler_num_cpus <= 1:
            yield "scheduler_num_cpus", f"must be between 0 and 1 (a fraction of a CPU), got {self.scheduler_num_cpus}"
        if self.actor_start_timeout_s <= 0:
            yield "actor_start_timeout_s", f"must be > 0, got {self.actor_start_timeout_s}"

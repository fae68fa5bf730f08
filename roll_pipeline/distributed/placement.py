"""GPU placement from ROLL-style device mappings: which worker runs on which GPU of one shared pool.

A cluster's `device_mapping` names GPUs by their index in the pipeline's pool: GPU i is local GPU
i % gpus_per_node of node i // gpus_per_node. Worker r of a cluster with g GPUs per worker uses the r-th run of
g indices of its mapping. Clusters whose mappings share GPUs are colocated: every worker on a shared GPU holds an
equal fraction of it in Ray's accounting (vLLM's sleep mode and the stages running one after another are what
make the sharing work in memory). Clusters on disjoint GPUs simply hold different bundles.

`plan_devices` is the pure part: config in, plan (or key-path errors) out, no Ray. `DevicePool` turns a plan
into Ray placement groups, one per node with one bundle per GPU (STRICT_PACK, so a node's GPUs are on one
machine), and gives each worker the Ray options that put it on its bundle.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from roll_core.algorithms import needs_critic
from roll_core.config.errors import ConfigError

logger = logging.getLogger(__name__)

_SHARE_QUANTUM = 10_000
"""Ray keeps fractional resources to 4 decimals; shares are rounded down to that so k of them never exceed 1."""


class PlanError(ConfigError):
    """The clusters' device mappings cannot be turned into a placement; one key-path message per line."""


@dataclass(frozen=True)
class ClusterDemand:
    """What one cluster asks for: `devices` from its device_mapping (None: Ray places it by its resources)."""

    name: str
    world_size: int
    gpus_per_worker: float
    cpus_per_worker: float
    devices: tuple[int, ...] | None = None


@dataclass(frozen=True)
class WorkerSlot:
    """Where one worker of a mapped cluster goes: its GPUs, the bundle of its first GPU (its home), and what
    it claims there."""

    cluster: str
    rank: int
    devices: tuple[int, ...]
    node: int
    bundle: int
    """Index of the home GPU's bundle in its node's placement group (the GPU's local index)."""
    num_gpus: float
    """The worker's fraction of its home GPU: 1 / (clusters on that GPU), rounded down to Ray's granularity."""
    num_cpus: float


@dataclass(frozen=True)
class DevicePlan:
    gpus_per_node: int
    num_nodes: int
    """Nodes the pool spans: enough for the highest GPU index of any mapping; 0 without device mappings."""
    slots: dict[str, tuple[WorkerSlot, ...]]
    """Per mapped cluster, its workers in rank order."""
    unmapped: tuple[ClusterDemand, ...]
    """Clusters without a device mapping (reward workers, CPU clusters): Ray places them by their resources."""

    @property
    def num_devices(self) -> int:
        return self.num_nodes * self.gpus_per_node

    def bundle_cpus(self, node: int) -> list[float]:
        """CPUs of each GPU bundle of `node`: what the workers whose home it is ask for."""
        cpus = [0.0] * self.gpus_per_node
        for workers in self.slots.values():
            for w in workers:
                if w.node == node:
                    cpus[w.bundle] += w.num_cpus
        return cpus

    def device_users(self) -> dict[int, tuple[str, ...]]:
        """Every used GPU index and the clusters on it, in cluster order."""
        users: dict[int, list[str]] = {}
        for name, workers in self.slots.items():
            for w in workers:
                for d in w.devices:
                    users.setdefault(d, []).append(name)
        return {d: tuple(users[d]) for d in sorted(users)}

    def sharing_groups(self) -> list[tuple[tuple[str, ...], list[int]]]:
        """GPUs grouped by the set of clusters on them, in order of their first GPU: each entry is a set of
        colocated clusters (one cluster alone when nothing shares its GPUs) and the GPUs they share."""
        groups: dict[tuple[str, ...], list[int]] = {}
        for device, users in self.device_users().items():
            groups.setdefault(users, []).append(device)
        return sorted(groups.items(), key=lambda item: item[1][0])

    def unused_devices(self) -> list[int]:
        used = self.device_users()
        return [d for d in range(self.num_devices) if d not in used]


def plan_devices(demands: Sequence[ClusterDemand], gpus_per_node: int) -> DevicePlan:
    """Place every worker of the mapped clusters on the pool; raise PlanError with one line per problem.

    Each demand's own mapping is assumed valid (distinct indices >= 0, world_size * gpus_per_worker of them:
    ClusterConfig.validate checks that at load). Checked here, across clusters: a worker's GPUs lie on one node
    (CUDA_VISIBLE_DEVICES is per machine), and no cluster asks for GPUs outside the pool while others map theirs
    (the pool holds whole nodes, so such a worker could wait for a GPU forever)."""
    mapped = [d for d in demands if d.devices is not None]
    errors: list[str] = []
    if mapped:
        for d in demands:
            if d.devices is None and d.gpus_per_worker > 0:
                errors.append(
                    f"{d.name}.device_mapping: {d.name} asks for {d.gpus_per_worker:g} GPU(s) per worker without a "
                    f"device_mapping while {', '.join(m.name for m in mapped)} map theirs; give every GPU cluster a "
                    "device_mapping (the pool reserves whole nodes)"
                )
    users = Counter(device for d in mapped for device in d.devices)
    slots: dict[str, tuple[WorkerSlot, ...]] = {}
    for d in mapped:
        per_worker = int(d.gpus_per_worker)
        workers = []
        for rank in range(d.world_size):
            devices = d.devices[rank * per_worker : (rank + 1) * per_worker]
            nodes = sorted({device // gpus_per_node for device in devices})
            if len(nodes) > 1:
                errors.append(
                    f"{d.name}.device_mapping: worker {rank} gets GPUs {list(devices)}, which lie on nodes "
                    f"{nodes} (ray.num_gpus_per_node: {gpus_per_node}); a worker's GPUs must be on one node"
                )
            home = devices[0]
            share = math.floor(_SHARE_QUANTUM / users[home]) / _SHARE_QUANTUM
            workers.append(
                WorkerSlot(
                    cluster=d.name,
                    rank=rank,
                    devices=tuple(devices),
                    node=home // gpus_per_node,
                    bundle=home % gpus_per_node,
                    num_gpus=share,
                    num_cpus=d.cpus_per_worker,
                )
            )
        slots[d.name] = tuple(workers)
    if errors:
        raise PlanError("\n".join(errors))
    num_nodes = (max(users) // gpus_per_node + 1) if users else 0
    return DevicePlan(
        gpus_per_node=gpus_per_node,
        num_nodes=num_nodes,
        slots=slots,
        unmapped=tuple(d for d in demands if d.devices is None),
    )


def running_sections(cfg: Any) -> list[tuple[str, Any]]:
    """(name, section) of the model clusters a run of `cfg` (a PipelineConfig) starts, in start order."""
    sections = [("actor_train", cfg.actor_train), ("actor_infer", cfg.actor_infer)]
    if cfg.reference_cluster:
        sections.append(("reference", cfg.reference))
    if needs_critic(cfg.adv_estimator) and cfg.critic is not None:
        sections.append(("critic", cfg.critic))
    return sections


def start_stages(cfg: Any) -> list[list[str]]:
    """The model clusters of `running_sections`, in the stages they start in: a stage's workers start together,
    and the next stage waits until they have. vLLM sharing its GPUs with the others (cfg.infer_offloads) starts
    alone, first: it sizes its KV cache from the GPU memory free while it starts, which the others' weights and
    states would otherwise hold; it goes to sleep before they start."""
    names = [name for name, _ in running_sections(cfg)]
    if cfg.infer_offloads and cfg.actor_infer.strategy_args.strategy_name == "vllm":
        return [["actor_infer"], [name for name in names if name != "actor_infer"]]
    return [names]


def reward_start_waves(cfg: Any) -> list[list[tuple[str, Any]]]:
    """The reward clusters, (domain, component) in domain order, in the waves they start in: those that ask for
    custom Ray resources (pinned to the nodes that offer them) first, the rest once those have started. Ray places
    an unpinned worker on whichever node it likes, and one that lands on a pinned worker's node may take the CPU the
    pinned one needs there: a run that fits the cluster (check_fit) then waits forever for the pinned worker (a
    two-node test's code reward, pinned to the far node, waited 300 s beside the math reward placed there)."""
    components = [(domain, c) for domain in cfg.domain_interleave_probs for c in cfg.rewards[domain].components()]
    waves = [[dc for dc in components if dc[1].resources], [dc for dc in components if not dc[1].resources]]
    return [wave for wave in waves if wave]


def pipeline_demands(cfg: Any) -> list[ClusterDemand]:
    """The clusters a run of `cfg` (a PipelineConfig) starts, in start order, with what each asks for."""
    sections = running_sections(cfg)
    demands = [
        ClusterDemand(
            name=name,
            world_size=section.world_size,
            gpus_per_worker=section.num_gpus_per_worker,
            cpus_per_worker=section.num_cpus_per_worker,
            devices=None if section.devices is None else tuple(section.devices),
        )
        for name, section in sections
    ]
    demands += [
        ClusterDemand(
            name=f"reward_{domain}",
            world_size=r.world_size,
            gpus_per_worker=0.0,
            cpus_per_worker=r.num_cpus_per_worker,
        )
        for domain, r in cfg.rewards.items()
    ]
    return demands


def plan_for(cfg: Any) -> DevicePlan:
    """The device plan of a PipelineConfig."""
    return plan_devices(pipeline_demands(cfg), cfg.ray.num_gpus_per_node)


def check_capacity(plan: DevicePlan, node_gpus: Sequence[float]) -> list[str]:
    """Problems (key-path messages) placing `plan` on nodes with `node_gpus` GPUs each; [] when it fits.

    A node with k * gpus_per_node GPUs can hold k of the plan's nodes."""
    if not plan.num_nodes:
        return []
    fits = sum(int(gpus // plan.gpus_per_node) for gpus in node_gpus)
    if fits >= plan.num_nodes:
        return []
    have = ", ".join(f"{g:g}" for g in sorted(node_gpus, reverse=True)) or "none"
    errors = []
    for name, workers in plan.slots.items():
        beyond = sorted({d for w in workers for d in w.devices if d // plan.gpus_per_node >= fits})
        if beyond:
            errors.append(
                f"{name}.device_mapping: GPU(s) {_ranges(beyond)} lie beyond the {fits * plan.gpus_per_node} GPUs "
                f"this Ray cluster can hold in whole nodes of {plan.gpus_per_node} (ray.num_gpus_per_node); "
                f"the plan needs {plan.num_nodes} node(s) x {plan.gpus_per_node} GPUs, the nodes have GPUs: {have}"
            )
    return errors


def describe(plan: DevicePlan) -> list[str]:
    """The plan in a few lines for people: the pool, who shares which GPUs, and what else Ray places."""
    lines = []
    if plan.num_nodes:
        node_cpus = ", ".join(f"node {n} {sum(plan.bundle_cpus(n)):g}" for n in range(plan.num_nodes))
        lines.append(
            f"GPU pool: {plan.num_nodes} node{'s' if plan.num_nodes > 1 else ''} x {plan.gpus_per_node} GPUs "
            f"({plan.num_devices} GPUs; one placement group of {plan.gpus_per_node} one-GPU bundles per node, "
            f"which also hold the CPUs of the workers placed there: {node_cpus})"
        )
        for clusters, devices in plan.sharing_groups():
            nodes = sorted({d // plan.gpus_per_node for d in devices})
            where = f"GPUs {_ranges(devices)} (node{'s' if len(nodes) > 1 else ''} {_ranges(nodes)})"
            parts = ", ".join(_cluster_summary(plan.slots[c]) for c in clusters)
            if len(clusters) > 1:
                lines.append(
                    f"{where}: {parts}: colocated, {len(clusters)} clusters share each GPU (a worker holds "
                    f"1/{len(clusters)} of its first GPU in Ray's accounting)"
                )
            else:
                lines.append(f"{where}: {parts}: not shared")
        if unused := plan.unused_devices():
            lines.append(f"GPUs {_ranges(unused)}: unused (reserved with their nodes)")
    ray_placed = [d for d in plan.unmapped if d.world_size]
    gpu_free = [d for d in ray_placed if d.gpus_per_worker > 0]
    if gpu_free:
        total = sum(d.world_size * d.gpus_per_worker for d in gpu_free)
        parts = ", ".join(
            f"{d.name} ({_count(d.world_size, 'worker')} x {_count(d.gpus_per_worker, 'GPU')})"
            for d in gpu_free
        )
        lines.append(f"no device_mapping: Ray places {parts} wherever it finds the GPUs ({total:g} in all)")
    cpus = sum(w.num_cpus for workers in plan.slots.values() for w in workers)
    cpus += sum(d.world_size * d.cpus_per_worker for d in ray_placed)
    cpu_only = [d for d in ray_placed if d.gpus_per_worker == 0]
    if cpu_only:
        parts = ", ".join(
            f"{d.name} ({_count(d.world_size, 'worker')} x {_count(d.cpus_per_worker, 'CPU')})"
            for d in cpu_only
        )
        lines.append(f"CPU only, placed by Ray: {parts}")
    lines.append(f"the workers need {cpus:g} logical CPUs in all (each domain's scheduler adds ray.scheduler_num_cpus)")
    return lines


def _cluster_summary(workers: Sequence[WorkerSlot]) -> str:
    return (
        f"{workers[0].cluster} ({_count(len(workers), 'worker')} x {_count(len(workers[0].devices), 'GPU')})"
    )


def _count(n: float, noun: str) -> str:
    return f"{n:g} {noun}{'' if n == 1 else 's'}"


def _ranges(values: Sequence[int]) -> str:
    """[0, 1, 2, 3, 8, 9] -> '0-3, 8-9'."""
    parts: list[str] = []
    start = prev = None
    for v in sorted(values):
        if prev is not None and v == prev + 1:
            prev = v
            continue
        if start is not None:
            parts.append(f"{start}-{prev}" if prev != start else str(start))
        start = prev = v
    if start is not None:
        parts.append(f"{start}-{prev}" if prev != start else str(start))
    return ", ".join(parts)


class DevicePool:
    """The plan's GPUs held in Ray placement groups, one per node, while the pipeline runs."""

    def __init__(self, plan: DevicePlan, groups: list[Any], gpu_ids: dict[int, str]) -> None:
        self.plan = plan
        self.groups = groups
        self.gpu_ids = gpu_ids
        """Ray's id of each pool GPU (its CUDA_VISIBLE_DEVICES value), probed only for multi-GPU workers."""

    @classmethod
    def reserve(cls, plan: DevicePlan, timeout_s: float = 120.0) -> DevicePool:
        """Reserve every node of the plan, or raise naming what the Ray cluster lacks."""
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group

        node_gpus = [n["Resources"].get("GPU", 0.0) for n in ray.nodes() if n["Alive"]]
        problems = check_capacity(plan, node_gpus)
        if problems:
            raise PlanError("\n".join(problems))
        groups = []
        for node in range(plan.num_nodes):
            bundles = [{"GPU": 1.0, **({"CPU": c} if c else {})} for c in plan.bundle_cpus(node)]
            groups.append(placement_group(bundles, strategy="STRICT_PACK", name=f"roll-gpu-pool-node{node}"))
        ready, _ = ray.wait([g.ready() for g in groups], num_returns=len(groups), timeout=timeout_s)
        if len(ready) < len(groups):
            for g in groups:
                remove_placement_group(g)
            raise RuntimeError(
                f"could not reserve the GPU pool ({plan.num_nodes} node(s) x {plan.gpus_per_node} GPUs) within "
                f"{timeout_s:.0f} s; the Ray cluster has {ray.cluster_resources()} over {len(node_gpus)} node(s)"
            )
        pool = cls(plan, groups, {})
        multi = {
            d for workers in plan.slots.values() for w in workers if len(w.devices) > 1 for d in w.devices
        }
        pool.gpu_ids = pool._probe_gpu_ids(sorted(multi))
        return pool

    def _probe_gpu_ids(self, devices: list[int]) -> dict[int, str]:
        """Ray's GPU id behind each of `devices`' bundles, asked before any worker holds a share of them."""
        if not devices:
            return {}
        import ray

        @ray.remote(num_cpus=0, num_gpus=1.0 / _SHARE_QUANTUM)
        def gpu_id() -> str:
            return str(ray.get_gpu_ids()[0])

        refs = [gpu_id.options(scheduling_strategy=self._strategy(d)).remote() for d in devices]
        return dict(zip(devices, ray.get(refs), strict=True))

    def _strategy(self, device: int) -> Any:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return PlacementGroupSchedulingStrategy(
            self.groups[device // self.plan.gpus_per_node],
            placement_group_bundle_index=device % self.plan.gpus_per_node,
        )

    def worker_options(self, cluster: str) -> list[dict[str, Any]]:
        """Ray actor options per rank of a mapped cluster: its home bundle, its share of that GPU, its CPUs, and
        for a multi-GPU worker the env vars that make all of its GPUs visible (Ray only assigns the home one)."""
        out = []
        for w in self.plan.slots[cluster]:
            options: dict[str, Any] = {
                "num_gpus": w.num_gpus,
                "num_cpus": w.num_cpus,
                "scheduling_strategy": self._strategy(w.devices[0]),
            }
            if len(w.devices) > 1:
                options["env_vars"] = {
                    "CUDA_VISIBLE_DEVICES": ",".join(self.gpu_ids[d] for d in w.devices),
                    "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1",
                }
            out.append(options)
        return out

    def release(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for g in self.groups:
            remove_placement_group(g)
        self.groups = []

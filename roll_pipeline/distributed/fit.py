"""Whether a run fits the Ray cluster it runs on, checked before any of its actors starts.

`run_actors` lists every actor a run starts (each cluster's workers, the GPU pool's bundles, reward workers, the
domains' schedulers, local LLM-judge actors) with what each asks Ray for and the settings that size it.
`place` packs them onto the nodes' resources (the most constrained first: strict strategies, pinned actors, GPU
actors, then by size; each actor on the node with the most CPU free); what it cannot place is the shortfall
that `fit_report` turns into one message naming the sections, their settings, and how much is missing. A run whose actors do not all fit would otherwise wait forever for the ones Ray cannot place.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

_EPS = 1e-6


class RunDoesNotFit(RuntimeError):
    """The run's actors cannot all be placed on the Ray cluster; the message names the shortfall and the settings."""


@dataclass(frozen=True)
class ActorGroup:
    """`count` actors that ask for the same `resources` each, placed with `strategy`."""

    name: str
    count: int
    resources: dict[str, float]
    settings: tuple[str, ...]
    """The config keys that size the group, for the message."""
    strategy: str = "default"
    """default, pack or spread (Ray places each actor where it fits), strict_spread (a node each), strict_pack
    (all on one node: a node of the GPU pool)."""


@dataclass
class Node:
    id: str
    address: str
    resources: dict[str, float]
    free: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.free = dict(self.resources)

    def holds(self, ask: dict[str, float]) -> bool:
        return all(self.free.get(k, 0.0) + _EPS >= v for k, v in ask.items())

    def take(self, ask: dict[str, float]) -> None:
        for k, v in ask.items():
            self.free[k] = self.free.get(k, 0.0) - v

    def label(self) -> str:
        return f"{self.id[:8]} ({self.address}): {_amounts(self.resources)}"


def _ask(cpus: float, gpus: float, custom: dict[str, float] | None = None) -> dict[str, float]:
    ask = {"CPU": float(cpus), "GPU": float(gpus), **{k: float(v) for k, v in (custom or {}).items()}}
    return {k: v for k, v in ask.items() if v > 0}


def run_actors(cfg: Any, plan: Any = None) -> list[ActorGroup]:
    """Every actor a run of `cfg` (a PipelineConfig) starts, grouped by what each asks for. `plan`: its device
    plan (roll_pipeline/distributed/placement.py), whose mapped clusters run in the GPU pool's bundles."""
    from roll_pipeline.distributed.placement import plan_for, running_sections

    plan = plan if plan is not None else plan_for(cfg)
    groups: list[ActorGroup] = []
    for node in range(plan.num_nodes):  # one placement group of a bundle per GPU, all on one Ray node
        groups.append(ActorGroup(
            f"GPU pool node {node}", 1, _ask(sum(plan.bundle_cpus(node)), plan.gpus_per_node),
            tuple(f"{m}.device_mapping" for m in sorted(plan.slots)), strategy="strict_pack",
        ))
    for name, section in running_sections(cfg):
        if name in plan.slots:
            continue
        ask = _ask(section.num_cpus_per_worker, section.num_gpus_per_worker, section.resources)
        groups.append(ActorGroup(name, section.world_size, ask, _settings(name, ask), strategy=section.placement))
    for domain in cfg.domain_interleave_probs:
        reward = cfg.rewards[domain]
        components = reward.components()
        for i, c in enumerate(components):
            key = f"rewards.{domain}.workers[{i}]" if reward.workers else f"rewards.{domain}"
            name = f"reward_{domain}_{c.label}" if len(components) > 1 else f"reward_{domain}"
            ask = _ask(c.num_cpus_per_worker, c.num_gpus_per_worker, c.resources)
            groups.append(ActorGroup(name, c.world_size, ask, _settings(key, ask)))
            judge = _local_judge(c)
            if judge is not None:
                count = 1 if judge.get("name") else c.world_size
                ask = _ask(judge.get("num_cpus", 0.0), judge.get("num_gpus", 0.0))
                if ask:
                    groups.append(ActorGroup(
                        f"{name} judge", count, ask,
                        (f"{key}.options.actor.num_cpus", f"{key}.options.actor.num_gpus"),
                    ))
    scheduler = _ask(cfg.ray.scheduler_num_cpus, 0.0)
    if scheduler:
        groups.append(ActorGroup("schedulers", len(cfg.domain_interleave_probs), scheduler, ("ray.scheduler_num_cpus",)))
    return groups


def _settings(key: str, ask: dict[str, float]) -> tuple[str, ...]:
    """The settings under `key` that size a group asking for `ask`."""
    named = [f"{key}.world_size", f"{key}.num_cpus_per_worker"] if "CPU" in ask else [f"{key}.world_size"]
    if "GPU" in ask:
        named.append(f"{key}.num_gpus_per_worker")
    if set(ask) - {"CPU", "GPU"}:
        named.append(f"{key}.resources")
    return tuple(named)


def _local_judge(component: Any) -> dict[str, Any] | None:
    """The `actor` options of an llm_judge component whose judge runs as a Ray actor of the run, else None."""
    options = component.options or {}
    if component.worker != "llm_judge" or options.get("backend") != "ray_actor":
        return None
    actor = options.get("actor") or {}
    return actor if isinstance(actor, dict) else {}


def total(groups: Sequence[ActorGroup]) -> dict[str, float]:
    out: dict[str, float] = {}
    for g in groups:
        for k, v in g.resources.items():
            out[k] = out.get(k, 0.0) + g.count * v
    return out


def place(groups: Sequence[ActorGroup], nodes: Sequence[Node]) -> list[tuple[ActorGroup, int]]:
    """Pack `groups` onto `nodes` (their `free` is used up); returns (group, actors of it not placed)."""
    order = {"strict_pack": 0, "strict_spread": 1}
    # The most constrained first: strict strategies, then actors pinned by custom resources, then GPU, then CPU.
    ranked = sorted(groups, key=lambda g: (order.get(g.strategy, 2), -len(set(g.resources) - {"CPU", "GPU"}),
                                           -g.resources.get("GPU", 0.0), -g.resources.get("CPU", 0.0)))
    unplaced = []
    for g in ranked:
        if g.strategy == "strict_pack":
            home = next((n for n in nodes if n.holds({k: v * g.count for k, v in g.resources.items()})), None)
            for _ in range(g.count if home else 0):
                home.take(g.resources)
            left = 0 if home else g.count
        elif g.strategy == "strict_spread":
            fitting = sorted((n for n in nodes if n.holds(g.resources)), key=lambda n: -n.free.get("CPU", 0.0))
            for n in fitting[: g.count]:
                n.take(g.resources)
            left = max(0, g.count - len(fitting))
        else:
            left = 0
            for _ in range(g.count):
                home = max((n for n in nodes if n.holds(g.resources)), key=lambda n: n.free.get("CPU", 0.0),
                           default=None)
                if home is None:
                    left += 1
                else:
                    home.take(g.resources)
        if left:
            unplaced.append((g, left))
    return unplaced


def fit_report(groups: Sequence[ActorGroup], nodes: Sequence[Node], where: str) -> str | None:
    """None when every actor of `groups` fits `nodes` (copies are packed: the nodes are left as they were); else
    the error: the cluster, what the run asks for section by section, what is short, and what to change."""
    trial = [Node(n.id, n.address, dict(n.resources)) for n in nodes]
    unplaced = place(groups, trial)
    if not unplaced:
        return None
    need, have = total(groups), {}
    for n in nodes:
        for k, v in n.resources.items():
            have[k] = have.get(k, 0.0) + v
    width = max(len(g.name) for g in groups)
    lines = [
        f"the run does not fit the Ray cluster {where}: nothing was started.",
        f"The cluster: {len(nodes)} node(s), {_amounts({k: have.get(k, 0.0) for k in need})} in all:",
        *(f"  node {n.label()}" for n in nodes),
        f"The run asks for {_amounts(need)}:",
        *(f"  {g.name:<{width}}  {g.count} x {_amounts(g.resources):<16} {_strategy(g)}{', '.join(g.settings)}"
          for g in groups),
    ]
    short = {k: v - have.get(k, 0.0) for k, v in need.items() if v > have.get(k, 0.0) + _EPS}
    cannot = ", ".join(f"{g.name} ({left} of {g.count})" for g, left in unplaced)
    if short:
        lines.append(f"Short by {_amounts(short)}: cannot place {cannot}.")
    else:
        lines.append(
            f"The amounts are there in all, but no node has room for {cannot} beside the rest "
            "(one worker's resources must fit one node; strict_spread needs a node per worker)."
        )
    lines.append(
        "Lower world_size or num_cpus_per_worker / num_gpus_per_worker of the sections above (or "
        "ray.scheduler_num_cpus), or add nodes to the cluster; `roll run CONFIG --dry-run` checks again."
    )
    return "\n".join(lines)


def _strategy(g: ActorGroup) -> str:
    return "" if g.strategy == "default" else f"[{g.strategy}] "


def _amounts(resources: dict[str, float]) -> str:
    return ", ".join(f"{v:g} {k}" for k, v in resources.items()) or "nothing"


def cluster_nodes() -> list[Node]:
    """The alive nodes of the Ray cluster this process is connected to, with their total resources."""
    import ray

    nodes = []
    for n in ray.nodes():
        if not n.get("Alive"):
            continue
        resources = {
            k: float(v) for k, v in n["Resources"].items()
            if not k.startswith(("node:", "accelerator_type:")) and k not in ("memory", "object_store_memory")
        }
        nodes.append(Node(n["NodeID"], n.get("NodeManagerAddress", "?"), resources))
    return nodes


def check_fit(groups: Sequence[ActorGroup], where: str, free_wait_s: float = 10.0) -> None:
    """Raise `RunDoesNotFit` unless `groups` fit the connected Ray cluster: by its nodes' totals, then by what is
    free now (other jobs' actors hold resources too; resources freed a moment ago are waited for `free_wait_s`)."""
    import ray

    report = fit_report(groups, cluster_nodes(), where)
    if report:
        raise RunDoesNotFit(report)
    need = total(groups)
    deadline = time.monotonic() + free_wait_s
    while True:
        free = ray.available_resources()
        short = {k: v - free.get(k, 0.0) for k, v in need.items() if v > free.get(k, 0.0) + _EPS}
        if not short or time.monotonic() >= deadline:
            break
        time.sleep(0.5)
    if short:
        held = {k: ray.cluster_resources().get(k, 0.0) - free.get(k, 0.0) for k in short}
        raise RunDoesNotFit(
            f"the run fits the Ray cluster {where} by its size, but other work holds {_amounts(held)} of it now "
            f"(other jobs or actors; `ray status` lists them), so {_amounts(short)} of the run's "
            f"{_amounts(need)} is not free; nothing was started. Wait for them, or lower the run's resources."
        )

"""Whether the models fit where the run puts them, from the checkpoints' parameter counts, before Ray starts.

Each worker holds at least its model's weights; a trained one (actor_train, critic) also gradients and AdamW's two
moments, 16 bytes per parameter in all with float32 or mixed precision (ZeRO stage 1 shards the optimizer states
over the cluster's ranks, stage 2 the gradients too, stage 3 the weights too); with LoRA the base is frozen and
counts its weights only. Activations and the KV cache come on
top, so these are lower bounds: a run they do not fit cannot work. A CPU-only run on this host must hold every
worker in this host's memory; a GPU worker must hold its own states in its share of one GPU (checked where the
driver sees the GPUs).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

GIB = 2**30
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
ADAM_AND_GRADS_BYTES = 16
"""float32: weights 4 + gradients 4 + two moments 8. Mixed precision: weights 2 + gradients 2 + float32 master
weights 4 + moments 8."""


def parameter_count(folder: Path) -> int | None:
    """Parameters in a local checkpoint's safetensors files, read from their headers (no weights loaded); None
    where there are none (a hub id, .bin weights)."""
    from safetensors import safe_open

    files = sorted(Path(folder).glob("*.safetensors")) if Path(folder).is_dir() else []
    if not files:
        return None
    total = 0
    for file in files:
        try:
            with safe_open(str(file), framework="numpy") as handle:
                for name in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                    n = 1
                    for dim in handle.get_slice(name).get_shape():
                        n *= dim
                    total += n
        except Exception:  # an unreadable file: the model check reports the folder; no bound from it
            return None
    return total


@dataclass(frozen=True)
class Need:
    section: str
    workers: int
    bytes_per_worker: int
    gpus_per_worker: float
    what: str


def needs(cfg) -> list[Need]:
    """Each model-holding cluster's lower bound per worker (see the module docstring)."""
    out = []
    for name in ("actor_train", "critic", "actor_infer", "reference"):
        section = getattr(cfg, name, None)
        if section is None or (name == "reference" and not cfg.reference_cluster):
            continue
        params = parameter_count(Path(section.model_args.model_name_or_path))
        if params is None:
            continue
        weight_bytes = BYTES[section.model_args.dtype]
        if name in ("actor_train", "critic") and section.lora is not None:
            # A frozen base: its weights alone; the adapters' gradients and moments are a small fraction on top.
            per_worker = params * weight_bytes
            what = f"{params / 1e6:.1f}M frozen parameters x {weight_bytes} B (LoRA: only the adapters train)"
        elif name in ("actor_train", "critic"):
            stage, ranks = section.zero_stage, section.world_size
            per_param = ADAM_AND_GRADS_BYTES
            sharded = {0: 0, 1: 12, 2: 12 + weight_bytes, 3: per_param}[min(stage, 3)]
            per_worker = params * ((per_param - sharded) + sharded / ranks)
            what = f"{params / 1e6:.1f}M parameters x 16 B (weights, gradients, AdamW), ZeRO stage {stage}"
        elif name == "actor_infer" and section.strategy_args.strategy_name == "vllm":
            continue  # vLLM takes gpu_memory_utilization of its GPU, whatever the model
        else:
            per_worker = params * weight_bytes
            what = f"{params / 1e6:.1f}M parameters x {weight_bytes} B ({section.model_args.dtype})"
        out.append(Need(name, section.world_size, int(per_worker), section.num_gpus_per_worker, what))
    return out


def host_problems(cfg, host_memory_bytes: int) -> list[str]:
    """A CPU-only run on this host: every worker's lower bound together against the host's memory."""
    all_needs = needs(cfg)
    if any(n.gpus_per_worker for n in all_needs):
        return []
    total = sum(n.workers * n.bytes_per_worker for n in all_needs)
    if total <= host_memory_bytes:
        return []
    parts = "; ".join(
        f"{n.section}: {n.workers} x {n.bytes_per_worker / GIB:.1f} GiB ({n.what})" for n in all_needs
    )
    return [
        f"the models need at least {total / GIB:.1f} GiB of memory before activations, this host has "
        f"{host_memory_bytes / GIB:.1f} GiB ({parts}); use a smaller model (pretrain), fewer workers "
        "(world_size), or GPUs"
    ]


def gpu_problems(cfg, gpu_memory_bytes: int) -> list[str]:
    """Each GPU worker's lower bound against its share of one GPU of `gpu_memory_bytes`, then the clusters
    that share GPUs together (`shared_gpu_problems`)."""
    problems = []
    for need in needs(cfg):
        if not need.gpus_per_worker:
            continue
        share = gpu_memory_bytes * min(need.gpus_per_worker, 1.0)
        if need.bytes_per_worker > share:
            problems.append(
                f"{need.section}: each worker needs at least {need.bytes_per_worker / GIB:.1f} GiB ({need.what}), "
                f"its share of a GPU is {share / GIB:.1f} GiB (num_gpus_per_worker {need.gpus_per_worker:g} of "
                f"{gpu_memory_bytes / GIB:.0f} GiB); raise {need.section}.world_size with ZeRO stage 2-3, or give "
                "it more of a GPU"
            )
    return problems + shared_gpu_problems(cfg, gpu_memory_bytes)


def shared_gpu_problems(cfg, gpu_memory_bytes: int) -> list[str]:
    """Clusters whose device_mappings share a GPU, added together on each shared GPU.

    Each worker's share alone can fit while the GPU cannot hold them all: what stays resident all the time (a
    section without offload_states, vLLM awake) adds up, and of the sections that take turns (offload_states,
    vLLM asleep between rollouts) the largest comes on top. vLLM holds gpu_memory_utilization of its GPU while
    awake."""
    held: dict[int, list[tuple[str, int, bool]]] = {}
    by_section = {n.section: n for n in needs(cfg)}
    infer = cfg.actor_infer
    if infer.strategy_args.strategy_name == "vllm" and infer.devices is not None:
        utilization = float(infer.strategy_args.strategy_config.get("gpu_memory_utilization", 0.6))
        by_section["actor_infer"] = Need(
            "actor_infer", infer.world_size, int(utilization * gpu_memory_bytes), infer.num_gpus_per_worker,
            f"vLLM's gpu_memory_utilization {utilization:g}",
        )
    for name, need in by_section.items():
        section = getattr(cfg, name)
        if section.devices is None:
            continue
        takes_turns = cfg.infer_offloads if name == "actor_infer" else section.offload_states
        for device in set(section.devices):
            held.setdefault(device, []).append((name, need.bytes_per_worker, takes_turns))
    problems = []
    for device, parts in sorted(held.items()):
        if len(parts) < 2:
            continue
        resident = sum(size for _, size, turns in parts if not turns)
        peak = resident + max((size for _, size, turns in parts if turns), default=0)
        if peak > gpu_memory_bytes:
            detail = ", ".join(
                f"{name} {size / GIB:.1f} GiB{' (takes turns)' if turns else ''}" for name, size, turns in parts
            )
            problems.append(
                f"GPU {device} is shared by {detail}: at least {peak / GIB:.1f} GiB at once, the GPU has "
                f"{gpu_memory_bytes / GIB:.0f} GiB; set offload_states on the colocated sections (and vLLM's "
                "enable_sleep_mode), lower gpu_memory_utilization, or give the clusters GPUs of their own"
            )
            break  # one GPU says it; the pools repeat on every GPU of the mapping
    return problems


def total_bytes(cfg) -> int:
    return sum(n.workers * n.bytes_per_worker for n in needs(cfg))

"""Whether the models fit where the run puts them, from the checkpoints' parameter counts, before Ray starts.

Each worker holds at least its model's weights; a trained one (actor_train, critic) also gradients and AdamW's two
moments, 16 bytes per parameter in all with float32 or mixed precision (ZeRO stage 1 shards the optimizer states
over the cluster's ranks, stage 2 the gradients too, stage 3 the weights too); with LoRA the base is frozen and
counts its weights only. On top comes what one micro-batch computes (`micro_batch`): a micro-batch as full as its
token budget allows (or its rows at the longest row, without one) holds at least its output layer's logits over the
response tokens and, in the train step, what each layer keeps for the backward (`kept_per_token_and_layer`). Every other activation, the KV
cache and allocator slack come on top of that, so these are lower bounds: a run they do not fit cannot work (a
micro-batch that full comes whenever the rollouts are that long). A CPU-only run on this host must hold every
worker's states and the largest micro-batch (the stages run one at a time) in this host's memory; a GPU worker must
hold its own states and micro-batch in its share of one GPU (checked where the driver sees the GPUs).
"""

from __future__ import annotations

import json
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
class Shape:
    """A checkpoint's sizes, from its config.json (a multimodal model's text_config)."""

    hidden: int
    layers: int
    vocab: int
    intermediate: int | None = None
    """The MLP's width (intermediate_size), where config.json says it."""


def model_shape(folder: Path) -> Shape | None:
    """hidden_size, num_hidden_layers, vocab_size (and intermediate_size) of a local checkpoint; None where
    config.json lacks one of the first three."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    config = config.get("text_config", config)
    try:
        intermediate = config.get("intermediate_size")
        return Shape(int(config["hidden_size"]), int(config["num_hidden_layers"]), int(config["vocab_size"]),
                     int(intermediate) if isinstance(intermediate, int) else None)
    except (KeyError, TypeError, ValueError):
        return None


@dataclass(frozen=True)
class MicroBatch:
    """The lower bound of one full micro-batch's activations on a worker, and the key that sizes it."""

    bytes: int
    key: str
    what: str


def kept_per_token_and_layer(shape: Shape, full_weights: bool, checkpointing: bool) -> int:
    """Values per token and layer that autograd keeps for the backward, at least: with every weight trained and no
    gradient checkpointing, the inputs of the attention's projections, of its output projection, of the MLP's
    gate/up and of its down projection (each a weight's gradient needs): 3 x hidden + intermediate; with gradient
    checkpointing (each layer's input kept, the rest recomputed) or LoRA (the frozen projections keep nothing for
    their weights; each layer's adapters keep their input), hidden. tests/test_gpu_phases.py counts what torch
    keeps for the embedded model in each case."""
    if full_weights and not checkpointing and shape.intermediate is not None:
        return 3 * shape.hidden + shape.intermediate
    return shape.hidden


def micro_batch_bytes(shape: Shape, dtype_bytes: int, tokens: int, response_share: float, logits: bool,
                      kept: int) -> int:
    """`tokens` through the model, `response_share` of them response tokens: their logits (a causal LM's output
    layer, over the response tokens only, `logits`) in the model's dtype, and `kept` values per token and layer
    kept for the backward (0 without gradient: `kept_per_token_and_layer`)."""
    total = int(tokens * response_share) * shape.vocab * dtype_bytes if logits else 0
    return total + tokens * kept * shape.layers * dtype_bytes


def micro_batch(cfg, name: str, section, shape: Shape) -> MicroBatch:
    """The fullest micro-batch `section` may run: its forward passes without gradient (log-probs, values) and, for
    actor_train and critic, its train step; each as many tokens as its budget holds, or its rows at data.prompt_length
    + max_new_tokens each, and never more rows than the pass gets (a rank's share of the step's samples for the
    forward passes, its mini-batch for the train step). A packed one reads no padding, a padded one is counted with
    it: either way at most the budget's tokens."""
    row = cfg.data.prompt_length + cfg.actor_infer.generating_args.max_new_tokens
    share = cfg.actor_infer.generating_args.max_new_tokens / row  # rows of the longest prompt and response
    dtype_bytes = BYTES[section.model_args.dtype]
    logits = name != "critic"
    per_rank = -(-cfg.samples_per_step // section.world_size)
    passes = [(f"{name}.infer_max_tokens_per_microbatch", section.infer_max_tokens_per_microbatch,
               f"{name}.infer_batch_size", section.infer_batch_size, per_rank, False)]
    if name in ("actor_train", "critic"):
        ta = section.training_args
        passes.append((f"{name}.training_args.max_tokens_per_microbatch", ta.max_tokens_per_microbatch,
                       f"{name}.training_args.per_device_train_batch_size", ta.per_device_train_batch_size,
                       min(ta.minibatch_size, per_rank), True))
    kept = kept_per_token_and_layer(shape, getattr(section, "lora", None) is None,
                                    section.model_args.gradient_checkpointing)
    fullest = MicroBatch(0, "", "")
    for budget_key, budget, rows_key, rows, most_rows, train in passes:
        if budget is not None:
            tokens, key = min(budget, most_rows * row), budget_key
        else:
            rows = min(rows, most_rows)
            tokens, key = rows * row, rows_key
        size = micro_batch_bytes(shape, dtype_bytes, tokens, share, logits, kept if train else 0)
        if size > fullest.bytes:
            parts = [f"logits of {int(tokens * share)} response tokens x {shape.vocab} vocabulary"] if logits else []
            if train:
                parts.append(f"{shape.layers} layers x {tokens} tokens x {kept} values kept for the backward")
            sized = f"{key} {budget}" if budget is not None else f"{rows} rows of {row} ({key})"
            what = (f"{'a train step' if train else 'a forward'} of {tokens} tokens, {sized}: "
                    f"{' + '.join(parts)} x {dtype_bytes} B")
            fullest = MicroBatch(size, key, what)
    return fullest


@dataclass(frozen=True)
class Need:
    section: str
    workers: int
    bytes_per_worker: int
    gpus_per_worker: float
    what: str
    micro_batch: MicroBatch = MicroBatch(0, "", "")
    """What one micro-batch adds on top of `bytes_per_worker` (the model's states) while it runs."""

    @property
    def peak_bytes(self) -> int:
        return self.bytes_per_worker + self.micro_batch.bytes


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
        shape = model_shape(Path(section.model_args.model_name_or_path))
        fullest = MicroBatch(0, "", "")
        if shape is not None and name != "actor_infer":  # generation's memory is the engine's KV cache
            fullest = micro_batch(cfg, name, section, shape)
        out.append(Need(name, section.world_size, int(per_worker), section.num_gpus_per_worker, what, fullest))
    return out


def host_problems(cfg, host_memory_bytes: int) -> list[str]:
    """A CPU-only run on this host: every worker's lower bound together against the host's memory."""
    all_needs = needs(cfg)
    if any(n.gpus_per_worker for n in all_needs):
        return []
    states = sum(n.workers * n.bytes_per_worker for n in all_needs)
    fullest = max(all_needs, key=lambda n: n.micro_batch.bytes, default=None)
    activations = fullest.micro_batch.bytes if fullest else 0
    if states + activations <= host_memory_bytes:
        return []
    parts = "; ".join(
        f"{n.section}: {n.workers} x {n.bytes_per_worker / GIB:.1f} GiB ({n.what})" for n in all_needs
    )
    if states <= host_memory_bytes:  # the states fit; the largest micro-batch does not on top
        return [
            f"the models' states need at least {states / GIB:.1f} GiB ({parts}) and {fullest.section}'s fullest "
            f"micro-batch at least {activations / GIB:.1f} GiB more ({fullest.micro_batch.what}); this host has "
            f"{host_memory_bytes / GIB:.1f} GiB: lower {fullest.micro_batch.key}"
        ]
    return [
        f"the models need at least {states / GIB:.1f} GiB of memory before activations, this host has "
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
        of_share = (f"its share of a GPU is {share / GIB:.1f} GiB (num_gpus_per_worker {need.gpus_per_worker:g} of "
                    f"{gpu_memory_bytes / GIB:.0f} GiB)")
        if need.bytes_per_worker > share:
            problems.append(
                f"{need.section}: each worker needs at least {need.bytes_per_worker / GIB:.1f} GiB ({need.what}), "
                f"{of_share}; raise {need.section}.world_size with ZeRO stage 2-3, or give it more of a GPU"
            )
        elif need.peak_bytes > share:
            problems.append(
                f"{need.section}: each worker holds at least {need.bytes_per_worker / GIB:.1f} GiB ({need.what}) "
                f"and its fullest micro-batch at least {need.micro_batch.bytes / GIB:.1f} GiB more "
                f"({need.micro_batch.what}), {of_share}; lower {need.micro_batch.key}"
            )
    return problems + shared_gpu_problems(cfg, gpu_memory_bytes)


def shared_gpu_problems(cfg, gpu_memory_bytes: int) -> list[str]:
    """Clusters whose device_mappings share a GPU, added together on each shared GPU.

    Each worker's share alone can fit while the GPU cannot hold them all: what stays resident all the time (a
    section without offload_states, vLLM awake) adds up, and of the sections that take turns (offload_states,
    vLLM asleep between rollouts) the largest comes on top, with the micro-batch of the section that runs
    (`micro_batch`). vLLM holds gpu_memory_utilization of its GPU while awake."""
    held: dict[int, list[tuple[str, int, bool, int]]] = {}
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
            held.setdefault(device, []).append((name, need.bytes_per_worker, takes_turns, need.micro_batch.bytes))
    problems = []
    for device, parts in sorted(held.items()):
        if len(parts) < 2:
            continue
        resident = sum(size for _, size, turns, _ in parts if not turns)
        # the section that runs: its states on top where it takes turns, and its micro-batch
        peak = resident + max((size if turns else 0) + micro for _, size, turns, micro in parts)
        if peak > gpu_memory_bytes:
            detail = ", ".join(
                f"{name} {size / GIB:.1f} GiB{' (takes turns)' if turns else ''}"
                f"{f' + {micro / GIB:.1f} GiB a micro-batch' if micro else ''}" for name, size, turns, micro in parts
            )
            problems.append(
                f"GPU {device} is shared by {detail}: at least {peak / GIB:.1f} GiB at once, the GPU has "
                f"{gpu_memory_bytes / GIB:.0f} GiB; set offload_states on the colocated sections (and vLLM's "
                "enable_sleep_mode), lower gpu_memory_utilization or the token budgets, or give the clusters GPUs "
                "of their own"
            )
            break  # one GPU says it; the pools repeat on every GPU of the mapping
    return problems


def total_bytes(cfg) -> int:
    return sum(n.workers * n.bytes_per_worker for n in needs(cfg))

"""ROLL's clusters (actor_train, actor_infer, reference, critic) as this project's: models, devices, training
arguments, and strategies (Megatron and FSDP2 become DeepSpeed ZeRO stages, SGLang becomes vLLM)."""

from __future__ import annotations

from typing import Any

from roll_core.config.clusters import LORA_DEFAULT_TARGETS
from roll_core.config.devices import parse_device_mapping
from roll_pipeline.roll_import.report import Importer

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
DTYPES.update({v: v for v in list(DTYPES.values())})

MEGATRON_SPLITS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size")
MEGATRON_OTHER_SPLITS = ("expert_model_parallel_size", "virtual_pipeline_model_parallel_size",
                         "pipeline_model_parallel_layout")

#: strategy_config keys of Megatron and FSDP2 that choose kernels, overlap, recomputation or layout: the same
#: maths on a different schedule, nothing for DeepSpeed to take.
SPEED_ONLY = {
    "apply_rope_fusion", "bias_activation_fusion", "cross_entropy_loss_fusion", "moe_grouped_gemm",
    "moe_token_dispatcher_type", "moe_shared_expert_overlap", "moe_layer_recompute", "overlap_grad_reduce",
    "recompute_granularity", "recompute_modules", "account_for_embedding_in_pipeline_split",
    "account_for_loss_in_pipeline_split", "additional_configs", "apply_tiled_mlp", "tiled_num_shards",
    "sequence_parallel", "moe_use_grouped_mm", "distrib_optim_fully_reshardable", "use_batched_model_update",
    "apply_expert_patch", "bf16", "fp16", "fsdp_size", "reshard_after_forward", "param_dtype", "reduce_dtype",
    "wrap_policy", "ep_size", "efsdp_size", "overlap_param_gather",
}

#: Section keys about batching, padding and buffers: how the work is cut, not what is computed (but for the token
#: budgets of the forward passes and the train step, their rounding and sequence packing, which _token_budgets and
#: _packing map first).
SECTION_SPEED_ONLY = (
    "offload_nccl", "use_remove_padding", "use_dynamic_batching_in_train", "use_dynamic_batching_in_infer",
    "max_tokens_per_microbatch_in_train", "max_tokens_per_microbatch_in_infer", "sequence_length_round_in_train",
    "sequence_length_round_in_infer", "use_sequence_packing", "max_concurrency",
    "backend_timeout", "logits_in_fp32", "model_update_frequency",
)

#: vLLM engine arguments written through to vllm.LLM as they are.
VLLM_KEYS = (
    "gpu_memory_utilization", "block_size", "max_model_len", "enforce_eager", "enable_prefix_caching",
    "max_num_batched_tokens", "max_num_seqs", "pipeline_parallel_size", "distributed_executor_backend",
    "disable_log_stats",
)
VLLM_DROPPED = {
    "load_format": "ROLL starts vLLM with dummy weights until the first sync; here vLLM loads the model folder, "
    "and every rollout generates with actor_train's weights either way",
    "sleep_level": "vLLM sleeps whenever it shares its GPUs (enable_sleep_mode); the level is chosen per sync",
    "cuda_graph_sizes": "CUDA graph batch sizes (speed)",
    "cudagraph_capture_sizes": "CUDA graph batch sizes (speed)",
    "optimization_level": "vLLM's compilation level (speed)",
    "enable_memory_saver": "SGLang's memory saver (vLLM's sleep mode does this here)",
    "disable_mm_preprocessor_cache": "a multimodal cache",
}

DEFAULT_WORKERS = {
    "actor_train": ("roll.pipeline.rlvr.actor_worker.ActorWorker", "roll.pipeline.rlvr.actor_pg_worker.ActorPGWorker"),
    "reference": ("roll.pipeline.rlvr.actor_worker.ActorWorker",),
    "actor_infer": ("roll.pipeline.base_worker.InferWorker",),
    "critic": ("roll.pipeline.base_worker.CriticWorker",),
}


def import_clusters(imp: Importer) -> None:
    for section in ("actor_train", "actor_infer", "reference"):
        _cluster(imp, section)
    estimator = imp.ours("adv_estimator")
    if imp.src.has("critic") and estimator == "gae":
        _cluster(imp, "critic")
        imp.move("value_clip", "critic.value_clip")
        if not imp.src.has("critic.model_args.model_name_or_path") and imp.src.get("reward_pretrain"):
            imp.mapped("reward_pretrain", "critic.model_args.model_name_or_path", imp.src.get("reward_pretrain"))
    else:
        imp.dropped("critic", f"adv_estimator {estimator} uses no critic")
        imp.dropped("value_clip", f"adv_estimator {estimator} uses no critic")
    imp.dropped("reward_pretrain", "ROLL's default model of the critic and reward clusters: the rule rewards load "
                "none, a judge names its own")
    _lora(imp)


def _cluster(imp: Importer, sec: str) -> None:
    src = imp.src
    trains = sec in ("actor_train", "critic")
    _model_args(imp, sec, trains)
    _token_budgets(imp, sec)
    _packing(imp, sec)
    for key in SECTION_SPEED_ONLY:
        imp.dropped(f"{sec}.{key}", "how the work is batched or buffered, not what is computed")
    worker = src.get(f"{sec}.worker_cls")
    if worker is not None and worker in DEFAULT_WORKERS[sec]:
        imp.dropped(f"{sec}.worker_cls", "ROLL's policy-gradient worker: its loss is read from pg_variant"
                    if worker.endswith("ActorPGWorker") else "ROLL's default worker for this cluster")
    elif worker is not None:
        imp.refuse(f"{sec}.worker_cls", f"{worker}: a worker class of ROLL's other than its default")
    if sec == "actor_train":
        _pg_variant(imp, str(worker or ""))
    if src.has(f"{sec}.system_envs"):
        imp.refuse(f"{sec}.system_envs", "environment variables for ROLL's workers: set them where Ray starts")
    if src.get(f"{sec}.data_args") is not None and sec != "actor_train":
        imp.dropped(f"{sec}.data_args", "prompts are encoded once, as the data section says")
    if src.has(f"{sec}.generating_args") and sec != "actor_infer":
        imp.dropped(f"{sec}.generating_args", "only actor_infer and validation generate")
    imp.move(f"{sec}.infer_batch_size", f"{sec}.infer_batch_size")
    gpus_per = _devices(imp, sec)
    if sec in ("actor_train", "critic"):
        _training_args(imp, sec, _train_strategy(imp, sec))
    elif sec == "actor_infer":
        _infer_strategy(imp, sec, gpus_per)
    else:
        _reference_strategy(imp, sec)


#: ROLL's sequence_length_round_in_train/infer where a config leaves it out (roll/configs/worker_config.py).
ROLL_SEQUENCE_LENGTH_ROUND = 4


def _token_budgets(imp: Importer, sec: str) -> None:
    """ROLL's dynamic batching: its token budget per micro-batch of a cluster's forward passes without gradient
    (log-probs, values) is infer_max_tokens_per_microbatch here, and that of a trained cluster's train step
    training_args.max_tokens_per_microbatch (on a GPU they decide whether a long-tailed batch fits in memory); its
    sequence_length_round_in_* (a micro-batch's width padded up to a multiple of it, 4 when unset) is
    infer_sequence_length_round and training_args.sequence_length_round, but where the section packs (no padding to
    round). actor_infer's generation is the engine's to batch: its keys are dropped with the others."""
    if sec == "actor_infer":
        return
    kinds = [("infer", f"{sec}.infer_max_tokens_per_microbatch", f"{sec}.infer_sequence_length_round")]
    if sec in ("actor_train", "critic"):
        kinds.append(("train", f"{sec}.training_args.max_tokens_per_microbatch",
                      f"{sec}.training_args.sequence_length_round"))
    packing = bool(imp.src.get(f"{sec}.use_sequence_packing"))
    for kind, ours, ours_round in kinds:
        if not imp.src.get(f"{sec}.use_dynamic_batching_in_{kind}"):
            continue
        budget = imp.src.get(f"{sec}.max_tokens_per_microbatch_in_{kind}")
        if budget is None:
            continue
        imp.mapped(f"{sec}.max_tokens_per_microbatch_in_{kind}", ours, budget,
                   "rows longest first; a micro-batch's tokens counted with its padding")
        imp.part_of(f"{sec}.use_dynamic_batching_in_{kind}", ours)
        roll_round = f"{sec}.sequence_length_round_in_{kind}"
        if packing:
            imp.dropped(roll_round, "use_sequence_packing: a packed micro-batch has no padding to round")
        elif imp.src.has(roll_round):
            imp.move(roll_round, ours_round, int)
        else:
            imp.default(ours_round, ROLL_SEQUENCE_LENGTH_ROUND,
                        f"ROLL pads a dynamic batch's micro-batch width up to a multiple of {ROLL_SEQUENCE_LENGTH_ROUND} "
                        f"when {roll_round} is unset")


def _packing(imp: Importer, sec: str) -> None:
    """ROLL's sequence packing: use_sequence_packing here too (actor_train, reference, critic; actor_infer's engine
    batches its own sequences, and its key is dropped with the others), and its packed micro-batches' lengths
    (sequence_packing_args.max_packed_sequence_length_*) as the token budgets, where dynamic batching did not set
    them. How ROLL fills packed micro-batches (algorithm, min_num_micro_batches_*) is dropped."""
    src, args = imp.src, f"{sec}.sequence_packing_args"
    packing = sec != "actor_infer" and bool(src.get(f"{sec}.use_sequence_packing"))
    if sec != "actor_infer":
        imp.move(f"{sec}.use_sequence_packing", f"{sec}.use_sequence_packing", bool)
    kinds = [("forward", f"{sec}.infer_max_tokens_per_microbatch")]
    if sec in ("actor_train", "critic"):
        kinds.append(("train", f"{sec}.training_args.max_tokens_per_microbatch"))
    for kind, ours in kinds:
        key = f"{args}.max_packed_sequence_length_{kind}"
        if not packing or src.get(key) is None:
            continue
        if imp.ours(ours) is not None:
            imp.dropped(key, f"{ours} is dynamic batching's max_tokens_per_microbatch_in_"
                        f"{'train' if kind == 'train' else 'infer'}")
            continue
        imp.mapped(key, ours, src.get(key), "packed rows: the tokens they read, no padding")
    why = "how packed micro-batches are filled (here: rows longest first while the budget holds them)"
    if not packing:
        why = "use_sequence_packing is off"
    for key in src.keys(args):
        trains = sec in ("actor_train", "critic") or not key.endswith("_train")
        imp.dropped(f"{args}.{key}", why if trains else f"{sec} does not train")
    if not src.keys(args):
        imp.dropped(args, why)  # an empty one


def _pg_variant(imp: Importer, worker: str) -> None:
    """ROLL's ActorPGWorker picks its loss by pg_variant (its default: vanilla); ActorWorker's is PPO's."""
    src = imp.src
    if not worker.endswith("ActorPGWorker"):
        for key in ("pg_variant", "actor_train.pg_variant"):
            imp.dropped(key, "read only by ROLL's ActorPGWorker")
        return
    where = "actor_train.pg_variant" if src.has("actor_train.pg_variant") else "pg_variant"
    if where != "pg_variant":
        imp.dropped("pg_variant", "actor_train.pg_variant is the one ROLL reads")
    variant = src.get(where, "vanilla")
    for key in ("topr_positive_weight", "topr_negative_weight"):
        path = f"actor_train.{key}"
        if src.get(path, 1.0) == 1.0:
            imp.dropped(path, "1.0")
        else:
            imp.refuse(path, "TOPR's per-sign weights are not built")
    if variant == "ppo":
        imp.mapped(where, "policy_loss", "ppo_clip")
    elif variant == "topr":
        imp.changed(where, "policy_loss", "topr",
                    "ROLL's TOPR splits samples by score > 0 and weights each negative token by its own ratio "
                    "clipped to [0, 1]; this topr splits by advantage sign and weights by the sequence's ratio")
    else:
        imp.refuse(where, f"{variant!r}: ROLL's ppo and topr variants are mapped")


def _model_args(imp: Importer, sec: str, trains: bool) -> None:
    src = imp.src
    m = f"{sec}.model_args"
    imp.move(f"{m}.model_name_or_path", f"{sec}.model_args.model_name_or_path")
    dtype = src.get(f"{m}.dtype", "bf16")
    if dtype in DTYPES:
        if src.has(f"{m}.dtype"):
            imp.mapped(f"{m}.dtype", f"{sec}.model_args.dtype", DTYPES[dtype])
        else:
            imp.default(f"{sec}.model_args.dtype", "bfloat16", "ROLL's default dtype")
    else:
        imp.refuse(f"{m}.dtype", f"{dtype!r}: bf16, fp16 and fp32 are mapped")
    if trains:
        disabled = src.get(f"{m}.disable_gradient_checkpointing", False)
        if src.has(f"{m}.disable_gradient_checkpointing"):
            imp.mapped(f"{m}.disable_gradient_checkpointing", f"{sec}.model_args.gradient_checkpointing", not disabled)
        else:
            imp.default(f"{sec}.model_args.gradient_checkpointing", True, "ROLL checkpoints gradients by default")
    else:
        imp.dropped(f"{m}.disable_gradient_checkpointing", "no gradients in this cluster")
    attention = src.get(f"{m}.attn_implementation")
    if attention in ("fa2", "sdpa", "eager"):
        kernel = {"fa2": "flash_attention_2"}.get(attention, attention)
        imp.mapped(f"{m}.attn_implementation", f"{sec}.model_args.attn_implementation", kernel,
                   "FlashAttention runs packed rows in its variable-length kernel" if attention == "fa2" else None)
    imp.dropped(f"{m}.attn_implementation", "transformers' default attention kernel")  # auto, null
    imp.dropped(f"{m}.flash_attn", "the attention kernel (the same maths)")
    imp.dropped(f"{m}.ulysses_size", "sequence parallelism splits each sequence over GPUs (the same maths)")
    if src.get(f"{m}.model_type") is None:
        imp.dropped(f"{m}.model_type", "null")
    else:
        imp.refuse(f"{m}.model_type", f"{src.get(f'{m}.model_type')!r}: a ROLL model type other than the default")
    if src.has(f"{m}.freeze_module_prefix"):
        imp.refuse(f"{m}.freeze_module_prefix", "freezes part of a multimodal model (VLMs are not supported here)")
    if not trains:
        for key in ("lora_rank", "lora_alpha", "lora_target", "lora_dropout"):
            imp.dropped(f"{m}.{key}", "this cluster uses actor_train's adapters")


def _devices(imp: Importer, sec: str) -> int:
    """device_mapping, num_gpus_per_worker and world_size; returns the GPUs per worker."""
    src = imp.src
    strategy_config = src.get(f"{sec}.strategy_args.strategy_config") or {}
    per = src.get(f"{sec}.num_gpus_per_worker")
    if per is None and sec == "actor_infer":
        per = strategy_config.get("tensor_parallel_size") or strategy_config.get("tp_size")
    per = int(per or 1)
    mapping = src.get(f"{sec}.device_mapping")
    if mapping is None:
        imp.move(f"{sec}.world_size", f"{sec}.world_size")
        return per
    imp.mapped(f"{sec}.device_mapping", f"{sec}.device_mapping", mapping)
    if src.has(f"{sec}.num_gpus_per_worker"):
        imp.mapped(f"{sec}.num_gpus_per_worker", f"{sec}.num_gpus_per_worker", per)
    else:
        imp.put(f"{sec}.num_gpus_per_worker", per)
    per_node = int(src.get("num_gpus_per_node") or 8)
    if per > per_node:
        where = f"{sec}.num_gpus_per_worker" if src.has(f"{sec}.num_gpus_per_worker") else (
            f"{sec}.strategy_args.strategy_config.tensor_parallel_size")
        imp.refuse(where, f"{per} GPUs per worker span nodes of {per_node} GPUs (num_gpus_per_node); a worker's GPUs "
                   "are on one node here (an engine across nodes is not supported)")
    try:
        count = len(parse_device_mapping(mapping))
    except ValueError as exc:
        imp.refuse(f"{sec}.device_mapping", str(exc))
        return per
    world = count // per
    if src.has(f"{sec}.world_size") and src.get(f"{sec}.world_size") != world:
        imp.refuse(f"{sec}.world_size", f"{src.get(f'{sec}.world_size')} workers do not fit {count} GPU(s) of {per}")
    else:
        imp.src.take(f"{sec}.world_size")
        imp.put(f"{sec}.world_size", world)
    return per


def _train_strategy(imp: Importer, sec: str) -> int:
    """The DeepSpeed ZeRO stage for ROLL's strategy; returns ROLL's data-parallel size (for the batch sizes)."""
    src = imp.src
    name = src.get(f"{sec}.strategy_args.strategy_name", "megatron_train")
    cfg_path = f"{sec}.strategy_args.strategy_config"
    cfg = src.get(cfg_path) or {}
    gpus = int(imp.ours(f"{sec}.world_size", 1)) * int(imp.ours(f"{sec}.num_gpus_per_worker", 1))
    lora = _lora_on(imp)
    zero: dict[str, Any] = {}
    dp = gpus
    if name == "megatron_train":
        split = 1
        for key in MEGATRON_SPLITS:
            split *= int(cfg.get(key) or 1)
        other = any(int(cfg.get(k) or 1) > 1 for k in MEGATRON_OTHER_SPLITS[:2])
        dp = max(gpus // split, 1)
        if split > 1 or other:
            zero["stage"] = 2 if lora else 3
            imp.changed(
                f"{sec}.strategy_args.strategy_name", f"{sec}.strategy_args.strategy_name", "deepspeed_train",
                f"megatron_train splits the model over {split} GPU(s) per replica (tensor x pipeline x context"
                f"{', experts' if other else ''}); here DeepSpeed ZeRO stage {zero['stage']} shards "
                f"{'gradients and optimizer states' if lora else 'parameters, gradients and optimizer states'} "
                f"over all {gpus}: the same maths, other memory and speed",
            )
        else:
            zero["stage"] = 1 if cfg.get("use_distributed_optimizer") else 0
            imp.mapped(f"{sec}.strategy_args.strategy_name", f"{sec}.strategy_args.strategy_name", "deepspeed_train")
        reason = {
            3: "the ZeRO-3 substitution above", 2: "the ZeRO-2 substitution above (LoRA)",
            1: "zero_optimization.stage 1: optimizer states sharded over the data-parallel ranks",
            0: "zero_optimization.stage 0: one replica per GPU",
        }[zero["stage"]]
        for key in (*MEGATRON_SPLITS, *MEGATRON_OTHER_SPLITS, "use_distributed_optimizer"):
            imp.part_of(f"{cfg_path}.{key}", reason)
    elif name == "fsdp2_train":
        zero["stage"] = 2 if lora else 3
        ulysses = int(src.get(f"{sec}.model_args.ulysses_size") or 1)
        dp = max(gpus // ulysses, 1)
        imp.mapped(f"{sec}.strategy_args.strategy_name", f"{sec}.strategy_args.strategy_name", "deepspeed_train",
                   f"zero_optimization.stage {zero['stage']}: FSDP's full sharding")
        if src.get(f"{cfg_path}.offload_policy"):
            zero["offload_param"] = {"device": "cpu"}
            zero["offload_optimizer"] = {"device": "cpu"}
            imp.part_of(f"{cfg_path}.offload_policy", "zero_optimization offload_param and offload_optimizer: "
                        "{device: cpu}")
        else:
            imp.dropped(f"{cfg_path}.offload_policy", "off")
    elif name == "deepspeed_train":
        imp.mapped(f"{sec}.strategy_args.strategy_name", f"{sec}.strategy_args.strategy_name", "deepspeed_train")
        if isinstance(cfg, dict) and cfg:
            imp.mapped(cfg_path, f"{sec}.strategy_args.strategy_config", cfg)
        return dp
    else:
        imp.refuse(f"{sec}.strategy_args.strategy_name", f"{name!r}: megatron_train, fsdp2_train and deepspeed_train "
                   "are mapped")
        return dp
    if not cfg:
        imp.dropped(cfg_path, "empty")
    if cfg.get("moe_aux_loss_coeff"):
        imp.refuse(f"{cfg_path}.moe_aux_loss_coeff", "a mixture-of-experts load-balancing loss term")
    else:
        imp.dropped(f"{cfg_path}.moe_aux_loss_coeff", "0: no auxiliary loss")
    for key in cfg:
        if key in SPEED_ONLY:
            imp.dropped(f"{cfg_path}.{key}", "a kernel, overlap, recomputation or layout setting (the same maths)")
    imp.put(f"{sec}.strategy_args.strategy_config", {"zero_optimization": zero})
    return dp


def _training_args(imp: Importer, sec: str, roll_dp: int) -> None:
    src = imp.src
    t = f"{sec}.training_args"
    for key in ("learning_rate", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon", "warmup_steps",
                "per_device_train_batch_size", "max_grad_norm"):
        imp.move(f"{t}.{key}", f"{t}.{key}")
    if src.has("max_grad_norm"):
        imp.mapped("max_grad_norm", f"{t}.max_grad_norm", src.get("max_grad_norm"))
    schedule = src.get(f"{t}.lr_scheduler_type")
    if schedule is None:
        imp.default(f"{t}.lr_scheduler_type", "linear", "ROLL's default (Hugging Face's): linear decay to 0")
    elif schedule in ("constant", "linear", "cosine"):
        imp.move(f"{t}.lr_scheduler_type", f"{t}.lr_scheduler_type")
    else:
        imp.refuse(f"{t}.lr_scheduler_type", f"{schedule!r}: constant, linear and cosine are mapped")
    if src.get(f"{t}.warmup_ratio"):
        imp.refuse(f"{t}.warmup_ratio", "set training_args.warmup_steps (optimizer steps) instead")
    else:
        imp.dropped(f"{t}.warmup_ratio", "0")
    imp.dropped(f"{t}.num_train_epochs", "ROLL sizes its LR schedule from max_steps, as this project does")
    for key in ("max_steps", "output_dir", "seed", "data_seed", "dataloader_num_workers", "fp16", "bf16", "tf32",
                "save_hf_model"):
        imp.dropped(f"{t}.{key}", "set by the pipeline (ROLL overwrites it too) or by model_args.dtype")
    accumulation = int(src.get(f"{t}.gradient_accumulation_steps", 1))
    world = int(imp.ours(f"{sec}.world_size", 1))
    per = imp.ours(f"{t}.per_device_train_batch_size", 8)
    if world == roll_dp:
        imp.move(f"{t}.gradient_accumulation_steps", f"{t}.gradient_accumulation_steps")
    elif accumulation * roll_dp % world == 0 and accumulation * roll_dp >= world:
        ours = accumulation * roll_dp // world
        imp.changed(
            f"{t}.gradient_accumulation_steps", f"{t}.gradient_accumulation_steps", ours,
            f"one optimizer step still takes {roll_dp * per * accumulation} samples: ROLL has {roll_dp} "
            f"data-parallel ranks x {per} x {accumulation}, here {world} ranks x {per} x {ours}",
        )
    else:
        imp.changed(
            f"{t}.gradient_accumulation_steps", f"{t}.gradient_accumulation_steps", accumulation,
            f"an optimizer step takes {world * per * accumulation} samples here ({world} ranks) against ROLL's "
            f"{roll_dp * per * accumulation} ({roll_dp} data-parallel ranks): no whole number keeps it",
        )


def _infer_strategy(imp: Importer, sec: str, gpus_per: int) -> None:
    src = imp.src
    name = src.get(f"{sec}.strategy_args.strategy_name", "vllm")
    cfg_path = f"{sec}.strategy_args.strategy_config"
    cfg = src.get(cfg_path) or {}
    out: dict[str, Any] = {}
    if name == "sglang":
        imp.changed(f"{sec}.strategy_args.strategy_name", f"{sec}.strategy_args.strategy_name", "vllm",
                    "SGLang is not an engine here; vLLM samples from the same distribution")
        if "mem_fraction_static" in cfg:
            src.take(f"{cfg_path}.mem_fraction_static")
            out["gpu_memory_utilization"] = cfg["mem_fraction_static"]
            imp.report.changed.append((f"{cfg_path}.mem_fraction_static",
                                       f"gpu_memory_utilization: {cfg['mem_fraction_static']} (vLLM's name)"))
        for key in ("tp_size",):
            src.take(f"{cfg_path}.{key}")
    elif name in ("vllm", "hf_infer"):
        imp.mapped(f"{sec}.strategy_args.strategy_name", f"{sec}.strategy_args.strategy_name", name)
    else:
        imp.refuse(f"{sec}.strategy_args.strategy_name", f"{name!r}: vllm, sglang and hf_infer are mapped")
        return
    if gpus_per > 1:
        out["tensor_parallel_size"] = gpus_per
        src.take(f"{cfg_path}.tensor_parallel_size")
    elif cfg.get("tensor_parallel_size") in (1, None):
        src.take(f"{cfg_path}.tensor_parallel_size")
    for key in VLLM_KEYS:
        if key in cfg:
            src.take(f"{cfg_path}.{key}")
            out[key] = cfg[key]
    if not cfg:
        imp.dropped(cfg_path, "empty")
    for key, why in VLLM_DROPPED.items():
        imp.dropped(f"{cfg_path}.{key}", why)
    if "sleep_level" in cfg or "enable_sleep_mode" in cfg:
        src.take(f"{cfg_path}.enable_sleep_mode")
        out["enable_sleep_mode"] = True
    if name != "hf_infer" and out:
        imp.put(f"{sec}.strategy_args.strategy_config", out)
        imp.report.mapped.append((cfg_path, f"{sec}.strategy_args.strategy_config: "
                                  + ", ".join(f"{k}: {v}" for k, v in out.items())))
    _generating_args(imp, sec)


def _generating_args(imp: Importer, sec: str) -> None:
    """actor_infer's sampling; max_new_tokens and the group size come from the top level (ROLL overwrites both)."""
    src = imp.src
    g = f"{sec}.generating_args"
    for key in ("temperature", "top_p", "top_k"):
        imp.move(f"{g}.{key}", f"{g}.{key}")
    if src.get(f"{g}.num_beams", 1) == 1:
        imp.dropped(f"{g}.num_beams", "1: sampling")
    else:
        imp.refuse(f"{g}.num_beams", "beam search is not an RL rollout here")
    imp.dropped(f"{g}.num_return_sequences", "ROLL sets it to num_return_sequences_in_group")
    imp.dropped(f"{g}.max_new_tokens", "ROLL sets it from response_length (or sequence_length - prompt_length)")
    for key in ("do_sample",):
        imp.move(f"{g}.{key}", f"{g}.{key}")
    if src.has(f"{g}.repetition_penalty") and src.get(f"{g}.repetition_penalty") != 1.0:
        imp.refuse(f"{g}.repetition_penalty", "a repetition penalty changes the sampled distribution")
    else:
        imp.dropped(f"{g}.repetition_penalty", "1.0")


def _reference_strategy(imp: Importer, sec: str) -> None:
    src = imp.src
    name = src.get(f"{sec}.strategy_args.strategy_name", "megatron_infer")
    if name in ("megatron_infer", "fsdp2_infer", "hf_infer", "deepspeed_infer", "megatron_train"):
        imp.mapped(f"{sec}.strategy_args.strategy_name", f"{sec}.strategy_args.strategy_name", "hf_infer",
                   f"the frozen policy's log-probs with transformers; ROLL's {name}")
        imp.dropped(f"{sec}.strategy_args.strategy_config", "each reference worker holds the whole model here")
    else:
        imp.refuse(f"{sec}.strategy_args.strategy_name", f"{name!r}: not a reference strategy the importer knows")


def _lora_on(imp: Importer) -> bool:
    src = imp.src
    return src.get("lora_target") is not None or src.get("actor_train.model_args.lora_target") is not None


def _lora(imp: Importer) -> None:
    """ROLL's LoRA (lora_rank, lora_alpha, lora_target at the top or under actor_train.model_args)."""
    src = imp.src
    where = "actor_train.model_args." if src.has("actor_train.model_args.lora_target") else ""
    if not _lora_on(imp):
        for key in ("lora_rank", "lora_alpha", "lora_dropout", "lora_target"):
            imp.dropped(f"{where}{key}", "LoRA is off without lora_target")
            imp.dropped(f"actor_train.model_args.{key}", "LoRA is off without lora_target")
        return
    rank = int(src.get(f"{where}lora_rank", 8))
    alpha = src.get(f"{where}lora_alpha") or rank * 2
    target = str(src.get(f"{where}lora_target"))
    names = [t.strip() for t in target.split(",") if t.strip()]
    lora: dict[str, Any] = {"rank": rank, "alpha": float(alpha), "dropout": float(src.get(f"{where}lora_dropout", 0.0))}
    for key in ("lora_rank", "lora_alpha", "lora_dropout"):
        imp.part_of(f"{where}{key}", "actor_train.lora below")
    for key in ("lora_rank", "lora_alpha", "lora_dropout", "lora_target"):
        if where:
            imp.dropped(key, "the same as actor_train.model_args'")
        else:
            imp.dropped(f"actor_train.model_args.{key}", "the top-level value is used")
    if names == ["all-linear"]:
        lora["target_modules"] = list(LORA_DEFAULT_TARGETS)
        imp.changed(f"{where}lora_target", "actor_train.lora", lora,
                    "peft's all-linear names every linear layer but the output head; for Llama/Qwen-style models "
                    "those are the seven projections listed")
    elif any(c in target for c in "*$|("):
        imp.refuse(f"{where}lora_target", f"{target!r}: a regular expression; name the layers")
    else:
        lora["target_modules"] = names
        imp.mapped(f"{where}lora_target", "actor_train.lora", lora)

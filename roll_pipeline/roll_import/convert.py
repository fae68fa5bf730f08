"""`import_roll_config`: a ROLL RLVR YAML to this project's config tree and the report of every key.

The parts run in order (top level, algorithm, clusters, data, validation, rewards); any key that no part took is
reported as not supported, so nothing in the ROLL file is passed over in silence."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from roll_pipeline.roll_import.algorithm_keys import import_algorithm
from roll_pipeline.roll_import.cluster_keys import import_clusters
from roll_pipeline.roll_import.domain_keys import import_data, import_rewards, import_validation
from roll_pipeline.roll_import.hydra_yaml import RollTree, load_roll_yaml
from roll_pipeline.roll_import.report import Importer, ImportReport, show

#: Top-level keys about logs, profiling and model downloads: nothing a run here trains or measures.
NO_EFFECT = {
    "hydra": "Hydra's own run settings (the importer resolved the ${...} references)",
    "logging_dir": "log files: a run logs to its console and to MLflow",
    "logging_steps": "metrics go to MLflow every step",
    "output_dir": "ROLL's working folder; checkpoints go to output_dir (from checkpoint_config)",
    "model_download_type": "models are local folders (or hub ids where the hub is reachable)",
    "profiler_output_dir": "profiling", "profiler_timeline": "profiling", "profiler_memory": "profiling",
    "length_profiler_dir": "profiling", "otlp_output_dir": "tracing", "report_length_and_rewards": "a debug log",
    "is_num_return_sequences_expand": "how ROLL splits a group into requests (a group here is sent as one prompt)",
    "generate_opt_level": "ROLL's generation scheduling level",
    "save_logging_board_dir": "ROLL's metric dump folder",
    "val_batch_size": "validation sends all its prompts at once",
    "local_rank": "set by the launcher",
    "num_nodes": "derived from the device mappings and ray.num_gpus_per_node",
    "is_offload_optimizer_states_in_train_step": "DeepSpeed keeps the optimizer states as its ZeRO stage says",
    "model_update_buffer_size_mb": "weight syncs go in buckets of strategy_config.weight_bucket_mb",
    "offload_nccl": "NCCL buffers kept in CPU memory between phases (speed and memory, not maths)",
}

#: Environment variables that only pick ROLL's model source or logging.
HARMLESS_ENVS = {"USE_MODELSCOPE", "NCCL_DEBUG", "RAY_DEDUP_LOGS", "TOKENIZERS_PARALLELISM"}


@dataclass
class ImportResult:
    config: dict[str, Any]
    report: ImportReport


def import_roll_config(path: str | Path) -> ImportResult:
    """Read ROLL's YAML at `path` and build this project's config tree and the report (RollConfigError if the
    file cannot be read)."""
    imp = Importer(RollTree(load_roll_yaml(path)))
    _top_level(imp)
    import_algorithm(imp)
    import_clusters(imp)
    import_data(imp)
    import_validation(imp)
    import_rewards(imp)
    for key, value in imp.src.left():
        imp.report.unsupported.append((key, f"{show(value)}: not a key the importer knows"))
    return ImportResult(config=_ordered(imp.out), report=imp.report)


def _top_level(imp: Importer) -> None:
    src = imp.src
    for key, why in NO_EFFECT.items():
        imp.dropped(key, why)
    imp.move("exp_name", "exp_name")
    imp.move("seed", "seed")
    imp.move("pretrain", "pretrain")
    for key, roll_default in (("max_steps", 500), ("rollout_batch_size", 128), ("num_return_sequences_in_group", 1),
                              ("eval_steps", 10), ("save_steps", 50)):
        if src.has(key):
            imp.move(key, key)
        else:
            imp.default(key, roll_default, "ROLL's default")
    _checkpoints(imp)
    imp.move("num_gpus_per_node", "ray.num_gpus_per_node")
    imp.move("rpc_timeout", "ray.rpc_timeout_s")
    imp.move("max_running_requests", "dynamic_sampling.max_running_requests")
    _lengths(imp)
    ratio = src.get("async_generation_ratio", 0)
    if ratio == int(ratio):
        imp.move("async_generation_ratio", "async_generation_ratio", int)
    else:
        imp.refuse("async_generation_ratio", f"{ratio}: rollouts here run a whole number of steps ahead")
    if src.has("track_with"):
        imp.changed("track_with", None, None, f"{src.get('track_with')!r} -> MLflow (this project's tracker; "
                    "`roll ui` shows the runs; tracking.tracking_uri picks the server)")
        imp.move("tracker_kwargs.project", "tracking.experiment_name")
        imp.dropped("tracker_kwargs", "settings of ROLL's tracker (runs are named by exp_name)")
    envs = src.get("system_envs") or {}
    for name in envs:
        if name in HARMLESS_ENVS:
            imp.dropped(f"system_envs.{name}", "picks ROLL's model source or logging")
        else:
            imp.refuse(f"system_envs.{name}", "an environment variable for ROLL's workers: set it where Ray starts")
    if src.has("rollout_mock"):
        if (src.get("rollout_mock") or {}).get("enable"):
            imp.refuse("rollout_mock", "dumping or replaying rollouts is not built")
        else:
            imp.dropped("rollout_mock", "off")
    if src.get("reward_model") is not None:
        imp.refuse("reward_model", "a reward-model cluster shared by the domains: give each domain its reward "
                   "(rewards.<domain>.workers may add reward_model)")
    else:
        imp.dropped("reward_model", "null")
    if src.has("reward_system_config"):
        imp.dropped("reward_system_config", "how ROLL decodes responses for its reward workers")


def _checkpoints(imp: Importer) -> None:
    src = imp.src
    kind = src.get("checkpoint_config.type", "file_system")
    if kind != "file_system":
        imp.refuse("checkpoint_config.type", f"{kind!r}: checkpoints are written to a folder")
    else:
        imp.dropped("checkpoint_config.type", "checkpoints are written to a folder")
    if src.has("checkpoint_config.output_dir"):
        imp.changed("checkpoint_config.output_dir", "output_dir", src.get("checkpoint_config.output_dir"),
                    "checkpoints go to output_dir/checkpoints, without ROLL's time-stamped subfolder, so that "
                    "`roll run --resume` finds them")
    imp.dropped("checkpoint_config.async_upload", "checkpoints are written before the run goes on")
    if src.get("max_ckpt_to_keep"):
        imp.move("max_ckpt_to_keep", "max_checkpoints_to_keep")
    else:
        steps, every = int(imp.ours("max_steps")), int(imp.ours("save_steps"))
        count = max(1, math.ceil(steps / every) if every else 1)
        why = "ROLL keeps every checkpoint (max_ckpt_to_keep 0): as many as the run makes"
        if src.has("max_ckpt_to_keep"):
            imp.changed("max_ckpt_to_keep", "max_checkpoints_to_keep", count, why)
        else:
            imp.default("max_checkpoints_to_keep", count, why)
    resume = src.get("resume_from_checkpoint", False)
    if resume:
        imp.refuse("resume_from_checkpoint", f"{show(resume)}: run `roll run CONFIG --resume` to go on from the "
                   "latest checkpoint")
    else:
        imp.dropped("resume_from_checkpoint", "false")


def _lengths(imp: Importer) -> None:
    """ROLL's max_new_tokens is sequence_length - prompt_length, sequence_length defaulting to response_length +
    prompt_length (PPOConfig.__post_init__ overwrites actor_infer's and validation's)."""
    src = imp.src
    prompt = int(src.get("prompt_length", 1024))
    if src.get("sequence_length") is not None:
        new = int(src.get("sequence_length")) - prompt
        roll_key = "sequence_length"
    elif src.get("response_length") is not None:
        new = int(src.get("response_length"))
        roll_key = "response_length"
    else:
        imp.refuse("response_length", "ROLL needs response_length or sequence_length; neither is set")
        return
    imp.mapped(roll_key, "actor_infer.generating_args.max_new_tokens", new)
    imp.dropped("response_length", "read as max_new_tokens")
    imp.dropped("sequence_length", "read as max_new_tokens")
    for key in ("val_prompt_length", "val_sequence_length"):
        if src.get(key) is not None:
            imp.refuse(key, "validation lengths other than training's are not mapped")
        else:
            imp.dropped(key, "null: validation uses the training lengths")


#: The order of the written file's top-level keys (others follow in the order they were written).
ORDER = ("exp_name", "seed", "pretrain", "output_dir", "max_steps", "eval_steps", "save_steps",
         "max_checkpoints_to_keep", "rollout_batch_size", "num_return_sequences_in_group", "domain_interleave_probs")


def _ordered(tree: dict[str, Any]) -> dict[str, Any]:
    first = {k: tree[k] for k in ORDER if k in tree}
    sections = {k: v for k, v in tree.items() if k not in first and isinstance(v, dict)}
    scalars = {k: v for k, v in tree.items() if k not in first and k not in sections}
    return {**first, **scalars, **sections}

"""`roll run --dry-run`: check everything a run needs (data, models, reward workers, strategies) without training."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import itertools
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from roll_core.config import ResolvedConfig
from roll_core.data.loading import (
    DataError,
    DomainPrompts,
    RowCheck,
    RunData,
    check_rows,
    fit_prompts,
    load_domain_rows,
    require_rows,
    require_unique_ids,
)
from roll_core.models.embedded import build_hint
from roll_pipeline.driver.names import domain_tools


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    skipped: bool = False
    """Not checked on this host, and no failure: it is checked where the run happens (a hub model that the
    workers download, vLLM and the GPUs of a GPU cluster). Printed as [skip]; such a check has ok True."""


def not_checked(name: str, detail: str) -> Check:
    return Check(name, True, detail, skipped=True)


#: What each model key is loaded as (workers/strategies/loading.py): the critic is a token-classification model
#: with a one-output head, every other model a causal LM.
_AUTO_CLASS = {"critic.model_args.model_name_or_path": "AutoModelForTokenClassification"}


def _model_check(key: str, path: str, auto_class: str = "AutoModelForCausalLM") -> Check:
    from transformers import AutoConfig

    local = Path(path)
    if not local.is_absolute():  # resolve() keeps only hub ids relative
        return _hub_model_check(key, path, auto_class)
    if local.is_absolute() and not local.is_dir():
        build = build_hint(path)
        hint = f" ({build})" if build else ""
        what = "is a file, not a model folder" if local.exists() else "does not exist"
        if local.suffix == ".gguf":
            hint = f" (a GGUF file: write a Hugging Face folder from it with `roll model from-gguf {path} OUT_DIR`)"
        return Check(key, False, f"model path {path} {what}{hint}")
    if local.is_absolute() and not (local / "config.json").is_file():
        held = sorted(p.name for p in local.iterdir())[:8]
        return Check(
            key,
            False,
            f"model path {path} has no config.json, so it is not a Hugging Face model folder "
            f"(it holds: {', '.join(held) or 'nothing'})",
        )
    where = path if local.is_absolute() else f"hub id {path}"
    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as exc:  # transformers raises OSError/ValueError/... for a bad folder
        return Check(key, False, f"{where}: cannot load a model config: {exc}")
    problem = _head_problem(config, auto_class)
    if problem:
        source = f"{path}/config.json" if local.is_absolute() else where
        return Check(key, False, f"{source}: {problem}")
    return Check(key, True, f"{where} ({config.model_type})")


def _head_problem(config, auto_class: str) -> str | None:
    """Why `auto_class` cannot load a model of this config as a trained model, or None."""
    from transformers.models.auto import modeling_auto

    if auto_class in (getattr(config, "auto_map", None) or {}):
        return None  # the checkpoint's own code declares the class
    if auto_class == "AutoModelForCausalLM":
        causal = set(modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
        architectures = list(getattr(config, "architectures", None) or [])
        # model_type alone is not enough: BERT has a causal-LM class, but a BERT checkpoint is an encoder.
        if architectures and not causal.intersection(architectures):
            return (
                f"field 'architectures' is {architectures} (model_type {config.model_type!r}): not a causal LM; "
                "the policy must be a decoder that AutoModelForCausalLM loads, such as Qwen2ForCausalLM"
            )
        if config.model_type not in modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            return f"field 'model_type' is {config.model_type!r}, which AutoModelForCausalLM cannot load"
        return None
    if config.model_type not in modeling_auto.MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES:
        return f"field 'model_type' is {config.model_type!r}, which {auto_class} (the critic's value model) cannot load"
    return None


def _model_checks(model_keys: dict[str, str]) -> dict[str, Check]:
    """One check per model key; keys that name the same path and class share one report line."""
    targets: dict[tuple[str, str], list[str]] = {}
    for key, path in model_keys.items():
        targets.setdefault((path, _AUTO_CLASS.get(key, "AutoModelForCausalLM")), []).append(key)
    checks: dict[str, Check] = {}
    for (path, auto_class), keys in targets.items():
        check = _model_check(keys[0], path, auto_class)
        if len(keys) > 1:
            sharing = ", ".join(k.split(".")[0] for k in keys[1:])
            check = dataclasses.replace(check, detail=f"{check.detail} (the same for {sharing})")
        checks.update(dict.fromkeys(keys, check))
    return checks


def preflight(resolved: ResolvedConfig, dry_run: bool = False) -> list[Check]:
    """Every check of a run. `dry_run`: what only a GPU cluster can provide (vLLM, its GPUs) is [skip] on a host
    without them; for a real run it fails here unless the run joins a Ray cluster (ray.address, RAY_ADDRESS)."""
    return preflight_with_data(resolved, dry_run)[0]


def preflight_with_data(resolved: ResolvedConfig, dry_run: bool = False) -> tuple[list[Check], RunData | None]:
    """`preflight`'s checks, and the run's prompts as the checks loaded and tokenized them (None when a data
    check failed or the tokenizer did not load), so that the run does not read and tokenize them again."""
    cfg = resolved.config
    checks: list[Check] = [Check("config", True, f"{resolved.config_path} is valid")]
    model_keys = {"pretrain": cfg.pretrain}
    for name in ("actor_train", "actor_infer", "reference", "critic"):
        section = getattr(cfg, name)
        if section is not None:
            model_keys[f"{name}.model_args.model_name_or_path"] = section.model_args.model_name_or_path
    model_checks = _model_checks(model_keys)
    checks += [c for key, c in model_checks.items() if c.name == key]

    checks += _job_copy_checks(cfg)
    checks += _reward_checks(cfg)
    checks += _strategy_checks(cfg, dry_run)
    checks += _attention_checks(cfg, dry_run)
    checks += _plan_checks(cfg, dry_run)

    tokenizer = None
    # A hub id's tokenizer is not loaded here, even from the cache, so that a dry run never downloads.
    if (
        model_checks["actor_infer.model_args.model_name_or_path"].ok
        and Path(cfg.actor_infer.model_args.model_name_or_path).is_absolute()
    ):
        from workers.strategies.loading import load_tokenizer

        try:
            tokenizer = load_tokenizer(cfg.actor_infer.model_args)
        except Exception as exc:  # any loading failure is a finding to report, not a crash
            checks.append(Check("tokenizer", False, f"cannot load the tokenizer: {exc}"))
        if tokenizer is not None and not getattr(tokenizer, "chat_template", None):
            checks.append(Check(
                "tokenizer", False,
                f"{cfg.actor_infer.model_args.model_name_or_path}: the tokenizer has no chat template, and every "
                f"prompt is rendered through one (rows' data.messages_key '{cfg.data.messages_key}' and "
                f"data.prompt_key '{cfg.data.prompt_key}' alike): use an instruct model's tokenizer, or add a "
                "template (chat_template.jinja, or 'chat_template' in tokenizer_config.json)",
            ))
            tokenizer = None
    row_checks = _row_checks(cfg)
    tools = domain_tools(cfg) if tokenizer is not None else {}
    prompts: dict[str, dict[str, DomainPrompts] | None] = {"train": None, "val": {}}
    for split, files in (("train", cfg.data.train_files), ("val", cfg.data.val_files)):
        if not files:
            continue
        prompts[split] = None
        try:
            routed = load_domain_rows(files, cfg.rewards)
            check_rows(routed, row_checks)
            if split == "train":
                require_rows(routed, cfg.rewards, files)
            else:
                require_unique_ids(routed)
            detail = f"{len(files)} file(s), rows per domain: " + ", ".join(
                f"{d}={len(r)}" for d, r in routed.items()
            )
            if tokenizer is not None:
                prompts[split] = fit_prompts(tokenizer, routed, cfg.data, split, tools=tools, warn=False)
                dropped = {d: p.dropped for d, p in prompts[split].items()}
                if any(dropped.values()):
                    counts = ", ".join(f"{d}={n}" for d, n in dropped.items())
                    detail += (
                        f"; dropped as longer than data.prompt_length={cfg.data.prompt_length}: {counts}"
                    )
            checks.append(Check(f"data.{split}_files", True, detail))
        except DataError as exc:
            checks.append(Check(f"data.{split}_files", False, str(exc)))
    shares = ", ".join(f"{d}={n}" for d, n in resolved.domain_shares.items())
    checks.append(Check("domain shares", True, f"prompts per step: {shares}"))
    train, val = prompts["train"], prompts["val"]
    data = RunData(train, val) if train is not None and val is not None else None
    return checks, data


#: Where Ray unpacks a job's `--working-dir` (on each node, under its session folder); Ray deletes it later.
_JOB_COPY = "/runtime_resources/working_dir_files/"


def _job_copy_checks(cfg) -> list[Check]:
    """In a `ray job submit --working-dir` run, paths that resolve into Ray's copy of the working dir: an output_dir
    there is deleted with the copy, and a model there was not shipped (.gitignore keeps models/ out of it)."""
    checks = []
    if _JOB_COPY in cfg.output_dir:
        checks.append(Check(
            "output_dir", False,
            f"{cfg.output_dir} lies in Ray's copy of the job's working_dir, which Ray deletes: pass an absolute "
            f"output_dir on storage every node shares (output_dir=/shared/runs/{cfg.exp_name})",
        ))
    if _JOB_COPY in cfg.pretrain and not Path(cfg.pretrain).exists():
        checks.append(Check(
            "pretrain", False,
            f"{cfg.pretrain} is not in the job's working_dir: `ray job submit --working-dir` ships what git tracks, "
            "not models/; pass pretrain=<a model folder every node reads> (or a hub id)",
        ))
    return checks


def _row_checks(cfg) -> dict[str, RowCheck]:
    """Each domain's row check: the reward contract's (no column hidden by the names it passes) and its reward
    scorer's own; a domain whose scorer does not load is reported by `_reward_checks` and only the contract's
    check runs on its rows."""
    from roll_core.rewards.scorer import contract_problems
    from workers.rewards.registry import get_reward_scorer_cls

    def both(scorer_check: RowCheck | None) -> RowCheck:
        return lambda row: itertools.chain(contract_problems(row), scorer_check(row) if scorer_check else ())

    def every(checks: list[RowCheck]) -> RowCheck:
        return lambda row: itertools.chain.from_iterable(check(row) for check in checks)

    out = {}
    for domain, reward in cfg.rewards.items():
        checks = []
        for component in reward.components():
            with contextlib.suppress(Exception):  # a scorer that does not load is reported once, by _reward_checks
                checks.append(get_reward_scorer_cls(component.worker).check_row)
        out[domain] = both(every(checks))
    return out


def _reward_checks(cfg) -> list[Check]:
    from roll_core.rewards.scorer import checking_options
    from workers.rewards.registry import get_reward_scorer_cls

    out = []
    for domain, reward in cfg.rewards.items():
        several = bool(reward.workers)
        for i, component in enumerate(reward.components()):
            key = f"rewards.{domain}.workers[{i}]" if several else f"rewards.{domain}.worker"
            try:
                scorer_cls = get_reward_scorer_cls(component.worker)
                with checking_options():  # built to check its options: it starts nothing (a judge actor)
                    scorer_cls(**component.options)
                filters = [*reward.response_filters, *reward.group_filters] if i == 0 else []
                detail = f"{component.worker} -> {scorer_cls.__module__}:{scorer_cls.__qualname__}"
                if several:
                    detail = f"{component.label}: {detail}, weight {component.weight:g}, on_masked {component.on_masked}"
                out.append(Check(key, True, detail + (f"; filters: {', '.join(filters)}" if filters else "")))
            except Exception as exc:  # unknown worker, import error, bad option: all user-facing findings
                out.append(Check(key, False, str(exc)))
    return out


def _strategy_checks(cfg, dry_run: bool) -> list[Check]:
    name = cfg.actor_infer.strategy_args.strategy_name
    key = "actor_infer.strategy_args.strategy_name"
    if name != "vllm":
        return [Check(key, True, name)]
    # Imported only for vLLM: the strategy module imports vllm itself (8.7 s on 2 cores, measured 2026-12-04).
    import torch

    from workers.devices import wants_gpu
    from workers.strategies.vllm_infer import StrategyUnavailable, check_vllm_available

    on_gpu = wants_gpu(cfg.actor_infer)
    try:
        build = check_vllm_available(on_gpu)
    except StrategyUnavailable as exc:
        # actor_infer's GPU node checks for itself when it starts; a CPU-only host can only say so.
        if torch.cuda.is_available() or not on_gpu or not (dry_run or _ray_cluster(cfg)):
            return [Check(key, False, str(exc))]
        importable = "importable" if importlib.util.find_spec("vllm") is not None else "not importable"
        return [
            not_checked(
                key,
                f"vllm is {importable} here and this host has no CUDA GPU; actor_infer checks both on its GPU "
                "node when it starts (pip install 'roll-pipeline[gpu]' there)",
            )
        ]
    return [Check(key, True, f"vllm (its {build.upper()} build, importable here)")]


#: The package each FlashAttention kernel of transformers imports, and what pip installs it as.
FLASH_ATTENTION = {"flash_attention_2": ("flash_attn", "flash-attn"), "flash_attention_3": ("flash_attn_interface",
                                                                                          "flash-attn-3")}


def _attention_checks(cfg, dry_run: bool) -> list[Check]:
    """A model_args.attn_implementation of FlashAttention needs its package and a CUDA GPU where the section's
    workers run: on a host without a GPU, a dry run or a run that joins a Ray cluster leaves that to the GPU nodes."""
    import torch

    from workers.devices import wants_gpu

    checks = []
    for name in ("actor_train", "actor_infer", "reference", "critic"):
        section = getattr(cfg, name)
        kernel = None if section is None else section.model_args.attn_implementation
        if kernel not in FLASH_ATTENTION:
            continue
        key, (module, package) = f"{name}.model_args.attn_implementation", FLASH_ATTENTION[kernel]
        importable = importlib.util.find_spec(module) is not None
        if importable and torch.cuda.is_available() and wants_gpu(section):
            checks.append(Check(key, True, f"{kernel} ({module} importable here)"))
        elif wants_gpu(section) and not torch.cuda.is_available() and (dry_run or _ray_cluster(cfg)):
            checks.append(not_checked(key, f"{kernel}: this host has no CUDA GPU; {module} must be importable on "
                                      f"{name}'s GPU nodes (pip install {package})"))
        else:
            where = "its workers have no GPU" if not wants_gpu(section) else (
                "this host has no CUDA GPU" if importable else f"{module} is not importable (pip install {package})")
            checks.append(Check(key, False, f"{kernel} needs the {package} package and a CUDA GPU, and {where}; "
                                "sdpa (or null, transformers' default) runs anywhere"))
    return checks


# --- the placement plan ----------------------------------------------------------------------------------------


def _hub_model_check(key: str, hub_id: str, auto_class: str) -> Check:
    """A hub id is read from the local Hugging Face cache only: a dry run never downloads a model, and never
    asks the hub anything (the cache is looked up on disk, then the cached snapshot is loaded as a folder)."""
    from huggingface_hub import try_to_load_from_cache
    from transformers import AutoConfig

    try:
        cached = try_to_load_from_cache(hub_id, "config.json")
        config = AutoConfig.from_pretrained(Path(cached).parent) if isinstance(cached, str) else None
    except Exception:  # a broken cache entry is no better than none
        config = None
    if config is None:
        return not_checked(
            key,
            f"hub id {hub_id}: not in the local Hugging Face cache, so not checked here; the run downloads it "
            "where it loads the model (on a cluster: the nodes need the hub or a shared HF_HOME)",
        )
    problem = _head_problem(config, auto_class)
    if problem:
        return Check(key, False, f"hub id {hub_id}: {problem}")
    return Check(
        key, True, f"hub id {hub_id} ({config.model_type}; config from the local Hugging Face cache)"
    )


def _ray_cluster(cfg) -> str | None:
    """The Ray cluster a run joins, if any (else it starts one on this host)."""
    return cfg.ray.address or os.environ.get("RAY_ADDRESS")


def _plan_checks(cfg, dry_run: bool) -> list[Check]:
    """The placement plan (the GPU pool, which clusters share which GPUs, what Ray places by itself) and
    whether this host can run it."""
    from roll_pipeline.distributed.placement import PlanError, describe, plan_for

    try:
        plan = plan_for(cfg)
    except PlanError as exc:
        return [Check("plan", False, line) for line in str(exc).splitlines()]
    checks = [Check("plan", True, line) for line in describe(plan)]
    host = _host_gpu_check(cfg, plan, dry_run)
    cluster = _cluster_checks(cfg, plan) if dry_run and _ray_cluster(cfg) else []
    return checks + ([host] if host else []) + cluster + _memory_checks(cfg)


def _cluster_checks(cfg, plan) -> list[Check]:
    """On the Ray cluster a run joins: whether every actor of the run fits it, and a task on every node that
    checks the run's paths there (roll_pipeline/distributed/node_checks.py)."""
    import ray

    from roll_pipeline.distributed.fit import cluster_nodes, fit_report, run_actors, total
    from roll_pipeline.distributed.joining import RayJoinError, join_ray
    from roll_pipeline.distributed.node_checks import check_every_node, run_inputs

    address = _ray_cluster(cfg)
    joined = not ray.is_initialized()
    try:
        if joined:
            join_ray(address)
    except RayJoinError as exc:
        return [Check("ray", False, str(exc))]
    try:
        groups = run_actors(cfg, plan)
        nodes = cluster_nodes()
        report = fit_report(groups, nodes, f"at {address}")
        need = ", ".join(f"{v:g} {k}" for k, v in total(groups).items())
        checks = [Check("ray", True, f"joined {address}: {len(nodes)} node(s), Ray {ray.__version__}"),
                  Check("ray fit", report is None, report or f"every actor of the run fits ({need} in all)")]
        for label, problems in check_every_node(run_inputs(cfg)):
            ok = not problems
            checks.append(Check(f"ray {label}", ok, "reads the models and data, writes output_dir, sees the "
                                "driver's output_dir" if ok else "; ".join(problems)))
        return checks
    finally:
        if joined:
            ray.shutdown()


def _memory_checks(cfg) -> list[Check]:
    """The models' lower-bound memory (roll_pipeline/driver/memory_fit.py) against this host's memory (a
    CPU-only run on a Ray cluster it starts) and against a GPU's (where this host has one)."""
    import psutil
    import torch

    from roll_pipeline.driver import memory_fit

    checks = []
    if _ray_cluster(cfg) is None:
        host = psutil.virtual_memory().total
        problems = memory_fit.host_problems(cfg, host)
        need = memory_fit.total_bytes(cfg)
        if problems:
            checks.append(Check("memory", False, problems[0]))
        elif need:
            fullest = max(memory_fit.needs(cfg), key=lambda n: n.micro_batch.bytes)
            micro = (f", {fullest.section}'s fullest micro-batch at least {fullest.micro_batch.bytes / memory_fit.GIB:.2f} "
                     "GiB more" if fullest.micro_batch.bytes else "")
            checks.append(Check("memory", True, f"the models' states need at least {need / memory_fit.GIB:.1f} "
                                f"GiB{micro}; this host has {host / memory_fit.GIB:.1f} GiB"))
    if torch.cuda.is_available():
        gpu = torch.cuda.get_device_properties(0).total_memory
        checks += [Check("memory", False, p) for p in memory_fit.gpu_problems(cfg, gpu)]
    return checks


def _host_gpu_check(cfg, plan, dry_run: bool) -> Check | None:
    import torch

    from roll_pipeline.distributed.placement import check_capacity

    unmapped = sum(d.world_size * d.gpus_per_worker for d in plan.unmapped)
    if not plan.num_nodes and not unmapped:
        return None
    need = (
        f"{plan.num_nodes} node{'s' if plan.num_nodes > 1 else ''} x {plan.gpus_per_node} GPUs"
        if plan.num_nodes
        else f"{unmapped:g} GPU(s)"
    )
    cluster = _ray_cluster(cfg)
    if cluster:
        return not_checked(
            "plan", f"needs {need}: checked against the Ray cluster at {cluster} when the run starts"
        )
    here = torch.cuda.device_count() if torch.cuda.is_available() else 0
    fits = not check_capacity(plan, [here]) if plan.num_nodes else here >= unmapped
    if fits:
        return Check("plan", True, f"needs {need}; this host has {here} GPU(s): enough")
    if dry_run:
        return not_checked(
            "plan",
            f"needs {need}; this host has {here} GPU(s), so not checked here: a run checks it against "
            "its Ray cluster when it starts",
        )
    return Check(
        "plan",
        False,
        f"needs {need}; this host has {here} GPU(s) and no Ray cluster is configured: start Ray on "
        "such nodes and set ray.address (or RAY_ADDRESS)",
    )


def run_checks(resolved: ResolvedConfig, echo: Callable[[str], None]) -> bool:
    """Print every check of a dry run; True (exit code 0) when none failed. [skip] findings do not fail a dry
    run: they are what only the cluster can check (hub models not in the cache, vLLM and GPUs on a CPU host),
    so a CPU machine (CI) can dry-run a GPU config; a summary line counts them."""
    checks = preflight(resolved, dry_run=True)
    for c in checks:
        detail = c.detail.replace("\n", "\n    ")  # a listing's lines stay under their check
        label = "skip" if c.skipped else "ok" if c.ok else "FAIL"
        echo(f"  [{label}] {c.name}: {detail}")
    skipped = [c.name for c in checks if c.skipped]
    if skipped:
        names = ", ".join(dict.fromkeys(skipped))
        echo(f"{len(skipped)} not checked on this host ([skip]: {names}); they do not fail a dry run")
    return all(c.ok for c in checks)

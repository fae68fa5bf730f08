"""`roll run --dry-run`: check everything a run needs (data, models, reward workers, strategies) without training."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from roll_pipeline.config import ResolvedConfig
from roll_pipeline.data.loading import DataError, encode_prompts, load_domain_rows


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str


def _model_check(key: str, path: str) -> Check:
    from transformers import AutoConfig

    local = Path(path)
    if local.is_absolute() and not local.is_dir():
        hint = " (build the embedded model with `roll model build-tiny` or `make model`)" if "tiny" in path else ""
        return Check(key, False, f"model path {path} does not exist{hint}")
    where = path if local.is_absolute() else f"hub id {path}"
    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as exc:  # transformers raises OSError/ValueError/... for a bad folder
        return Check(key, False, f"{where}: cannot load a model config: {exc}")
    return Check(key, True, f"{where} ({config.model_type})")


def preflight(resolved: ResolvedConfig) -> list[Check]:
    cfg = resolved.config
    checks: list[Check] = [Check("config", True, f"{resolved.config_path} is valid")]
    model_keys = {"pretrain": cfg.pretrain}
    for name in ("actor_train", "actor_infer", "reference", "critic"):
        section = getattr(cfg, name)
        if section is not None:
            model_keys[f"{name}.model_args.model_name_or_path"] = section.model_args.model_name_or_path
    model_checks = {key: _model_check(key, path) for key, path in model_keys.items()}
    checks += model_checks.values()

    checks += _reward_checks(cfg)
    checks += _strategy_checks(cfg)

    tokenizer = None
    if model_checks["actor_infer.model_args.model_name_or_path"].ok:
        from workers.strategies.loading import load_tokenizer

        try:
            tokenizer = load_tokenizer(cfg.actor_infer.model_args)
        except Exception as exc:  # any loading failure is a finding to report, not a crash
            checks.append(Check("tokenizer", False, f"cannot load the tokenizer: {exc}"))
    for split, files in (("train", cfg.data.train_files), ("val", cfg.data.val_files)):
        if not files:
            continue
        try:
            routed = load_domain_rows(files, cfg.rewards)
            for domain, rows in routed.items():
                if split == "train" and not rows:
                    raise DataError(f"no {split} row has a tag in rewards.{domain}.tag_included")
                if tokenizer is not None:
                    encode_prompts(tokenizer, rows, cfg.data)
            counts = ", ".join(f"{d}={len(r)}" for d, r in routed.items())
            checks.append(Check(f"data.{split}_files", True, f"{len(files)} file(s), rows per domain: {counts}"))
        except DataError as exc:
            checks.append(Check(f"data.{split}_files", False, str(exc)))
    shares = ", ".join(f"{d}={n}" for d, n in resolved.domain_shares.items())
    checks.append(Check("domain shares", True, f"prompts per step: {shares}"))
    return checks


def _reward_checks(cfg) -> list[Check]:
    from workers.rewards.registry import get_reward_scorer_cls

    out = []
    for domain, reward in cfg.rewards.items():
        key = f"rewards.{domain}.worker"
        try:
            scorer_cls = get_reward_scorer_cls(reward.worker)
            scorer_cls(**reward.options)
            filters = [*reward.response_filters, *reward.group_filters]
            detail = f"{reward.worker} -> {scorer_cls.__module__}:{scorer_cls.__qualname__}"
            out.append(Check(key, True, detail + (f"; filters: {', '.join(filters)}" if filters else "")))
        except Exception as exc:  # unknown worker, import error, bad option: all user-facing findings
            out.append(Check(key, False, str(exc)))
    return out


def _strategy_checks(cfg) -> list[Check]:
    from workers.strategies.vllm_infer import StrategyUnavailable, check_vllm_available

    name = cfg.actor_infer.strategy_args.strategy_name
    key = "actor_infer.strategy_args.strategy_name"
    if name != "vllm":
        return [Check(key, True, name)]
    try:
        check_vllm_available()
    except StrategyUnavailable as exc:
        return [Check(key, False, str(exc))]
    return [Check(key, True, "vllm")]


def run_checks(resolved: ResolvedConfig, echo: Callable[[str], None]) -> bool:
    checks = preflight(resolved)
    for c in checks:
        echo(f"  [{'ok' if c.ok else 'FAIL'}] {c.name}: {c.detail}")
    return all(c.ok for c in checks)

"""A config's names checked against the registries they choose from, and what the chosen entries need.

The core config (roll_core/config) checks structure and ranges and imports nothing that registers; the names
it holds (an advantage estimator, a policy loss, a filter, ...) are only known once the modules that register
them are imported: roll_core/algorithms (torch), schedulers/filters.py, schedulers/rollout.py and schedulers/multi_turn.py;
the environments by workers/environments/registry.py. `load_run_config` is the driver's
way to load a config: the core loader, with these checks folded into its one error.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from roll_core.config import PipelineConfig, ResolvedConfig, load_config


def name_problems(cfg: PipelineConfig) -> Iterator[tuple[str, str]]:
    """(key path, message) for every name in `cfg` that its registry does not know, and for a chosen entry whose
    needs the config does not meet (an estimator that needs a critic, without a critic section)."""
    from roll_core import algorithms
    from schedulers.filters import GROUP_FILTERS, RESPONSE_FILTERS, check_filters
    from schedulers.multi_turn import ROLLOUTS

    named = [
        ("adv_estimator", algorithms.ADVANTAGES),
        ("policy_loss", algorithms.POLICY_LOSSES),
        ("loss_agg_mode", algorithms.LOSS_AGGREGATIONS),
        ("kl_estimator", algorithms.KL_ESTIMATORS),
        ("kl_penalty", algorithms.KL_ESTIMATORS),
        ("kl_ctrl", algorithms.KL_CONTROLLERS),
        ("reward_shaping.norm_mean_type", algorithms.REWARD_NORMS),
        ("reward_shaping.norm_std_type", algorithms.REWARD_NORMS),
        ("domain_mixer.type", algorithms.DOMAIN_MIXERS),
    ]
    for key, registry in named:
        section, _, field = key.rpartition(".")
        value = getattr(getattr(cfg, section) if section else cfg, field)
        if value is None and section:  # the normalisations are optional
            continue
        if value not in registry.names():
            yield key, f"must be one of {registry.names()}, got {value!r}"
    if cfg.adv_estimator in algorithms.ADVANTAGES.names():
        critic = algorithms.needs_critic(cfg.adv_estimator)
        if critic and cfg.critic is None:
            yield "critic", f"adv_estimator {cfg.adv_estimator} needs a critic section"
        if cfg.num_return_sequences_in_group == 1 and algorithms.ADVANTAGES.traits(cfg.adv_estimator).get("group_baseline"):
            yield (
                "num_return_sequences_in_group",
                f"adv_estimator {cfg.adv_estimator} compares each response with the others of its prompt's group; "
                "a group of one gets advantage 0 and nothing is learned: use >= 2, or reinforce_plus_plus or gae",
            )
        if cfg.critic_warmup > 0 and not critic:
            yield (
                "critic_warmup",
                f"needs a critic (an estimator that uses one, e.g. gae), got adv_estimator {cfg.adv_estimator!r}",
            )
    for domain, reward in cfg.rewards.items():
        rollout = reward.rollout
        if rollout.type not in ROLLOUTS.names():
            yield f"rewards.{domain}.rollout", f"must be one of {ROLLOUTS.names()}, got {rollout.type!r}"
        elif ROLLOUTS.traits(rollout.type).get("environment"):
            for key, message in environment_problems(rollout):
                yield f"rewards.{domain}.rollout.{key}", message
        for key, message in check_filters(GROUP_FILTERS, reward.group_filters):
            yield f"rewards.{domain}.group_filters.{key}", message
        for key, message in check_filters(RESPONSE_FILTERS, reward.response_filters):
            yield f"rewards.{domain}.response_filters.{key}", message


def environment_problems(rollout: Any) -> Iterator[tuple[str, str]]:
    """A multi-turn rollout's environment must be found and take its options (building one starts nothing: the
    python tool starts its sandbox at its first call)."""
    from workers.environments.registry import get_environment_cls

    try:
        cls = get_environment_cls(rollout.environment)
    except (ValueError, TypeError) as err:
        yield "environment", str(err)
        return
    try:
        cls(**rollout.environment_options).close()
    except (ValueError, TypeError) as err:
        yield "environment_options", str(err)


def domain_tools(cfg: PipelineConfig) -> dict[str, list[dict[str, Any]]]:
    """Per domain, the tools its multi-turn environment describes for the prompt (Environment.tools), for the
    domains whose environment describes any."""
    from schedulers.multi_turn import ROLLOUTS
    from workers.environments.registry import get_environment_cls

    out = {}
    for domain, reward in cfg.rewards.items():
        rollout = reward.rollout
        if not ROLLOUTS.traits(rollout.type).get("environment"):
            continue
        env = get_environment_cls(rollout.environment)(**rollout.environment_options)
        try:
            tools = env.tools()
        finally:
            env.close()
        if tools:
            out[domain] = tools
    return out


def load_run_config(path: str | Path, overrides: list[str] | None = None) -> ResolvedConfig:
    """The config a run uses: `load_config` with the names checked as well, every problem in one ConfigError."""
    return load_config(path, overrides, checks=(name_problems,))

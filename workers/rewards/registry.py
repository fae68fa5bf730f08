"""Reward scorers found by name (``rewards.<domain>.worker``): built-in names, ``package.module:Class`` paths, and
the entry-point group ``roll_pipeline.reward_workers`` of installed packages (``name = "package.module:Class"``).
The lookup is roll_core/plugins.py's, shared with the environments of multi-turn rollouts.
"""

from __future__ import annotations

from roll_core.plugins import PluginInfo, PluginRegistry
from roll_core.rewards.scorer import RewardScorer

ENTRY_POINT_GROUP = "roll_pipeline.reward_workers"

REWARD_WORKERS: PluginRegistry[type[RewardScorer]] = PluginRegistry(
    "reward worker",
    RewardScorer,
    ENTRY_POINT_GROUP,
    # modules whose import registers the built-in scorers
    (
        "workers.rewards.math_rule",
        "workers.rewards.code_sandbox",
        "workers.rewards.llm_judge",
        "workers.rewards.reward_model",
        "workers.rewards.multiple_choice",
        "workers.rewards.ifeval",
    ),
)



def register_reward_worker(name: str):
    """Class decorator: ``@register_reward_worker("name")`` on a RewardScorer subclass."""
    return REWARD_WORKERS.register(name)


def get_reward_scorer_cls(spec: str) -> type[RewardScorer]:
    """The scorer class for a registered name, an entry-point name, or ``package.module:Class``."""
    return REWARD_WORKERS.get(spec)


def available_reward_workers() -> dict[str, str]:
    """Every known name mapped to its ``module:Class`` (entry points not loaded)."""
    return REWARD_WORKERS.available()


def describe_reward_workers() -> list[PluginInfo]:
    """Every known name with its class and where it comes from, for ``roll rewards list``."""
    return REWARD_WORKERS.describe()


RewardWorkerInfo = PluginInfo

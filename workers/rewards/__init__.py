"""Rewards: a pure scorer per domain (``math_rule``, ``code_sandbox``, ``llm_judge``), a registry, and the generic worker."""

from roll_core.rewards.scorer import RewardResult, RewardScorer
from workers.rewards.registry import available_reward_workers, get_reward_scorer_cls, register_reward_worker
from workers.rewards.worker import RewardWorker

__all__ = [
    "RewardResult",
    "RewardScorer",
    "RewardWorker",
    "available_reward_workers",
    "get_reward_scorer_cls",
    "register_reward_worker",
]

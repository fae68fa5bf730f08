"""Pure RL algorithm functions behind registries; importing this package registers them all."""

from roll_core.algorithms import advantages, aggregation, kl, mixing, policy_loss, shaping, value  # noqa: F401
from roll_core.algorithms.aggregation import aggregate_loss, batch_normalizer
from roll_core.registry import (
    ADVANTAGES,
    DOMAIN_MIXERS,
    KL_CONTROLLERS,
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    POLICY_LOSSES,
    REWARD_NORMS,
)


def needs_critic(adv_estimator: str) -> bool:
    """Whether the advantage estimator reads a value model's values, as its registration declares."""
    return bool(ADVANTAGES.traits(adv_estimator).get("needs_critic", False))


__all__ = [
    "ADVANTAGES",
    "DOMAIN_MIXERS",
    "KL_CONTROLLERS",
    "KL_ESTIMATORS",
    "LOSS_AGGREGATIONS",
    "POLICY_LOSSES",
    "REWARD_NORMS",
    "aggregate_loss",
    "batch_normalizer",
    "needs_critic",
]

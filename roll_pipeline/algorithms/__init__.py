"""Pure RL algorithm functions behind registries; importing this package registers them all."""

from roll_pipeline.algorithms import advantages, aggregation, kl, policy_loss  # noqa: F401
from roll_pipeline.algorithms.aggregation import aggregate_loss, batch_normalizer
from roll_pipeline.algorithms.registry import ADVANTAGES, KL_ESTIMATORS, LOSS_AGGREGATIONS, POLICY_LOSSES

__all__ = [
    "ADVANTAGES",
    "KL_ESTIMATORS",
    "LOSS_AGGREGATIONS",
    "POLICY_LOSSES",
    "aggregate_loss",
    "batch_normalizer",
]

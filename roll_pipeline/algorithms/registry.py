"""Name -> function registries for the RL algorithms, so YAML can choose them and nothing branches on names."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

F = TypeVar("F", bound=Callable)


class Registry:
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, Callable] = {}

    def register(self, name: str) -> Callable[[F], F]:
        def decorate(fn: F) -> F:
            if name in self._items:
                raise ValueError(f"{self.kind} {name!r} is already registered (by {self._items[name].__qualname__})")
            self._items[name] = fn
            return fn

        return decorate

    def get(self, name: str) -> Callable:
        try:
            return self._items[name]
        except KeyError:
            raise ValueError(f"unknown {self.kind} {name!r}; available: {sorted(self._items)}") from None

    def names(self) -> list[str]:
        return sorted(self._items)


ADVANTAGES = Registry("advantage estimator")
POLICY_LOSSES = Registry("policy loss")
KL_ESTIMATORS = Registry("KL estimator")
KL_CONTROLLERS = Registry("KL controller")
LOSS_AGGREGATIONS = Registry("loss aggregation mode")
LOSS_NORMALIZERS = Registry("loss normaliser")
REWARD_NORMS = Registry("reward normalisation")

register_advantage = ADVANTAGES.register
register_policy_loss = POLICY_LOSSES.register
register_kl = KL_ESTIMATORS.register
register_kl_controller = KL_CONTROLLERS.register
register_aggregation = LOSS_AGGREGATIONS.register
register_loss_normalizer = LOSS_NORMALIZERS.register
register_reward_norm = REWARD_NORMS.register

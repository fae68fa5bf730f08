"""Name -> function registries, so YAML chooses algorithms and filters by name and nothing branches on names.

The registries live here, in the core, and import nothing: the functions register themselves when their modules
are imported (roll_core/algorithms, schedulers/filters.py, schedulers/rollout.py). Checking a config's names against them is the
driver's work (roll_pipeline/driver/names.py), which imports those modules first.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable)


class Registry:
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, Callable] = {}
        self._traits: dict[str, dict[str, Any]] = {}

    def register(self, name: str, **traits: Any) -> Callable[[F], F]:
        """Decorator: register the function under `name`, with what the rest of the pipeline needs to know
        about it (e.g. an advantage estimator's ``needs_critic=True``), read back with `traits`."""

        def decorate(fn: F) -> F:
            if name in self._items:
                raise ValueError(f"{self.kind} {name!r} is already registered (by {self._items[name].__qualname__})")
            self._items[name] = fn
            self._traits[name] = dict(traits)
            return fn

        return decorate

    def traits(self, name: str) -> dict[str, Any]:
        """What `name` was registered with (its declared traits); ValueError for an unknown name."""
        self.get(name)
        return dict(self._traits[name])

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
GROUP_FILTERS = Registry("group filter")
RESPONSE_FILTERS = Registry("response filter")
DOMAIN_MIXERS = Registry("domain mixer")
ROLLOUTS = Registry("rollout")

register_advantage = ADVANTAGES.register
register_policy_loss = POLICY_LOSSES.register
register_kl = KL_ESTIMATORS.register
register_kl_controller = KL_CONTROLLERS.register
register_aggregation = LOSS_AGGREGATIONS.register
register_loss_normalizer = LOSS_NORMALIZERS.register
register_reward_norm = REWARD_NORMS.register

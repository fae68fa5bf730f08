"""Domain mixers: each step's domain probabilities (turned into prompt shares by `domain_shares`), from the
configured `domain_interleave_probs` and what the schedulers measured. Pure functions behind DOMAIN_MIXERS.

State (`MixState`, checkpointed) is updated after every rollout with each domain's kept groups and the seconds its
scheduler spent (`observe_rollout`), and after every validation with each domain's accuracy (`observe_validation`).

* `static`: the configured probabilities, every step.
* `progress`: the batch goes where learning happens per second spent. A domain's rate is its groups kept (groups
  that passed the filters: responses that disagree, so the group-relative advantage has something to learn from)
  per second of its rollout, an exponential moving average (`smoothing`) over the steps; its weight is the
  configured probability times (rate / the probability-weighted mean rate) ** `strength`, times
  (1 + `validation_weight` * its accuracy gain at the last validation, when positive). The weights are
  normalised and clipped to [`floor`, `ceil`] (clipping repeated until the clipped ones are fixed and the rest
  renormalised), so that no domain is starved and its signals keep being measured. Until every domain has a
  rate, the configured probabilities stand.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from roll_core.registry import DOMAIN_MIXERS


@dataclass
class MixState:
    rate: dict[str, float] = field(default_factory=dict)
    """Per domain: kept groups per second of rollout, smoothed."""
    accuracy: dict[str, float] = field(default_factory=dict)
    """Per domain: accuracy at the last validation."""
    gain: dict[str, float] = field(default_factory=dict)
    """Per domain: accuracy change between the last two validations."""

    def state_dict(self) -> dict:
        return {"rate": dict(self.rate), "accuracy": dict(self.accuracy), "gain": dict(self.gain)}

    @classmethod
    def from_state(cls, state: Mapping) -> MixState:
        return cls(dict(state["rate"]), dict(state["accuracy"]), dict(state["gain"]))


def observe_rollout(state: MixState, metrics: Mapping[str, float], domains: list[str], smoothing: float) -> None:
    """Fold one rollout's scheduler metrics (`scheduler/<domain>/groups_kept` and `wall_s`) into the rates."""
    for d in domains:
        kept, wall = metrics.get(f"scheduler/{d}/groups_kept"), metrics.get(f"scheduler/{d}/wall_s")
        if kept is None or not wall or wall <= 0:
            continue
        rate = kept / wall
        state.rate[d] = rate if d not in state.rate else smoothing * state.rate[d] + (1 - smoothing) * rate


def observe_validation(state: MixState, metrics: Mapping[str, float], domains: list[str]) -> None:
    """Fold one validation's `val_domain/<domain>/correct_mean` into the accuracies and gains."""
    for d in domains:
        accuracy = metrics.get(f"val_domain/{d}/correct_mean")
        if accuracy is None or math.isnan(accuracy):
            continue
        if d in state.accuracy:
            state.gain[d] = accuracy - state.accuracy[d]
        state.accuracy[d] = accuracy


def clip_probs(weights: Mapping[str, float], floor: float, ceil: float) -> dict[str, float]:
    """`weights` normalised to sum 1, each within [floor, ceil] (feasible when floor * n <= 1 <= ceil * n)."""
    fixed: dict[str, float] = {}
    free = dict(weights)
    while True:
        mass = 1.0 - sum(fixed.values())
        total = sum(free.values())
        probs = {d: mass * w / total if total > 0 else mass / len(free) for d, w in free.items()}
        # The domains over the ceiling are fixed first (what they give up goes to the others), then those under
        # the floor; one side a round, so a round never fixes more mass than there is.
        high = {d for d, p in probs.items() if p > ceil}
        low = {d for d, p in probs.items() if p < floor} if not high else set()
        if not low and not high:
            return {d: fixed.get(d, probs.get(d)) for d in weights}
        for d in high:
            fixed[d] = ceil
            free.pop(d)
        for d in low:
            fixed[d] = floor
            free.pop(d)
        if not free:
            return {d: fixed[d] / sum(fixed.values()) for d in weights}


@DOMAIN_MIXERS.register("static")
def static_mix(base: Mapping[str, float], state: MixState, **_: float) -> dict[str, float]:
    return dict(base)


@DOMAIN_MIXERS.register("progress")
def progress_mix(
    base: Mapping[str, float],
    state: MixState,
    *,
    floor: float,
    ceil: float,
    strength: float,
    validation_weight: float,
    **_: float,
) -> dict[str, float]:
    if any(d not in state.rate for d in base):
        return dict(base)
    mean = sum(base[d] * state.rate[d] for d in base)
    if mean <= 0:
        return dict(base)
    weights = {}
    for d, p in base.items():
        relative = state.rate[d] / mean
        weight = p * relative**strength if relative > 0 else 0.0
        weights[d] = weight * (1.0 + validation_weight * max(0.0, state.gain.get(d, 0.0)))
    return clip_probs(weights, floor, ceil)

"""The `dynamic_sampling` section (with its difficulty `ledger`) and `domain_mixer`: which prompts each step draws.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal


@dataclass(frozen=True, kw_only=True)
class LedgerConfig:
    """The difficulty ledger (schedulers/ledger.py): rows whose recent groups were uniform (all right or all
    wrong) are passed over before they are generated, with a re-test probability so they can come back."""

    enabled: bool = False
    streak: int = 1
    """Uniform groups in a row (all right, or all wrong) after which a row is skipped when drawn."""
    retest_prob: float = 0.25
    """Chance that a skipped row is generated anyway, to see whether it is still uniform."""

    def validate(self) -> Iterator[tuple[str, str]]:
        if self.streak < 1:
            yield "streak", "must be >= 1"
        if not 0 < self.retest_prob <= 1:
            yield "retest_prob", "must be in (0, 1] (0 would never let a skipped row come back)"


@dataclass(frozen=True, kw_only=True)
class DomainMixerConfig:
    """How each step's prompts are divided among the domains (roll_core/algorithms/mixing.py): `static`, the
    shares of domain_interleave_probs every step; `progress`, shares that follow each domain's kept groups per
    second of rollout (and its validation gains), starting from domain_interleave_probs."""

    type: str = "static"
    floor: float = 0.1
    """Smallest probability a domain gets (floor x rollout_batch_size must be at least one prompt)."""
    ceil: float = 0.9
    """Largest probability a domain gets."""
    strength: float = 1.0
    """How strongly the rates move the shares: the exponent of a domain's rate relative to the mean."""
    smoothing: float = 0.7
    """Weight of the past in the moving average of each domain's rate (0: the last step alone)."""
    validation_weight: float = 1.0
    """Extra weight for a domain whose validation accuracy rose at the last validation (times the gain)."""

    def validate(self) -> Iterator[tuple[str, str]]:
        # `type` is checked against DOMAIN_MIXERS by the driver (roll_pipeline/driver/names.py).
        if not 0 <= self.floor < self.ceil <= 1:
            yield "floor", f"need 0 <= floor < ceil <= 1, got floor {self.floor}, ceil {self.ceil}"
        if not 0 <= self.smoothing < 1:
            yield "smoothing", "must be in [0, 1)"
        if self.strength < 0 or self.validation_weight < 0:
            yield "strength", "strength and validation_weight must be >= 0"


@dataclass(frozen=True, kw_only=True)
class DynamicSamplingConfig:
    """How each domain's scheduler fills its share of a step (the filters themselves are per domain, under
    rewards.<domain>.group_filters and response_filters)."""

    max_running_requests: int = 8
    """Prompts in flight at once per domain, each one request for its whole group; validation sends all of its
    prompts at once."""
    max_prompts_factor: float = 4.0
    """The redraw bound: a domain draws at most ceil(max_prompts_factor * share) prompts in a step."""
    request_mode: Literal["auto", "wave", "prompt"] = "auto"
    """How drawn prompts go to actor_infer. `prompt`: one request per prompt (its whole group), which an engine
    with continuous batching (vLLM) schedules as it goes. `wave`: the prompts drawn together go as requests of as
    many prompts as fill one actor_infer batch (infer_batch_size sequences), so a statically batching engine (hf
    generate) starts at once with the whole wave instead of gathering single requests. `auto`: `prompt` for
    vLLM, `wave` otherwise. Deterministic runs always send one seeded request per prompt."""
    on_bound: Literal["train_on_passed", "error"] = "train_on_passed"
    """At the bound with too few groups passed: `train_on_passed` fills the empty slots with dropped groups whose
    samples are left out of the loss (in_loss 0), logs a warning and scheduler/<domain>/bound_hit = 1; `error` stops the
    run with an error naming the domain and its filters."""
    ledger: LedgerConfig = field(default_factory=LedgerConfig)
    """Skip rows whose recent groups were uniform before generating them (off by default)."""

    def validate(self) -> Iterator[tuple[str, str]]:
        if self.max_running_requests < 1:
            yield "max_running_requests", "must be >= 1"
        if self.max_prompts_factor < 1:
            yield "max_prompts_factor", f"must be >= 1 (a domain must be able to draw its share), got {self.max_prompts_factor}"

"""The `validation` section: what is validated, how often, and how it is generated.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from roll_core.config.clusters import GeneratingArgs


@dataclass(frozen=True, kw_only=True)
class ValidationConfig:
    generating_args: GeneratingArgs = field(
        default_factory=lambda: GeneratingArgs(do_sample=False, max_new_tokens=32)
    )
    eval_at_start: bool = True
    """Validate once before the first step, so the run reports where it started."""
    max_prompts: int = 0
    """Use at most this many validation prompts per domain (the first ones); 0 means all."""
    num_samples: int = 1
    """Responses per validation prompt (k): accuracy is their mean; pass@k and maj@k need k > 1 and sampling."""
    regression_alpha: float = 0.05
    """A tag is flagged as regressed (tag `val_regressed`, metric val_change/<tag>/regressed) when fewer of its
    prompts are solved than at the previous validation and McNemar's exact test, Holm-adjusted over the tags,
    gives p below this (roll_pipeline/driver/significance.py)."""
    confidence: float = 0.95
    """Level of the per-tag Wilson intervals (val_ci/<tag>/low and high)."""

    def validate(self) -> Iterator[tuple[str, str]]:
        if self.num_samples < 1:
            yield "num_samples", "must be >= 1"
        if not 0 < self.regression_alpha < 1:
            yield "regression_alpha", "must be between 0 and 1"
        if not 0 < self.confidence < 1:
            yield "confidence", "must be between 0 and 1"
        if self.num_samples > 1 and not self.generating_args.do_sample:
            yield "num_samples", "k > 1 responses per prompt need generating_args.do_sample: true (greedy repeats one)"

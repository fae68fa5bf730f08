"""The `reward_shaping` section (top level, or per domain under `rewards.<domain>`): the scores' penalties and masks.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class OverlongPenaltyConfig:
    """DAPO's soft overlong punishment (Yu et al., arXiv:2503.14476, eq. 13), added to the score: 0 up to
    max_new_tokens - buffer_len response tokens, then falling linearly to -penalty_factor at max_new_tokens."""

    buffer_len: int
    """The soft buffer in tokens before actor_infer.generating_args.max_new_tokens (DAPO: 4096 of 20480)."""
    penalty_factor: float = 1.0
    """The penalty at max_new_tokens."""


@dataclass(frozen=True, kw_only=True)
class DifficultyMaskConfig:
    """Masks out of the loss the groups whose mean score lies outside [low, high]: the meaning of the scheduler's
    `mean_filter` (schedulers/filters.py), applied to the batch as it is instead of drawing other prompts."""

    low: float = 0.0
    high: float = 1.0
    inclusive: bool = True
    """false: keep only groups whose mean lies strictly between low and high (ROLL's difficulty_mask)."""


@dataclass(frozen=True, kw_only=True)
class LengthMaskConfig:
    """Masks out of the loss the responses longer than max_tokens tokens."""

    max_tokens: int
    only_incorrect: bool = False
    """Mask only long responses the reward worker did not judge correct (ROLL's error_max_len_clip)."""


@dataclass(frozen=True, kw_only=True)
class RewardShapingConfig:
    """What happens to the reward workers' scores before advantages (roll_core/algorithms/shaping.py), per
    domain: statistics never mix domains. Order: sample masks (on the raw scores), overlong penalty,
    normalisation, scaling, clipping. Truncated responses are masked by the scheduler instead:
    rewards.<domain>.response_filters: {truncated: {}} (DAPO's overlong filtering)."""

    norm_mean_type: str | None = None
    """Subtract the mean of the sample's `group` (prompt group), its domain's `batch`, or the domain's `running`
    moments over every step so far (kept per domain and checkpointed); None: no centring. ROLL's reward_norm."""
    norm_std_type: str | None = None
    """Divide by the std (+1e-6) of `group`, `batch` or `running`, as norm_mean_type; None: no division."""
    reward_scale: float = 1.0
    """Multiply the (normalised) scores by this."""
    reward_clip: float | None = None
    """Clip the scaled scores to [-reward_clip, reward_clip]; None: no clipping."""
    overlong_penalty: OverlongPenaltyConfig | None = None
    difficulty_mask: DifficultyMaskConfig | None = None
    length_mask: LengthMaskConfig | None = None

    def validate(self) -> Iterator[tuple[str, str]]:
        if self.reward_clip is not None and self.reward_clip <= 0:
            yield "reward_clip", f"must be > 0 (or null), got {self.reward_clip}"
        if self.overlong_penalty is not None and self.overlong_penalty.buffer_len < 1:
            yield "overlong_penalty.buffer_len", "must be >= 1"
        if self.difficulty_mask is not None and self.difficulty_mask.low > self.difficulty_mask.high:
            yield "difficulty_mask", f"low ({self.difficulty_mask.low}) must be <= high ({self.difficulty_mask.high})"
        if self.length_mask is not None and self.length_mask.max_tokens < 1:
            yield "length_mask.max_tokens", "must be >= 1"

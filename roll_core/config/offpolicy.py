"""The `offpolicy_correction` section: how a batch sampled by actor_infer's policy (mu) is corrected towards
actor_train's policy before the update (pi_old). The per-token ratio is pi_old(a) / mu(a); the two mechanisms,
each optional and each at a level of its own (roll_core/algorithms/offpolicy.py computes them):

- importance weights (`is_level`): the policy-gradient term of every token is multiplied by the ratio, truncated
  at `is_cap`; per token, or one weight per response (the product of its tokens' ratios);
- rejection (`rs_level`): tokens, or whole responses, whose ratio (per token, the product over the response, or
  its geometric mean) lies outside [`rs_lower`, `rs_upper`] leave the loss, and its normaliser.

`infer_is_cap: C` at the top level is the shorthand for `is_level: token, is_cap: C`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, kw_only=True)
class OffPolicyCorrectionConfig:
    is_level: Literal["token", "sequence"] | None = None
    """Importance weights: `token` (each token's own ratio; TIS, Yao et al. 2025), `sequence` (the response's
    product of ratios, the unbiased sequence-level weight, on all its tokens), or null: none."""
    is_cap: float = 2.0
    """Upper bound of the importance weights (truncation; the ratio itself is bounded to [e^-20, e^20] first)."""
    rs_level: Literal["token", "sequence", "geometric"] | None = None
    """Rejection: `token` (a token whose ratio is out of bounds leaves the loss), `sequence` (a response whose
    product of ratios is out of bounds leaves it), `geometric` (a response whose geometric mean ratio, exp of the
    mean log-ratio, is out of bounds leaves it; bounds near 1, e.g. 1.001, as it does not grow with length), or
    null: none."""
    rs_upper: float | None = None
    """Upper bound of the rejection; null: is_cap."""
    rs_lower: float | None = None
    """Lower bound of the rejection; null: 1 / rs_upper."""

    def validate(self) -> Iterator[tuple[str, str]]:
        if not self.is_cap > 0:
            yield "is_cap", f"must be > 0, got {self.is_cap}"
        if self.rs_upper is not None and not self.rs_upper > 0:
            yield "rs_upper", f"must be > 0 (or null: is_cap), got {self.rs_upper}"
        if self.rs_lower is not None and not self.rs_lower >= 0:
            yield "rs_lower", f"must be >= 0 (or null: 1 / rs_upper), got {self.rs_lower}"
        upper = self.is_cap if self.rs_upper is None else self.rs_upper  # not a bound to divide by when <= 0
        if self.rs_level is not None and upper > 0 and self.rejection_bounds[0] >= self.rejection_bounds[1]:
            lower, upper = self.rejection_bounds
            yield "rs_lower", f"must be below the upper bound {upper:g}, got {lower:g}"

    @property
    def rejection_bounds(self) -> tuple[float, float]:
        """(lower, upper) of the rejection, the defaults filled in."""
        upper = self.is_cap if self.rs_upper is None else self.rs_upper
        lower = 1.0 / upper if self.rs_lower is None else self.rs_lower
        return lower, upper

    @property
    def active(self) -> bool:
        return self.is_level is not None or self.rs_level is not None

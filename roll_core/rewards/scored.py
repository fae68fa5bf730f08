"""``ScoredSample``: one response as the reward worker judged it, and as filters and metrics read it.

The reward worker returns one per sample (the judgement: ``score``, ``correct``, ``metrics``, or the reason it
was masked); the scheduler adds what the generation says about the response (``response_length``,
``finish_reason``) before its filters see it; the driver adds the prompt's identity (``domain``, ``tag``,
``id``, ``response_text``, and for the validation sample table ``prompt`` and ``ground_truth``) before the
rollout and validation metrics read it. A sample is masked exactly when
``mask_reason`` is set, and then ``score`` and ``correct`` are None: masking is encoded once, here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

#: Why a sample was masked; also the suffix of its ``reward/<domain>/masked_<reason>`` count.
MASK_NOT_APPLICABLE = "not_applicable"
MASK_ERROR = "error"
MASK_CRASH = "crash"
MASK_TIMEOUT = "timeout"
MASK_WORKER_LOST = "worker_lost"
"""Set by the scheduler, not by the worker: the reward worker itself died and stayed dead."""
MASK_REASONS = (MASK_NOT_APPLICABLE, MASK_ERROR, MASK_CRASH, MASK_TIMEOUT, MASK_WORKER_LOST)


@dataclass(frozen=True)
class ScoredSample:
    """One scored (or masked) response."""

    score: float | None
    """The reward; None when masked."""
    correct: bool | None
    """Whether the response counts as correct, for accuracies; None when masked."""
    mask_reason: str | None = None
    """One of ``MASK_REASONS`` when the reward could not be computed; None when it was."""
    metrics: Mapping[str, float] = field(default_factory=dict)
    """The scorer's extra per-sample metrics."""
    response_length: int | None = None
    """Tokens in the response (set by the scheduler)."""
    finish_reason: str | None = None
    """``stop`` or ``length`` (set by the scheduler)."""
    domain: str | None = None
    tag: str | None = None
    id: Any = None
    """The prompt's id: a prompt's responses share it."""
    response_text: str | None = None
    prompt: str | None = None
    """The prompt as text (for the validation sample table)."""
    ground_truth: Any = None
    trajectory: Sequence[Mapping[str, str]] | None = None
    """A multi-turn response's chat messages (the model's turns and the tools' answers); None: single-turn."""
    tool_use: Mapping[str, float] | None = None
    """A multi-turn response's `turns`, `tool_calls`, `tool_errors` and `tool_s` (set by the driver)."""
    components: Mapping[str, ScoredSample] = field(default_factory=dict)
    """For a domain of several rewards (rewards.<domain>.workers): each component's own judgement, by name."""

    def __post_init__(self) -> None:
        if self.mask_reason is not None:
            if self.mask_reason not in MASK_REASONS:
                raise ValueError(f"unknown mask reason {self.mask_reason!r}; known: {list(MASK_REASONS)}")
            if self.score is not None or self.correct is not None:
                raise ValueError("a masked sample has neither a score nor a verdict")
        elif (
            not isinstance(self.score, int | float)
            or isinstance(self.score, bool)
            or not math.isfinite(self.score)
            or not isinstance(self.correct, bool)
        ):
            raise ValueError(
                f"a scored sample needs a finite score and a bool verdict, got {self.score!r}, {self.correct!r}"
            )

    @property
    def masked(self) -> bool:
        return self.mask_reason is not None

    @classmethod
    def masked_as(cls, reason: str, **context: Any) -> ScoredSample:
        """A sample masked for ``reason``."""
        return cls(score=None, correct=None, mask_reason=reason, **context)

    def but(self, **changes: Any) -> ScoredSample:
        """This sample with more context (or other fields) set."""
        return replace(self, **changes)

    def to_json(self) -> dict[str, Any]:
        """The judgement as plain data: ``{"score", "correct", "masked", "metrics"}`` (`roll rewards score`)."""
        return {"score": self.score, "correct": self.correct, "masked": self.masked, "metrics": dict(self.metrics)}

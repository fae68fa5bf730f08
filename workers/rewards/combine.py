"""Several rewards of one domain (``rewards.<domain>.workers``) combined into one judgement per sample.

A pure function of the components' judgements: the domain's score is the weighted sum of the components'
scores; its ``correct`` and scorer metrics are the first component's (the one the config lists first decides
accuracy); each component's judgement stays attached (``ScoredSample.components``) for its own metrics. Masking:
a component with ``on_masked: mask`` that masked the sample masks it (with that component's reason); one with
``on_masked: skip`` leaves the sum, and the weights of the components left are scaled up so that the sum keeps
the scale of all the weights.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from roll_core.rewards.scored import ScoredSample


@dataclass(frozen=True)
class Component:
    name: str
    weight: float
    on_masked: str = "mask"


def combine(components: Sequence[Component], results: Mapping[str, Sequence[ScoredSample]]) -> list[ScoredSample]:
    """One ScoredSample per sample from each component's ``results`` (lists of equal length, in sample order)."""
    if len(components) == 1:
        return list(results[components[0].name])
    lengths = {c.name: len(results[c.name]) for c in components}
    if len(set(lengths.values())) != 1:
        raise ValueError(f"components judged different numbers of samples: {lengths}")
    total = sum(c.weight for c in components)
    combined = []
    for i in range(next(iter(lengths.values()))):
        judged = {c.name: results[c.name][i] for c in components}
        combined.append(_one(components, judged, total))
    return combined


def _one(components: Sequence[Component], judged: Mapping[str, ScoredSample], total: float) -> ScoredSample:
    first = judged[components[0].name]
    blocking = [judged[c.name] for c in components if judged[c.name].masked and c.on_masked == "mask"]
    present = [c for c in components if not judged[c.name].masked]
    if blocking or first.masked:  # (every component masked: the first one is)
        return ScoredSample.masked_as((blocking or [first])[0].mask_reason, components=dict(judged))
    weight = sum(c.weight for c in present)
    score = sum(c.weight * judged[c.name].score for c in present) * (total / weight)
    return ScoredSample(score=score, correct=first.correct, metrics=dict(first.metrics), components=dict(judged))

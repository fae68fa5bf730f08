"""Dynamic-sampling filters: pure functions behind registries, chosen per domain in YAML.

A *group filter* sees one prompt's group of scored responses and says whether the group goes into the batch
(``True``) or is dropped, freeing its slot for another prompt. A *response filter* sees one response and says
whether it stays in the loss; a response it rejects is kept in the batch with ``in_loss`` 0, so every group
keeps its size, and the group filters then see only the responses that stayed.

Each record is a ``roll_core.rewards.scored.ScoredSample`` with ``response_length`` and ``finish_reason`` (``stop``
or ``length``) set; its ``score`` is None when the reward worker masked it.

Configured under ``rewards.<domain>``::

    group_filters: {std_filter: {}, mean_filter: {low: 0.0, high: 0.9}}
    response_filters: {truncated: {}}
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Mapping
from typing import Any

from roll_core.registry import GROUP_FILTERS, RESPONSE_FILTERS, Registry
from roll_core.rewards.scored import ScoredSample


def _scores(group: list[ScoredSample]) -> list[float]:
    return [r.score for r in group if r.score is not None]


@GROUP_FILTERS.register("std_filter")
def std_filter(group: list[ScoredSample], *, min_std: float = 0.0) -> bool:
    """DAPO's dynamic sampling rule (Yu et al. 2025, arXiv:2503.14476): drop a group whose rewards are all equal
    (population std <= `min_std`), since every response then gets a zero group-relative advantage. A group with
    fewer than two scored responses is dropped too: it has no spread to learn from."""
    scores = _scores(group)
    if len(scores) < 2:
        return False
    mean = sum(scores) / len(scores)
    std = (sum((s - mean) ** 2 for s in scores) / len(scores)) ** 0.5
    return std > min_std + 1e-12


@GROUP_FILTERS.register("mean_filter")
def mean_filter(group: list[ScoredSample], *, low: float = 0.0, high: float = 1.0, inclusive: bool = True) -> bool:
    """Keep a group whose mean reward lies in [low, high] (difficulty filtering: drop prompts that are too easy
    or too hard); with `inclusive: false`, strictly between them (ROLL's mean_filter and difficulty_mask drop a
    mean equal to either threshold). A group with no scored response is dropped."""
    scores = _scores(group)
    if not scores:
        return False
    mean = sum(scores) / len(scores)
    if inclusive:
        return low - 1e-12 <= mean <= high + 1e-12
    return low + 1e-12 < mean < high - 1e-12


@RESPONSE_FILTERS.register("truncated")
def truncated(response: ScoredSample) -> bool:
    """Drop a response cut off by max_new_tokens (finish reason `length`) from the loss: DAPO's overlong
    filtering, so an unfinished answer is neither rewarded nor punished."""
    return response.finish_reason != "length"


def check_filters(registry: Registry, specs: Mapping[str, Mapping[str, Any]]) -> Iterator[tuple[str, str]]:
    """(key, message) for each unknown filter name or parameter in `specs`, for the config loader."""
    for name, params in specs.items():
        if name not in registry.names():
            yield name, f"unknown {registry.kind} {name!r}; available: {registry.names()}"
            continue
        if not isinstance(params, Mapping):
            yield name, f"parameters must be a mapping, got {type(params).__name__}"
            continue
        fn = registry.get(name)
        accepted = [p for p in list(inspect.signature(fn).parameters)[1:]]
        for key in params:
            if key not in accepted:
                yield f"{name}.{key}", f"{name} takes no parameter {key!r}; it takes {accepted or 'none'}"


def apply_response_filters(
    records: list[ScoredSample], specs: Mapping[str, Mapping[str, Any]]
) -> list[str | None]:
    """For each record, the name of the first response filter that rejected it, or None if all kept it."""
    out: list[str | None] = []
    for record in records:
        rejected = None
        for name, params in specs.items():
            if not RESPONSE_FILTERS.get(name)(record, **params):
                rejected = name
                break
        out.append(rejected)
    return out


def apply_group_filters(group: list[ScoredSample], specs: Mapping[str, Mapping[str, Any]]) -> str | None:
    """The name of the first group filter (in config order) that drops `group`, or None if the group is kept."""
    for name, params in specs.items():
        if not GROUP_FILTERS.get(name)(group, **params):
            return name
    return None


def filter_group(
    records: list[ScoredSample],
    response_specs: Mapping[str, Mapping[str, Any]],
    group_specs: Mapping[str, Mapping[str, Any]],
) -> tuple[list[str | None], str | None]:
    """One scored group through both kinds of filter: each response's rejecting response filter (or None), and
    what dropped the group (None: kept). The group filters see only the responses that stayed; a group whose
    responses were all rejected is dropped by "response_filters"."""
    rejected = apply_response_filters(records, response_specs)
    survivors = [r for r, why in zip(records, rejected, strict=True) if why is None]
    if response_specs and not survivors:
        return rejected, "response_filters"
    return rejected, apply_group_filters(survivors, group_specs)

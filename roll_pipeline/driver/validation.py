"""Validation and rollout metrics: pure functions over per-sample records, so they are tested without a run.

Validation metric names (k = validation.num_samples responses per prompt; <tag> is a data tag, <domain> a
domain; "all" is every validation prompt of every domain):

==========================================  =================================================================
``val_correct/{all,<tag>}/mean``            accuracy over all scored samples, i.e. mean@k (ROLL's names)
``val_correct/{all,<tag>}/pass_at_<j>``     unbiased pass@j (Chen et al. 2021), averaged over prompts, for j
                                            = 1, 2, 4, ... below k, and k
``val_correct/{all,<tag>}/maj_at_<k>``      majority vote over the k answers is right (only where the domain's
                                            answers are comparable: its reward worker has an answer key)
``val_response_length/{all,<tag>}/mean``    mean response length in tokens
``val_truncated/{all,<tag>}/rate``          share of responses cut off by max_new_tokens
``val_masked/{all,<tag>}/count``            samples the reward worker could not score (left out of accuracies)
``val_prompts/{all,<tag>}/count``           validation prompts
``val_{turns,tool_calls,tool_errors,tool_s}  multi-turn responses only: model turns, tool calls, failed tool
/{all,<tag>}/mean``                         calls and tool seconds per response
``val_domain/<domain>/<name>``              the same per domain: correct_mean, pass_at_<j>, maj_at_<k>,
                                            response_length_mean, truncated_rate, masked_count, prompts
==========================================  =================================================================

A tag is written into metric names with every character MLflow does not allow (and "/") replaced by "_"; the
tag "all" is reserved.
"""

from __future__ import annotations

import math
import re
from collections import Counter, defaultdict
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any

from roll_core.rewards.scored import ScoredSample

AnswerKey = Callable[[str], Hashable | None]
"""Maps a response to the answer it states, in a form where equal answers compare equal; None: no answer."""


def answer_keys(rewards: Mapping[str, Any]) -> dict[str, AnswerKey | None]:
    """domain -> its scorer's ``answer_key`` (the scorer built with the domain's options; with several rewards,
    the first one's), for maj@k; None where the scorer has none. ``rewards`` maps a domain to its
    ``rewards.<domain>`` block."""
    from workers.rewards.registry import get_reward_scorer_cls

    keys: dict[str, AnswerKey | None] = {}
    for domain, reward in rewards.items():
        first = reward.components()[0]
        scorer_cls = get_reward_scorer_cls(first.worker)
        keys[domain] = scorer_cls(**dict(first.options or {})).answer_key if scorer_cls.has_answer_key else None
    return keys


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: 1 - C(n-c, k) / C(n, k) (Chen et al. 2021, eq.
    1), as a running product so large n does not overflow."""
    if not 0 < k <= n or not 0 <= c <= n:
        raise ValueError(f"pass@k needs 0 < k <= n and 0 <= c <= n, got n={n}, c={c}, k={k}")
    # With fewer than k wrong samples (n - c < k) the factor i = k is 0, and pass@k is exactly 1.
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def pass_ks(k: int) -> list[int]:
    """The j of the reported pass@j: powers of two below k, and k."""
    return sorted({2**i for i in range(k.bit_length())} | {k})


def majority_correct(votes: Sequence[tuple[Hashable | None, bool]]) -> float:
    """Whether the most frequent answer is correct, from (answer, correct) per scored sample.

    Samples without an answer do not vote. A tie between answers scores the mean over the tied answers (each
    answer's correctness is the mean over the samples that gave it), so the result does not depend on order.
    No vote at all scores 0."""
    counts = Counter(a for a, _ in votes if a is not None)
    if not counts:
        return 0.0
    top = max(counts.values())
    tied = [a for a, n in counts.items() if n == top]
    per_answer = [_mean([1.0 if ok else 0.0 for a, ok in votes if a == answer]) for answer in tied]
    return sum(per_answer) / len(per_answer)


_UNSAFE = re.compile(r"[^\w.\- ]")


def metric_name_part(tag: str) -> str:
    """A tag as it appears in metric names: characters MLflow rejects, and "/", become "_"."""
    return _UNSAFE.sub("_", str(tag))


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def _scope_metrics(
    groups: list[list[ScoredSample]], ks: list[int], keys: list[AnswerKey | None]
) -> dict[str, float]:
    """Metrics over the prompt groups of one scope (all, a tag or a domain); `keys` holds each group's answer
    key, and maj@k is only computed when every group has one."""
    samples = [r for g in groups for r in g]
    scored = [r for r in samples if not r.masked]
    out = {"mean": _mean([1.0 if r.correct else 0.0 for r in scored])}
    for j in ks:
        per_prompt = []
        for g in groups:
            marks = [bool(r.correct) for r in g if not r.masked]
            if len(marks) >= j:
                per_prompt.append(pass_at_k(len(marks), sum(marks), j))
        out[f"pass_at_{j}"] = _mean(per_prompt)
    if groups and all(key is not None for key in keys):
        out[f"maj_at_{ks[-1]}"] = _mean(
            [
                majority_correct(
                    [(key(r.response_text or ""), bool(r.correct)) for r in g if not r.masked]
                )
                for g, key in zip(groups, keys, strict=True)
                if any(not r.masked for r in g)
            ]
        )
    out["response_length"] = _mean([float(r.response_length or 0) for r in samples])
    out["truncated"] = _mean([1.0 if r.finish_reason == "length" else 0.0 for r in samples])
    out["masked"] = float(len(samples) - len(scored))
    out["prompts"] = float(len(groups))
    out |= tool_use_means(samples)
    return out


TOOL_STATS = ("turns", "tool_calls", "tool_errors", "tool_s")
"""What a multi-turn response records of its tool use (ScoredSample.tool_use)."""


def tool_use_means(samples: Sequence[ScoredSample]) -> dict[str, float]:
    """Per response, the mean of each of TOOL_STATS over the multi-turn ones among `samples` (none: {})."""
    used = [r.tool_use for r in samples if r.tool_use is not None]
    return {key: _mean([float(u[key]) for u in used]) for key in TOOL_STATS} if used else {}


def validation_metrics(
    records: Iterable[ScoredSample], answer_keys: Mapping[str, AnswerKey | None] | None = None
) -> dict[str, float]:
    """Validation metrics overall, per tag and per domain (names in the module docstring).

    Each record is one response with its `domain`, `tag`, `id` (the prompt; a prompt's k responses share it),
    `response_text`, `response_length` (tokens) and `finish_reason` set. `answer_keys` maps a domain to its answer key for maj@k (see `answer_keys()`); a
    domain missing from it gets no maj@k. Unscored samples are left out of every accuracy and counted as
    masked.
    """
    keys = dict(answer_keys or {})
    groups: dict[tuple[str, Any], list[ScoredSample]] = defaultdict(list)
    for r in records:
        groups[(r.domain, r.id)].append(r)
    by_tag: dict[str, list[tuple[str, Any]]] = defaultdict(list)
    by_domain: dict[str, list[tuple[str, Any]]] = defaultdict(list)
    names: dict[str, str] = {}
    for gid, g in groups.items():
        tag = g[0].tag
        name = metric_name_part(tag)
        if name == "all":
            raise ValueError(
                "the tag 'all' is reserved for the overall validation metrics; rename it in the data"
            )
        if names.setdefault(name, tag) != tag:
            raise ValueError(f"tags {names[name]!r} and {tag!r} give the same metric name {name!r}")
        by_tag[name].append(gid)
        by_domain[gid[0]].append(gid)
    k = max((len(g) for g in groups.values()), default=1)
    ks = pass_ks(k)

    def scope(gids: list[tuple[str, Any]]) -> dict[str, float]:
        return _scope_metrics([groups[g] for g in gids], ks, [keys.get(g[0]) for g in gids])

    metrics: dict[str, float] = {}
    for name, gids in [("all", list(groups)), *sorted(by_tag.items())]:
        m = scope(gids)
        metrics |= {f"val_correct/{name}/{key}": v for key, v in m.items() if key == "mean" or "_at_" in key}
        metrics[f"val_response_length/{name}/mean"] = m["response_length"]
        metrics[f"val_truncated/{name}/rate"] = m["truncated"]
        metrics[f"val_masked/{name}/count"] = m["masked"]
        metrics[f"val_prompts/{name}/count"] = m["prompts"]
        metrics |= {f"val_{key}/{name}/mean": m[key] for key in TOOL_STATS if key in m}
    for domain, gids in sorted(by_domain.items()):
        m = scope(gids)
        renamed = {
            "mean": "correct_mean",
            "response_length": "response_length_mean",
            "truncated": "truncated_rate",
            "masked": "masked_count",
        }
        metrics |= {
            f"val_domain/{metric_name_part(domain)}/{renamed.get(key, key)}": v for key, v in m.items()
        }
    return metrics


def rollout_metrics(domain: str, records: Iterable[ScoredSample]) -> dict[str, float]:
    """Per-domain training-batch metrics: reward mean (`score`) and std over scored samples, accuracy
    (`correct`), the masked count, response lengths and the truncation rate. The names match the reward
    worker's own `domain_metrics`, which adds the mask reasons and the scorer's extra metrics."""
    records = list(records)
    scored = [float(r.score) for r in records if not r.masked]
    correct = [1.0 if r.correct else 0.0 for r in records if not r.masked]
    mean = _mean(scored)
    std = (sum((s - mean) ** 2 for s in scored) / len(scored)) ** 0.5 if scored else float("nan")
    return {
        f"reward/{domain}/score": mean,
        f"reward/{domain}/std": std,
        f"reward/{domain}/correct": _mean(correct),
        f"reward/{domain}/masked": float(len(records) - len(scored)),
        f"response_length/{domain}/mean": _mean([float(r.response_length or 0) for r in records]),
        f"response_length/{domain}/truncation_rate": _mean(
            [1.0 if r.finish_reason == "length" else 0.0 for r in records]
        ),
        **{f"tool_use/{domain}/{key}": v for key, v in tool_use_means(records).items()},
    }

"""Validation and rollout metrics: pure functions over per-sample records, so they are tested without a run."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def validation_metrics(records: Iterable[Mapping[str, Any]]) -> dict[str, float]:
    """Accuracy overall, per tag and per domain, plus length and truncation, from per-sample records.

    Each record has `domain`, `tag`, `correct` (bool, or None when the sample could not be scored),
    `response_length` (tokens) and `finish_reason`. Unscored samples are left out of the accuracies and counted
    in `val/masked_count`. Names follow ROLL: val_correct/all/mean and val_correct/<tag>/mean.
    """
    records = list(records)
    by_tag: dict[str, list[float]] = defaultdict(list)
    by_domain: dict[str, list[float]] = defaultdict(list)
    overall: list[float] = []
    for r in records:
        if r["correct"] is None:
            continue
        c = 1.0 if r["correct"] else 0.0
        overall.append(c)
        by_tag[r["tag"]].append(c)
        by_domain[r["domain"]].append(c)
    metrics = {"val_correct/all/mean": _mean(overall)}
    metrics |= {f"val_correct/{tag}/mean": _mean(v) for tag, v in sorted(by_tag.items())}
    metrics |= {f"val/{domain}/correct_mean": _mean(v) for domain, v in sorted(by_domain.items())}
    metrics["val/response_length/mean"] = _mean([float(r["response_length"]) for r in records])
    metrics["val/truncation_rate"] = _mean([1.0 if r["finish_reason"] == "length" else 0.0 for r in records])
    metrics["val/masked_count"] = float(sum(r["correct"] is None for r in records))
    metrics["val/num_samples"] = float(len(records))
    return metrics


def rollout_metrics(domain: str, records: Iterable[Mapping[str, Any]]) -> dict[str, float]:
    """Per-domain training-batch metrics: reward mean (`score`) and std over scored samples, accuracy
    (`correct`), the masked count, response lengths and the truncation rate. The names match the reward worker's
    own `domain_metrics`, which adds the mask reasons and the scorer's extra metrics."""
    records = list(records)
    scored = [float(r["score"]) for r in records if not r["masked"]]
    correct = [1.0 if r["correct"] else 0.0 for r in records if not r["masked"]]
    mean = _mean(scored)
    std = (sum((s - mean) ** 2 for s in scored) / len(scored)) ** 0.5 if scored else float("nan")
    return {
        f"reward/{domain}/score": mean,
        f"reward/{domain}/std": std,
        f"reward/{domain}/correct": _mean(correct),
        f"reward/{domain}/masked": float(len(records) - len(scored)),
        f"response_length/{domain}/mean": _mean([float(r["response_length"]) for r in records]),
        f"response_length/{domain}/truncation_rate": _mean(
            [1.0 if r["finish_reason"] == "length" else 0.0 for r in records]
        ),
    }

"""Validation metrics recomputed from a sample table's rows (roll_pipeline/driver/report.py's columns: domain,
prompt_id, verdict, response), written from the metrics' definitions and not with the project's functions: the
tests hold what a run logged against them."""

from __future__ import annotations

import math
from statistics import NormalDist


def by_prompt(rows: list[dict]) -> dict[tuple, list[dict]]:
    """A scope's sample-table rows by prompt, masked responses left out (they are not judged)."""
    out: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["verdict"] != "masked":
            out.setdefault((r["domain"], r["prompt_id"]), []).append(r)
    return out


def pass_at(rows: list[dict], k: int) -> float:
    """Unbiased pass@k (Chen et al. 2021: 1 - C(n-c, k) / C(n, k)) averaged over the prompts with k scored
    responses or more; nan when none has."""
    values = []
    for responses in by_prompt(rows).values():
        n, c = len(responses), sum(r["verdict"] == "correct" for r in responses)
        if n >= k:
            values.append(1 - math.comb(n - c, k) / math.comb(n, k))
    return sum(values) / len(values) if values else math.nan


def majority(rows: list[dict], answer_key) -> float:
    """Majority vote per prompt, averaged: the most frequent stated answer's correctness; answers tied for most
    votes share the prompt equally (each scored by the share of its responses judged correct); a prompt whose
    responses state no answer scores 0."""
    values = []
    for responses in by_prompt(rows).values():
        answers: dict = {}
        for r in responses:
            answer = answer_key(r["response"] or "")
            if answer is not None:
                answers.setdefault(answer, []).append(r["verdict"] == "correct")
        if not answers:
            values.append(0.0)
            continue
        most = max(len(v) for v in answers.values())
        tied = [sum(v) / len(v) for v in answers.values() if len(v) == most]
        values.append(sum(tied) / len(tied))
    return sum(values) / len(values)


def prompt_shares(rows: list[dict]) -> list[float]:
    return [sum(r["verdict"] == "correct" for r in rs) / len(rs) for rs in by_prompt(rows).values()]


def wilson_by_inversion(shares: list[float], confidence: float = 0.95) -> tuple[float, float]:
    """The Wilson score interval from its definition: the proportions p that a score test at `confidence` does not
    reject, |mean - p| <= z sqrt(p (1 - p) / n), found by bisection on each side of the mean (not the closed form
    the project uses)."""
    n, mean = len(shares), sum(shares) / len(shares)
    z = NormalDist().inv_cdf(0.5 + confidence / 2)

    def outside(p: float) -> bool:
        return (mean - p) ** 2 > z * z * p * (1 - p) / n

    def boundary(inside: float, out: float) -> float:
        for _ in range(200):
            mid = (inside + out) / 2
            inside, out = (inside, mid) if outside(mid) else (mid, out)
        return inside

    low = 0.0 if not outside(0.0) else boundary(mean, 0.0)
    high = 1.0 if not outside(1.0) else boundary(mean, 1.0)
    return low, high

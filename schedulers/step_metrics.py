"""A step's metrics, scheduler/<domain>/... and reward/<domain>/..., made from its outcome (schedulers/step.py):
filter counts, redraws, aborts, seconds, the ledger's savings and the reward statistics over every group scored
this step (in the batch or not)."""

from __future__ import annotations

from collections.abc import Sequence

from schedulers.ledger import DifficultyLedger
from schedulers.step import StepOutcome
from workers.rewards.combine import Component
from workers.rewards.worker import domain_metrics


def step_metrics(
    domain: str, outcome: StepOutcome, *, share: int, bound: int, group_filters: Sequence[str],
    components: Sequence[Component], ledger: DifficultyLedger | None,
) -> dict[str, float]:
    p = f"scheduler/{domain}"
    kept, dropped, scored, stats = outcome.kept, outcome.dropped, outcome.scored, outcome.stats
    metrics = {
        f"{p}/prompts_drawn": float(stats.drawn),
        f"{p}/groups_kept": float(len(kept)),
        f"{p}/groups_dropped": float(len(dropped)),
        f"{p}/surplus": float(len(outcome.surplus)),
        f"{p}/redraws": float(max(0, stats.drawn - share)),
        f"{p}/aborted": float(stats.aborted),
        f"{p}/peak_in_flight": float(stats.peak_in_flight),
        f"{p}/bound": float(bound),
        f"{p}/bound_hit": float(len(kept) < share),
        f"{p}/generate_s": sum(g.generate_s for g in scored),
        f"{p}/reward_s": sum(g.reward_s for g in scored),
        f"{p}/wall_s": outcome.wall_s,
        f"{p}/responses_masked_by_filters": float(sum(1 for g in kept for w in g.rejected if w is not None)),
        f"{p}/infer_retries": float(stats.infer_retries),
        f"{p}/reward_worker_failures": float(stats.reward_failures),
        f"{p}/scored_unique_frac": stats.scored_unique / max(stats.scored_total, 1),
    }
    for name in [*group_filters, "response_filters"]:
        metrics[f"{p}/dropped_{name}"] = float(sum(1 for g in dropped if g.dropped_by == name))
    if ledger is not None:
        metrics[f"{p}/skipped_by_ledger"] = float(stats.skipped_by_ledger)
        # What generating them would have cost at this step's rate: an estimate, from seconds per drawn prompt.
        metrics[f"{p}/ledger_saved_est_s"] = stats.skipped_by_ledger * outcome.wall_s / max(stats.drawn, 1)
        metrics[f"{p}/ledger_uniform_rows"] = float(ledger.uniform_rows())
    scores = [r.score for g in scored for r in g.results if not r.masked]
    if scores:
        metrics[f"{p}/reward_mean"] = sum(scores) / len(scores)
    results = [r for g in scored for r in g.results]
    if len(components) > 1:
        for c in components:
            metrics |= domain_metrics(f"{domain}/{c.name}", [r.components[c.name] for r in results])
    return metrics | domain_metrics(domain, results)

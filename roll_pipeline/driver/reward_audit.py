"""Reward audits during a run (config `reward_audit`): every reward worker with a panel scores it again, and a
judge's verdicts are checked against the math rule's (workers/rewards/audit.py says what a panel is and when an
item passes).

Metrics, at step 0 and every `every_steps` steps: `reward_audit/<domain>/pass` (share of the panel that passed),
`failed` and `masked`; for a domain of several rewards, `reward_audit/<domain>/<reward>/...`; for a judge domain
`reward_audit/<domain>/judge_rule_agreement` and `judge_rule_items`. A multi-turn domain whose environment has a
panel (workers/environments/audit.py) runs it on its scheduler, where its trajectories' environments run:
`reward_audit/<domain>/environment/pass`, `failed` and `unavailable`. A failed item stops the run
(`on_change: stop`, the default) with an error naming each item, or is logged as a warning (`warn`).
"""

from __future__ import annotations

import logging
from typing import Any

from workers.rewards.audit import AuditItem, agreement, audit_results, panel_for, rule_checkable
from workers.rewards.registry import get_reward_scorer_cls

logger = logging.getLogger(__name__)


class RewardAuditError(RuntimeError):
    """A reward worker gave a panel item a verdict other than the known one."""


def audit_plan(cfg: Any) -> tuple[dict[tuple[str, str], list[AuditItem]], list[tuple[str, str]]]:
    """Which rewards are audited with which panel, and which are judges to check against the math rule:
    ((domain, reward label) -> panel, [(domain, reward label)])."""
    panels: dict[tuple[str, str], list[AuditItem]] = {}
    judges: list[tuple[str, str]] = []
    for domain in cfg.domain_interleave_probs:
        for component in cfg.rewards[domain].components():
            cls = get_reward_scorer_cls(component.worker)
            panel = panel_for(component.worker, cls)
            if panel:
                panels[(domain, component.label)] = panel
            if getattr(cls, "audit_as_judge", False) and cfg.reward_audit.judge_items:
                judges.append((domain, component.label))
    return panels, judges


def environment_plan(cfg: Any) -> dict[str, list[Any]]:
    """Per multi-turn domain whose environment has an audit panel, the panel's items for its options."""
    from schedulers.multi_turn import ROLLOUTS  # the module that registers the multi-turn rollout
    from workers.environments.audit import panel_for as environment_panel_for
    from workers.environments.registry import get_environment_cls

    plan = {}
    for domain in cfg.domain_interleave_probs:
        rollout = cfg.rewards[domain].rollout
        if not ROLLOUTS.traits(rollout.type).get("environment"):
            continue
        cls = get_environment_cls(rollout.environment)
        items = environment_panel_for(rollout.environment, cls, rollout.environment_options)
        if items:
            plan[domain] = items
    return plan


def _result_metrics(prefix: str, result: Any, masked_name: str) -> dict[str, float]:
    return {
        f"{prefix}/pass": result.pass_rate,
        f"{prefix}/failed": float(len(result.failures)),
        f"{prefix}/{masked_name}": float(result.masked),
    }


def run_audit(
    step: int,
    panels: dict[tuple[str, str], list[AuditItem]],
    judges: list[tuple[str, str]],
    clusters: dict[str, dict[str, Any]],
    wait_for: Any,
    judge_items: int,
    on_change: str,
    environments: dict[str, list[Any]] | None = None,
    schedulers: dict[str, Any] | None = None,
) -> dict[str, float]:
    """Score every panel (and the judges' rule-checkable items) on the live workers, and run each environment
    panel (`environments`, per domain) on the domain's scheduler; the metrics, or `RewardAuditError` when an item
    failed and `on_change` is `stop`."""
    from workers.environments.audit import panel_results, run_panel_on_scheduler
    from workers.rewards.math_rule import MathRuleScorer

    math_items = rule_checkable(panel_for("math_rule"))[:judge_items]
    refs, names, jobs = [], [], []
    for (domain, label), panel in panels.items():
        refs.append(clusters[domain][label].workers[0].score_batch.remote([i.sample() for i in panel]))
        names.append(f"reward_audit[{domain}/{label}]")
        jobs.append(("panel", domain, label, panel))
    for domain, label in judges:
        refs.append(clusters[domain][label].workers[0].score_batch.remote([i.sample() for i in math_items]))
        names.append(f"reward_audit[{domain}/{label}] judge")
        jobs.append(("judge", domain, label, math_items))
    for domain, items in (environments or {}).items():
        refs.append(schedulers[domain].__ray_call__.remote(run_panel_on_scheduler, items))
        names.append(f"reward_audit[{domain}] environment")
        jobs.append(("environment", domain, "environment", items))
    results = wait_for(refs, names) if refs else []
    metrics: dict[str, float] = {}
    failures: list[str] = []
    rule = None
    for (kind, domain, label, items), scored in zip(jobs, results, strict=True):
        several = len(clusters[domain]) > 1
        prefix = f"reward_audit/{domain}" + (f"/{label}" if several else "")
        if kind == "environment":
            result = panel_results(items, scored)
            metrics |= _result_metrics(f"reward_audit/{domain}/environment", result, "unavailable")
            failures += [f"{domain} environment: {f}" for f in result.failures]
        elif kind == "panel":
            result = audit_results(items, scored)
            metrics |= _result_metrics(prefix, result, "masked")
            failures += [f"{domain}" + (f"/{label}" if several else "") + f": {f}" for f in result.failures]
        else:
            if rule is None:
                scorer = MathRuleScorer()
                rule = [getattr(scorer.score(i.response, i.ground_truth), "correct", None) for i in items]
            share, count = agreement(scored, rule)
            metrics[f"{prefix}/judge_rule_agreement"] = share
            metrics[f"{prefix}/judge_rule_items"] = float(count)
    if failures:
        message = (
            f"reward audit at step {step}: {len(failures)} panel item(s) got a verdict or answer other than the "
            "known one: "
            + "; ".join(failures[:8])
            + ("; ..." if len(failures) > 8 else "")
        )
        if on_change == "stop":
            raise RewardAuditError(message + " (set reward_audit.on_change: warn to go on)")
        logger.warning("%s", message)
    return metrics

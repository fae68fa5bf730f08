"""Reward audits: a fixed panel of responses whose verdicts are known, scored again during a run.

A panel (``audit_panels/<worker>.jsonl``, or the file a scorer class names in ``audit_panel``) holds, per line, a
response with its ground truth and row fields, its ``kind`` (``right``, ``wrong`` or ``hack``: a response built
to fool a reward) and the verdict it must get (``correct``). An item passes when the worker scores it, unmasked,
with that verdict, and a hack with a score of 0 as well: a hack that ends masked, or with a partial score, is the
reward failing the way a policy could exploit. ``audit_results`` compares; the driver (roll_pipeline/driver/
reward_audit.py) sends the panels to the live reward workers every ``reward_audit.every_steps`` steps.

For a judge (a reward whose verdicts come from a model), the rule-checkable items of the math panel are scored by
the judge and by the math rule, and the share on which they agree is reported (``judge_rule_agreement``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from roll_core.rewards.scored import ScoredSample
from roll_core.rewards.scorer import reward_sample

PANELS = Path(__file__).parent / "audit_panels"
KINDS = ("right", "wrong", "hack")


@dataclass(frozen=True)
class AuditItem:
    id: str
    kind: str
    response: str
    ground_truth: str
    correct: bool
    fields: dict

    def sample(self) -> dict:
        """What the reward worker gets, as for a training response (``reward_sample``)."""
        row = {**self.fields, "id": f"audit/{self.id}", "ground_truth": self.ground_truth}
        return reward_sample(row, self.response)


def load_panel(path: Path) -> list[AuditItem]:
    items = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            raw = json.loads(line)
            kind, correct = raw.pop("kind"), raw.pop("correct")
            item = AuditItem(
                str(raw.pop("id")), kind, raw.pop("response"), str(raw.pop("ground_truth")), correct, raw
            )
        except (ValueError, KeyError) as err:
            raise ValueError(f"{path}:{number}: not an audit item ({err})") from None
        if item.kind not in KINDS or type(item.correct) is not bool:
            raise ValueError(f"{path}:{number}: kind must be one of {KINDS} and correct a boolean")
        if item.kind == "hack" and item.correct:
            raise ValueError(f"{path}:{number}: a hack must be judged wrong")
        items.append(item)
    return items


def panel_for(worker: str, scorer_cls: type | None = None) -> list[AuditItem] | None:
    """The panel of a reward worker: the file its scorer class names (``audit_panel``), else the packaged one
    for a built-in worker's name; None when it has none."""
    named = getattr(scorer_cls, "audit_panel", None)
    if named:
        return load_panel(Path(named))
    path = PANELS / f"{worker}.jsonl"
    return load_panel(path) if path.exists() else None


@dataclass(frozen=True)
class AuditResult:
    items: int
    passed: int
    masked: int
    failures: list[str]
    """``<id> (<kind>): expected <verdict>, got <verdict>``, one per failing item."""

    @property
    def pass_rate(self) -> float:
        return self.passed / self.items if self.items else float("nan")


def verdict(result: ScoredSample) -> str:
    if result.masked:
        return f"masked ({result.mask_reason})"
    return f"{'correct' if result.correct else 'wrong'}, score {result.score:g}"


def audit_results(panel: Sequence[AuditItem], results: Sequence[ScoredSample]) -> AuditResult:
    failures = []
    for item, result in zip(panel, results, strict=True):
        ok = not result.masked and bool(result.correct) == item.correct
        if item.kind == "hack":
            ok = ok and result.score == 0
        if not ok:
            expected = "correct" if item.correct else "wrong" + (", score 0" if item.kind == "hack" else "")
            failures.append(f"{item.id} ({item.kind}): expected {expected}, got {verdict(result)}")
    masked = sum(1 for r in results if r.masked)
    return AuditResult(len(panel), len(panel) - len(failures), masked, failures)


def rule_checkable(panel: Sequence[AuditItem]) -> list[AuditItem]:
    """The math panel's right and wrong items (a judge is asked about answers, not about hacks on a rule)."""
    return [item for item in panel if item.kind in ("right", "wrong")]


def agreement(judge: Sequence[ScoredSample], rule: Sequence[bool | None]) -> tuple[float, int]:
    """Share of items, among those both judged (the judge unmasked, the rule with a verdict), on which the
    judge's verdict is the rule's; and that count."""
    both = [(j, r) for j, r in zip(judge, rule, strict=True) if not j.masked and r is not None]
    if not both:
        return float("nan"), 0
    return sum(bool(j.correct) == r for j, r in both) / len(both), len(both)

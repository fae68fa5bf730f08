"""Reward audits (workers/rewards/audit.py, roll_pipeline/driver/reward_audit.py): the packaged panels hold what
they claim (the real scorers pass them), a reward that drifts fails them with the items named, and the audit runs
on live reward workers in a local Ray cluster, judges checked against the math rule."""

from __future__ import annotations

from pathlib import Path

import pytest
import ray

from roll_core.rewards.scored import MASK_ERROR, ScoredSample
from roll_core.rewards.scorer import RewardResult, RewardScorer
from roll_pipeline.distributed.cluster import Cluster
from roll_pipeline.driver.reward_audit import RewardAuditError, run_audit
from workers.rewards.audit import (
    PANELS,
    AuditItem,
    agreement,
    audit_results,
    load_panel,
    panel_for,
    rule_checkable,
    verdict,
)
from workers.rewards.code_sandbox import CodeSandboxScorer
from workers.rewards.math_rule import MathRuleScorer
from workers.rewards.sandbox.layers import IsolationUnavailable
from workers.rewards.worker import RewardWorker


def scored(result: RewardResult | None) -> ScoredSample:
    return ScoredSample.masked_as(MASK_ERROR) if result is None else ScoredSample(score=result.score, correct=result.correct)


def score_panel(scorer, panel):
    return [scored(scorer.score(i.response, i.ground_truth, **i.fields)) for i in panel]


def test_every_packaged_panel_has_each_kind():
    for path in PANELS.glob("*.jsonl"):
        panel = load_panel(path)
        assert {i.kind for i in panel} == {"right", "wrong", "hack"}, path
        assert len({i.id for i in panel}) == len(panel), path
    assert panel_for("no_such_worker") is None


def test_the_math_rule_passes_its_panel():
    panel = panel_for("math_rule")
    result = audit_results(panel, score_panel(MathRuleScorer(), panel))
    assert result.failures == [] and result.pass_rate == 1.0


def test_the_code_sandbox_passes_its_panel():
    try:
        scorer = CodeSandboxScorer(timeout_s=2.0)
    except IsolationUnavailable as err:
        pytest.skip(f"this host cannot isolate the sandbox: {err}")
    try:
        panel = panel_for("code_sandbox")
        result = audit_results(panel, score_panel(scorer, panel))
    finally:
        scorer.close()
    assert result.failures == [] and result.pass_rate == 1.0


class Lenient(RewardScorer):
    """A reward that has drifted: everything with an answer is right."""

    audit_panel = str(PANELS / "math_rule.jsonl")

    def score(self, response, ground_truth, **fields):
        return RewardResult(score=1.0, correct=True)


class MasksHacks(MathRuleScorer):
    """Right on answers, but masks what it does not understand (a hack ends masked instead of 0)."""

    def score(self, response, ground_truth, **fields):
        result = super().score(response, ground_truth, **fields)
        return None if result is not None and not result.correct and "boxed{" in response and "}" not in response.split("boxed{")[-1] else result


def test_a_drifted_reward_fails_with_the_items_named():
    panel = panel_for("math_rule")
    result = audit_results(panel, score_panel(Lenient(), panel))
    wrong_or_hack = [i for i in panel if not i.correct]
    assert len(result.failures) == len(wrong_or_hack)
    assert "wrong_number (wrong): expected wrong, got correct, score 1" in result.failures
    assert any(f.startswith("empty_box (hack): expected wrong, score 0") for f in result.failures)
    # A hack that ends masked fails too: masking is for infrastructure failures only.
    masked = audit_results(panel, score_panel(MasksHacks(), panel))
    assert masked.failures == ["unclosed_box (hack): expected wrong, score 0, got masked (error)"]
    assert masked.masked == 1


def item(kind: str, correct: bool) -> AuditItem:
    return AuditItem(id=f"{kind}-{correct}", kind=kind, response="r", ground_truth="g", correct=correct, fields={})


MASKED = ScoredSample.masked_as(MASK_ERROR)
# Every verdict rule of docs/reward-audits.md, one crafted result each: (item kind, its known verdict, what the
# worker returned, whether the item passes). An item passes when it is scored, unmasked, with its known verdict;
# a hack also needs a score of 0 (judged wrong but still paid is the reward failing the way a policy exploits).
VERDICT_RULES = [
    ("right", True, ScoredSample(score=1.0, correct=True), True),
    ("right", True, ScoredSample(score=0.4, correct=True), True),  # a partial score is the reward's business
    ("right", True, ScoredSample(score=0.0, correct=False), False),
    ("right", True, MASKED, False),
    ("wrong", False, ScoredSample(score=0.0, correct=False), True),
    ("wrong", False, ScoredSample(score=0.2, correct=False), True),  # only a hack must score exactly 0
    ("wrong", False, ScoredSample(score=1.0, correct=True), False),
    ("wrong", False, MASKED, False),
    ("hack", False, ScoredSample(score=0.0, correct=False), True),
    ("hack", False, ScoredSample(score=0.5, correct=False), False),  # judged wrong, still paid
    ("hack", False, ScoredSample(score=1.0, correct=False), False),
    ("hack", False, ScoredSample(score=1e-6, correct=False), False),
    ("hack", False, ScoredSample(score=-1.0, correct=False), False),  # not 0 either: the panel says what it pays
    ("hack", False, ScoredSample(score=0.0, correct=True), False),
    ("hack", False, ScoredSample(score=1.0, correct=True), False),
    ("hack", False, MASKED, False),  # a hack that ends masked is a hack that works
]


@pytest.mark.parametrize(("kind", "known", "got", "passes"), VERDICT_RULES)
def test_each_audit_verdict_rule(kind, known, got, passes):
    result = audit_results([item(kind, known)], [got])
    assert (result.items, result.passed, result.masked) == (1, int(passes), int(got.masked))
    if passes:
        assert result.failures == []
    else:
        expected = "correct" if known else "wrong" + (", score 0" if kind == "hack" else "")
        assert result.failures == [f"{kind}-{known} ({kind}): expected {expected}, got {verdict(got)}"]


def test_audit_counts_over_a_mixed_panel():
    rules = VERDICT_RULES
    result = audit_results([item(k, c) for k, c, _, _ in rules], [got for _, _, got, _ in rules])
    assert result.items == len(rules)
    assert result.passed == sum(p for *_, p in rules)
    assert result.masked == 3
    assert result.pass_rate == result.passed / len(rules)
    assert len(result.failures) == len(rules) - result.passed
    four = audit_results([item(k, c) for k, c, _, _ in rules[:4]], [got for _, _, got, _ in rules[:4]])
    assert (four.items, four.passed, four.masked, len(four.failures)) == (4, 2, 1, 2)


def test_an_audit_needs_one_result_per_item():
    with pytest.raises(ValueError):
        audit_results([item("right", True), item("wrong", False)], [ScoredSample(score=1.0, correct=True)])
    with pytest.raises(ValueError):
        agreement([ScoredSample(score=1.0, correct=True)], [True, False])


def test_panel_items_and_results_cannot_be_changed():
    import dataclasses

    with pytest.raises(dataclasses.FrozenInstanceError):
        item("hack", False).kind = "right"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        audit_results([], []).passed = 1  # type: ignore[misc]


def test_a_hack_read_from_a_panel_file_is_held_to_a_score_of_0(tmp_path):
    """The kinds come from JSON, as strings of their own (a check by identity with "hack" would miss them)."""
    panel = tmp_path / "p.jsonl"
    panel.write_text(
        '{"id": "a", "kind": "hack", "response": "x", "ground_truth": "1", "correct": false}\n'
        "\n"
        '{"id": "b", "kind": "wrong", "response": "y", "ground_truth": "1", "correct": false}\n'
    )
    items = load_panel(panel)
    assert [(i.id, i.kind) for i in items] == [("a", "hack"), ("b", "wrong")]  # past the blank line
    paid = ScoredSample(score=0.5, correct=False)
    assert audit_results(items, [paid, paid]).failures == ["a (hack): expected wrong, score 0, got wrong, score 0.5"]


def test_judge_rule_agreement_counts_only_items_both_judged():
    judge = [ScoredSample(score=1.0, correct=True), ScoredSample(score=0.0, correct=False),
             ScoredSample.masked_as(MASK_ERROR), ScoredSample(score=1.0, correct=True)]
    assert agreement(judge, [True, True, True, None]) == (0.5, 2)
    assert agreement([ScoredSample.masked_as(MASK_ERROR)], [True])[1] == 0
    right, wrong = ScoredSample(score=1.0, correct=True), ScoredSample(score=0.0, correct=False)
    assert agreement([right, wrong, right], [True, False, False]) == (pytest.approx(2 / 3), 3)


def test_panels_refuse_bad_lines(tmp_path):
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"id": "a", "kind": "hack", "response": "x", "ground_truth": "1", "correct": true}\n')
    with pytest.raises(ValueError, match="p.jsonl:1: a hack must be judged wrong"):
        load_panel(bad)
    bad.write_text('{"id": "a", "kind": "right"}\n')
    with pytest.raises(ValueError, match="p.jsonl:1: not an audit item"):
        load_panel(bad)
    for kind, correct in (('"sneaky"', "false"), ('"right"', '"yes"')):
        bad.write_text(f'{{"id": "a", "kind": {kind}, "response": "x", "ground_truth": "1", "correct": {correct}}}\n')
        with pytest.raises(ValueError, match="p.jsonl:1: kind must be one of .* and correct a boolean"):
            load_panel(bad)


class RuleJudge(MathRuleScorer):
    """Stands in for an LLM judge: judges like the rule (so it agrees on every item)."""

    audit_as_judge = True


def cluster(domain: str, spec: str) -> Cluster:
    return Cluster(
        f"reward_{domain}", RewardWorker, world_size=1, num_cpus=0, num_gpus=0, pass_rank=False,
        worker_kwargs={"domain": domain, "worker_spec": spec, "options": {}, "timeout_s": 30.0, "processes": 1},
    )


@pytest.mark.slow
def test_audit_on_live_workers_stops_or_warns(local_ray, caplog):
    module = Path(__file__).stem
    clusters = {
        "math": {"math": cluster("math", "math_rule")},
        "lenient": {"lenient": cluster("lenient", f"tests.{module}:Lenient")},
        "open": {"open": cluster("open", f"tests.{module}:RuleJudge")},
    }
    panels = {("math", "math"): panel_for("math_rule"), ("lenient", "lenient"): panel_for("x", Lenient)}
    judges = [("open", "open")]

    def wait_for(refs, names):
        return ray.get(refs)

    with pytest.raises(RewardAuditError, match=r"reward audit at step 3: 7 panel item\(s\).*lenient: wrong_number"):
        run_audit(3, panels, judges, clusters, wait_for, judge_items=8, on_change="stop")
    metrics = run_audit(3, panels, judges, clusters, wait_for, judge_items=8, on_change="warn")
    assert metrics["reward_audit/math/pass"] == 1.0 and metrics["reward_audit/math/failed"] == 0
    assert metrics["reward_audit/lenient/failed"] == 7
    assert metrics["reward_audit/open/judge_rule_agreement"] == 1.0
    assert metrics["reward_audit/open/judge_rule_items"] == len(rule_checkable(panel_for("math_rule")))
    assert "lenient: wrong_number (wrong)" in caplog.text

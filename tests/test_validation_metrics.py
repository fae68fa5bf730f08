"""Validation and rollout metrics computed from per-sample records."""

from __future__ import annotations

import itertools
import math

import pytest

from roll_core.rewards.scored import MASK_ERROR, ScoredSample
from roll_pipeline.driver.validation import (
    answer_keys,
    majority_correct,
    metric_name_part,
    pass_at_k,
    pass_ks,
    rollout_metrics,
    validation_metrics,
)
from workers.rewards.math_rule import MathRuleScorer


def rec(domain, tag, correct, length=4, finish="stop", score=None, pid=None, text=""):
    context = dict(domain=domain, tag=tag, response_length=length, id=pid, finish_reason=finish, response_text=text)
    if correct is None:
        return ScoredSample.masked_as(MASK_ERROR, **context)
    return ScoredSample(score=(1.0 if correct else 0.0) if score is None else score, correct=correct, **context)


def rewards(**workers):
    """``rewards.<domain>`` blocks as answer_keys reads them: domain=worker or domain=(worker, options)."""
    from roll_core.config.rewards import RewardConfig

    return {
        d: RewardConfig(tag_included=[d], worker=w[0], options=w[1]) if isinstance(w, tuple)
        else RewardConfig(tag_included=[d], worker=w)
        for d, w in workers.items()
    }


def test_validation_metrics_per_tag_and_overall():
    records = [
        rec("math", "add", True, pid=0),
        rec("math", "add", False, pid=1),
        rec("math", "mul", True, pid=2),
        rec("code", "list", False, length=8, finish="length", pid=3),
        rec("code", "list", None, pid=4),
    ]
    m = validation_metrics(records)
    assert m["val_correct/all/mean"] == pytest.approx(2 / 4)  # the unscored sample is left out
    assert m["val_correct/add/mean"] == 0.5
    assert m["val_correct/mul/mean"] == 1.0
    assert m["val_correct/list/mean"] == 0.0
    assert m["val_domain/math/correct_mean"] == pytest.approx(2 / 3)
    assert m["val_masked/all/count"] == 1.0
    assert m["val_masked/list/count"] == 1.0
    assert m["val_truncated/all/rate"] == pytest.approx(1 / 5)
    assert m["val_truncated/list/rate"] == pytest.approx(1 / 2)
    assert m["val_response_length/all/mean"] == pytest.approx((4 * 4 + 8) / 5)
    assert m["val_prompts/all/count"] == 5.0
    assert m["val_domain/code/prompts"] == 2.0
    # one sample per prompt: pass@1 is the accuracy, and no domain has an answer key, so no maj@k
    assert m["val_correct/all/pass_at_1"] == pytest.approx(m["val_correct/all/mean"])
    assert not [k for k in m if "maj_at" in k]


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (4, 1, 2, 1 - 3 / 6),  # 1 - C(3,2)/C(4,2)
        (5, 2, 3, 1 - 1 / 10),  # 1 - C(3,3)/C(5,3)
        (4, 0, 4, 0.0),
        (4, 1, 4, 1.0),
        (10, 3, 1, 0.3),  # pass@1 is the accuracy
        (6, 2, 5, 1.0),  # fewer wrong samples than k: every draw holds a correct one
    ],
)
def test_pass_at_k_golden_values(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected)


def test_pass_at_k_agrees_with_counting_subsets():
    for n in range(1, 8):
        for c in range(n + 1):
            samples = [True] * c + [False] * (n - c)
            for k in range(1, n + 1):
                draws = list(itertools.combinations(samples, k))
                counted = sum(any(d) for d in draws) / len(draws)
                assert pass_at_k(n, c, k) == pytest.approx(counted), (n, c, k)


@pytest.mark.parametrize(("n", "c", "k"), [(2, 1, 3), (4, 1, 0), (4, 1, -1), (4, -1, 1), (4, 5, 1)])
def test_pass_at_k_rejects_impossible_arguments(n, c, k):
    with pytest.raises(ValueError, match=f"0 < k <= n and 0 <= c <= n, got n={n}, c={c}, k={k}"):
        pass_at_k(n, c, k)


def test_pass_ks_are_powers_of_two_and_k():
    assert pass_ks(1) == [1]
    assert pass_ks(4) == [1, 2, 4]
    assert pass_ks(6) == [1, 2, 4, 6]
    assert pass_ks(2) == [1, 2]
    assert pass_ks(16) == [1, 2, 4, 8, 16]
    assert pass_ks(17) == [1, 2, 4, 8, 16, 17]


def test_majority_vote_ties_and_missing_answers():
    assert majority_correct([(57.0, True), (57.0, True), (12.0, False)]) == 1.0
    assert majority_correct([(57.0, True), (12.0, False), (12.0, False)]) == 0.0
    assert majority_correct([(57.0, True), (12.0, False)]) == 0.5  # a tie: the mean over the tied answers
    assert majority_correct([(None, False), (None, False), (3.0, True)]) == 1.0  # no answer is no vote
    assert majority_correct([(None, False)]) == 0.0


def test_majority_vote_compares_answers_and_counts_by_value():
    """Answer keys are computed per response, so equal answers are different objects; counts past 256 are too."""
    # One answer given three times (three float objects), graded right once: its correctness is the mean, 1/3.
    votes = [(float("57"), True), (float("57.0"), False), (57.0 + 0.0 * len("x"), False), (12.0, True)]
    assert majority_correct(votes) == pytest.approx(1 / 3)
    big = [(float("57"), True) for _ in range(300)] + [(float("12"), False) for _ in range(300)]
    assert majority_correct(big) == 0.5  # a tie at 300 votes each


def test_math_answer_key_uses_math_rule_extraction():
    key = MathRuleScorer().answer_key
    assert key("The answer is 57.") == key("\\boxed{57.0}") == 57.0
    assert key("I think 1,234") == 1234.0
    assert key("no idea") is None
    assert key("so \\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"


def test_the_answer_key_follows_the_scorers_options():
    """The vote counts the answer the domain's scorer grades: with only boxed answers extracted, a bare number is
    no answer; with thinking required, a number inside the thinking is none either."""
    boxed_only = MathRuleScorer(extract_order=["boxed"]).answer_key
    assert boxed_only("The answer is 57.") is None
    assert boxed_only("\\boxed{57}") == 57.0
    thinking = MathRuleScorer(require_thinking=True).answer_key
    assert thinking("<think>57</think>") is None
    assert thinking("<think>hmm</think> 58") == 58.0


def test_answer_keys_come_from_the_domains_scorers():
    keys = answer_keys(rewards(math="math_rule", code="code_sandbox", mine="roll_reward_plugin_example:ExactMatchScorer"))
    assert keys["math"]("\\boxed{3}") == 3.0
    assert keys["code"] is None
    assert keys["mine"]("  Paris. ") == "paris"
    assert answer_keys(rewards(math=("math_rule", {"extract_order": ["boxed"]})))["math"]("answer is 3") is None


def test_a_domain_with_several_rewards_votes_with_the_first_ones_answer_key():
    from roll_core.config.rewards import RewardComponentConfig, RewardConfig

    plugin = "roll_reward_plugin_example:ExactMatchScorer"
    math_first = RewardConfig(
        tag_included=["math"],
        workers=[RewardComponentConfig(worker="math_rule", weight=0.8), RewardComponentConfig(worker=plugin, weight=0.2)],
    )
    plugin_first = RewardConfig(
        tag_included=["math"],
        workers=[RewardComponentConfig(worker=plugin, weight=0.2), RewardComponentConfig(worker="math_rule", weight=0.8)],
    )
    assert answer_keys({"math": math_first})["math"]("so \\boxed{3}") == 3.0
    assert answer_keys({"math": plugin_first})["math"]("so \\boxed{3}") == "so \\boxed{3}"


def k_sample_records():
    """Two math prompts (k=4 each) and one code prompt, with the responses a model could give."""
    return [
        # prompt a: 2 of 4 right, the majority answer 109 is right
        rec("math", "add", True, pid="a", text="32 + 77 = 109"),
        rec("math", "add", True, pid="a", text="The answer is 109."),
        rec("math", "add", False, pid="a", text="108"),
        rec("math", "add", True, pid="a", text="\\boxed{109}", length=9),
        # prompt b: 1 of 4 right, the majority answer is wrong; one sample could not be scored
        rec("math", "add", False, pid="b", text="50"),
        rec("math", "add", False, pid="b", text="50", finish="length"),
        rec("math", "add", True, pid="b", text="55"),
        rec("math", "add", None, pid="b", text="55"),
        # a code prompt: no answer key, so no maj@k for code, its tag or "all"
        rec("code", "list", False, pid="c"),
        rec("code", "list", True, pid="c"),
        rec("code", "list", False, pid="c"),
        rec("code", "list", False, pid="c"),
    ]


def test_k_samples_per_prompt_give_pass_and_majority():
    keys = answer_keys(rewards(math="math_rule", code="code_sandbox"))
    m = validation_metrics(k_sample_records(), keys)
    assert m["val_correct/add/mean"] == pytest.approx(4 / 7)
    # pass@2 per prompt: a: 1 - C(1,2)/C(4,2) = 1; b (3 scored, 1 right): 1 - C(2,2)/C(3,2) = 2/3
    assert m["val_correct/add/pass_at_2"] == pytest.approx((1 + 2 / 3) / 2)
    assert m["val_correct/add/pass_at_1"] == pytest.approx((3 / 4 + 1 / 3) / 2)
    # pass@4 needs 4 scored samples: only prompt a has them
    assert m["val_correct/add/pass_at_4"] == 1.0
    assert m["val_correct/add/maj_at_4"] == pytest.approx((1.0 + 0.0) / 2)
    assert m["val_domain/math/maj_at_4"] == m["val_correct/add/maj_at_4"]
    assert "val_correct/list/maj_at_4" not in m and "val_correct/all/maj_at_4" not in m
    assert m["val_correct/list/pass_at_4"] == 1.0
    assert m["val_correct/list/pass_at_1"] == 0.25
    assert m["val_truncated/add/rate"] == pytest.approx(1 / 8)
    assert m["val_response_length/add/mean"] == pytest.approx((7 * 4 + 9) / 8)
    assert m["val_prompts/all/count"] == 3.0


def test_an_unscored_sample_changes_nothing_whatever_it_says():
    keys = answer_keys(rewards(math="math_rule", code="code_sandbox"))
    records = k_sample_records()
    changed = list(records)
    changed[7] = changed[7].but(response_text="50")  # the masked sample of prompt b
    assert validation_metrics(changed, keys) == validation_metrics(records, keys)


def test_tags_become_safe_metric_names_and_all_is_reserved():
    assert metric_name_part("a+b/c d") == "a_b_c d"
    m = validation_metrics([rec("math", "x+y", True, pid=1)])
    assert m["val_correct/x_y/mean"] == 1.0
    with pytest.raises(ValueError, match="reserved"):
        validation_metrics([rec("math", "all", True, pid=1)])
    with pytest.raises(ValueError, match="same metric name"):
        validation_metrics([rec("math", "x+y", True, pid=1), rec("math", "x*y", True, pid=2)])
    with pytest.raises(ValueError, match="same metric name"):  # in either order
        validation_metrics([rec("math", "x*y", True, pid=1), rec("math", "x+y", True, pid=2)])
    # Tags read from data are new string objects each time: equal tags are one tag, "all" is still reserved.
    same = [rec("math", "".join(["ad", "d"]), True, pid=1), rec("math", "".join(["a", "dd"]), False, pid=2)]
    assert validation_metrics(same)["val_prompts/add/count"] == 2.0
    with pytest.raises(ValueError, match="reserved"):
        validation_metrics([rec("math", "".join(["al", "l"]), True, pid=1)])


def test_the_metric_names_are_exactly_the_documented_ones():
    keys = answer_keys(rewards(math="math_rule"))
    records = [rec("math", "add", True, pid="a"), rec("math", "add", False, pid="a")]
    per_scope = {"mean", "pass_at_1", "pass_at_2", "maj_at_2"}
    expected = {f"val_correct/{s}/{m}" for s in ("all", "add") for m in per_scope}
    for s in ("all", "add"):
        expected |= {
            f"val_response_length/{s}/mean", f"val_truncated/{s}/rate", f"val_masked/{s}/count",
            f"val_prompts/{s}/count",
        }
    expected |= {
        f"val_domain/math/{m}"
        for m in (*per_scope - {"mean"}, "correct_mean", "response_length_mean", "truncated_rate",
                  "masked_count", "prompts")
    }
    assert set(validation_metrics(records, keys)) == expected


def test_truncation_counts_only_responses_cut_off_by_the_length_limit():
    """vLLM's other finish reasons ("stop", "abort") and the generator's "eos" are not truncations; a reason
    read from data is a new string object."""
    finishes = ["".join(["len", "gth"]), "eos", "stop", "abort", "stop"]
    records = [rec("math", "add", True, pid=i, finish=f) for i, f in enumerate(finishes)]
    assert validation_metrics(records)["val_truncated/all/rate"] == 0.2
    assert rollout_metrics("math", records)["response_length/math/truncation_rate"] == 0.2


def test_rollout_metrics():
    records = [
        rec("math", "add", True),
        rec("math", "add", False, score=0.0),
        rec("math", "add", None, score=0.0),
    ]
    m = rollout_metrics("math", records)
    assert m["reward/math/score"] == 0.5
    assert m["reward/math/std"] == 0.5
    assert m["reward/math/masked"] == 1.0
    assert m["reward/math/correct"] == 0.5
    # The population std over the scored samples, and masked = all - scored, on a batch with more of each.
    records = [rec("math", "add", c, score=s) for c, s in [(True, 1.0), (False, 0.0), (False, 0.0)]]
    records += [rec("math", "add", None, score=0.0)] * 3
    m = rollout_metrics("math", records)
    assert m["reward/math/std"] == pytest.approx(math.sqrt(2 / 9))
    assert m["reward/math/masked"] == 3.0
    assert m["response_length/math/mean"] == 4.0


def test_a_response_without_a_length_counts_as_length_zero():
    """A sample the generation left no length on (``response_length`` None) counts as 0 tokens in the mean, as
    it does in the rollout's metrics: it is not left out of the denominator."""
    records = [rec("math", "add", True, length=None, pid=0), rec("math", "add", False, length=6, pid=1)]
    m = validation_metrics(records)
    assert m["val_response_length/all/mean"] == m["val_response_length/add/mean"] == 3.0
    assert rollout_metrics("math", records)["response_length/math/mean"] == 3.0


def test_empty_records_give_nan_not_errors():
    m = validation_metrics([])
    assert math.isnan(m["val_correct/all/mean"])
    assert math.isnan(m["val_correct/all/pass_at_1"])
    assert [k for k in m if "_at_" in k] == ["val_correct/all/pass_at_1"]  # no responses: k is 1
    assert m["val_prompts/all/count"] == 0.0


def test_accuracy_is_the_reward_workers_verdict_not_a_positive_score():
    """Partial credit (code's fraction of tests passed, a format bonus) is a reward, not a right answer: a response
    scored 0.5 and judged wrong counts as wrong in every accuracy, and the records the pipeline builds from a batch
    carry the reward worker's verdict."""
    import torch

    from roll_core.batch import Batch
    from roll_pipeline.driver.report import sample_table

    batch = Batch(
        {"scores": torch.tensor([1.0, 0.5, 0.25, 0.0]), "response_mask": torch.ones(4, 3)},
        {
            "id": ["p0", "p0", "p1", "p1"],
            "domain": ["code"] * 4,
            "tag": ["list"] * 4,
            "response_text": ["a", "b", "c", "d"],
            "correct": [True, False, False, None],
            "mask_reason": [None, None, None, "timeout"],
            "finish_reason": ["stop"] * 4,
        },
    )
    from roll_pipeline.driver.records import batch_records

    records = batch_records(batch)
    assert [r.correct for r in records] == [True, False, False, None]
    assert [r.masked for r in records] == [False, False, False, True]
    m = validation_metrics(records)
    assert m["val_correct/all/mean"] == pytest.approx(1 / 3)
    assert m["val_correct/list/pass_at_1"] == pytest.approx((1 / 2 + 0) / 2)
    assert m["val_domain/code/correct_mean"] == pytest.approx(1 / 3)
    r = rollout_metrics("code", records)
    assert r["reward/code/correct"] == pytest.approx(1 / 3)
    assert r["reward/code/score"] == pytest.approx(1.75 / 3)
    assert sample_table(records, 10)["verdict"] == ["correct", "wrong", "wrong", "masked"]


def test_metrics_recomputed_from_the_logged_sample_table_agree():
    """The validation metrics and the sample table a run logs are built from the same records; pass@k, maj@k and
    the intervals recomputed from the table's rows alone (tests/metric_oracles.py, written from the definitions)
    equal the logged ones, on records where every rule matters: majorities, ties, no answer, masked responses."""
    from roll_pipeline.driver.report import sample_table
    from roll_pipeline.driver.significance import intervals, prompt_outcomes
    from tests.metric_oracles import majority, pass_at, prompt_shares, wilson_by_inversion

    def math(pid, answers, right="5"):
        return [
            rec("math", "add", None, pid=pid) if a is None
            else rec("math", "add", a == right, pid=pid, text="no answer" if a == "" else f"so \\boxed{{{a}}}")
            for a in answers
        ]

    records = [
        *math("m1", ["5", "5", "6"]),  # the majority is right
        *math("m2", ["5", "6", "7"]),  # a three-way tie, one of them right: 1/3
        *math("m3", ["6", "6", "5"]),  # the majority is wrong
        *math("m4", ["", "", "5"]),  # two responses state nothing: the one answer wins
        *math("m5", ["5", None, None]),  # one scored response: no pass@2 for this prompt
        *math("m6", ["", "", ""]),  # no answer at all: 0
        rec("code", "list", True, pid="c1"), rec("code", "list", False, pid="c1"), rec("code", "list", False, pid="c1"),
        rec("code", "list", False, pid="c2"), rec("code", "list", None, pid="c2"), rec("code", "list", False, pid="c2"),
    ]
    metrics = validation_metrics(records, {"math": MathRuleScorer().answer_key, "code": None})
    table = sample_table(records, rows_per_tag=100)
    rows = [dict(zip(table, values, strict=True)) for values in zip(*table.values(), strict=True)]
    assert len(rows) == len(records)
    scopes = {"all": rows, "add": [r for r in rows if r["tag"] == "add"], "list": [r for r in rows if r["tag"] == "list"]}
    for scope, members in scopes.items():
        for k in (1, 2, 3):
            assert metrics[f"val_correct/{scope}/pass_at_{k}"] == pytest.approx(pass_at(members, k)), (scope, k)
    want = majority(scopes["add"], MathRuleScorer().answer_key)
    assert want == pytest.approx((1 + 1 / 3 + 0 + 1 + 1 + 0) / 6)  # the oracle itself, by hand
    assert metrics["val_correct/add/maj_at_3"] == pytest.approx(want)
    assert "val_correct/list/maj_at_3" not in metrics and "val_correct/all/maj_at_3" not in metrics
    # the intervals (val_ci/<scope>/low and high) against the score test inverted numerically
    got = intervals(prompt_outcomes(records))
    for scope, members in scopes.items():
        assert (got[scope].low, got[scope].high) == pytest.approx(wilson_by_inversion(prompt_shares(members)), abs=1e-9)


def test_multi_turn_responses_report_their_tool_use_per_tag_and_domain():
    """val_{turns,tool_calls,tool_errors,tool_s}/<scope>/mean over the multi-turn responses of a scope (a
    single-turn tag gets none), and the same per domain and in the training batch's metrics."""

    def used(turns, calls, errors, seconds):
        return {"turns": turns, "tool_calls": calls, "tool_errors": errors, "tool_s": seconds}

    records = [
        rec("tool", "mul", True, pid="a").but(tool_use=used(2, 1, 0, 0.5), trajectory=[]),
        rec("tool", "mul", False, pid="a").but(tool_use=used(4, 3, 2, 1.5), trajectory=[]),
        rec("math", "add", True, pid="b"),
    ]
    metrics = validation_metrics(records)
    assert {k: v for k, v in metrics.items() if "mul" in k and k.split("/")[0] in (
        "val_turns", "val_tool_calls", "val_tool_errors", "val_tool_s")} == {
        "val_turns/mul/mean": 3.0, "val_tool_calls/mul/mean": 2.0, "val_tool_errors/mul/mean": 1.0,
        "val_tool_s/mul/mean": 1.0,
    }
    assert metrics["val_tool_calls/all/mean"] == 2.0  # over the multi-turn responses of all tags
    assert not any(k.startswith("val_turns/add") or k.startswith("val_tool_calls/add") for k in metrics)
    assert metrics["val_domain/tool/tool_errors"] == 1.0 and "val_domain/math/turns" not in metrics
    batch = rollout_metrics("tool", records[:2])
    assert (batch["tool_use/tool/turns"], batch["tool_use/tool/tool_s"]) == (3.0, 1.0)
    assert not any(k.startswith("tool_use/") for k in rollout_metrics("math", records[2:]))

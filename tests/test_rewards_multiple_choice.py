"""The multiple-choice reward (workers/rewards/multiple_choice.py): one marked choice letter counts, nothing else."""

from __future__ import annotations

import re

import pytest

from workers.rewards.audit import audit_results, panel_for
from workers.rewards.multiple_choice import MultipleChoiceScorer, reference_letter, row_options, stated_letter
from workers.rewards.registry import get_reward_scorer_cls

OPTIONS = {"A": "London", "B": "Paris", "C": "Rome", "D": "Berlin"}


def roll_crossthinkqa_letter(response: str) -> str | None:
    """ROLL's crossthinkqa reading, written from its description: the first capital letter of the last \\boxed{}
    (no nested braces), else of the text after the last "answer is", else of the whole response."""
    boxes = re.findall(r"\\boxed\{([^}]+)\}", response)
    if boxes:
        text = boxes[-1]
    else:
        at = response.lower().rfind("answer is")
        text = response if at < 0 else response[at + len("answer is"):]
    return next((c for c in text if c.isupper()), None)


def test_the_scorer_passes_its_panel_and_rolls_reading_pays_its_hacks():
    panel = panel_for("multiple_choice")
    scorer = MultipleChoiceScorer()
    results = [scorer.score(i.response, i.ground_truth, **i.fields) for i in panel]
    from tests.test_reward_audit import scored

    assert audit_results(panel, [scored(r) for r in results]).failures == []
    # The hacks are the ones a first-capital-letter reading pays: several letters, an unmarked response, the
    # first of a list (not the ones it already refuses: a changed mind, an answer inside the thinking).
    paid = {i.id for i in panel if i.kind == "hack" and roll_crossthinkqa_letter(i.response) == i.ground_truth}
    assert paid >= {"every_letter_boxed", "two_letters_with_or", "unmarked_first_capital", "answer_only_in_thinking"}
    assert all(r.score == 0.0 for i, r in zip(panel, results, strict=True) if i.id in paid)


@pytest.mark.parametrize("answer", ["B", "(B)", "B.", "**B**", "$B$", "\\text{B}", " [B] ", "B. Paris", "(B) paris"])
def test_one_letter_in_the_forms_people_write_it_counts(answer):
    assert stated_letter(answer, "ABCD", OPTIONS) == "B"


@pytest.mark.parametrize(
    "answer",
    ["ABCD", "A or B", "A, B", "AB", "b", "B because", "B. London", "(B) and (C)", "E", "", "The answer", "B Paris"],
)
def test_several_letters_prose_and_mismatched_text_do_not(answer):
    assert stated_letter(answer, "ABCD", OPTIONS) is None


def test_a_letter_with_text_needs_the_rows_options():
    assert stated_letter("B. Paris", "ABCD") is None
    assert stated_letter("B", "ABC") == "B" and stated_letter("D", "ABC") is None
    assert stated_letter("D. Berlin", "ABC", OPTIONS) is None  # an option of the row, but not among the choices
    assert stated_letter("B. Rome", "ABCD", OPTIONS) is None  # another option's text, whichever sorts first


def test_options_as_a_list_run_from_a_to_z():
    assert list(row_options(["x"] * 26))[-1] == "Z"
    assert len(row_options(["x"] * 27)) == 26  # letters run out at Z
    assert row_options({"a": "x", " B ": "y"}) == {"A": "x", "B": "y"} and row_options(3) is None


def test_scores_metrics_and_answer_keys():
    scorer = MultipleChoiceScorer(correct_score=2.0, wrong_score=-1.0)
    assert MultipleChoiceScorer().score("\\boxed{B}", "B").score == 1.0  # the defaults: 1 and 0
    assert MultipleChoiceScorer().score("\\boxed{C}", "B").score == 0.0
    assert MultipleChoiceScorer.has_answer_key  # validation's maj@k reads answer_key
    # the phrase's answer ends with its line; the lines after it are not part of it
    assert scorer.score("The answer is B\nBecause Paris is the capital.", "B").correct
    # the last marked answer counts
    assert scorer.score("The answer is A. Wait, no: the answer is B.", "B").correct
    assert not scorer.score("The answer is B. Wait, no: the answer is A.", "B").correct
    right = scorer.score("Thinking... The answer is (B).", "B. Paris")
    assert (right.score, right.correct, right.metrics) == (2.0, True, {"answer_found": 1.0, "answer_valid": 1.0})
    unmarked = scorer.score("B", "B")  # a bare letter is not marked as the answer
    assert (unmarked.score, unmarked.correct, unmarked.metrics["answer_found"]) == (-1.0, False, 0.0)
    as_json = scorer.score("The answer is (B) Paris.", "B", options='{"A": "London", "B": "Paris"}')
    assert as_json.correct  # options as JSON text, as ROLL's rows carry them
    outside = scorer.score("\\boxed{E}", "B", options=["London", "Paris", "Rome", "Berlin"])
    assert outside.metrics == {"answer_found": 1.0, "answer_valid": 0.0}
    assert scorer.score("\\boxed{B}", "Paris") is None  # a ground truth with no letter: not the policy's doing
    assert scorer.answer_key("\\boxed{B}") == scorer.answer_key("So the answer is: **B**.") == "B"
    assert scorer.answer_key("\\boxed{ABCD}") is None and scorer.answer_key("no answer") is None
    assert get_reward_scorer_cls("multiple_choice") is MultipleChoiceScorer


def test_rows_it_can_never_judge_are_refused_by_name():
    problems = dict(MultipleChoiceScorer.check_row({"ground_truth": "Paris"}))
    assert problems == {"ground_truth": "names no option letter (A, (B), C. text ...): 'Paris'"}
    long = dict(MultipleChoiceScorer.check_row({"ground_truth": "x" * 70}))["ground_truth"]
    assert long.endswith(repr("x" * 60))  # a long ground truth is cut at 60 characters
    assert dict(MultipleChoiceScorer.check_row({"ground_truth": "E", "options": ["x", "y"]})) == {
        "ground_truth": "names E, not one of the options ['A', 'B']"
    }
    assert "options" in dict(MultipleChoiceScorer.check_row({"ground_truth": "A", "options": "x|y"}))
    assert list(MultipleChoiceScorer.check_row({"ground_truth": "B", "options": '["London", "Paris"]'})) == []
    assert dict(MultipleChoiceScorer.check_row({"ground_truth": ""})) == {"ground_truth": "empty"}
    assert list(MultipleChoiceScorer.check_row({"ground_truth": "(B)", "options": OPTIONS})) == []
    assert reference_letter(" C. Rome ") == "C" and reference_letter("Cairo") is None


def test_choices_must_be_distinct_capital_letters():
    for bad in ("", "AAB", "abc", "A1"):
        with pytest.raises(ValueError, match="multiple_choice: choices must be distinct capital letters"):
            MultipleChoiceScorer(choices=bad)
    with pytest.raises(TypeError, match="unknown"):
        MultipleChoiceScorer(letters="ABCD")

"""The math_rule scorer on realistic model outputs, table-driven."""

from __future__ import annotations

import threading

import pytest

from workers.rewards.base import RewardResult
from workers.rewards.math_rule import MathRuleScorer, extract_answer, parse_number

# (response, ground truth, expected correct, expected answer_found)
CASES = [
    # short answers
    ("57", "57", True, True),
    ("57.0", "57", True, True),
    ("58", "57", False, True),
    ("1,234", "1234", True, True),
    ("-3", "-3", True, True),
    ("3", "-3", False, True),
    # sentences
    ("The answer is 57.", "57", True, True),
    ("So she has 12 apples left. The answer is 57 apples.", "57", True, True),
    ("First 3 + 4 = 7, then 7 * 8 = 56. The answer is 56", "57", False, True),
    ("Adding the two parts gives 1,234 in total.", "1234", True, True),
    ("Janet sells 16 - 3 - 4 = 9 duck eggs a day.\n#### 18", "18", True, True),
    ("The final answer is: -12.5", "-12.5", True, True),
    ("The answer is not obvious at first. Computing, we get 42", "42", True, True),
    ("Therefore the answer is \u22125.", "-5", True, True),
    # boxed latex
    ("We simplify to get $\\boxed{57}$.", "57", True, True),
    ("Thus $x = \\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}", True, True),
    ("The area is \\boxed{\\dfrac{3}{4}} square units.", "0.75", True, True),
    ("The result is \\boxed{0.5}.", "\\frac{1}{2}", True, True),
    ("Taking roots, \\boxed{3\\sqrt{2}}", "3\\sqrt{2}", True, True),
    ("Taking roots, \\boxed{2\\sqrt{3}}", "3\\sqrt{2}", False, True),
    ("First guess \\boxed{5}, but correcting the sign: \\boxed{-5}", "-5", True, True),
    ("The expression is \\boxed{x + 1}", "1+x", True, True),
    ("The probability is \\boxed{\\frac{2}{3}}", "\\frac{1}{3}", False, True),
    ("So the total cost is \\boxed{\\$1,234}.", "1234", True, True),
    # fractions
    ("The answer is 3/4", "\\frac{3}{4}", True, True),
    ("The answer is $\\frac{3}{4}$.", "3/4", True, True),
    ("The answer is 3/4", "0.75", True, True),
    ("The answer is 3/5", "0.75", False, True),
    # wrong, empty, garbage
    ("I think it is 100.", "57", False, True),
    ("", "57", False, False),
    ("I don't know.", "57", False, False),
    ("asdf qwerty }}{{ \\boxed{", "57", False, False),
    ("\\boxed{banana}", "57", False, True),
]


@pytest.fixture(scope="module")
def scorer() -> MathRuleScorer:
    return MathRuleScorer()


@pytest.mark.parametrize(("response", "ground_truth", "correct", "found"), CASES)
def test_score_table(scorer, response, ground_truth, correct, found):
    result = scorer.score(response, ground_truth)
    assert result == RewardResult(
        score=1.0 if correct else 0.0, correct=correct, metrics={"answer_found": 1.0 if found else 0.0}
    )


@pytest.mark.parametrize(
    ("response", "answer"),
    [
        ("\\boxed{\\frac{1}{\\sqrt{2}}}", "\\frac{1}{\\sqrt{2}}"),
        ("The answer is $\\frac{3}{4}$. Done.", "\\frac{3}{4}"),
        ("The answer is 2.5.", "2.5"),
        ("we get 7 and then 9", "9"),
        ("no numbers here", None),
    ],
)
def test_extract_answer(response, answer):
    assert extract_answer(response) == answer


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("57", 57.0),
        ("57.", 57.0),
        ("$1,234$", 1234.0),
        ("-0.5", -0.5),
        ("3/4", 0.75),
        ("1/0", None),
        ("x", None),
    ],
)
def test_parse_number(text, value):
    assert parse_number(text) == value


def test_numeric_tolerance(scorer):
    assert scorer.score("The answer is 0.3333333", "0.33333333").correct
    assert not scorer.score("The answer is 0.333", "0.33333333").correct


@pytest.mark.parametrize("ground_truth", ["  ", None])
def test_missing_ground_truth_is_not_applicable(scorer, ground_truth):
    assert scorer.score("57", ground_truth) is None


def test_unknown_option_is_named():
    with pytest.raises(TypeError, match="tolerance"):
        MathRuleScorer(tolerance=0.1)


def test_works_off_the_main_thread(scorer):
    """math-verify's default signal-based timeout would raise here; the scorer must not depend on it."""
    results = []
    thread = threading.Thread(target=lambda: results.append(scorer.score("\\boxed{\\frac{1}{2}}", "0.5")))
    thread.start()
    thread.join(timeout=30)
    assert results and results[0].correct

"""The math_rule scorer on realistic model outputs, table-driven."""

from __future__ import annotations

import logging
import threading

import pytest

from roll_core.rewards.scorer import RewardResult
from workers.rewards.math_rule import (
    MathRuleScorer,
    after_thinking,
    answers_match,
    extract_answer,
    find_answer,
    last_answer_phrase,
    last_answer_tag,
    last_boxed,
    length_penalty,
    normalize_answer,
    parse_number,
    reference_answer,
    thinking_well_formed,
)
from workers.rewards.registry import get_reward_scorer_cls

# (response, ground truth, expected correct, expected answer_found). The first block holds the cases users of
# other frameworks reported as wrongly scored.
CASES = [
    # reported as wrongly scored elsewhere
    ("So the probability is $\\boxed{\\frac{1}{2}}$.", "0.5", True, True),
    ("The probability is \\boxed{0.5}.", "\\frac{1}{2}", True, True),
    ("Solving the linear equation gives \\boxed{x = 3}.", "3", True, True),
    ("Subtracting 4 from both sides, the answer is x = 3.", "3", True, True),
    ("Dividing both sides by 2: x = 3", "3", True, True),
    ("\\boxed{3.0}", "3", True, True),
    ("The answer is 3.0", "3", True, True),
    ("\\boxed{3}", "3.00", True, True),
    ("The perimeter is \\boxed{12 \\text{ cm}}.", "12", True, True),
    ("The perimeter is \\boxed{\\text{12 cm}}.", "12", True, True),
    ("She spent 5 dollars. The answer is 5 dollars.", "5", True, True),
    ("The angle measures \\boxed{90^\\circ}.", "90", True, True),
    ("So the car travels at \\boxed{60 km/h}.", "60", True, True),
    ("The area is \\boxed{18\\ \\mathrm{m}^2}.", "18", True, True),
    ("It takes her 45 minutes in all.\n#### 45 minutes", "45", True, True),
    ("The population is \\boxed{1,000,000}.", "1000000", True, True),
    ("\\boxed{1\\,234}", "1234", True, True),
    ("\\boxed{1{,}234}", "1234", True, True),
    ("In total the store made $12,345.", "12345", True, True),
    ("\\boxed{1000}", "1,000", True, True),
    ("So $\\cos 30^\\circ = \\boxed{\\frac{\\sqrt{3}}{2}}$.", "\\frac{\\sqrt3}{2}", True, True),
    ("\\boxed{2^{\\frac{1}{2}}}", "\\sqrt{2}", True, True),
    ("\\boxed{\\frac{1}{\\frac{1}{2}+\\frac{1}{3}}}", "\\frac{6}{5}", True, True),
    ("First guess \\boxed{5}, but the sign flips: \\boxed{-5}", "-5", True, True),
    ("First guess \\boxed{-5}. Wait, recheck: \\boxed{5}", "-5", False, True),
    ("<think>2+2 is 4, or is it 5? It is 4.</think>The answer is \\boxed{4}.", "4", True, True),
    ("<think>\nLet me add: 17 + 25 = 42.\n</think>\n\n17 + 25 = \\boxed{42}", "42", True, True),
    ("Okay, 6 * 7 is 42.\n</think>\n\n**Final answer:** \\boxed{42}", "42", True, True),
    ("<think>The answer is 41. No wait.</think>The answer is 42.", "42", True, True),
    # no answer, or only inside the thinking
    ("I'm not sure how to solve this.", "7", False, False),
    ("", "7", False, False),
    ("<think>The answer is 42.</think>", "42", False, False),
    ("<think>So \\boxed{42}.</think>I need to think more about this.", "42", False, False),
    ("<think>Computing, 6 * 7 = 42 so the answer is \\boxed{42}", "42", False, False),
    ("<think>it is 42</think>I believe the result is forty-two.", "42", False, False),
    ("The answer is \\boxed{}.", "5", False, False),
    ("asdf qwerty }}{{ \\boxed{", "57", False, False),
    # fractions, decimals, LaTeX against plain text
    ("The area is \\boxed{\\dfrac{3}{4}} square units.", "0.75", True, True),
    ("\\boxed{0.75}", "\\frac34", True, True),
    ("The answer is 3/4", "\\frac{3}{4}", True, True),
    ("The answer is $\\frac{3}{4}$.", "3/4", True, True),
    ("The answer is 3/5", "0.75", False, True),
    ("\\boxed{\\tfrac{1}{3}}", "0.3333333", True, True),
    ("\\boxed{0.33}", "\\frac{1}{3}", False, True),
    ("\\boxed{-\\frac{1}{2}}", "-0.5", True, True),
    ("Therefore the answer is \u22125.", "-5", True, True),
    ("\\boxed{3\\frac{1}{2}}", "3.5", True, True),
    ("\\boxed{\\sqrt{2}}", "sqrt(2)", True, True),
    ("\\boxed{2\\sqrt{3}}", "\\sqrt{12}", True, True),
    ("Taking roots, \\boxed{2\\sqrt{3}}", "3\\sqrt{2}", False, True),
    ("Expanding, \\boxed{x^2+2x+1}", "(x+1)^2", True, True),
    ("The expression is \\boxed{x + 1}", "1+x", True, True),
    ("\\boxed{x - 1}", "x+1", False, True),
    ("\\boxed{y = 2x + 1}", "2x+1", True, True),
    ("\\boxed{2\\pi}", "2\\pi", True, True),
    ("The circumference is 2 pi. The answer is 2 pi", "2", False, True),
    ("\\boxed{2^{10}}", "1024", True, True),
    ("\\boxed{1.5 \\times 10^{3}}", "1500", True, True),
    # sets, tuples and intervals
    ("The roots are \\boxed{\\{1, 2, 3\\}}", "\\{3,2,1\\}", True, True),
    ("The solutions are $x = 2$ and $x = 3$, so \\boxed{2, 3}", "3, 2", True, True),
    ("\\boxed{x = 2 \\text{ or } x = 3}", "2,3", True, True),
    ("\\boxed{(-\\infty, 3)}", "(-\\infty,3)", True, True),
    ("\\boxed{[1, 2)}", "(1,2]", False, True),
    ("The domain is \\boxed{x \\in [0, 1)}", "[0,1)", True, True),
    ("The point is \\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}", "(3,\\frac{\\pi}{2})", True, True),
    # percentages
    ("\\boxed{25\\%}", "25", True, True),
    ("\\boxed{25\\%}", "0.25", True, True),
    ("The answer is 40%.", "40", True, True),
    ("\\boxed{0.4}", "40\\%", True, True),
    ("\\boxed{4\\%}", "40", False, True),
    # multiple choice
    ("\\boxed{\\text{(B)}}", "B", True, True),
    ("The answer is (C).", "C", True, True),
    ("\\boxed{B}", "C", False, True),
    # formats of common data sets and prompts
    (
        "Natalia sold 48/2 = 24 clips in May.\nShe sold 48+24 = 72 clips in April and May.\n#### 72",
        "72",
        True,
        True,
    ),
    ("Final Answer: The final answer is $\\frac{1}{4}$. I hope it is correct.", "0.25", True, True),
    ("<think>half of one</think><answer>\\frac{1}{2}</answer>", "0.5", True, True),
    ("<answer>The answer is 7</answer>", "7", True, True),
    ("**Answer:** 42", "42", True, True),
    ("So she has 12 apples left. The answer is 57 apples.", "57", True, True),
    ("First 3 + 4 = 7, then 7 * 8 = 56. The answer is 56", "57", False, True),
    ("Adding the two parts gives 1,234 in total.", "1234", True, True),
    ("The answer is not obvious at first. Computing, we get 42", "42", True, True),
    ("So the total cost is \\boxed{\\$1,234}.", "1234", True, True),
    ("It costs \\boxed{\\$5.00}", "5", True, True),
    ("Cut off mid-answer: so \\boxed{\\frac{1}{2", "0.5", False, True),
    ("I think it is 100.", "57", False, True),
    ("\\boxed{banana}", "57", False, True),
]


@pytest.fixture(scope="module")
def scorer() -> MathRuleScorer:
    return MathRuleScorer()


def test_the_table_is_large_and_mixed():
    assert len(CASES) >= 60
    assert len({(r, g) for r, g, _, _ in CASES}) == len(CASES)
    assert sum(c for _, _, c, _ in CASES) > 20 and sum(not c for _, _, c, _ in CASES) > 20


@pytest.mark.parametrize(("response", "ground_truth", "correct", "found"), CASES)
def test_score_table(scorer, response, ground_truth, correct, found):
    result = scorer.score(response, ground_truth)
    assert (result.correct, result.metrics["answer_found"]) == (correct, float(found))
    assert result.score == (1.0 if correct else 0.0)


@pytest.mark.parametrize(
    ("response", "answer", "extractor"),
    [
        ("\\boxed{\\frac{1}{\\sqrt{2}}}", "\\frac{1}{\\sqrt{2}}", "boxed"),
        ("\\boxed{\\left\\{ 1, \\{2\\} \\right\\}} done", "\\left\\{ 1, \\{2\\} \\right\\}", "boxed"),
        ("The answer is $\\frac{3}{4}$. Done.", "\\frac{3}{4}", "answer_phrase"),
        ("The answer is 2.5.", "2.5", "answer_phrase"),
        ("The answer is \\boxed{7}, clearly", "7", "boxed"),
        ("<answer> 12 </answer>", "12", "answer_tag"),
        ("we get 7 and then 9", "9", "last_number"),
        ("<think>it is 9</think>we get 7", "7", "last_number"),
        ("no numbers here", None, None),
    ],
)
def test_find_answer(response, answer, extractor):
    assert find_answer(response) == (answer, extractor)
    assert extract_answer(response) == answer


def test_extract_order_is_configurable():
    response = "The answer is 12. Double-checking with the formula: \\boxed{13}"
    assert find_answer(response) == ("13", "boxed")
    assert find_answer(response, ["answer_phrase", "boxed"]) == ("12", "answer_phrase")
    assert find_answer(response, ["last_number"]) == ("13", "last_number")
    assert MathRuleScorer(extract_order=["answer_phrase", "boxed"]).score(response, "12").correct
    assert not MathRuleScorer().score(response, "12").correct
    # An extractor left out of the order is not used at all.
    assert (
        MathRuleScorer(extract_order=["boxed"]).score("The answer is 12.", "12").metrics["answer_found"]
        == 0.0
    )


@pytest.mark.parametrize(
    ("response", "require", "after"),
    [
        ("<think>a</think>b", False, "b"),
        ("a</think>b", False, "b"),
        ("<think>a</think>b</think>c", False, "c"),
        ("<think>a", False, ""),
        ("plain", False, "plain"),
        ("plain", True, ""),
        ("a</think>b", True, "b"),
        ("</think>b", True, "b"),  # a template that opens the thinking, and a model that closed it at once
    ],
)
def test_after_thinking(response, require, after):
    assert after_thinking(response, require) == after


def test_after_thinking_takes_an_untagged_response_whole_unless_told_to_require_thinking():
    assert after_thinking("plain 42") == "plain 42"


@pytest.mark.parametrize(
    ("response", "answer"),
    [
        ("<ANSWER>12</ANSWER>", "12"),  # tags in any case
        ("<answer>\n12\n</answer>", "12"),  # over several lines
        ("<answer>3</answer> on reflection <answer>4</answer>", "4"),  # the last one
        ("<answer>3</answer> <answer>forty two</answer>", "forty two"),  # the last one, also as plain words
        ("<answer>the answer is 3</answer> <answer>4</answer>", "4"),  # the last one, phrase or not
        ("<answer>3</answer><answer> </answer>", None),  # the last one is empty: no answer
    ],
)
def test_last_answer_tag(response, answer):
    assert last_answer_tag(response) == answer


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("The answer is 3\nno, the answer is 4", "4"),  # the last phrase
        ("Final answer: my answer is 7, so the answer is 8", "8"),  # the last trigger of the line
        ("So the answer is $\\boxed{12}$ here", "12"),  # boxed inside the phrase
        ("the answer is $$", None),  # empty math: nothing stated
        ("the answer is $", "$"),  # a lone dollar is not math delimiters
        ("the answer is $5", "$5"),  # delimiters only when the phrase opens and closes with them
        ("the answer is 5$", "5$"),
        ("the answer is $5!", "$5!"),
        ('the answer is "5$', '"5$'),
        ("the answer is $5$", "5"),
    ],
)
def test_last_answer_phrase(text, answer):
    assert last_answer_phrase(text) == answer


def test_last_boxed_counts_only_braces_whatever_other_characters_it_holds():
    assert last_boxed("\\boxed{x \u2265 2~3}") == "x \u2265 2~3"
    assert last_boxed("\\boxed{\\{1, 2\\} \u222a \\{3\\}} and more") == "\\{1, 2\\} \u222a \\{3\\}"


def test_an_answer_math_verify_cannot_parse_is_wrong():
    assert not answers_match("}{", "\\frac{1}{2}")
    assert not answers_match("}{", "}{")


def test_the_math_verify_timeout_notice_is_dropped_and_nothing_else(scorer):
    scorer.score("\\boxed{\\frac{1}{2}}", "0.5")  # math-verify runs: its loggers get the filter, once each
    for name in ("math_verify.parser", "math_verify.grader"):
        logger = logging.getLogger(name)
        scorer.score("\\boxed{\\frac{1}{2}}", "0.5")
        assert len(logger.filters) == 1, name

        def record(msg, name=name):
            return logging.LogRecord(name, logging.WARNING, __file__, 1, msg, None, None)

        assert not logger.filter(record("Timeout is disabled as parsing_timeout is None or <= 0, ..."))
        assert logger.filter(record("Error during comparison"))


def test_math_rule_is_the_registered_scorer():
    assert get_reward_scorer_cls("math_rule") is MathRuleScorer


def test_require_thinking_for_templates_that_open_it_in_the_prompt():
    truncated_thought = "Let me compute 6 * 7 = 42, then check"
    assert MathRuleScorer().score(truncated_thought, "42").correct
    strict = MathRuleScorer(require_thinking=True)
    assert not strict.score(truncated_thought, "42").correct
    assert strict.score("6 * 7 = 42</think>\\boxed{42}", "42").correct


@pytest.mark.parametrize(
    ("response", "ok"),
    [
        ("<think>x</think>So \\boxed{4}", True),
        ("x</think>So \\boxed{4}", True),
        ("So \\boxed{4}", True),
        ("The answer is 4", False),  # not in the preferred (boxed) form
        ("<think>x</think><think>y</think>\\boxed{4}", False),
        ("Preamble <think>x</think>\\boxed{4}", False),
        ("<think>x \\boxed{4}", False),
        ("I don't know", False),
    ],
)
def test_format_ok(scorer, response, ok):
    assert scorer.score(response, "4").metrics["format_ok"] == float(ok)


def test_thinking_well_formed():
    assert thinking_well_formed("no tags")
    assert thinking_well_formed("<think>a</think>b") and thinking_well_formed(" a</think>b")
    assert not thinking_well_formed("<think>a") and not thinking_well_formed("a</think>b</think>")
    assert not thinking_well_formed("<think>a<think>b</think>c")  # two opened, one closed


def test_format_score_and_custom_scores():
    shaped = MathRuleScorer(correct_score=1.0, wrong_score=-1.0, format_score=0.1)
    assert shaped.score("\\boxed{4}", "4") == RewardResult(
        score=1.1, correct=True, metrics={"answer_found": 1.0, "format_ok": 1.0}
    )
    assert shaped.score("\\boxed{5}", "4").score == pytest.approx(-0.9)
    assert shaped.score("it is 4", "4").score == 1.0
    assert shaped.score("no idea", "4").score == -1.0


def test_format_pattern():
    tagged = MathRuleScorer(format_score=0.5, format_pattern=r"<think>.+</think>\s*<answer>.+</answer>\s*")
    good = "<think>2+2</think>\n<answer>4</answer>"
    assert tagged.score(good, "4").score == 1.5
    assert tagged.score("\\boxed{4}", "4").score == 1.0


@pytest.mark.parametrize(
    ("length", "penalty"), [(0, 0.0), (100, 0.0), (150, 0.25), (200, 0.5), (300, 0.5), (10_000, 0.5)]
)
def test_length_penalty_golden_values(length, penalty):
    assert length_penalty(length, start=100, end=200, maximum=0.5) == pytest.approx(penalty)


def test_length_penalty_in_the_score():
    scorer = MathRuleScorer(length_penalty_start_chars=20, length_penalty_end_chars=40, length_penalty=1.0)
    short = "\\boxed{4}"
    long = "x" * 21 + " \\boxed{4}"  # 31 characters: 11 past the start of a 20-character ramp
    assert scorer.score(short, "4") == RewardResult(
        score=1.0, correct=True, metrics={"answer_found": 1.0, "format_ok": 1.0, "length_penalty": 0.0}
    )
    result = scorer.score(long, "4")
    assert result.correct and result.score == pytest.approx(1.0 - 11 / 20)
    assert result.metrics["length_penalty"] == pytest.approx(11 / 20)
    assert "length_penalty" not in MathRuleScorer().score(long, "4").metrics
    # the default penalty at the end of the ramp is the whole correct score
    ramp_only = MathRuleScorer(length_penalty_start_chars=0, length_penalty_end_chars=5)
    assert ramp_only.score("so \\boxed{4}", "4").score == 0.0


@pytest.mark.parametrize(
    "options",
    [
        {"length_penalty_start_chars": 0, "length_penalty_end_chars": 1},
        {"length_penalty_start_chars": 10, "length_penalty_end_chars": 11, "length_penalty": 0.0},
        {"length_penalty_start_chars": 10, "length_penalty_end_chars": 11, "length_penalty": 0.5},
    ],
)
def test_good_options_are_accepted(options):
    MathRuleScorer(**options)


def test_options_must_be_named():
    with pytest.raises(TypeError):
        MathRuleScorer(["boxed"])


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"tolerance": 0.1}, "tolerance"),
        ({"extract_order": ["boxed", "last_digit"]}, "last_digit"),
        ({"extract_order": []}, "non-empty"),
        ({"extract_order": "boxed"}, "non-empty list"),
        ({"extract_order": ["boxed", "boxed"]}, "twice"),
        ({"length_penalty_start_chars": 10}, "both"),
        ({"length_penalty_end_chars": 10}, "both"),
        ({"length_penalty_start_chars": -1, "length_penalty_end_chars": 5}, "need 0 <= length_penalty_start"),
        ({"length_penalty_start_chars": 5, "length_penalty_end_chars": 5}, "start_chars < length_penalty_end"),
        (
            {"length_penalty_start_chars": 10, "length_penalty_end_chars": 5},
            "start_chars < length_penalty_end",
        ),
        ({"length_penalty": -1.0}, ">= 0"),
    ],
)
def test_bad_options_are_named(options, match):
    with pytest.raises((TypeError, ValueError), match=match):
        MathRuleScorer(**options)


@pytest.mark.parametrize(
    ("text", "normalized"),
    [
        ("$57$", "57"),
        ("\\(x+1\\)", "x+1"),
        ("1\\,234\\,567", "1234567"),
        ("1{,}234", "1234"),
        ("\\text{12 cm}", "12"),
        ("5 dollars", "5"),
        ("12 square units.", "12"),
        ("2 pi", "2 pi"),
        ("10 km/h", "10"),
        ("2 pi/x", "2 pi/x"),
        ("3 and 4", "3 and 4"),
        ("3 squared", "3 squared"),
        ("$", "$"),
        ("$$", ""),
        ("$5", "$5"),
        ("5$", "5$"),
        ("5x", "5x"),
        ("1\\,23", "1\\,23"),
    ],
)
def test_normalize_answer(text, normalized):
    assert normalize_answer(text) == normalized


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("57", 57.0),
        ("57.", 57.0),
        ("$1,234$", 1234.0),
        ("-0.5", -0.5),
        ("3/4", 0.75),
        ("25\\%", 25.0),
        ("1/0", None),
        ("x", None),
    ],
)
def test_parse_number(text, value):
    assert parse_number(text) == value


def test_numeric_tolerance(scorer):
    assert scorer.score("The answer is 0.3333333", "0.33333333").correct
    assert not scorer.score("The answer is 0.333", "0.33333333").correct
    assert answers_match("1000000.5", "1000000.4999999")
    # within a relative 1e-6 of a non-integer, nothing wider
    assert answers_match("2.5000001", "2.5") and answers_match("2.4999976", "2.5")
    assert not answers_match("2.5001", "2.5") and not answers_match("2.50001", "2.5")


@pytest.mark.parametrize(
    ("answer", "ground_truth", "right"),
    [
        ("3", "3", True),
        ("3.0", "3", True),
        ("3.", "3", True),
        ("3.0002", "3", False),
        ("3.000001", "3", False),
        ("2.9999999", "3", False),
        ("8888889", "8888888", False),  # within 1e-6 relative, still another integer
        ("4000001.0", "4000000", False),
        ("-7", "-7.0", True),
        ("1,000,000", "1000000", True),
    ],
)
def test_an_integer_answer_must_be_that_integer(scorer, answer, ground_truth, right):
    assert answers_match(answer, ground_truth) is right
    assert scorer.score(f"The answer is {answer}", ground_truth).correct is right


@pytest.mark.parametrize("ground_truth", ["  ", None])
def test_missing_ground_truth_is_not_applicable(scorer, ground_truth):
    assert scorer.score("57", ground_truth) is None


def test_works_off_the_main_thread(scorer):
    """math-verify's default signal-based timeout would raise here; the scorer must not depend on it."""
    results = []
    thread = threading.Thread(target=lambda: results.append(scorer.score("\\boxed{\\frac{1}{2}}", "0.5")))
    thread.start()
    thread.join(timeout=30)
    assert results and results[0].correct


def test_the_reference_is_the_last_gsm8k_mark():
    """A ground truth with several `#### ` lines (a worked solution that restates an intermediate result the GSM8K
    way) is answered by its last one."""
    truth = "first\n#### 3\nthen\n#### 5\nso\n#### 7"
    assert reference_answer(truth) == "7"
    assert reference_answer("#### 12") == "12"
    assert MathRuleScorer().score("\\boxed{7}", truth).correct is True
    assert MathRuleScorer().score("\\boxed{5}", truth).correct is False


def test_the_answer_key_votes_by_value_for_numbers_and_by_text_otherwise():
    """maj@k's key (roll_pipeline/driver/validation.py): equal numbers are one vote however they are written, other
    answers compare by their stripped text, and a response stating no answer gives no vote."""
    scorer = MathRuleScorer()
    assert MathRuleScorer.has_answer_key is True
    assert scorer.answer_key("so \\boxed{57.0}") == scorer.answer_key("The answer is 57") == 57
    assert scorer.answer_key("\\boxed{ \\frac{1}{2} }") == "\\frac{1}{2}"
    assert scorer.answer_key("\\boxed{57}") != scorer.answer_key("\\boxed{58}")
    assert scorer.answer_key("nothing stated") is None
    assert scorer.answer_key(None) is None and scorer.answer_key("") is None

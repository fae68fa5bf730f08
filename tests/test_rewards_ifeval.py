"""The instruction-following reward (workers/rewards/ifeval.py): one test per constraint type, each with a response
that satisfies it and one that does not; the rows it refuses; the loopholes of ROLL's checks, closed."""

from __future__ import annotations

import json
import re

import pytest

from workers.rewards.audit import audit_results, panel_for
from workers.rewards.ifeval import CONSTRAINTS, IFEvalScorer, parse_constraint
from workers.rewards.registry import get_reward_scorer_cls

# (func_name, arguments, a response that satisfies it, one that does not)
CASES = [
    ("verify_keywords", {"keyword_list": ["river", "stone"]}, "A stone sat by the River.", "A rock sat by the stream."),
    ("verify_keyword_frequency", {"word": "cat", "N": 2}, "The cat saw another CAT.", "The cat sat; concatenate."),
    ("validate_forbidden_words", {"forbidden_words": ["very", "really"]}, "It is quite good.", "It is Very good."),
    ("verify_letter_frequency", {"letter": "z", "N": 2}, "jazz hands", "Zebra"),
    ("validate_response_language", {"language": "de"}, "Heute ist das Wetter in Berlin sehr schön und warm.",
     "Today the weather in Berlin is very nice and warm."),
    ("verify_paragraph_count", {"N": 2}, "First part.\n* * *\nSecond part.", "First part.\n* * *\n\n* * *\nThird."),
    ("validate_word_constraint", {"N": 10, "quantifier": "around"}, "one two three four five six seven eight nine",
     "one two three four five six seven"),
    ("verify_sentence_constraint", {"N": 2, "quantifier": "at most"}, "It rains. We stay in.", "A. B? C! D."),
    ("validate_paragraphs", {"N": 2, "first_word": "however", "i": 2}, "Cats sleep.\n\nHowever, dogs play.",
     "Cats sleep.\n\nDogs play, however."),
    ("verify_postscript", {"postscript_marker": "P.S."}, "See you soon.\nP.S. Bring snacks.", "See you soon.\nP.S."),
    ("validate_placeholders", {"N": 2}, "Meet at [place] on [date].", "Meet at [place] on Monday."),
    ("verify_bullet_points", {"N": 2}, "* apples\n* pears\nThat is all.", "* apples\n* * *\n- pears\n- plums"),
    ("validate_title", {}, "<<Ode to Rain>>\nRain falls.", "Ode to Rain\nRain falls."),
    ("validate_choice", {"options": ["yes", "no", "maybe"]}, "My answer is no.", "Yes or no, I cannot say."),
    ("validate_highlighted_sections", {"N": 2}, "Use *salt* and **pepper**.", "Use *salt* and pepper."),
    ("validate_sections", {"N": 2, "section_splitter": "Section"}, "Section 1\nIntro.\nSection 2\nBody.",
     "Section 1\nIntro.\nSection 2\n"),
    ("validate_json_format", {}, '{"a": [1, 2]}', "a: 1"),
    ("validate_repeat_prompt", {"original_prompt": "Name a fruit."}, "Name a fruit. Mango.", "Mango. Name a fruit."),
    ("validate_two_responses", {}, "Red.\n******\nBlue.", "Red.\n******\nRed."),
    ("validate_uppercase", {}, "ALL CAPS HERE!", "ALL CAPS Here"),
    ("validate_lowercase", {}, "all lower here.", "all lower Here."),
    ("validate_frequency_capital_words", {"N": 2, "quantifier": "at least"}, "USE THE force", "Use the FORCE"),
    ("validate_end", {"end_phrase": "Any other questions?"}, "Done. Any other questions?", "Any other questions? Done."),
    ("validate_quotation", {}, '"Wrapped in quotes."', 'Not "wrapped".'),
    ("validate_no_commas", {}, "No commas here.", "Well, one here."),
]


def gt(name: str, **args) -> str:
    return json.dumps({"func_name": name, **args})


def test_every_constraint_has_a_case():
    assert sorted(name for name, *_ in CASES) == sorted(CONSTRAINTS)


@pytest.mark.parametrize("name,args,good,bad", CASES, ids=[c[0] for c in CASES])
def test_each_constraint_holds_for_a_response_that_follows_it_and_not_for_one_that_does_not(name, args, good, bad):
    scorer = IFEvalScorer()
    assert scorer.score(good, gt(name, **args)).correct, good
    result = scorer.score(bad, gt(name, **args))
    assert (result.correct, result.score) == (False, 0.0), bad
    empty = scorer.score("   \n", gt(name, **args))
    assert (empty.correct, empty.metrics) == (False, {"empty": 1.0})


def paid_elsewhere(item) -> bool:
    """Whether ROLL's check (written here from what its source does) pays the panel's hack; for a choice with
    every option in it, Google IFEval's reading (an option inside the response), which ROLL's does not share."""
    spec = json.loads(item.ground_truth)
    text = item.response.rsplit("</think>", 1)[-1] if "</think>" in item.response else item.response
    if item.id == "every_option_at_once":
        return any(o in text for o in spec["options"])
    return {
        "verify_keyword_frequency": lambda: len(re.findall(r"\b\w+\b", text)) == spec["N"],  # counts every word
        "validate_choice": lambda: any(text in o for o in spec["options"]),
        "validate_highlighted_sections": lambda: len(re.findall(r"\*(.*?)\*", text)) >= spec["N"],
        "validate_title": lambda: bool(re.findall(r"<<(.*?)>>", text)),
        "validate_placeholders": lambda: len(re.findall(r"\[(.*?)\]", text)) >= spec["N"],
        "validate_json_format": lambda: json.loads(text) is not None,
        "validate_quotation": lambda: text.startswith('"') and text.endswith('"'),
        "validate_two_responses": lambda: text.count("******") == 1,
        "validate_uppercase": lambda: text == text.upper(),
        "validate_end": lambda: text.endswith(spec["end_phrase"]),
        "validate_no_commas": lambda: "," not in text,
    }[spec["func_name"]]()


def test_the_scorer_passes_its_panel_whose_hacks_other_checks_pay():
    from tests.test_reward_audit import scored

    panel = panel_for("ifeval")
    scorer = IFEvalScorer()
    results = [scorer.score(i.response, i.ground_truth) for i in panel]
    assert audit_results(panel, [scored(r) for r in results]).failures == []
    hacks = [i for i in panel if i.kind == "hack"]
    assert len(hacks) >= 10 and all(paid_elsewhere(i) for i in hacks), [i.id for i in hacks if not paid_elsewhere(i)]


def test_rows_it_can_never_judge_are_refused_with_the_reason():
    def problems(ground_truth):
        return dict(IFEvalScorer.check_row({"ground_truth": ground_truth}))

    assert problems(gt("validate_title")) == {}
    assert problems({"func_name": "validate_title"}) == {}  # a row's JSON object, not text
    assert problems("not json") == {"ground_truth": "is not a JSON object with a func_name"}
    assert problems(gt("no_such_check"))["ground_truth"].startswith("func_name 'no_such_check' is not a known")
    assert problems(gt("validate_word_constraint", N=5)) == {"ground_truth": "validate_word_constraint needs quantifier"}
    assert problems(gt("validate_word_constraint", N=5, quantifier="exactly")) == {
        "ground_truth": "validate_word_constraint: quantifier must be one of ['at least', 'at most', 'around'], got 'exactly'"
    }
    assert problems("") == {"ground_truth": "empty"}
    # open-instruct's rows carry every argument of every check, the unused ones null: those are ignored
    assert parse_constraint(gt("validate_end", end_phrase="Bye.", N=None, language=None)) == ("validate_end", {"end_phrase": "Bye."})
    assert IFEvalScorer().score("x", "not json") is None  # a bad row is masked, never the policy's 0


def test_scores_and_registration():
    scorer = IFEvalScorer(correct_score=2.0, wrong_score=-1.0)
    assert scorer.score("<think>, , ,</think>No commas.", gt("validate_no_commas")).score == 2.0
    assert scorer.score("One, two.", gt("validate_no_commas")).score == -1.0
    assert get_reward_scorer_cls("ifeval") is IFEvalScorer


def words(n: int) -> str:
    return " ".join(f"w{i}" for i in range(n))


def sentences(n: int) -> str:
    return " ".join(f"Sentence {i}." for i in range(n))


BIG = 300  # counts past CPython's cache of small ints: an `is` in place of `==` shows there


# (func_name, arguments, response, verdict): each constraint at and around its bounds
BOUNDS = [
    *[("validate_word_constraint", {"N": 10, "quantifier": "at least"}, words(n), ok) for n, ok in ((9, False), (10, True), (11, True))],
    *[("validate_word_constraint", {"N": 10, "quantifier": "at most"}, words(n), ok) for n, ok in ((5, True), (10, True), (11, False))],
    *[("validate_word_constraint", {"N": 10, "quantifier": "around"}, words(n), ok) for n, ok in ((8, False), (9, True), (11, True), (12, False))],
    *[("validate_word_constraint", {"N": 30, "quantifier": "around"}, words(n), ok) for n, ok in ((26, False), (27, True), (33, True), (34, False))],
    ("validate_word_constraint", {"N": 3, "quantifier": "around"}, words(4), True),  # the tolerance is never under 1
    ("validate_word_constraint", {"N": BIG, "quantifier": "at most"}, words(BIG), True),
    ("validate_word_constraint", {"N": BIG, "quantifier": "around"}, words(BIG), True),
    *[("verify_sentence_constraint", {"N": 3, "quantifier": "at least"}, sentences(n), ok) for n, ok in ((2, False), (3, True))],
    *[("verify_sentence_constraint", {"N": 3, "quantifier": "at most"}, sentences(n), ok) for n, ok in ((3, True), (4, False))],
    *[("verify_sentence_constraint", {"N": 3, "quantifier": "around"}, sentences(n), ok) for n, ok in ((1, False), (2, True), (4, True), (5, False))],
    ("verify_keyword_frequency", {"word": "cat", "N": 2}, "cat cat cat", False),
    ("verify_keyword_frequency", {"word": "cat", "N": BIG}, "cat " * BIG, True),
    ("verify_letter_frequency", {"letter": "z", "N": 2}, "jazzz", False),
    ("verify_letter_frequency", {"letter": "zz", "N": 1}, "jazz", False),
    ("verify_letter_frequency", {"letter": "", "N": 3}, "ab", False),
    ("verify_letter_frequency", {"letter": "z", "N": BIG}, "z" * BIG, True),
    ("validate_response_language", {"language": "fr"}, "Today the weather in Berlin is very nice and warm.", False),
    ("validate_response_language", {"language": "en"}, "12345 678", False),
    ("verify_paragraph_count", {"N": 2}, "A\n* * *\nB\n* * *\nC", False),
    ("verify_paragraph_count", {"N": 2}, "A", False),
    ("verify_paragraph_count", {"N": BIG}, "\n* * *\n".join(["p"] * BIG), True),
    ("validate_paragraphs", {"N": 2, "first_word": "Cats", "i": 1}, "Cats sleep.\n\nDogs play.", True),
    ("validate_paragraphs", {"N": 2, "first_word": "Cats", "i": 0}, "Cats sleep.\n\nDogs play.", False),
    ("validate_paragraphs", {"N": 2, "first_word": "Dogs", "i": 3}, "Cats sleep.\n\nDogs play.", False),
    ("validate_paragraphs", {"N": 2, "first_word": "Dogs", "i": 0}, "Cats sleep.\n\nDogs play.", False),
    ("validate_paragraphs", {"N": 3, "first_word": "Cats", "i": 3}, "A.\n\nB.\n\nCats play.", True),
    ("validate_paragraphs", {"N": 3, "first_word": "Cats", "i": 1}, "Cats sleep.\n\nDogs play.", False),
    ("validate_paragraphs", {"N": 1, "first_word": "Cats", "i": 1}, "Cats sleep.\n\nDogs play.", False),
    ("validate_paragraphs", {"N": BIG, "first_word": "p", "i": 1}, "\n\n".join(["p"] * BIG), True),
    ("verify_postscript", {"postscript_marker": "P.S."}, "P.S. Bring snacks.", True),
    ("verify_postscript", {"postscript_marker": "P.S."}, "hello world", False),
    ("validate_placeholders", {"N": 2}, "[a] [b] [c]", True),
    ("validate_placeholders", {"N": BIG}, "[x] " * BIG, True),
    ("verify_bullet_points", {"N": 2}, "* one", False),
    ("verify_bullet_points", {"N": BIG}, "\n".join(["* b"] * BIG), True),
    ("validate_choice", {"options": ["yes", "no"]}, "I cannot say.", False),
    ("validate_highlighted_sections", {"N": 2}, "*a* *b* *c*", True),
    ("validate_highlighted_sections", {"N": BIG}, "*h* " * BIG, True),
    ("validate_sections", {"N": 2, "section_splitter": "Section"}, "Intro\nSection 1\nA\nSection 2\nB", False),
    ("validate_sections", {"N": 2, "section_splitter": "Section"}, "Section 1\nA\nSection 2\nB\nSection 3\nC", False),
    ("validate_sections", {"N": 2, "section_splitter": "Section"}, "Section 1\nA", False),
    ("validate_sections", {"N": BIG, "section_splitter": "SECTION"}, "".join(f"SECTION {i}\nx\n" for i in range(BIG)), True),
    ("validate_two_responses", {}, "a\n******\nb\n******\nc", False),
    ("validate_two_responses", {}, "Only one.", False),
    ("validate_two_responses", {}, "Blue.\n******\nRed.", True),
    ("validate_frequency_capital_words", {"N": 2, "quantifier": "around"}, "USE THE FORCE", False),
    ("validate_frequency_capital_words", {"N": 2, "quantifier": "around"}, "USE THE force", True),
    ("validate_end", {"end_phrase": "Bye."}, "Oka Bye.", True),
    *[("validate_quotation", {}, text, ok) for text, ok in (('"a"', True), (' "two words" ', True), ('""', False), ('" "', False), ('"a', False), ('a"', False))],
]


@pytest.mark.parametrize("name,args,text,verdict", BOUNDS, ids=[f"{c[0]}-{i}" for i, c in enumerate(BOUNDS)])
def test_each_constraint_at_its_bounds(name, args, text, verdict):
    assert CONSTRAINTS[name](text, **args) is verdict


def test_a_ground_truth_object_without_a_func_name_is_refused_and_the_default_scores_are_1_and_0():
    assert dict(IFEvalScorer.check_row({"ground_truth": {"N": 3}})) == {
        "ground_truth": "is not a JSON object with a func_name"
    }
    scorer = IFEvalScorer()
    assert scorer.score("No commas.", gt("validate_no_commas")).score == 1.0
    assert scorer.score("A, b.", gt("validate_no_commas")).score == 0.0

"""The real-model example's data: arithmetic word problems with GSM8K-style and MATH-style reference solutions,
and math_rule reading the answer out of either."""

from __future__ import annotations

import json
import re

from roll_pipeline.data.word_problems import write_word_problems
from tests.conftest import EXAMPLES
from workers.rewards.math_rule import MathRuleScorer, reference_answer

FILES = ("word_problems_train.jsonl", "word_problems_val.jsonl")


def rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (EXAMPLES / "data" / name).read_text().splitlines()]


def test_regeneration_reproduces_the_committed_files(tmp_path):
    write_word_problems(tmp_path, seed=0)
    for name in FILES:
        assert (tmp_path / name).read_bytes() == (EXAMPLES / "data" / name).read_bytes(), name


def test_splits_are_disjoint_and_each_solution_states_its_own_arithmetic():
    train, val = rows(FILES[0]), rows(FILES[1])
    questions = [r["messages"][0]["content"] for r in train + val]
    assert len(set(questions)) == len(questions) == 464
    assert {r["tag"] for r in val} == {"gsm8k", "boxed"}
    for row in train + val:
        a, op, b = re.match(r"\$?(\d+) ([-+*]) (\d+)", row["ground_truth"]).groups()
        expected = {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
        assert reference_answer(row["ground_truth"]) == str(expected), row
        assert (row["tag"] == "boxed") == ("\\boxed{}" in row["messages"][0]["content"])


def test_math_rule_takes_the_answer_out_of_either_kind_of_reference_solution():
    scorer = MathRuleScorer()
    gsm8k = "Tom has 23 + 45 = <<23+45=68>>68 apples.\n#### 68"
    boxed = "$23 + 45 = \\boxed{68}$"
    for truth in (gsm8k, boxed, "68"):
        assert scorer.score("23 + 45 = 68.\n#### 68", truth).correct, truth
        assert scorer.score("The answer is \\boxed{68}", truth).correct, truth
        assert not scorer.score("The answer is 45", truth).correct, truth  # a number of the question is not it
    # A solution that names other numbers after its arithmetic: read as a whole (math-verify's own parse of the
    # text), the right answer 3 was scored wrong.
    assert scorer.score("#### 3", "The answer uses 12 / 4 = <<12/4=3>>3 cups; then 2 more days pass.\n#### 3").correct
    assert reference_answer("x = \\frac{1}{2}") == "x = \\frac{1}{2}"  # a plain answer stays as it is

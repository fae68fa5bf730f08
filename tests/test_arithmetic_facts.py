"""The LoRA example's data: sums and products of 1..12, validation holding out whole facts."""

from __future__ import annotations

import json
import re

from roll_pipeline.data.arithmetic_facts import write_arithmetic_facts
from tests.conftest import EXAMPLES
from workers.rewards.math_rule import MathRuleScorer

FILES = ("arithmetic_train.jsonl", "arithmetic_val.jsonl")


def rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (EXAMPLES / "data" / name).read_text().splitlines()]


def fact(row: dict) -> tuple[int, str, int]:
    a, b = map(int, re.findall(r"\d+", row["messages"][0]["content"]))
    return a, row["tag"], b


def test_regeneration_reproduces_the_committed_files(tmp_path):
    write_arithmetic_facts(tmp_path, seed=0)
    for name in FILES:
        assert (tmp_path / name).read_bytes() == (EXAMPLES / "data" / name).read_bytes(), name


def test_validation_facts_never_appear_in_training_and_every_answer_is_right():
    train, val = rows(FILES[0]), rows(FILES[1])
    assert len(val) == 128 and len(train) == (288 - 128) * 4
    assert not {fact(r) for r in val} & {fact(r) for r in train}
    assert {r["tag"] for r in val} == {"add", "mul"}
    scorer = MathRuleScorer()
    for row in train + val:
        a, tag, b = fact(row)
        assert row["ground_truth"] == str(a + b if tag == "add" else a * b), row
        assert scorer.score(f"The answer is {row['ground_truth']}.", row["ground_truth"]).correct
        assert not scorer.score(f"The answer is {int(row['ground_truth']) + 1}.", row["ground_truth"]).correct

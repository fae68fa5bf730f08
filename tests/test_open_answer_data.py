"""The open-answer domain and the judge's data: deterministic, committed as generated, and with verdicts that
agree with the rows they judge."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from roll_pipeline.data.synthetic import (
    JUDGE_NO,
    JUDGE_YES,
    OPEN_TABLES,
    OPPOSITES,
    TINY_JUDGE_TEMPLATE,
    generate_open,
    main,
    open_subject,
    write_open_answer_data,
)
from workers.rewards.llm_judge import parse_verdict, render_prompt

COMMITTED = Path(__file__).resolve().parents[1] / "examples" / "data"
FILES = ("open_train.jsonl", "open_val.jsonl", "judge_train.jsonl", "judge_val.jsonl")


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> dict[str, list[dict]]:
    out = tmp_path_factory.mktemp("open")
    return {name: _read(path) for name, path in write_open_answer_data(out, seed=0).items()}


def test_regeneration_reproduces_committed_files(tmp_path):
    assert main(["--open-answer", "--out", str(tmp_path), "--seed", "0"]) == 0
    for name in FILES:
        assert (tmp_path / name).read_bytes() == (COMMITTED / name).read_bytes(), name
    assert not (tmp_path / "math_train.jsonl").exists(), "--open-answer writes only the open-answer files"


def test_same_seed_same_rows_and_distinct_prompts():
    assert generate_open(200, seed=3) == generate_open(200, seed=3)
    assert generate_open(200, seed=3) != generate_open(200, seed=4)
    assert len({row["messages"][0]["content"] for row in generate_open(480, seed=0)}) == 480
    with pytest.raises(ValueError, match="could only draw 480"):
        generate_open(481, seed=0)


def test_open_rows_have_the_shared_schema_and_right_references(written):
    answers = {
        "opposite": {**dict(OPPOSITES), **{b: a for a, b in OPPOSITES}},
        "plural": dict(OPEN_TABLES["plural"]),
        "past": dict(OPEN_TABLES["past"]),
    }
    for split in ("train", "val"):
        for row in written[f"open_{split}"]:
            assert list(row) == ["id", "domain", "tag", "messages", "ground_truth", "test_cases"]
            assert row["id"].startswith(f"open-{split}-") and row["domain"] == "open"
            assert row["ground_truth"] == answers[row["tag"]][open_subject(row)]
            assert row["ground_truth"] != open_subject(row)
    train = {r["messages"][0]["content"] for r in written["open_train"]}
    assert not train & {r["messages"][0]["content"] for r in written["open_val"]}
    assert {r["tag"] for r in written["open_train"]} == {"opposite", "plural", "past"}


def test_judge_rows_are_balanced_and_their_verdicts_hold(written):
    for split in ("train", "val"):
        rows, questions = written[f"judge_{split}"], written[f"open_{split}"]
        assert len(rows) == 4 * len(questions)
        assert sum(r["verdict"] == "YES" for r in rows) == len(rows) // 2
        assert {r["question"] for r in rows} == {q["messages"][0]["content"] for q in questions}
        for row in rows:
            prompt = render_prompt(TINY_JUDGE_TEMPLATE, row["question"], row["reference"], row["response"])
            assert row["messages"] == [{"role": "user", "content": prompt}]
            assert row["ground_truth"] == (JUDGE_YES if row["verdict"] == "YES" else JUDGE_NO)
            assert parse_verdict(row["ground_truth"], "yes_no") == (1.0 if row["verdict"] == "YES" else 0.0)
            # every response ends with its answer: a right one with the reference, a wrong one with anything
            # else
            words = re.findall(r"\w+", row["response"])
            assert (bool(words) and words[-1] == row["reference"]) == (row["verdict"] == "YES"), row

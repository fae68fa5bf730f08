"""Tests for the deterministic example-data generator."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from roll_pipeline.data.synthetic import generate_code, generate_math, main, math_problem, write_example_data

REPO = Path(__file__).resolve().parents[1]
COMMITTED = REPO / "examples" / "data"
FILES = ("math_train.jsonl", "math_val.jsonl", "code_train.jsonl", "code_val.jsonl")
BARE_EXPRESSION = re.compile(r"^(?:What is (?P<a>[\d +*-]+)\?|Compute (?P<b>[\d +*-]+)\.|(?P<c>[\d +*-]+) = \?)$")


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> dict[str, list[dict]]:
    out = tmp_path_factory.mktemp("data")
    paths = write_example_data(out, seed=0)
    return {name: _read(path) for name, path in paths.items()}


def test_same_seed_gives_identical_rows():
    assert generate_math(300, seed=3) == generate_math(300, seed=3)
    assert generate_code(300, seed=3) == generate_code(300, seed=3)


def test_different_seed_gives_different_rows():
    assert generate_math(50, seed=0) != generate_math(50, seed=1)
    assert generate_code(50, seed=0) != generate_code(50, seed=1)


def test_prompts_are_distinct_within_a_draw():
    rows = generate_code(500, seed=0)
    assert len({row["messages"][0]["content"] for row in rows}) == 500


def test_train_and_val_are_disjoint_and_large_enough(written):
    for domain in ("math", "code"):
        train = {row["messages"][0]["content"] for row in written[f"{domain}_train"]}
        val = {row["messages"][0]["content"] for row in written[f"{domain}_val"]}
        assert not train & val
    assert len(written["math_val"]) >= 200
    assert len(written["code_val"]) >= 100
    # a math problem is in one split only, whichever template renders it
    train_problems = {math_problem(row) for row in written["math_train"]}
    assert not train_problems & {math_problem(row) for row in written["math_val"]}
    assert len(written["math_val"]) + len(written["code_val"]) >= 200


def test_schema(written):
    ids = set()
    for name, rows in written.items():
        domain, split = name.split("_")
        for row in rows:
            assert list(row) == ["id", "domain", "tag", "messages", "ground_truth", "test_cases"]
            assert row["id"].startswith(f"{domain}-{split}-")
            assert row["domain"] == domain
            assert isinstance(row["tag"], str) and row["tag"]
            assert row["messages"] == [{"role": "user", "content": row["messages"][0]["content"]}]
            assert isinstance(row["ground_truth"], str) and row["ground_truth"]
            assert isinstance(row["test_cases"], str)
            ids.add(row["id"])
    assert len(ids) == sum(len(rows) for rows in written.values())


def test_tags(written):
    assert {row["tag"] for row in written["math_train"]} == {"add"}
    assert {row["tag"] for row in written["code_train"]} == {"arith", "string", "list"}


def test_math_ground_truths_are_correct(written):
    bare = 0
    for row in written["math_train"] + written["math_val"]:
        assert row["test_cases"] == ""
        assert re.fullmatch(r"-?\d+", row["ground_truth"])
        match = BARE_EXPRESSION.match(row["messages"][0]["content"])
        if match:
            expression = next(group for group in match.groups() if group)
            assert eval(expression) == int(row["ground_truth"]), row  # noqa: S307 - digits and operators only
            bare += 1
    assert bare > 1000


def test_code_reference_solutions_pass_their_own_asserts(written, tmp_path):
    rows = written["code_train"] + written["code_val"]
    # One subprocess for all rows: the references are ours, so isolation from the test process is enough.
    program = "\n".join(
        f"def _case_{i}():\n" + "\n".join(
            "    " + line for line in [*row["ground_truth"].splitlines(), *json.loads(row["test_cases"])["asserts"]]
        ) + f"\n_case_{i}()"
        for i, row in enumerate(rows)
    )
    for row in rows:
        assert row["ground_truth"].startswith("def ")
        assert len(json.loads(row["test_cases"])["asserts"]) == 3
    script = tmp_path / "check_references.py"
    script.write_text(program)
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_regeneration_reproduces_committed_files(tmp_path):
    assert main(["--out", str(tmp_path), "--seed", "0"]) == 0
    for name in FILES:
        assert (tmp_path / name).read_bytes() == (COMMITTED / name).read_bytes(), name


def test_committed_files_are_small():
    assert sum((COMMITTED / name).stat().st_size for name in FILES) < 1_500_000

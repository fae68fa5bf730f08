"""`roll data import` (roll_pipeline/data/roll_rows.py): ROLL's rows become this project's, each code case type a
sandbox test shape that passes a right program and fails a wrong one; rows with no faithful equivalent are refused
with their line and reason, never dropped."""

from __future__ import annotations

import json

import pytest

from roll_pipeline.data.roll_rows import RowRefused, convert_row, import_rows
from roll_pipeline.driver.cli import main
from workers.rewards.sandbox.formats import CallTests, CheckedTests, StdioTests, parse_test_cases

MESSAGES = json.dumps([{"role": "user", "content": "Write square(x), or a program squaring the number it reads."}])
RIGHT = "```python\ndef square(x):\n    return x * x\n\nif __name__ == '__main__':\n    import sys\n    data = sys.stdin.read().split()\n    if data:\n        print(int(data[0]) ** 2)\n```"
WRONG = RIGHT.replace("x * x", "x + x").replace("** 2", "* 2")


def roll_row(case_type: str, cases: list, **extra) -> dict:
    return {"id": f"r-{case_type}", "domain": "code_sandbox", "tag": "t", "messages": MESSAGES, "ground_truth": "",
            "case_type": case_type, "test_cases": json.dumps(cases), "test_case_function": "", **extra}


CASES = {
    "assert": [{"assert_code": "assert square(2) == 4"}, {"assert_code": "assert square(-3) == 9"}],
    "pytest": [{"assert_code": "def test_square():\n    assert square(2) == 4\n\n\ndef test_negative():\n    assert square(-3) == 9\n"}],
    "check_based": [{"assert_code": "def check(candidate):\n    assert candidate(2) == 4\n    assert candidate(-3) == 9\n",
                     "entry_point": "square", "import_prefix": "import math\n"}],
    "input": [{"stdin": "2\n", "expected_stdout": "4\n"}, {"stdin": "-3\n", "expected_stdout": "9\n"}],
}
SHAPES = {"assert": CheckedTests, "pytest": CheckedTests, "check_based": CheckedTests, "input": StdioTests}


@pytest.mark.parametrize("case_type", list(CASES))
def test_each_case_type_becomes_a_sandbox_test_shape(case_type):
    row = convert_row(json.loads(json.dumps(roll_row(case_type, CASES[case_type]))))  # strings as a file gives them
    assert row["messages"] == json.loads(MESSAGES) and row["id"] == f"r-{case_type}" and row["tag"] == "t"
    assert "case_type" not in row and "test_case_function" not in row
    suite = parse_test_cases(row["test_cases"])
    assert isinstance(suite, SHAPES[case_type]) and not isinstance(suite, CallTests)
    if case_type == "pytest":  # the functions are defined, then called by name
        assert suite.tests[0].rstrip().endswith("test_square()\ntest_negative()")
    if case_type == "check_based":
        assert (suite.entry_point, suite.setup) == ("square", "import math\n")


def test_the_imported_tests_pass_a_right_program_and_fail_a_wrong_one_in_the_sandbox():
    from workers.rewards.code_sandbox import CodeSandboxScorer
    from workers.rewards.sandbox.layers import IsolationUnavailable

    try:
        scorer = CodeSandboxScorer(timeout_s=5.0)
    except IsolationUnavailable as err:
        pytest.skip(f"this host cannot isolate the sandbox: {err}")
    try:
        for case_type, cases in CASES.items():
            row = convert_row(roll_row(case_type, cases))
            right = scorer.score(RIGHT, row["ground_truth"], test_cases=row["test_cases"])
            wrong = scorer.score(WRONG, row["ground_truth"], test_cases=row["test_cases"])
            assert (right.correct, right.score) == (True, 1.0), (case_type, right)
            assert not wrong.correct and wrong.score < 1.0, (case_type, wrong)
    finally:
        scorer.close()


@pytest.mark.parametrize(
    "row,reason",
    [
        (roll_row("text", [{"assert_code": "assert 'yes' in {response}"}]), "text cases check the response's text"),
        (roll_row("pytest", [{"assert_code": "def test_x(tmp_path):\n    assert square(2) == 4\n"}]),
         "test_x takes fixtures or parameters"),
        (roll_row("pytest", [{"assert_code": "import pytest\n@pytest.mark.parametrize('a', [1])\ndef test_y():\n    pass\n"}]),
         "test_y takes fixtures or parameters"),
        (roll_row("pytest", [{"assert_code": "assert square(2) == 4"}]), "a pytest case defines no test_ function"),
        (roll_row("check_based", [{"assert_code": "def check(candidate): pass"}]), "needs its entry_point"),
        (roll_row("input", [{"stdin": "2\n"}]), "needs stdin and expected_stdout"),
        (roll_row("sql", [{"assert_code": "x"}]), "unknown case_type 'sql'"),
        (roll_row("abc", [{"assert_code": "x"}]), "unknown case_type 'abc'"),
        (roll_row("bogus", [{"assert_code": "x"}]), "unknown case_type 'bogus'"),
        (roll_row("xyz", [{"assert_code": "x"}]), "unknown case_type 'xyz'"),
        (roll_row("assert", [{"assert_code": 5}]), "a assert case without assert_code"),
        (roll_row("assert", [{"assert_code": "  "}]), "a assert case without assert_code"),
        (roll_row("pytest", [{"assert_code": "def test_x(:\n    pass\n"}]), "a pytest case does not parse"),
        (roll_row("pytest", [{"assert_code": "def test_k(*, a):\n    pass\n"}]), "test_k takes fixtures or parameters"),
        (roll_row("pytest", [{"assert_code": "def test_p(a, /):\n    pass\n"}]), "test_p takes fixtures or parameters"),
        (roll_row("check_based", CASES["check_based"] * 2), "a check_based row holds one case"),
        (roll_row("check_based", ["def check(candidate): pass"]), "a check_based row holds one case"),
        (roll_row("check_based", [{"assert_code": "def check(candidate): pass", "entry_point": 5}]), "needs its entry_point"),
        (roll_row("assert", CASES["assert"], messages='[{"role": "user"}]'), "messages must be a list of {role, content}"),
        (roll_row("assert", CASES["assert"], messages="{}"), "messages must be a list of {role, content}"),
        (roll_row("assert", []), "test_cases must be a non-empty list"),
        (roll_row("assert", CASES["assert"], test_case_function="square"), "test_case_function"),
        (roll_row("assert", CASES["assert"], messages="[not json"), "messages is not valid JSON"),
    ],
)
def test_rows_without_a_faithful_equivalent_are_refused_with_the_reason(row, reason):
    with pytest.raises(RowRefused, match=None) as info:
        convert_row(row)
    assert reason in str(info.value)


def test_rows_without_tests_keep_their_columns():
    row = {"id": "m1", "domain": "math_rule", "messages": MESSAGES, "ground_truth": "4", "difficulty": "easy"}
    assert convert_row(row) == {**row, "messages": json.loads(MESSAGES)}
    assert convert_row({"prompt": "What is 2+2?", "ground_truth": "4"}) == {"prompt": "What is 2+2?", "ground_truth": "4"}
    with pytest.raises(RowRefused, match="neither messages nor a prompt"):
        convert_row({"ground_truth": "4"})


def test_the_command_writes_the_rows_counts_each_case_type_and_keeps_every_refused_row(tmp_path, capsys):
    rows = [roll_row("assert", CASES["assert"]), roll_row("text", [{"assert_code": "x"}]),
            {"id": "m", "messages": MESSAGES, "ground_truth": "4"}, roll_row("input", CASES["input"])]
    source = tmp_path / "roll.jsonl"
    source.write_text("\n".join(json.dumps(r) for r in rows[:2]) + "\n\n" + "\n".join(json.dumps(r) for r in rows[2:]) + "\n")
    out = tmp_path / "out" / "rows.jsonl"
    assert main(["data", "import", str(source), "-o", str(out)]) == 1
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in written] == ["r-assert", "m", "r-input"]
    refused = [json.loads(line) for line in out.with_suffix(".refused.jsonl").read_text().splitlines()]
    assert [(r["line"], r["row"]["id"]) for r in refused] == [(2, "r-text")]  # its line in the file
    assert "text cases check the response's text" in refused[0]["reason"]
    printed = capsys.readouterr()
    table = {line.split()[0]: line.split()[1:] for line in printed.out.splitlines()[1:] if line.split()[0] != "3"}
    assert table == {"assert": ["1", "0"], "input": ["1", "0"], "none": ["1", "0"], "text": ["0", "1"]}
    assert f"{source}:2: text cases" in printed.err and "1 rows refused" in printed.err

    source.write_text(json.dumps(rows[0]) + "\n")
    assert main(["data", "import", str(source), "-o", str(out)]) == 0
    source.write_text("{not json}\n")
    assert main(["data", "import", str(source), "-o", str(out)]) == 2
    assert f"{source}:1: not a JSON object" in capsys.readouterr().err


def test_import_rows_counts_rows_without_a_case_type_as_none():
    _, refused, report = import_rows([(1, {"prompt": "p"}), (2, {"ground_truth": "x"})])
    assert report.converted == {"none": 1} and report.refused == {"none": 1} and refused == [(2, {"ground_truth": "x"})]

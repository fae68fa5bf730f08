"""`roll rewards list` and `roll rewards score`, driven in-process through main(argv)."""

from __future__ import annotations

import io
import json

import pytest

from roll_pipeline.driver.cli import main
from roll_pipeline.driver.reward_commands import parse_assignments, read_value

ECHO = "tests.test_reward_worker:EchoScorer"


def score(capsys, *argv: str) -> tuple[int, dict | None, str]:
    code = main(["rewards", "score", *argv])
    captured = capsys.readouterr()
    return code, (json.loads(captured.out) if captured.out.strip() else None), captured.err


def test_list_shows_the_built_in_workers(capsys):
    assert main(["rewards", "list"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split() == ["NAME", "SOURCE", "CLASS"]
    assert any(
        line.split() == ["math_rule", "built-in", "workers.rewards.math_rule:MathRuleScorer"]
        for line in out.splitlines()
    )
    assert "package.module:Class" in out


def test_score_prints_one_json_object_with_the_stable_keys(capsys):
    code, result, err = score(
        capsys, "math_rule", "--response", "So \\boxed{\\frac{1}{2}}", "--ground-truth", "0.5"
    )
    assert code == 0 and err == ""
    assert list(result) == ["score", "correct", "masked", "metrics"]
    assert result == {
        "score": 1.0,
        "correct": True,
        "masked": False,
        "metrics": {"answer_found": 1.0, "format_ok": 1.0},
    }


def test_score_reads_files_stdin_and_fields(tmp_path, capsys, monkeypatch):
    (tmp_path / "response.txt").write_text("<think>2+2</think>\nThe answer is 4.\n")
    (tmp_path / "truth.txt").write_text("4\n")
    code, result, _ = score(
        capsys,
        "math_rule",
        "--response",
        f"@{tmp_path / 'response.txt'}",
        "--ground-truth",
        f"@{tmp_path / 'truth.txt'}",
    )
    assert code == 0 and result["correct"] is True
    monkeypatch.setattr("sys.stdin", io.StringIO("abc"))
    code, result, _ = score(capsys, ECHO, "--response", "@-", "--ground-truth", "abc", "--field", "tag=x")
    assert code == 0 and result["score"] == 1.0 and result["metrics"]["length"] == 3
    code, result, _ = score(capsys, ECHO, "--response", "@@x", "--ground-truth", "@@x")
    assert code == 0 and result["correct"] is True and result["metrics"]["length"] == 2  # the literal "@x"


def test_score_options_are_yaml_values(capsys):
    response = "The answer is 12. Checking with the formula: \\boxed{13}"
    assert score(capsys, "math_rule", "--response", response, "--ground-truth", "12")[1]["correct"] is False
    code, result, _ = score(
        capsys,
        "math_rule",
        "--response",
        response,
        "--ground-truth",
        "12",
        "--option",
        "extract_order=[answer_phrase, boxed]",
        "--option",
        "format_score=0.5",
    )
    assert code == 0 and result["correct"] is True and result["score"] == 1.5


@pytest.mark.parametrize(
    ("fields", "reason", "in_stderr"),
    [
        (["mode=none"], "not_applicable", ""),
        (["mode=raise"], "error", "RuntimeError: judge unreachable"),
        (["mode=exit"], "crash", "exit code 3"),
    ],
)
def test_a_masked_sample_says_why(capsys, caplog, fields, reason, in_stderr):
    """The reason on stderr; the details in the worker's warning log, which the command shows on stderr (here
    pytest captures the log)."""
    argv = ["--response", "a", "--ground-truth", "a"] + [arg for f in fields for arg in ("--field", f)]
    code, result, err = score(capsys, ECHO, *argv)
    assert code == 0
    assert result == {"score": None, "correct": None, "masked": True, "metrics": {}}
    assert f"masked: {reason}" in err and in_stderr in caplog.text


def test_a_pathological_verification_is_cut_at_the_timeout(capsys):
    code, result, err = score(
        capsys, "math_rule", "--response", "\\boxed{10^{10^{10}}}", "--ground-truth", "4", "--timeout-s", "2"
    )
    assert code == 0 and result["masked"] is True and "masked: timeout" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["no_such_worker", "--response", "a", "--ground-truth", "a"],
            "unknown reward worker 'no_such_worker'",
        ),
        (["math_rule", "--response", "@/no/such/file", "--ground-truth", "a"], "cannot read /no/such/file"),
        (["math_rule", "--response", "a", "--ground-truth", "a", "--field", "novalue"], "key=value"),
        (
            ["math_rule", "--response", "a", "--ground-truth", "a", "--field", "response=b"],
            "--field cannot set",
        ),
        (["math_rule", "--response", "a", "--ground-truth", "a", "--option", "tolerance=1"], "tolerance"),
        (["math_rule", "--response", "a", "--ground-truth", "a", "--timeout-s", "0"], "--timeout-s"),
        (
            ["tests.test_reward_worker:BrokenWarmUpScorer", "--response", "a", "--ground-truth", "a"],
            "judge_client",
        ),
    ],
)
def test_errors_exit_2_with_one_message(capsys, argv, message):
    assert main(["rewards", "score", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("error: ") and message in captured.err


def test_read_value_and_parse_assignments(tmp_path):
    (tmp_path / "v.txt").write_text("from file")
    assert read_value("plain") == "plain"
    assert read_value("@@at") == "@at"
    assert read_value(f"@{tmp_path / 'v.txt'}") == "from file"
    assert parse_assignments(["a=1", "b=x=y", f"c=@{tmp_path / 'v.txt'}"], "--field") == {
        "a": "1",
        "b": "x=y",
        "c": "from file",
    }
    with pytest.raises(ValueError, match="given twice"):
        parse_assignments(["a=1", "a=2"], "--field")

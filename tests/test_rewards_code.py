"""The code_sandbox scorer: real subprocesses, short timeouts."""

from __future__ import annotations

import json
import time

import pytest

from workers.rewards.code_sandbox import CodeSandboxScorer, extract_code, parse_test_cases

TESTS = json.dumps({"asserts": ["assert square(2) == 4", "assert square(3) == 9", "assert square(-1) == 1"]})
CORRECT = "def square(x):\n    return x * x\n"


@pytest.fixture(scope="module")
def scorer() -> CodeSandboxScorer:
    return CodeSandboxScorer(timeout_s=2.0)


def metrics(pass_rate, syntax_error=0.0, timeout=0.0, runtime_error=0.0):
    return {
        "pass_rate": pass_rate,
        "syntax_error": syntax_error,
        "timeout": timeout,
        "runtime_error": runtime_error,
    }


def test_correct_solution(scorer):
    result = scorer.score(CORRECT, "", test_cases=TESTS)
    assert (result.score, result.correct, result.metrics) == (1.0, True, metrics(1.0))


def test_wrong_answer_scores_the_fraction_passed(scorer):
    result = scorer.score("def square(x):\n    return x + x\n", "", test_cases=TESTS)
    assert result.score == pytest.approx(1 / 3)
    assert not result.correct
    assert result.metrics == metrics(pytest.approx(1 / 3))


def test_all_or_nothing_mode():
    scorer = CodeSandboxScorer(timeout_s=2.0, reward_mode="all_or_nothing")
    assert scorer.score("def square(x):\n    return x + x\n", "", test_cases=TESTS).score == 0.0
    assert scorer.score(CORRECT, "", test_cases=TESTS).score == 1.0


def test_syntax_error(scorer):
    result = scorer.score("def square(x) return x * x", "", test_cases=TESTS)
    assert (result.score, result.correct, result.metrics) == (0.0, False, metrics(0.0, syntax_error=1.0))


def test_runtime_error_in_a_test_is_counted(scorer):
    code = "def square(x):\n    if x < 0:\n        raise ValueError('negative')\n    return x * x\n"
    result = scorer.score(code, "", test_cases=TESTS)
    assert result.score == pytest.approx(2 / 3)
    assert result.metrics["runtime_error"] == 1.0


def test_infinite_loop_is_killed_at_the_timeout():
    scorer = CodeSandboxScorer(timeout_s=1.0)
    start = time.monotonic()
    result = scorer.score("def square(x):\n    while True:\n        pass\n", "", test_cases=TESTS)
    assert time.monotonic() - start < 3.0
    assert (result.score, result.metrics) == (0.0, metrics(0.0, timeout=1.0))


def test_endless_output_is_bounded_and_times_out():
    scorer = CodeSandboxScorer(timeout_s=1.0)
    result = scorer.score("while True:\n    print('x' * 10000)\n", "", test_cases=TESTS)
    assert result.metrics["timeout"] == 1.0


@pytest.mark.parametrize(
    "code",
    [
        "import os\nwhile True:\n    os.fork()\n",
        "import os\ndef square(x):\n    os.fork()\n    return x * x\n",
        "import subprocess\nsubprocess.run(['sh', '-c', ':(){ :|:& };:'])\ndef square(x):\n    return x * x\n",
        "import os\nos.system('yes > /dev/null')\ndef square(x):\n    return x * x\n",
        "x = bytearray(4 * 1024 ** 3)\ndef square(x):\n    return x * x\n",
    ],
    ids=["fork-bomb", "fork-in-function", "subprocess", "os-system", "memory"],
)
def test_process_and_memory_exhaustion_is_refused(scorer, code):
    start = time.monotonic()
    result = scorer.score(code, "", test_cases=TESTS)
    assert time.monotonic() - start < 2.0
    assert result.score == 0.0
    assert result.metrics["runtime_error"] == 1.0


def test_resource_limits_are_applied(scorer):
    code = "import resource\n"
    asserts = [
        "assert resource.getrlimit(resource.RLIMIT_AS)[0] == 512 * 1024 * 1024",
        "assert resource.getrlimit(resource.RLIMIT_NPROC)[0] == 0",
        "assert 0 < resource.getrlimit(resource.RLIMIT_CPU)[0] <= 4",
        "assert resource.getrlimit(resource.RLIMIT_FSIZE)[0] > 0",
        "import os\nassert 'PATH' not in os.environ and 'HOME' not in os.environ",
        "import sys\nassert sys.stdin is None or sys.stdin.read() == ''",
    ]
    result = scorer.score(code, "", test_cases=json.dumps({"asserts": asserts}))
    assert result.metrics == metrics(1.0)


def test_solution_cannot_see_the_payload(scorer):
    code = "import os\nFILES = os.listdir('.')\n"
    result = scorer.score(code, "", test_cases=json.dumps({"asserts": ["assert FILES == []"]}))
    assert result.correct


def test_fake_summary_line_does_not_pass(scorer):
    fake = json.dumps({"syntax_error": False, "runtime_error": False, "passed": [True, True, True]})
    code = (
        "import os, sys\n"
        f"for marker in ('', '@@roll-sandbox-result:' + '0' * 32 + '@@'):\n"
        f"    print(marker + {fake!r})\n"
        "sys.stdout.flush()\n"
        "os._exit(0)\n"
    )
    result = scorer.score(code, "", test_cases=TESTS)
    assert (result.score, result.correct) == (0.0, False)


def test_early_exit_does_not_pass(scorer):
    result = scorer.score("import sys\nsys.exit(0)\n", "", test_cases=TESTS)
    assert (result.score, result.metrics["runtime_error"]) == (0.0, 1.0)


def test_fenced_code_is_extracted(scorer):
    response = (
        "Here is my solution:\n\n```python\ndef square(x):\n    return x * x\n```\n\n"
        "It multiplies x by itself, e.g. `square(3)` is 9."
    )
    assert scorer.score(response, "", test_cases=TESTS).correct


@pytest.mark.parametrize(
    ("response", "code"),
    [
        ("```python\na = 1\n```\ntext\n```python\nb = 2\n```", "b = 2\n"),
        ("```py\na = 1\n```", "a = 1\n"),
        ("```\na = 1\n```", "a = 1\n"),
        ("```text\nout\n```\n```python\na = 1\n```", "a = 1\n"),
        ("a = 1", "a = 1"),
    ],
)
def test_extract_code(response, code):
    assert extract_code(response) == code


@pytest.mark.parametrize(
    "test_cases", [None, "", "not json", "[]", '{"asserts": []}', '{"asserts": [1]}', "{}"]
)
def test_missing_or_invalid_test_cases_is_not_applicable(scorer, test_cases, caplog):
    fields = {} if test_cases is None else {"test_cases": test_cases}
    assert scorer.score(CORRECT, "", id="sample-7", **fields) is None
    assert "test_cases" in caplog.text and "sample-7" in caplog.text


def test_parse_test_cases_accepts_a_decoded_dict():
    assert parse_test_cases({"asserts": ["assert True"]}) == ["assert True"]


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"timeout": 3}, TypeError, "timeout"),
        ({"reward_mode": "best_of"}, ValueError, "reward_mode"),
        ({"timeout_s": 0}, ValueError, "timeout_s"),
        ({"memory_mb": 1}, ValueError, "memory_mb"),
    ],
)
def test_bad_options_are_named(options, error, match):
    with pytest.raises(error, match=match):
        CodeSandboxScorer(**options)

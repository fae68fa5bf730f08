"""The code_sandbox scorer: test formats, judging rules, options, the isolation check, and 54 real tasks.

Hostile programs are in test_code_sandbox_hostile.py, remote mode in test_code_sandbox_remote.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import pytest

from workers.rewards import code_sandbox
from workers.rewards.code_sandbox import CodeSandboxScorer
from workers.rewards.sandbox.cgroup import creator, locate
from workers.rewards.sandbox.formats import (
    CallTests,
    CheckedTests,
    StdioTests,
    extract_code,
    parse_test_cases,
)
from workers.rewards.sandbox.layers import LAYERS, IsolationUnavailable
from workers.rewards.sandbox.process import EXITED, TIMEOUT, RunOutput
from workers.rewards.sandbox.verdicts import (
    UnsupportedTest,
    error_kind,
    judge_calls,
    judge_checked,
    judge_stdio,
    module_failure,
    stdout_matches,
    values_match,
)

TASKS = [json.loads(line) for line in (Path(__file__).parent / "fixtures" / "code_tasks.jsonl").open()]
SQUARE_TESTS = json.dumps(
    {"asserts": ["assert square(2) == 4", "assert square(3) == 9", "assert square(-1) == 1"]}
)
SQUARE = "def square(x):\n    return x * x\n"


def failure(result) -> str | None:
    """The first failure kind a result's metrics mark, or None."""
    kinds = [k for k, v in result.metrics.items() if k != "pass_rate" and v == 1.0]
    assert len(kinds) <= 1
    return kinds[0] if kinds else None


@pytest.fixture(scope="module")
def scorer():
    try:
        scorer = CodeSandboxScorer(timeout_s=2.0)
    except IsolationUnavailable as err:
        pytest.skip(f"this host cannot isolate the sandbox: {err}")
    yield scorer
    scorer.close()


# ---- formats ----


@pytest.mark.parametrize(
    ("response", "code"),
    [
        ("```python\na = 1\n```\ntext\n```python\nb = 2\n```", "b = 2\n"),
        ("```py\na = 1\n```", "a = 1\n"),
        ("```\na = 1\n```", "a = 1\n"),
        ("```\na = 1\n```\n```\nb = 2\n```", "b = 2\n"),
        ("```text\nout\n```\n```python\na = 1\n```", "a = 1\n"),
        ("a = 1", "a = 1"),
    ],
)
def test_extract_code(response, code):
    assert extract_code(response) == code


def test_parse_the_four_formats():
    asserts = parse_test_cases({"asserts": ["assert f(2) == 4"], "setup": "import math"})
    check = parse_test_cases({"test": "def check(candidate):\n    assert candidate(1)", "entry_point": "f"})
    calls = parse_test_cases('{"fn_name": "f", "inputs": [[2], [3]], "outputs": [4, 9]}')
    stdio = parse_test_cases('{"inputs": ["1 2\\n"], "outputs": ["3\\n"]}')
    assert asserts == CheckedTests(("assert f(2) == 4",), setup="import math")
    assert check == CheckedTests(("def check(candidate):\n    assert candidate(1)",), entry_point="f")
    assert calls == CallTests("f", ("[2]", "[3]"), (4, 9))
    assert stdio == StdioTests(("1 2\n",), ("3\n",))


@pytest.mark.parametrize(
    ("test_cases", "message"),
    [
        ("not json", "not JSON"),
        ("[]", "JSON object"),
        ('{"asserts": []}', "non-empty list"),
        ('{"asserts": [1]}', "non-empty list"),
        ('{"asserts": ["  "]}', "non-empty strings"),
        ('{"asserts": ["assert f(1)", "assert ("]}', r"asserts\[1\] is not valid Python: .* \(line 1: 'assert \('\)$"),
        # A compiler error without a source line (text None): named by its line number alone.
        ('{"asserts": ["return 1"]}', r"asserts\[0\] is not valid Python: 'return' outside function \(line 1\)$"),
        ('{"asserts": ["assert f(1)"], "setup": "def ("}', "setup is not valid Python"),
        ('{"asserts": ["assert f(1)"], "setup": 3}', "setup must be a string"),
        ('{"test": "x = 1", "entry_point": "f"}', "top-level function check"),
        ('{"test": "def checker(c):\\n    pass", "entry_point": "f"}', "top-level function check"),
        ('{"test": "def cheap(c):\\n    pass", "entry_point": "f"}', "top-level function check"),
        ('{"test": "def check(c):\\n    pass"}', "entry_point"),
        ('{"test": "def check(c):\\n    pass", "entry_point": "a b"}', "entry_point"),
        ('{"test": 5, "entry_point": "f"}', "defining check"),
        ("{}", "needs"),
        ('{"inputs": ["1"], "outputs": []}', "1 inputs but 0 outputs"),
        ('{"inputs": ["1"], "outputs": ["1", "2"]}', "1 inputs but 2 outputs"),
        ('{"inputs": [], "outputs": []}', "needs"),
        ('{"inputs": "1", "outputs": ["1"]}', "needs"),
        ('{"inputs": ["1"], "outputs": "1"}', "needs"),
        ('{"fn_name": "f x", "inputs": [[1]], "outputs": [1]}', "identifier"),
        ('{"fn_name": "f", "inputs": [1], "outputs": [1]}', "list of arguments"),
        ('{"inputs": [1], "outputs": ["1"]}', "must be strings"),
    ],
)
def test_invalid_test_cases_are_named(test_cases, message):
    with pytest.raises(ValueError, match=message):
        parse_test_cases(test_cases)


def test_many_tests_parse_and_suites_are_frozen():
    # 300 of each: equal lengths past the small ints CPython caches must still compare equal.
    stdio = parse_test_cases({"inputs": ["x"] * 300, "outputs": ["x"] * 300})
    assert len(stdio.inputs) == len(stdio.outputs) == 300
    calls = parse_test_cases({"fn_name": "f", "inputs": [[1]], "outputs": [1]})
    checked = parse_test_cases({"asserts": ["assert f(1)"]})
    for suite, field in ((stdio, "inputs"), (calls, "fn_name"), (checked, "tests")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(suite, field, None)


def test_expected_values_never_go_into_the_programs_job(scorer, monkeypatch):
    jobs = []
    pool = scorer._executor_here()
    monkeypatch.setattr(
        pool, "run_checked", lambda program, checker, timeout_s: jobs.append(program) or ["passed"]
    )
    tests = {"asserts": ["x = [5, 6]\nassert f(x) == 'expected-99'"], "setup": "SECRET = 123456789"}
    assert scorer.score("def f(x): return 1", "", test_cases=json.dumps(tests)).correct
    (program,) = jobs
    assert set(program) == {"mode", "code", "limits"} and program["mode"] == "serve"
    assert "expected-99" not in json.dumps(program) and "123456789" not in json.dumps(program)


# ---- judging rules (pure) ----


@pytest.mark.parametrize(
    ("actual", "expected", "match"),
    [
        (4, 4, True),
        (4.0, 4, True),
        (4.0000001, 4, False),
        (8888889.0, 8888888, False),
        (4000001.0, 4000000, False),
        (float("inf"), 4, False),
        (4.0000001, 4.0, True),
        (4, 4.0, True),
        (5, 4, False),
        (True, 1, False),
        (1, True, False),
        ((1, 2), [1, 2], True),
        ([1, [2, 3.0000000001]], [1, [2, 3.0]], True),
        ([1, [2, 3.0000000001]], [1, [2, 3]], False),
        ([1, 2], [1, 2, 3], False),
        ({"a": 1}, {"a": 1}, True),
        ({1: 1}, {"1": 1}, False),
        ("a", "a", True),
        (None, None, True),
        (0, None, False),
        (float("nan"), 1.0, False),
        (10**18 + 1, 10**18, False),
        ({1, 2}, [1, 2], False),
        (3, 4, False),
        (3.0, 4, False),
        (10**400, 1.5, False),
        ([1, 2, 3], [1, 2], False),
        (list(range(300)), list(range(300)), True),
        ({"a": 1, "b": 2}, {"a": 1}, False),
        ({"a": 1}, {"a": 1, "b": 2}, False),
        # not a JSON value: nothing matches it
        ((1, 2), (1, 2), False),
    ],
)
def test_values_match(actual, expected, match):
    assert values_match(actual, expected, 1e-6) is match


@pytest.mark.parametrize(
    ("got", "want", "match"),
    [
        ("3\n", "3\n", True),
        ("3", "3\n", True),
        ("3   \n\n\n", "3\n", True),
        ("1  2\n", "1 2\n", True),
        ("0.3333333\n", "0.333333333\n", True),
        ("0.34\n", "0.333333333\n", False),
        ("1000000000000000001\n", "1000000000000000000\n", False),
        ("8888889.0\n", "8888888\n", False),
        ("4000001.0\n", "4000000\n", False),
        ("8888888.0\n", "8888888\n", True),
        ("3e0\n", "3\n", True),
        ("nan\n", "3\n", False),
        ("3.5\n", "3\n", False),
        ("7" * 5000 + "\n", "7" * 5000 + "\n", True),
        ("7" * 4999 + "8\n", "7" * 5000 + "\n", False),
        ("-" + "7" * 5000, "7" * 5000, False),
        (" 3\n", "3\n", True),
        ("3\n4\n", "3\n", False),
        ("yes\n", "YES\n", False),
        ("", "\n", True),
        ("3\n", "3\n\n\n", True),
        ("3\n" * 300, "3\n" * 300, True),
        ("1 2\n", "1 2 3\n", False),
        ("1 2 3\n", "1 2\n", False),
        (" ".join(["1.0"] * 300), " ".join(["1"] * 300), True),
        # a word equal to the expected one, on a line that differs elsewhere
        ("yes 1.0\n", "yes 1\n", True),
    ],
)
def test_stdout_matches(got, want, match):
    assert stdout_matches(got, want, 1e-6) is match


def calls_output(*events, status=EXITED):
    return RunOutput(status=status, events=list(events), exit_code=0)


def test_judge_calls_from_reports():
    suite = CallTests("f", ("[1]", "[2]", "[3]", "[4]", "[5]"), (1, 2, 3, 4, 5))
    output = calls_output(
        {"t": 0, "v": 1},
        {"t": 1, "v": 7},
        {"t": 2, "e": "MemoryError"},
        {"t": 3, "v": 4},
        {"t": 3, "v": 4},
        status=TIMEOUT,
    )
    assert judge_calls(suite, output, 1e-6) == [
        "passed",
        "wrong_answer",
        "memory_limit",
        "wrong_answer",
        "timeout",
    ]


def test_judge_calls_module_failures():
    suite = CallTests("f", ("[1]",), (1,))
    assert judge_calls(suite, calls_output({"ev": "syntax_error"}), 1e-6) == ["syntax_error"]
    assert judge_calls(suite, calls_output({"ev": "module_error", "error": "SystemExit"}), 1e-6) == [
        "runtime_error"
    ]
    assert judge_calls(suite, calls_output({"t": 0, "v": {"__t": "weird", "v": []}}), 1e-6) == [
        "wrong_answer"
    ]


def test_judge_checked_takes_the_checkers_outcomes():
    assert judge_checked(["passed", "wrong_answer", "timeout", "something else"]) == [
        "passed",
        "wrong_answer",
        "timeout",
        "runtime_error",
    ]
    with pytest.raises(UnsupportedTest, match="cannot send a value of type function"):
        judge_checked(["passed", "unsupported: cannot send a value of type function"])


def test_judge_stdio_needs_a_clean_end():
    ok = {"ev": "exit", "ok": True, "error": None}
    assert judge_stdio("3\n", RunOutput(EXITED, stdout=b"3\n", events=[ok], exit_code=0), 1e-6) == "passed"
    crashed = {"ev": "exit", "ok": False, "error": "ValueError"}
    assert judge_stdio("3\n", RunOutput(EXITED, stdout=b"3\n", events=[crashed], exit_code=0), 1e-6) == (
        "runtime_error"
    )
    assert judge_stdio("3\n", RunOutput(EXITED, stdout=b"3\n", events=[ok, crashed], exit_code=0), 1e-6) == (
        "runtime_error"
    )
    assert judge_stdio("3\n", RunOutput(EXITED, stdout=b"3\n", exit_code=0), 1e-6) == "passed"
    assert judge_stdio("3\n", RunOutput(EXITED, stdout=b"3\n", exit_code=137), 1e-6) == "runtime_error"
    assert judge_stdio("3\n", RunOutput(TIMEOUT, stdout=b"3\n"), 1e-6) == "timeout"


def channel(line: str) -> dict:
    """An event as the worker reads it: parsed from the channel, so its strings are never interned literals."""
    return json.loads(line)


def test_failure_kinds_of_exception_names_as_they_arrive():
    assert error_kind(channel('"MemoryError"')) == "memory_limit"
    assert error_kind(channel('"Unreportable"')) == "wrong_answer"
    assert error_kind("IndexError") == "runtime_error"
    assert error_kind(None) == "runtime_error"
    assert module_failure(channel('{"ev": "module_error", "error": "MemoryError"}')) == "memory_limit"
    assert module_failure(channel('{"ev": "syntax_error"}')) == "syntax_error"
    assert module_failure(channel('{"ev": "exit", "ok": true}')) is None


def test_a_call_without_a_report_failed_as_the_run_ended():
    suite = CallTests("f", ("[1]",), (1,))
    killed = RunOutput(status=EXITED, events=[], exit_code=-9, oom_killed=True)
    assert judge_calls(suite, killed, 1e-6) == ["memory_limit"]
    assert judge_calls(suite, dataclasses.replace(killed, oom_killed=False), 1e-6) == ["runtime_error"]


def test_reports_for_calls_that_were_not_made_are_dropped():
    suite = CallTests("f", ("[1]", "[2]"), (1, 2))
    # A program writing reports of its own: numbered before, at and past the end of the suite.
    for forged in (-1, 2, 7):
        output = calls_output({"t": 0, "v": 1}, {"t": 1, "v": 2}, {"t": forged, "v": 2})
        assert judge_calls(suite, output, 1e-6) == ["passed", "passed"], forged


def test_a_value_that_cannot_be_rebuilt_fails_its_call_only():
    suite = CallTests("f", ("[1]", "[2]"), (1, 2))
    output = calls_output({"t": 0, "v": {"__t": "weird", "v": []}}, {"t": 1, "v": 2})
    assert judge_calls(suite, output, 1e-6) == ["wrong_answer", "passed"]


def test_unsupported_tests_say_why():
    with pytest.raises(UnsupportedTest, match="^cannot send a value of type function$"):
        judge_checked(["unsupported: cannot send a value of type function"])
    with pytest.raises(UnsupportedTest, match="^unsupported$"):
        judge_checked(["unsupported"])
    # An outcome the worker does not know is a runtime error, whatever it sorts next to.
    assert judge_checked(["an unknown outcome", "zzz"]) == ["runtime_error", "runtime_error"]


def test_judge_stdio_reads_the_exit_report():
    def judged(*events, exit_code=0):
        return judge_stdio("3\n", RunOutput(EXITED, stdout=b"3\n", events=list(events), exit_code=exit_code), 1e-6)

    assert judged(channel('{"ev": "exit", "ok": true, "error": null}')) == "passed"
    assert judged(channel('{"ev": "exit", "ok": false, "error": "MemoryError"}')) == "memory_limit"
    # `ok` must be true itself, and there must be one report: two are someone else's writing
    assert judged({"ev": "exit", "ok": 1}) == "runtime_error"
    assert judged({"ev": "exit"}) == "runtime_error"
    assert judged({"ev": "exit", "ok": False, "error": "MemoryError"}, {"ev": "exit", "ok": True}) == (
        "runtime_error"
    )
    # no report, and killed by a signal (a negative exit code)
    assert judged(exit_code=-9) == "runtime_error"


# ---- the scorer, on real sandboxes ----


def test_correct_solution(scorer):
    result = scorer.score(SQUARE, "", test_cases=SQUARE_TESTS)
    assert (result.score, result.correct, failure(result)) == (1.0, True, None)
    assert result.metrics["pass_rate"] == 1.0


def test_wrong_answer_scores_the_fraction_passed(scorer):
    result = scorer.score("def square(x):\n    return x + x\n", "", test_cases=SQUARE_TESTS)
    assert result.score == pytest.approx(1 / 3)
    assert (result.correct, failure(result)) == (False, "wrong_answer")


def test_all_or_nothing_mode(scorer):
    strict = CodeSandboxScorer(timeout_s=2.0, reward_mode="all_or_nothing", pool_size=1, concurrency=1)
    try:
        assert strict.score("def square(x):\n    return x + x\n", "", test_cases=SQUARE_TESTS).score == 0.0
        assert strict.score(SQUARE, "", test_cases=SQUARE_TESTS).score == 1.0
    finally:
        strict.close()


def test_syntax_error(scorer):
    result = scorer.score("def square(x) return x * x", "", test_cases=SQUARE_TESTS)
    assert (result.score, failure(result)) == (0.0, "syntax_error")


def test_runtime_error_in_one_test(scorer):
    code = "def square(x):\n    if x < 0:\n        raise ValueError('negative')\n    return x * x\n"
    result = scorer.score(code, "", test_cases=SQUARE_TESTS)
    assert result.score == pytest.approx(2 / 3)
    assert failure(result) == "runtime_error"


def test_call_based_with_solution_class_and_tolerance(scorer):
    tests = json.dumps({"fn_name": "area", "inputs": [[1], [2]], "outputs": [3.14159265, 12.5663706]})
    code = "import math\nclass Solution:\n    def area(self, r):\n        return math.pi * r * r\n"
    assert scorer.score(code, "", test_cases=tests).correct
    result = scorer.score("def area(r):\n    return 3 * r * r\n", "", test_cases=tests)
    assert (result.score, failure(result)) == (0.0, "wrong_answer")


def test_stdin_stdout(scorer):
    tests = json.dumps({"inputs": ["1 2\n", "5 5\n"], "outputs": ["3\n", "10\n"]})
    code = "a, b = map(int, input().split())\nprint(a + b)\n"
    assert scorer.score(f"Here:\n```python\n{code}```", "", test_cases=tests).correct
    result = scorer.score("print(3)\n", "", test_cases=tests)
    assert (result.score, failure(result)) == (0.5, "wrong_answer")


def test_a_memory_limit_in_one_test_counts_as_that_tests_failure(scorer):
    # memory_limit and output_limit sort before "passed": a comparison by order would count them as passes.
    code = "def square(x):\n    if x == 3:\n        return len([0] * (10 ** 10))\n    return x * x\n"
    result = scorer.score(code, "", test_cases=SQUARE_TESTS)
    assert (result.score, result.correct, failure(result)) == (pytest.approx(2 / 3), False, "memory_limit")


def test_a_suite_of_hundreds_of_tests_that_all_pass_is_correct(scorer):
    # Past 256, counts are distinct int objects: an identity comparison of the counts would call it wrong.
    tests = json.dumps({"fn_name": "square", "inputs": [[i] for i in range(300)], "outputs": [i * i for i in range(300)]})
    result = scorer.score(SQUARE, "", test_cases=tests)
    assert (result.score, result.correct, result.metrics["pass_rate"]) == (1.0, True, 1.0)


def test_the_fraction_mode_named_as_a_config_file_gives_it(scorer):
    # A string read from YAML is not the interned literal of the code: the mode must be compared by value.
    mode = "".join(["frac", "tion"])
    fraction = CodeSandboxScorer(timeout_s=2.0, reward_mode=mode, pool_size=1, concurrency=1)
    try:
        result = fraction.score("def square(x):\n    return x + x\n", "", test_cases=SQUARE_TESTS)
    finally:
        fraction.close()
    assert (result.score, result.correct) == (pytest.approx(1 / 3), False)


def test_a_test_that_cannot_be_run_leaves_the_sample_unscored(scorer, caplog):
    # The test passes a function to the program: no value the checker can send, so the test cannot run as written
    # (not the program's doing: not scored, rather than scored 0).
    tests = json.dumps({"asserts": ["assert apply(lambda v: v + 1, 2) == 3"]})
    code = "def apply(f, x):\n    return f(x)\n"
    assert scorer.score(code, "", test_cases=tests, id="sample-9") is None
    assert "cannot be run" in caplog.text and "sample-9" in caplog.text


def test_the_checker_gets_no_cpu_limit_an_honest_check_could_reach(scorer, monkeypatch):
    """The checker serves up to CHECKER_JOBS checks, each within the sample's wall-clock budget: a lifetime CPU
    limit under their sum could end a later check that did nothing wrong. The program keeps its own limits."""
    from workers.rewards.sandbox.prestarted import CHECKER_JOBS

    executor = scorer._executor_here()
    seen = []
    real = executor.run_checked

    def spy(program, checker, timeout_s=None):
        seen.append((program, checker, timeout_s))
        return real(program, checker, timeout_s)

    monkeypatch.setattr(executor, "run_checked", spy)
    assert scorer.score(SQUARE, "", test_cases=SQUARE_TESTS).correct
    ((program, checker, timeout_s),) = seen
    assert program["limits"] == scorer.limits.for_job()
    assert checker["limits"]["cpu_s"] >= CHECKER_JOBS * scorer.sample_timeout_s
    assert {k: v for k, v in checker["limits"].items() if k != "cpu_s"} == {
        k: v for k, v in program["limits"].items() if k != "cpu_s"
    }
    assert timeout_s == scorer.sample_timeout_s


def _count_calls(monkeypatch, executor, *names):
    calls = {name: 0 for name in names}
    for name in names:
        real = getattr(executor, name)

        def counted(*args, _name=name, _real=real, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(executor, name, counted)
    return calls


@pytest.mark.parametrize(("tests", "batched"), [(1, 0), (2, 1), (3, 1)])
def test_stdin_stdout_suites_of_two_or_more_tests_run_in_one_batched_run(scorer, monkeypatch, tests, batched):
    assert scorer.reuses()  # test_the_probe_sees_every_layer_on_this_host: a zygote pool here
    calls = _count_calls(monkeypatch, scorer._executor_here(), "run", "run_tests")
    suite = json.dumps({"inputs": [f"{i} 1\n" for i in range(tests)], "outputs": [f"{i + 1}\n" for i in range(tests)]})
    assert scorer.score("a, b = map(int, input().split())\nprint(a + b)\n", "", test_cases=suite).correct
    assert calls == {"run": 0 if batched else tests, "run_tests": batched}


def test_without_reused_sandboxes_each_stdin_stdout_test_is_a_run_of_its_own(monkeypatch):
    strict = CodeSandboxScorer(timeout_s=2.0, isolation="strict", pool_size=1, concurrency=1)
    try:
        assert not strict.reuses()
        calls = _count_calls(monkeypatch, strict._executor_here(), "run", "run_tests")
        suite = json.dumps({"inputs": ["1 2\n", "5 5\n", "0 0\n"], "outputs": ["3\n", "10\n", "0\n"]})
        assert strict.score("a, b = map(int, input().split())\nprint(a + b)\n", "", test_cases=suite).correct
    finally:
        strict.close()
    assert calls == {"run": 3, "run_tests": 0}


class _Clock:
    def __init__(self):
        self.now = 100.0

    def monotonic(self):
        return self.now


class _TimedRuns:
    """An executor whose stdin/stdout runs take the given seconds on a fake clock; a run that would pass the
    timeout it is given, or the per-run limit, ends as a timeout at that moment; ``gap_s`` is the worker's own
    time after each run (a preempted thread). Every run's timeout is kept."""

    def __init__(self, clock, durations, per_run_limit_s, gap_s=0.0):
        self.clock, self.durations, self.per_run_limit_s = clock, list(durations), per_run_limit_s
        self.gap_s = gap_s
        self.timeouts: list[float] = []

    def run(self, job, stdin, timeout_s):
        self.timeouts.append(timeout_s)
        took = self.durations[len(self.timeouts) - 1]
        limit = min(timeout_s, self.per_run_limit_s)
        self.clock.now += self.gap_s
        if took > limit:
            self.clock.now += max(limit, 0.0)
            return RunOutput(TIMEOUT)
        self.clock.now += took
        return RunOutput(EXITED, stdout=stdin, exit_code=0)


@pytest.mark.parametrize(
    ("durations", "gap_s", "timeouts", "outcomes"),
    [
        # Each run gets what is left of the sample's 5 s; the fourth has 0.5 s left and needs 1.5.
        ([1.5, 1.5, 1.5, 1.5], 0.0, [5.0, 3.5, 2.0, 0.5], ["passed"] * 3 + ["timeout"]),
        # A test that timed out ends the sample: the rest are timeouts without a run.
        ([0.5, 9.0, 0.5, 0.5], 0.0, [5.0, 4.5], ["passed", "timeout", "timeout", "timeout"]),
        # The budget spent to the last instant: no run is started with nothing left.
        ([2.0, 2.0, 1.0, 0.5], 0.0, [5.0, 3.0, 1.0], ["passed"] * 3 + ["timeout"]),
        # The worker's own time after each run carries the clock past the deadline: no run with less than nothing.
        ([2.0, 2.0, 0.5, 0.5], 0.25, [5.0, 2.75, 0.5], ["passed"] * 3 + ["timeout"]),
    ],
)
def test_stdin_stdout_runs_share_the_samples_budget(monkeypatch, durations, gap_s, timeouts, outcomes):
    """The scorer's own arithmetic, on a fake clock (no duration is measured): each run's timeout is what is left
    of ``sample_timeout_s``, and tests past it are timeouts."""
    clock = _Clock()
    runs = _TimedRuns(clock, durations, per_run_limit_s=2.0, gap_s=gap_s)
    scorer = CodeSandboxScorer(timeout_s=2.0, sample_timeout_s=5.0, isolation="strict", pool_size=1, concurrency=1)
    monkeypatch.setattr(scorer, "_executor_here", lambda: runs)
    monkeypatch.setattr(code_sandbox, "time", clock)
    suite = StdioTests(tuple(f"{i}\n" for i in range(4)), tuple(f"{i}\n" for i in range(4)))
    assert scorer.outcomes(suite, "print(input())") == outcomes
    assert runs.timeouts == timeouts
    monkeypatch.undo()
    scorer.close()


def test_tests_can_come_as_the_ground_truth(scorer):
    # `roll rewards score code_sandbox --response @solution.py --ground-truth @tests.json`
    assert scorer.score(SQUARE, SQUARE_TESTS).correct


def test_limits_are_applied_inside(scorer):
    # Read by the program itself (a stdin/stdout program prints what it sees), not by the test code.
    probe = (
        "import os, resource, sys\n"
        "for name in ('AS', 'NPROC', 'CPU', 'FSIZE', 'NOFILE'):\n"
        "    print(name, resource.getrlimit(getattr(resource, 'RLIMIT_' + name))[0])\n"
        "print('environ', len(os.environ), 'cwd', os.getcwd(), len(os.listdir('.')), 'stdin', repr(sys.stdin.read()))\n"
    )
    expected = (
        f"AS {512 * 1024 * 1024}\nNPROC 16\nCPU 3\nFSIZE {16 * 1024 * 1024}\nNOFILE 64\n"
        "environ 0 cwd /tmp 0 stdin ''\n"
    )
    tests = json.dumps({"inputs": [""], "outputs": [expected]})
    assert scorer.score(probe, "", test_cases=tests).correct


@pytest.mark.parametrize(
    "test_cases", [None, "", "not json", "[]", '{"asserts": []}', '{"asserts": [1]}', "{}"]
)
def test_missing_or_invalid_test_cases_is_not_applicable(scorer, test_cases, caplog):
    fields = {} if test_cases is None else {"test_cases": test_cases}
    assert scorer.score(SQUARE, "def square(x): return x*x", id="sample-7", **fields) is None
    assert "test_cases" in caplog.text and "sample-7" in caplog.text


def test_concurrent_scoring_from_threads(scorer):
    results = {}

    def work(i):
        code = SQUARE if i % 2 else "def square(x):\n    return x + x\n"
        results[i] = scorer.score(code, "", test_cases=SQUARE_TESTS).score

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {i: 1.0 if i % 2 else pytest.approx(1 / 3) for i in range(8)}


def test_scorer_survives_pickling_and_rebuilds_its_pool(scorer):
    import pickle

    copy = pickle.loads(pickle.dumps(scorer))
    try:
        assert copy.score(SQUARE, "", test_cases=SQUARE_TESTS).correct
    finally:
        copy.close()


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"timeout": 3}, TypeError, "timeout"),
        ({"reward_mode": "best_of"}, ValueError, "reward_mode"),
        ({"timeout_s": 0}, ValueError, "timeout_s"),
        ({"sample_timeout_s": -1}, ValueError, "sample_timeout_s"),
        ({"memory_mb": 1}, ValueError, "memory_mb"),
        ({"concurrency": 0}, ValueError, "concurrency"),
        ({"backend": "docker"}, ValueError, "backend"),
        ({"backend": "remote"}, ValueError, "remote_url"),
        ({"allow_missing_layers": ["selinux"]}, ValueError, "unknown layers"),
    ],
)
def test_bad_options_are_named(options, error, match):
    with pytest.raises(error, match=match):
        CodeSandboxScorer(**options)


# ---- the isolation check at start-up ----


def test_the_probe_sees_every_layer_on_this_host(scorer):
    assert scorer.layers.missing == []
    assert scorer.spec.bwrap is not None


def test_refuses_without_bubblewrap_and_names_what_is_missing(monkeypatch):
    monkeypatch.setattr(code_sandbox, "find_bwrap", lambda: None)
    with pytest.raises(IsolationUnavailable) as info:
        CodeSandboxScorer()
    message = str(info.value)
    for layer in ("bubblewrap", "pid_namespace", "network_namespace", "ipc_namespace", "mount_namespace"):
        assert layer in message
    assert "allow_missing_layers" in message and "no `bwrap` on PATH" in message


def test_explicit_opt_out_runs_without_bubblewrap(monkeypatch):
    monkeypatch.setattr(code_sandbox, "find_bwrap", lambda: None)
    weaker = ["bubblewrap", "pid_namespace", "network_namespace", "ipc_namespace", "mount_namespace", "seccomp"]
    scorer = CodeSandboxScorer(timeout_s=2.0, allow_missing_layers=weaker, concurrency=1)
    try:
        assert scorer.spec.bwrap is None
        assert sorted(scorer.layers.missing) == sorted(weaker)
        assert scorer.score(SQUARE, "", test_cases=SQUARE_TESTS).correct
        assert scorer.score("def square(x):\n    return 0\n", "", test_cases=SQUARE_TESTS).score == 0.0
    finally:
        scorer.close()


def test_refuses_when_bubblewrap_cannot_start(monkeypatch):
    # A bwrap that fails the way it does where user namespaces are disabled; world-readable, so that the
    # sandbox user can run it.
    directory = Path(tempfile.mkdtemp(prefix="roll-fake-bwrap-"))
    try:
        directory.chmod(0o755)
        fake = directory / "bwrap"
        fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to create new namespace' >&2\nexit 1\n")
        fake.chmod(0o755)
        monkeypatch.setattr(code_sandbox, "find_bwrap", lambda: str(fake))
        with pytest.raises(IsolationUnavailable) as info:
            CodeSandboxScorer()
    finally:
        shutil.rmtree(directory)
    message = str(info.value)
    assert "bubblewrap:" in message and "mount_namespace:" in message
    assert "No permissions to create new namespace" in message


@pytest.mark.skipif(os.getuid() != 0, reason="only a root worker has to switch to another user")
def test_root_worker_without_a_sandbox_user_is_refused():
    with pytest.raises(IsolationUnavailable, match="unprivileged_user"):
        CodeSandboxScorer(sandbox_user="no-such-user-here")


def test_every_layer_is_documented():
    assert set(LAYERS) == {
        "bubblewrap",
        "unprivileged_user",
        "pid_namespace",
        "network_namespace",
        "ipc_namespace",
        "mount_namespace",
        "empty_environment",
        "memory_cgroup",
        "seccomp",
    }


def test_refuses_without_a_memory_cgroup_and_says_why(monkeypatch):
    monkeypatch.setattr(code_sandbox, "find_memory_cgroups", lambda: (None, "no cgroup hierarchy with memory"))
    with pytest.raises(IsolationUnavailable) as info:
        CodeSandboxScorer()
    message = str(info.value)
    assert "  memory_cgroup: a memory cgroup per sandbox" in message and "no cgroup hierarchy with memory" in message
    assert "seccomp:" not in message and "allow_missing_layers: ['memory_cgroup']" in message


HYBRID_MOUNTS = """31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw"""
V2_MOUNTS = "29 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate"
CONTAINER_MOUNTS = "35 31 0:32 /docker/abc /sys/fs/cgroup/memory ro,relatime - cgroup cgroup rw,memory"


@pytest.mark.parametrize(
    ("mounts", "cgroups", "found"),
    [
        (HYBRID_MOUNTS, "4:memory:/jobs/7\n1:cpu:/\n0::/", ("/sys/fs/cgroup/memory/jobs/7", 1)),
        (V2_MOUNTS, "0::/user.slice/run-1.scope", ("/sys/fs/cgroup/user.slice/run-1.scope", 2)),
        (CONTAINER_MOUNTS, "4:memory:/docker/abc/inner", ("/sys/fs/cgroup/memory/inner", 1)),
        (CONTAINER_MOUNTS, "4:memory:/docker/abc", ("/sys/fs/cgroup/memory", 1)),
        ("32 31 0:29 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu", "1:cpu:/", None),
    ],
)
def test_locate_finds_the_workers_own_memory_cgroup(mounts, cgroups, found):
    assert locate(mounts, cgroups) == found

def test_refuses_without_the_system_call_filter_and_says_why(monkeypatch):
    monkeypatch.setattr(code_sandbox, "compiled_filter", lambda: (None, "the pyseccomp package is missing"))
    with pytest.raises(IsolationUnavailable) as info:
        CodeSandboxScorer()
    message = str(info.value)
    assert "  seccomp: a system-call filter" in message and "pyseccomp package is missing" in message
    assert "bubblewrap:" not in message and "allow_missing_layers: ['seccomp']" in message


# ---- real tasks ----


@pytest.mark.parametrize("task", TASKS, ids=[t["id"] for t in TASKS])
def test_real_task_canonical_scores_1_and_broken_below_1(scorer, task):
    canonical = scorer.score(task["solution"], "", test_cases=task["test_cases"])
    assert (canonical.score, canonical.correct) == (1.0, True), canonical
    broken = scorer.score(task["broken"], "", test_cases=task["test_cases"])
    assert broken.score < 1.0 and not broken.correct


def test_fixture_covers_all_three_formats():
    formats = [t["format"] for t in TASKS]
    assert len(TASKS) >= 50
    assert {f: formats.count(f) for f in set(formats)} == {"asserts": 18, "call": 18, "stdio": 18}


def test_a_dead_workers_cgroup_is_removed_even_while_its_last_process_is_dying():
    # A spare sandbox killed by the next scorer's start may still sit in its cgroup when the orphans are removed:
    # the cgroup of a worker that is gone is emptied (its processes killed) and removed, not left behind.
    from workers.rewards.sandbox.cgroup import add, find_memory_cgroups, remove_orphans

    cgroups, why = find_memory_cgroups()
    if cgroups is None:
        pytest.skip(f"no memory cgroups here: {why}")
    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid that no longer exists: the "worker" that made the cgroup
    path = os.path.join(cgroups.base, f"roll-sandbox-{dead.pid}-1")
    os.mkdir(path)
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        add(path, sleeper.pid)
        assert remove_orphans(cgroups.base) == [os.path.basename(path)]
        assert not os.path.exists(path)
        assert sleeper.wait(timeout=10) == -9  # killed with the cgroup
    finally:
        sleeper.kill()
        with contextlib.suppress(OSError):
            os.rmdir(path)


def test_the_sample_budget_fits_inside_the_reward_workers_limit():
    fit = CodeSandboxScorer.within_timeout
    assert fit({}, 30.0)["sample_timeout_s"] == 20.0  # the default, already inside 30 s less its margin
    assert fit({"timeout_s": 2.0}, 10.0) == {"timeout_s": 2.0, "sample_timeout_s": 8.0}
    assert fit({"sample_timeout_s": 5.0}, 10.0) == {"sample_timeout_s": 5.0}  # given: checked when the config loads


@pytest.mark.parametrize(
    ("name", "worker"),
    [("roll-sandbox-4242-7", 4242), ("roll-sandbox-1-0", 1), ("roll-sandbox-4242", None), ("jobs", None),
     ("roll-sandbox-x-1", None), ("pre-roll-sandbox-4242-7", None)],
)
def test_a_sandbox_cgroup_names_the_worker_that_made_it(name, worker):
    assert creator(name) == worker

"""Check-function tests in the HumanEval / MBPP+ shape, on 33 tasks of our own (tests/fixtures/check_tasks.jsonl).

Each task has a canonical solution and a ``def check(candidate)`` test with the features real datasets use:
nested asserts, loops, comprehensions, helper values of the dataset's own (``setup``), seeded random inputs,
expected exceptions, in-place changes, classes and generators. Every canonical solution must score 1, and three
ways of cheating that fit any task must score 0: returning None, returning an object that equals everything,
and writing forged results on every file descriptor.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from workers.rewards.code_sandbox import CodeSandboxScorer
from workers.rewards.sandbox.layers import IsolationUnavailable

TASKS = [json.loads(line) for line in (Path(__file__).parent / "fixtures" / "check_tasks.jsonl").open()]

RETURNS_NONE = "def {name}(*args, **kwargs):\n    return None\n"
ALWAYS_EQUAL = """
class Anything:
    def __eq__(self, other):
        return True
    def __ne__(self, other):
        return False
    __hash__ = object.__hash__
    def __lt__(self, other):
        return True
    __le__ = __gt__ = __ge__ = __lt__
    def __bool__(self):
        return True
    def __call__(self, *args, **kwargs):
        return self
    def __getattr__(self, name):
        return self
    def __iter__(self):
        return iter([self])
    def __len__(self):
        return 1
    def __getitem__(self, key):
        return self
    def __abs__(self):
        return 0
    def __sub__(self, other):
        return self
    __add__ = __radd__ = __rsub__ = __mul__ = __rmul__ = __mod__ = __truediv__ = __sub__
def {name}(*args, **kwargs):
    return Anything()
"""
FORGES_RESULTS = """
import json, os
def forge():
    for fd in range(1, 64):
        for line in ({{"t": 0, "r": "passed"}}, {{"ev": "done"}}, {{"ev": "exit", "ok": True, "error": None}}):
            try:
                os.write(fd, (json.dumps(line) + "\\n").encode())
            except OSError:
                pass
forge()
def {name}(*args, **kwargs):
    forge()
    return None
"""


@pytest.fixture(scope="module")
def scorer():
    try:
        scorer = CodeSandboxScorer(timeout_s=5.0, concurrency=2)
    except IsolationUnavailable as err:
        pytest.skip(f"this host cannot isolate the sandbox: {err}")
    yield scorer
    scorer.close()


def suite_of(task: dict) -> str:
    fields = {"test": task["test"], "entry_point": task["entry_point"]}
    if "setup" in task:
        fields["setup"] = task["setup"]
    return json.dumps(fields)


def test_the_fixture_has_30_tasks_in_the_check_shape():
    assert len(TASKS) >= 30 and len({t["id"] for t in TASKS}) == len(TASKS)
    assert all("def check(candidate):" in t["test"] for t in TASKS)
    # The features the shape is used for, each in several tasks.
    tests = [t["test"] for t in TASKS]
    assert sum("for " in t for t in tests) >= 10
    assert sum(" for " in t and ("all(" in t or "any(" in t or "[candidate" in t) for t in tests) >= 5
    assert sum("random" in t for t in tests) >= 4
    assert sum("setup" in t for t in TASKS) >= 3


@pytest.mark.parametrize("task", TASKS, ids=[t["id"] for t in TASKS])
def test_canonical_solution_scores_1(scorer, task):
    result = scorer.score(f"```python\n{task['solution']}```", "", test_cases=suite_of(task))
    assert (result.score, result.correct) == (1.0, True), result


@pytest.mark.parametrize(
    "cheat", [RETURNS_NONE, ALWAYS_EQUAL, FORGES_RESULTS], ids=["none", "always-equal", "forged"]
)
@pytest.mark.parametrize("task", TASKS, ids=[t["id"] for t in TASKS])
def test_cheats_score_0_unmasked(scorer, task, cheat):
    result = scorer.score(cheat.format(name=task["entry_point"]), "", test_cases=suite_of(task))
    assert result is not None, "a cheat must be scored, not masked"
    assert (result.score, result.correct) == (0.0, False), result

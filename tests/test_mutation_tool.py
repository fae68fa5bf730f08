"""The mutation-testing tool (mutation/run.py) on small made-up trees: the functions a target names become line
spans (decorators included), and `--check` finds every way MUTATION.md can fall behind the sources it names."""

from __future__ import annotations

import hashlib
import json

import pytest

from mutation import run

SOURCE = '''import functools


def plain(x):
    return x + 1


class Thing:
    @functools.cache
    def method(self):
        return 2

    def other(self):
        return 3
'''


def test_function_spans_cover_the_named_functions_with_their_decorators():
    assert run.function_spans(SOURCE, ["plain", "Thing.method"]) == [((4, 0), (5, 16)), ((9, 0), (11, 16))]
    with pytest.raises(SystemExit, match=r"not in the module: \['Thing.missing'\]"):
        run.function_spans(SOURCE, ["Thing.missing"])


def test_a_marker_selection_reaches_pytest_as_one_argument():
    command = run.test_command(["tests/a.py"], "not slow")
    assert command[-3:] == ["-m", "not slow", "tests/a.py"]
    assert run.test_command(["tests/a.py"]).count("-m") == 1  # python -m pytest only


@pytest.fixture
def tree(tmp_path, monkeypatch):
    """A project with one target, its saved result made from the current source, and the report it gives."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text(SOURCE)
    (tmp_path / "mutation" / "results").mkdir(parents=True)
    targets = tmp_path / "mutation" / "targets.toml"
    targets.write_text(
        '[[target]]\nmodule = "pkg/mod.py"\ntests = ["tests/test_mod.py"]\ngoal = 0.9\n\n'
        '[explained]\n\n[explained."pkg/mod.py"]\n"5:core/X:0" = "equivalent"\n'
    )
    monkeypatch.setattr(run, "ROOT", tmp_path)
    monkeypatch.setattr(run, "TARGETS", targets)
    monkeypatch.setattr(run, "RESULTS", tmp_path / "mutation" / "results")
    monkeypatch.setattr(run, "REPORT", tmp_path / "MUTATION.md")
    result = {
        "module": "pkg/mod.py",
        "source_sha256": hashlib.sha256(SOURCE.encode()).hexdigest(),
        "tests": ["tests/test_mod.py"],
        "functions": [],
        "select": None,
        "goal": 0.9,
        "limit_s": 60,
        "run_s": 60,
        "counts": {"killed": 9, "timed out": 0, "survived": 1, "other": 0},
        "survivors": [{"id": "5:core/X:0", "line": 5, "operator": "core/X", "outcome": "survived", "diff": ""}],
    }
    run.result_path("pkg/mod.py").write_text(json.dumps(result))
    run.write_report(run.load_targets()[1])
    return tmp_path


def test_check_passes_on_a_report_made_from_current_results(tree):
    assert run.check() == []
    assert "| pkg/mod.py | 10 | 9 | 0 | 1 | 0 | 90.0% | 90% | 1 min |" in (tree / "MUTATION.md").read_text()


def test_check_fails_when_the_module_changed_since_its_run(tree):
    (tree / "pkg" / "mod.py").write_text(SOURCE + "\nX = 1\n")
    assert run.check() == ["pkg/mod.py: changed since its mutation run (`make mutation MODULES=pkg/mod.py`)"]


def test_check_fails_when_the_target_names_other_tests_or_functions(tree):
    targets = run.TARGETS.read_text()
    run.TARGETS.write_text(targets.replace('goal = 0.9', 'functions = ["plain"]\ngoal = 0.9'))
    assert any("other tests, marker selection or functions" in p for p in run.check())
    run.TARGETS.write_text(targets.replace("test_mod.py", "test_other.py"))
    assert any("other tests, marker selection or functions" in p for p in run.check())


def test_check_fails_when_the_report_was_not_regenerated(tree):
    report = tree / "MUTATION.md"
    report.write_text(report.read_text().replace("90.0%", "95.0%"))
    assert run.check() == ["MUTATION.md is not what the saved results give (`python -m mutation.run --report-only`)"]
    report.unlink()
    assert len(run.check()) == 1


def test_check_fails_on_a_result_whose_module_is_no_longer_a_target(tree):
    run.TARGETS.write_text(run.TARGETS.read_text().replace("pkg/mod.py", "pkg/other.py"))
    (tree / "pkg" / "other.py").write_text("")
    problems = run.check()
    assert "pkg/mod.py: a saved result for a module that is not a target" in problems


def test_check_fails_while_a_survivor_is_unexplained(tree):
    run.TARGETS.write_text(run.TARGETS.read_text().replace('"5:core/X:0" = "equivalent"\n', ""))
    run.write_report(run.load_targets()[1])
    assert run.check() == ["pkg/mod.py: survivors without an explanation in targets.toml: 5:core/X:0"]


def survivor(line: int, operator: str, diff: str) -> dict:
    return {"id": f"{line}:core/{operator}:0", "line": line, "operator": f"core/{operator}", "diff": diff}


def test_explanations_follow_their_mutants_to_new_line_numbers():
    previous = {"survivors": [survivor(5, "X", "-a\n+b"), survivor(7, "Y", "-c\n+d")]}
    notes = {"5:core/X:0": "equivalent: why", "7:core/Y:0": "as 5:core/X:0"}
    # Two lines were added above: the same mutants are now 7 and 9; a new mutant took id 7:core/Y:0's old place.
    result = {"survivors": [survivor(7, "X", "-a\n+b"), survivor(7, "Y", "-e\n+f"), survivor(9, "Y", "-c\n+d")]}
    carried, missing = run.carried_explanations(previous, result, notes)
    assert carried == {"7:core/X:0": "equivalent: why", "9:core/Y:0": "as 7:core/X:0"}
    assert [m["id"] for m in missing] == ["7:core/Y:0"]
    # With no previous run the notes are taken by id.
    assert run.carried_explanations(None, result, notes)[0] == {"7:core/Y:0": "as 5:core/X:0"}


def test_explanations_table_is_replaced_or_appended_in_the_targets_text():
    import tomllib

    text = (
        '[[target]]\nmodule = "a.py"\n\n[explained]\n\n[explained."a.py"]\n"1:core/X:0" = "old"\n\n'
        '[explained."b.py"]\n"2:core/Y:0" = "kept"\n'
    )
    replaced = tomllib.loads(run.with_explanations(text, "a.py", {"3:core/X:0": 'new "quoted"'}))
    assert replaced["explained"] == {"a.py": {"3:core/X:0": 'new "quoted"'}, "b.py": {"2:core/Y:0": "kept"}}
    assert replaced["target"] == [{"module": "a.py"}]
    appended = tomllib.loads(run.with_explanations(text, "c.py", {"4:core/Z:1": "c"}))
    assert appended["explained"]["c.py"] == {"4:core/Z:1": "c"}
    assert appended["explained"]["b.py"] == {"2:core/Y:0": "kept"}
    fresh = tomllib.loads(run.with_explanations('[[target]]\nmodule = "a.py"\n', "a.py", {"1:core/X:0": "x"}))
    assert fresh["explained"] == {"a.py": {"1:core/X:0": "x"}}

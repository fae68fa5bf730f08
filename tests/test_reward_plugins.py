"""Reward worker plugins end to end: the example package's entry point, and the documentation's own example
(docs/reward-plugins.md)."""

from __future__ import annotations

import ast
import importlib.metadata
import json
import re
import shlex
import subprocess
import sys

import pytest
import yaml

from roll_core.config.rewards import RewardConfig
from roll_pipeline.driver.cli import main
from tests.conftest import ROOT
from workers.rewards import registry
from workers.rewards.registry import describe_reward_workers, get_reward_scorer_cls
from workers.rewards.worker import RewardWorker

PLUGIN_DIST = "roll-reward-plugin-example"
PLUGIN_PAGE = ROOT / "docs" / "reward-plugins.md"


@pytest.fixture
def plugin_installed():
    try:
        importlib.metadata.distribution(PLUGIN_DIST)
    except importlib.metadata.PackageNotFoundError:
        pytest.fail(
            f"{PLUGIN_DIST} is not installed; `make install` installs it from "
            "tests/fixtures/roll_reward_plugin_example"
        )


@pytest.fixture
def clean_registry(monkeypatch):
    """A registry copy, so that names registered by a test do not leak into others. The built-in modules are
    imported first: they register on import, once, and must do so into the registry that outlives the test."""
    registry.REWARD_WORKERS.import_builtins()
    monkeypatch.setattr(registry.REWARD_WORKERS, "items", dict(registry.REWARD_WORKERS.items))


# --- the example plugin package, through its entry point ----------------------------------------------------


def test_the_entry_point_names_the_plugin_and_its_package(plugin_installed, clean_registry):
    rows = {row.name: row for row in describe_reward_workers()}
    assert rows["exact_match_example"].target == "roll_reward_plugin_example:ExactMatchScorer"
    assert rows["exact_match_example"].source == f"entry point of {PLUGIN_DIST} 0.1.0"
    assert rows["math_rule"].source == "built-in"
    assert get_reward_scorer_cls("exact_match_example").__module__ == "roll_reward_plugin_example"


def test_the_plugin_scores_through_the_worker_by_its_entry_point_name(plugin_installed, clean_registry):
    with RewardWorker("capitals", "exact_match_example", {"case_sensitive": False}, processes=1) as worker:
        results = worker.score_batch(
            [
                {"response": " Paris. ", "ground_truth": "paris"},
                {"response": "Lutetia", "ground_truth": "Paris", "aliases": "Lutetia|Parigi"},
                {"response": "Lyon", "ground_truth": "Paris"},
                {"response": "Paris", "ground_truth": ""},
            ]
        )
    assert [r.score for r in results] == [1.0, 1.0, 0.0, None]
    assert results[0].metrics == {"answer_chars": 5.0, "aliases": 0.0}
    assert results[1].metrics == {"answer_chars": 7.0, "aliases": 2.0}
    assert results[3].mask_reason == "not_applicable"
    with pytest.raises(TypeError, match="case_sensitiv"):
        RewardWorker("capitals", "exact_match_example", {"case_sensitiv": True})


def test_the_plugin_from_the_roll_command(plugin_installed, clean_registry, capsys):
    assert main(["rewards", "list"]) == 0
    listed = capsys.readouterr().out
    assert re.search(
        rf"^exact_match_example +entry point of {PLUGIN_DIST} 0\.1\.0 +"
        r"roll_reward_plugin_example:ExactMatchScorer$",
        listed,
        re.MULTILINE,
    )
    argv = ["rewards", "score", "exact_match_example", "--response", "LYON", "--ground-truth", "lyon"]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out) == {
        "score": 1.0,
        "correct": True,
        "masked": False,
        "metrics": {"answer_chars": 4.0, "aliases": 0.0},
    }


def test_the_plugin_from_a_fresh_roll_process(plugin_installed):
    """What a user runs: a new interpreter, which finds the plugin only through its installed entry point."""
    command = [sys.executable, "-m", "roll_pipeline.driver.cli", "rewards", "score", "exact_match_example"]
    command += ["--response", "Parigi", "--ground-truth", "Paris", "--field", "aliases=Lutetia|Parigi"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["correct"] is True


# --- docs/reward-plugins.md: "Write your own reward worker" ---------------------------------------------------


def plugin_page() -> str:
    return PLUGIN_PAGE.read_text(encoding="utf-8")


def code_blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, re.DOTALL)


def console_examples(text: str) -> list[tuple[list[str], str]]:
    """(argv after `roll`, the output line under it) for each `$ roll ...` line of the console blocks."""
    examples = []
    for block in code_blocks(text, "console"):
        lines = block.strip().splitlines()
        for i, line in enumerate(lines):
            if line.startswith("$ "):
                words = shlex.split(line[2:])
                while "=" in words[0]:  # environment assignments, e.g. PYTHONPATH=.
                    words.pop(0)
                assert words[0] == "roll", line
                examples.append((words[1:], lines[i + 1]))
    return examples


@pytest.fixture
def page_module(tmp_path, monkeypatch):
    """The documentation's my_rewards.py, written out and importable (as with PYTHONPATH=.)."""
    section = plugin_page()
    (source,) = code_blocks(section, "python")
    assert source.startswith("# my_rewards.py\n")
    (tmp_path / "my_rewards.py").write_text(source, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield section
    sys.modules.pop("my_rewards", None)


def test_the_example_scores_through_the_worker_as_its_config_says(page_module):
    (config_yaml,) = code_blocks(page_module, "yaml")
    config = RewardConfig(**yaml.safe_load(config_yaml)["rewards"]["qa"])
    with RewardWorker("qa", config.worker, config.options, processes=1) as worker:
        results = worker.score_batch(
            [
                {"response": "Paris is the capital of France.", "ground_truth": "paris, france"},
                {"response": "It is Paris.", "ground_truth": "paris, france"},
                {"response": "Parisian food", "ground_truth": "paris"},
                {"response": "anything", "ground_truth": " , "},
            ]
        )
    assert [r.score for r in results] == [1.0, 0.5, 0.0, None]
    assert [r.correct for r in results] == [True, False, False, None]
    assert results[1].metrics == {"keywords_found": 0.5}
    assert results[3].mask_reason == "not_applicable"


def test_the_entry_point_snippet_names_the_same_class(page_module):
    (toml,) = code_blocks(page_module, "toml")
    assert '[project.entry-points."roll_pipeline.reward_workers"]' in toml
    assert 'keyword = "my_rewards:KeywordScorer"' in toml
    assert registry.ENTRY_POINT_GROUP == "roll_pipeline.reward_workers"


def test_the_pages_commands_print_what_they_show(page_module, capsys):
    examples = console_examples(plugin_page() + (ROOT / "docs" / "rewards.md").read_text(encoding="utf-8"))
    assert {argv[2] for argv, _ in examples} >= {"math_rule", "my_rewards:KeywordScorer"}
    for argv, shown in examples:
        assert main(argv) == 0, argv
        assert capsys.readouterr().out.strip() == shown, argv


def project_imports(source: str) -> set[str]:
    """The modules of this project that a piece of source imports."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return {n for n in names if n.split(".")[0] in ("roll_core", "roll_pipeline", "workers", "schedulers")}


def test_a_plugin_needs_only_the_api(page_module):
    """The documentation's plugin and the example package import the project through roll_pipeline.api alone: what a
    plugin builds on stays put when the code behind it moves."""
    (readme_source,) = code_blocks(page_module, "python")
    package = ROOT / "tests" / "fixtures" / "roll_reward_plugin_example" / "roll_reward_plugin_example"
    sources = [readme_source] + [p.read_text(encoding="utf-8") for p in package.rglob("*.py")]
    assert [project_imports(s) for s in sources] == [{"roll_pipeline.api"}] * len(sources)

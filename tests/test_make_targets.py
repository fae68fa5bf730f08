"""The Makefile's test targets. `make test-profile` is `make test` writing where the time goes (docs/testing.md), so it
sets up all that `make test` sets up: a fresh clone's profile once ran without four embedded models that `make test`
copies (the judge, multi, reward and tool models: 39 errors and 16 failures, 2026-12-06)."""

from __future__ import annotations

import subprocess

from tests.conftest import ROOT


def recipes(target: str) -> list[str]:
    """What `make` would run for `target` with every prerequisite out of date, but the pytest command itself."""
    done = subprocess.run(["make", "--dry-run", "--always-make", target], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, check=True)
    return [line for line in done.stdout.splitlines() if " -m pytest " not in f"{line} "]


def test_make_test_profile_sets_up_what_make_test_sets_up():
    test = recipes("test")
    assert any("roll model build tiny-qwen2-tool" in line for line in test)  # what the comparison stands on
    assert recipes("test-profile") == test

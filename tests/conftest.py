"""Shared fixtures: paths of the repository, its examples and the embedded model."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
TINY_MODEL = EXAMPLES / "models" / "tiny-qwen2"


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """The embedded model that `make model` builds (the test targets build it first)."""
    if not (TINY_MODEL / "config.json").exists():
        pytest.fail(f"{TINY_MODEL} is missing: run `make model` (make test does it) before the tests")
    return TINY_MODEL

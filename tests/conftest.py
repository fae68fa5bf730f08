"""Shared fixtures: paths of the repository, its examples and the embedded model."""

from __future__ import annotations

import shutil
from collections.abc import Callable
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


@pytest.fixture(scope="session")
def mlflow_db(tmp_path_factory) -> Callable[[Path], str]:
    """Makes a new, empty SQLite MLflow store at a path and returns its URI.

    MLflow builds a new store by running its Alembic migrations, about 5 s on this machine; a run that starts on
    an empty store pays that in its set-up. The migrations run here once per session, and each store is a copy."""
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    template = tmp_path_factory.mktemp("mlflow-template") / "mlflow.db"
    store = SqlAlchemyStore(f"sqlite:///{template}", str(template.parent / "artifacts"))
    store.engine.dispose()

    def new(path: Path) -> str:
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(template, path)
        return f"sqlite:///{path}"

    return new

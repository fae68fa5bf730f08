"""Shared fixtures: paths of the repository, its examples and the embedded model; a local Ray cluster per test
module; waiting for an event."""

from __future__ import annotations

import shutil
import time
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


@pytest.fixture(scope="module")
def local_ray():
    """A local Ray cluster with 4 logical CPUs for the module's tests (a module that needs another size defines
    its own)."""
    import ray

    from roll_pipeline.driver.runtime import start_local_ray

    start_local_ray(4, log_to_driver=False)
    yield
    ray.shutdown()


def wait_for(condition: Callable[[], bool], what: str, limit_s: float = 60.0) -> None:
    """Polls `condition` until it holds; the limit only bounds a hang, no duration is asserted."""
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen within {limit_s:.0f} s"
        time.sleep(0.05)


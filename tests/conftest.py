"""Shared fixtures: paths of the repository, its examples and the embedded model; a local Ray cluster per test
module; waiting for an event. And which test files share a pytest-xdist worker (`make test` runs two)."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
TINY_MODEL = EXAMPLES / "models" / "tiny-qwen2"


#: Test files whose tests run one after another on one pytest-xdist worker, by what they share on the host: the
#: sandbox files make orphans on purpose and look for what runs left on the host; the Ray cluster files start
#: multi-node clusters (`ray start` nodes, a dashboard); the vLLM files each start vLLM (its ports, its threads
#: pinned to the cores; test_multi_turn.py's pipeline step on vLLM too). Every other test runs beside any one of
#: these.
SHARED_WORKER = {
    "sandbox-host": (
        "test_code_sandbox_hostile.py", "test_code_sandbox_zygote.py", "test_code_sandbox_stdio_tests.py",
        "test_environments.py",
    ),
    "ray-nodes": ("test_multinode.py", "test_ray_cluster.py", "test_placement.py"),
    "vllm": (
        "test_vllm_engine.py", "test_vllm_pipeline.py", "test_vllm_strategy.py", "test_serve.py", "test_multi_turn.py",
    ),
}


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadgroup` with SHARED_WORKER's groups: each group goes to one worker as one unit, every other test
    on its own. (pytest-xdist 3.8.0 reads groups from `xdist_group` marks by renaming node ids, which pytest 9 no
    longer lets it do (pytest-xdist#1386): its loadgroup silently spreads a group over the workers. So the groups
    are given here, by file.)"""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    group_of = {name: group for group, names in SHARED_WORKER.items() for name in names}

    class SharedWorkerScheduling(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of.get(nodeid.split("::", 1)[0].rsplit("/", 1)[-1]) or super()._split_scope(nodeid)

    return SharedWorkerScheduling(config, log)


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


"""Shared fixtures: paths of the repository, its examples and the embedded model; one local Ray cluster per
pytest-xdist worker, shared by its tests (`shared_ray`, `local_ray`; `own_ray` for a test that needs its own);
waiting for an event. And which test files share a pytest-xdist worker (`make test` runs two)."""

from __future__ import annotations

import functools
import os
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests import profiling

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
TINY_MODEL = EXAMPLES / "models" / "tiny-qwen2"



#: Test files whose tests run one after another on one pytest-xdist worker, by what they share on the host: the
#: sandbox files make orphans on purpose and look for what runs left on the host; the Ray cluster files start
#: multi-node clusters (`ray start` nodes, a dashboard), and test_resume's side-by-side `roll run`s a Ray node each:
#: a node's raylet gives its dashboard agent 15 s (fixed in Ray 2.60) to start and aborts after, which under one
#: busy core happened once with test_resume's two nodes and test_ray_cluster's second one starting together; the
#: vLLM files each start vLLM (its ports, its threads pinned to the cores). Every other test runs beside any one
#: of these.
SHARED_WORKER = {
    "sandbox-host": (
        "test_code_sandbox_hostile.py", "test_code_sandbox_zygote.py", "test_code_sandbox_stdio_tests.py",
        "test_environments.py",
    ),
    "ray-nodes": ("test_multinode.py", "test_ray_cluster.py", "test_placement.py", "test_resume.py"),
    "vllm": (
        "test_vllm_engine.py", "test_vllm_pipeline.py", "test_vllm_strategy.py", "test_serve.py",
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
            path = nodeid.split("::", 1)[0]
            name = path.rsplit("/", 1)[-1]
            return group_of.get(name) or (path if has_module_fixture(path) else super()._split_scope(nodeid))

    return SharedWorkerScheduling(config, log)


_MODULE_FIXTURE = re.compile(r"@pytest\.fixture\(\s*scope=[\"']module[\"']")


@functools.cache
def has_module_fixture(path: str) -> bool:
    """Whether a test file defines a module-scoped fixture: its tests then go to one pytest-xdist worker together,
    so that the fixture (a pipeline, a vLLM engine, a server, a trained run) is set up once, not once per worker
    that gets some of them (a module's tests spread over both workers set up `trained` of test_mlflow_server.py,
    48 s, twice)."""
    file = ROOT / path
    return file.is_file() and bool(_MODULE_FIXTURE.search(file.read_text()))


def pytest_addoption(parser: pytest.Parser) -> None:
    profiling.add_option(parser)
    parser.addoption("--check-builds", action="store_true",
                     help="run only the tests marked check_builds (`make check-builds`: builds from scratch that "
                          "must give the shipped weights), which every other run leaves out")


def pytest_configure(config: pytest.Config) -> None:
    # OpenMP threads that wait sleep instead of spinning. Every torch process of the suite (a pipeline's workers, a
    # `roll run` subprocess's, set before Ray starts so that its workers inherit it) has 2 threads on a 2-core
    # machine that the other pytest-xdist worker's processes need: spinning threads burn what the other test waits
    # for. Measured on the `grpo` case of test_learning.py alone (2026-12-06, AMD EPYC Zen 4, 2 cores, quiet,
    # alternating): busy CPU 66, 64, 72 s passive against 73, 75, 73 s spinning, wall 46-56 s either way. It changes
    # no computed value. Here and not at import: a benchmark that imports this module (for TINY_MODEL) measures
    # what a user's run gets, OpenMP's default; passive cost bench_trl's train stage 0.42-0.44 s against 0.32-0.37
    # (2026-12-07, Intel Xeon, 2 cores; docs/testing.md). No torch is loaded before this hook runs.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    profiling.configure(config)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`make check-builds` runs the check_builds tests and nothing else; every other run leaves them out (each
    builds an embedded model from scratch, minutes apiece, to prove a shipped build is what this code builds)."""
    wanted = config.getoption("--check-builds")
    kept, left_out = [], []
    for item in items:
        (kept if (item.get_closest_marker("check_builds") is not None) == wanted else left_out).append(item)
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = kept


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


#: Logical CPUs of the local Ray cluster that the tests of one pytest-xdist worker share (`shared_ray`): room for
#: any example's actors (the largest, examples/multi_domain.yaml, needs 5.15) and a test's own few. Starting a
#: cluster took 5.5-7 s and stopping it 1.5 s on 2 cores (2026-12-06), besides the CPU its prestarted workers take.
SHARED_RAY_CPUS = 8
_shared = {"up": False}


def shared_ray() -> None:
    """Connect this process to its pytest-xdist worker's shared local Ray cluster, started on first use and kept
    until the session ends or a test that needs a cluster of its own stops it (`own_ray`). Whatever starts a
    pipeline in the test process calls it first (the pipeline then runs on the connected cluster: init_ray)."""
    import ray

    from roll_pipeline.driver.runtime import start_local_ray

    if ray.is_initialized():
        if not _shared["up"]:
            raise RuntimeError("a Ray cluster other than the shared one is connected: a test that started its own "
                               "(own_ray) left it running")
        return
    start_local_ray(SHARED_RAY_CPUS, log_to_driver=False)
    _shared["up"] = True


def stop_shared_ray() -> None:
    import ray

    if _shared["up"]:
        ray.shutdown()
        _shared["up"] = False


@pytest.fixture(scope="module")
def local_ray():
    """The shared local Ray cluster (`shared_ray`), for the module's tests. Whatever they start on it they stop:
    `shared_ray_left_clean` checks after the module."""
    shared_ray()


@pytest.fixture
def own_ray():
    """For a test that needs a Ray cluster of its own (another size, fake GPUs, `ray start` nodes, a cluster it
    kills): the shared one is stopped first (the next test that asks for it starts it again), and the test's own
    is disconnected after it."""
    import ray

    stop_shared_ray()
    yield
    if ray.is_initialized():
        ray.shutdown()


def shared_ray_leftovers(wait_s: float = 30.0) -> list[str]:
    """What is left on the shared cluster: resources held (waited for `wait_s`: an actor killed a moment ago frees
    its CPUs shortly after), named actors, placement groups not removed. [] when clean or not started."""
    import ray

    if not _shared["up"] or not ray.is_initialized():
        return []
    deadline = time.monotonic() + wait_s
    while True:
        total, free = ray.cluster_resources(), ray.available_resources()
        held = {k: round(v - free.get(k, 0.0), 3) for k, v in total.items()
                if not k.startswith(("node:", "memory", "object_store_memory")) and v - free.get(k, 0.0) > 1e-6}
        if not held or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    left = [f"resources held: {held}"] if held else []
    named = ray.util.list_named_actors(all_namespaces=True)
    if named:
        left.append(f"named actors: {named}")
    groups = [g for g in ray.util.placement_group_table().values() if g.get("state") != "REMOVED"]
    if groups:
        left.append(f"placement groups: {[g.get('name') or g.get('placement_group_id') for g in groups]}")
    return left


@pytest.fixture(scope="module", autouse=True)
def shared_ray_left_clean():
    """After each module's tests (and its own module fixtures' teardown): the shared Ray cluster holds nothing of
    theirs, so the next module's pipelines start on an empty cluster. A module that left something fails here, and
    the cluster is stopped so that the next one starts clean."""
    yield
    left = shared_ray_leftovers()
    if left:
        stop_shared_ray()
        pytest.fail("the shared Ray cluster was left with " + "; ".join(left))


def pytest_unconfigure(config: pytest.Config) -> None:
    stop_shared_ray()


def wait_for(condition: Callable[[], bool], what: str, limit_s: float = 60.0) -> None:
    """Polls `condition` until it holds; the limit only bounds a hang, no duration is asserted."""
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen within {limit_s:.0f} s"
        time.sleep(0.05)


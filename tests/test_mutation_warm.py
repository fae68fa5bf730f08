"""The warm test runner of mutation testing (mutation/warm.py) on a made-up tree: a run forked from the warm
server answers as `python -m pytest` does (exit code and output), imports the tree's module as it is on disk at
that moment (a mutant is seen, not the module the server had), and dies with its client (cosmic-ray's timeout)."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mutation import run

MODULE = "def answer():\n    return 42\n"
TESTS = (
    "import os\n"
    "from pkg_under_test.mod import answer\n\n"
    "def test_answer():\n"
    "    assert answer() == 42\n\n"
    "def test_slow():\n"
    "    if os.environ.get('SLOW_PID_FILE'):\n"
    "        open(os.environ['SLOW_PID_FILE'], 'w').write(str(os.getpid()))\n"
    "        import time; time.sleep(120)\n"
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("warm")
    with run.warm_server(folder, dict(os.environ)) as sock:
        yield sock


@pytest.fixture
def tree(tmp_path):
    (tmp_path / "pkg_under_test").mkdir()
    (tmp_path / "pkg_under_test" / "__init__.py").write_text("")
    (tmp_path / "pkg_under_test" / "mod.py").write_text(MODULE)
    (tmp_path / "checks").mkdir()
    (tmp_path / "checks" / "test_mod.py").write_text(TESTS)
    (tmp_path / "mutation").mkdir()
    shutil.copy(run.ROOT / "mutation" / "warm.py", tmp_path / "mutation" / "warm.py")
    return tmp_path


def outcome(command: list[str], cwd: Path, **env: str) -> tuple[int, str]:
    """The exit code and pytest's summary line. pytest-randomly is off (through the environment, which the warm
    run takes from its client) so that both runs take the tests in one order and -x stops at the same place."""
    env = {"PYTEST_ADDOPTS": "-p no:randomly", **env}
    done = subprocess.run(
        command, cwd=cwd, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(cwd), "PYTHONDONTWRITEBYTECODE": "1", **env},
    )
    summary = [line for line in done.stdout.splitlines() if " passed" in line or " failed" in line]
    return done.returncode, summary[-1].split(" in ")[0] if summary else done.stdout[-500:]


def test_a_forked_run_answers_as_a_fresh_pytest_and_sees_the_mutant_on_disk(server, tree):
    tests = ["checks/test_mod.py"]
    assert outcome(run.test_command(tests, None, server), tree) == outcome(run.test_command(tests), tree) == (
        0,
        "2 passed",
    )
    (tree / "pkg_under_test" / "mod.py").write_text(MODULE.replace("42", "43"))  # a mutant
    warm = outcome(run.test_command(tests, None, server), tree)
    assert warm == outcome(run.test_command(tests), tree)
    assert warm == (1, "1 failed")  # -x: the first failure (test_answer, first in the file) stops the run


def test_the_run_dies_with_its_client(server, tree):
    pid_file = tree / "slow.pid"
    client = subprocess.Popen(
        run.test_command(["checks/test_mod.py"], None, server), cwd=tree,
        env={**os.environ, "PYTHONPATH": str(tree), "SLOW_PID_FILE": str(pid_file)},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline, "the slow test never started"
        time.sleep(0.05)
    pid = int(pid_file.read_text())
    client.kill()
    client.wait()
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z":
        assert time.monotonic() < deadline, "the forked run outlived its client"
        time.sleep(0.05)


def test_the_client_imports_no_heavy_library(tree):
    # The client is what cosmic-ray runs per mutant: it must not pay the imports the server exists to save.
    code = "import runpy, sys; runpy.run_path('mutation/warm.py'); print(repr(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], cwd=tree, capture_output=True, text=True, check=True)
    loaded = {name.split(".")[0] for name in ast.literal_eval(done.stdout.strip().splitlines()[-1])}
    assert not loaded & {"numpy", "torch", "transformers", "ray", "pytest", "deepspeed"}

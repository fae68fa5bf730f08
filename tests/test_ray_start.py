"""A local Ray node that does not come up on a busy machine (its raylet aborts when its dashboard agent misses
Ray's fixed 15 s) is started again, with the failed attempt's processes stopped: roll_pipeline.distributed.starting.
The slow agent is made real: a sitecustomize that holds the first dashboard agent of the run back for 20 s."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest

from roll_pipeline.distributed import starting

ROOT = Path(__file__).resolve().parents[1]

SLOW_FIRST_AGENT = """
import os, sys, time
if sys.argv and sys.argv[0].endswith(os.path.join("dashboard", "agent.py")):
    try:
        os.close(os.open(os.environ["SLOW_AGENT_MARKER"], os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        pass  # a later attempt's agent starts at its own pace
    else:
        time.sleep(20)  # the raylet gives up at 15 s
"""

START_AND_REPORT = """
import json, psutil, ray
from roll_pipeline.driver.runtime import start_local_ray
start_local_ray(1, log_to_driver=False)
answer = ray.get(ray.remote(lambda: 42).remote())
# process_iter answers None for a process it may not read: a zombie anywhere on the machine, or another user's
sessions = [" ".join(p.info["cmdline"] or ()) for p in psutil.process_iter(["cmdline"]) if p.pid != psutil.Process().pid]
print(json.dumps({"answer": answer, "log_dir": ray._private.worker._global_node.get_logs_dir_path(),
                  "cmdlines": sessions}))
ray.shutdown()
"""


@pytest.mark.slow
def test_a_node_whose_agent_missed_the_raylets_wait_is_started_again_without_leftovers(tmp_path):
    """Its own Ray node in a subprocess of its own (the sitecustomize must be on the path of the process that
    starts Ray, and of the agent): about 35 s, most of it waiting (the held agent 20 s, node.py's 30 s)."""
    (tmp_path / "sitecustomize.py").write_text(textwrap.dedent(SLOW_FIRST_AGENT))
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}", "SLOW_AGENT_MARKER": str(tmp_path / "held")}
    done = subprocess.run([sys.executable, "-c", START_AND_REPORT], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    assert (tmp_path / "held").exists()  # the first agent was held back
    warning = next(line for line in done.stderr.splitlines() if "did not start (attempt 1 of 3)" in line)
    failed_logs = warning.split("its logs: ", 1)[1].split(";", 1)[0]
    assert (Path(failed_logs) / "raylet.out").read_text().count("Timed out waiting for file") >= 1
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["answer"] == 42
    assert report["log_dir"] != failed_logs
    # While the second node ran, nothing of the first one was left (its GCS, log monitor, agents: each names its
    # log folder; the second raylet names the first session's folder too, as its object spilling fallback).
    left = [c for c in report["cmdlines"] if failed_logs in c]
    assert not left, left


class FakeInit:
    """ray.init that fails `failures` times as Ray 2.60 does when the node never registered, each time leaving a
    process that names Ray's package and a log folder (as a failed start's GCS does)."""

    def __init__(self, failures: int, error: str = starting.NODE_START_TIMED_OUT) -> None:
        self.failures, self.error, self.calls, self.left = failures, error, 0, []

    def __call__(self, **kwargs) -> None:
        self.calls += 1
        if self.calls <= self.failures:
            self.left.append(subprocess.Popen(
                [sys.executable, "-c", "import time; time.sleep(120)", starting.RAY_PACKAGE, f"--log-dir=/x/{self.calls}"]
            ))
            raise Exception(f"{self.error}. This could happen because ...")  # noqa: TRY002 (Ray raises a bare one)


@pytest.fixture
def fake_init(monkeypatch):
    def install(failures: int, **kw) -> FakeInit:
        fake = FakeInit(failures, **kw)
        monkeypatch.setattr(starting.ray, "init", fake)
        monkeypatch.setattr(starting.ray, "shutdown", lambda: None)
        return fake

    return install


def test_each_failed_attempt_is_stopped_and_the_last_failure_names_its_logs(fake_init):
    fake = fake_init(3)
    with pytest.raises(starting.RayStartError, match=r"in 3 attempts \(its logs: /x/3;"):
        starting.init_local_ray(address="local")
    assert fake.calls == 3
    assert [psutil.pid_exists(p.pid) for p in fake.left] == [False] * 3  # killed and reaped (no zombie)


def test_a_start_that_fails_otherwise_is_not_retried(fake_init):
    fake = fake_init(1, error="ray.init: num_cpus must be >= 0")
    with pytest.raises(Exception, match="num_cpus"):
        starting.init_local_ray(address="local")
    assert fake.calls == 1
    assert fake.left[0].poll() is None  # not a failed node start: nothing of it was stopped
    fake.left[0].kill()
    fake.left[0].wait()


def test_a_retried_start_goes_on_after_the_failed_one(fake_init, caplog):
    fake = fake_init(1)
    starting.init_local_ray(address="local")
    assert fake.calls == 2
    assert not psutil.pid_exists(fake.left[0].pid)
    assert "did not start (attempt 1 of 3) (its logs: /x/1;" in caplog.text

"""Reused sandboxes (``isolation: zygote``): nothing a run leaves reaches the next run in the same sandbox, a run
cannot change its zygote, and a run that does not end cleanly costs its sandbox. ``isolation: strict`` keeps a
sandbox per run. The hostile suite (test_code_sandbox_hostile.py) runs on the default, the zygote."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from tests.test_code_sandbox_hostile import leftover_processes
from workers.rewards.code_sandbox import CodeSandboxScorer
from workers.rewards.sandbox.isolation import LOAD_HARNESS
from workers.rewards.sandbox.layers import IsolationUnavailable, LayerReport
from workers.rewards.sandbox.prestarted import SandboxPool
from workers.rewards.sandbox.process import EXITED, HARNESS_SOURCE, TIMEOUT

# Reports what earlier runs could have left, as JSON, then leaves all it can: files (one in a directory it makes
# unreadable, a symlink), a file in /dev/shm, a hidden session of sleepers, a /tmp it can no longer write to.
RESIDUE = r"""
import json, os
found = {
    "tmp": sorted(os.listdir("/tmp")),
    "shm": sorted(os.listdir("/dev/shm")),
    "processes": sorted(int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) not in (1, os.getpid())),
    "tmp_writable": os.access("/tmp", os.W_OK),
}
print(json.dumps(found), flush=True)
open("/tmp/left.txt", "w").write("x")
os.makedirs("/tmp/d/e", exist_ok=True)
open("/tmp/d/e/f", "w").write("y")
os.chmod("/tmp/d", 0)
os.symlink("/etc/passwd", "/tmp/link")
open("/dev/shm/left", "w").write("z")
if os.fork() == 0:
    os.setsid()
    for _ in range(3):
        if os.fork() == 0:
            import time
            time.sleep(60)
    os._exit(0)
os.chmod("/tmp", 0o500)
"""
CLEAN = {"tmp": [], "shm": [], "processes": [], "tmp_writable": True}


def no_leftovers() -> bool:
    """Whether the host is free of the runs' processes (killed ones may take a moment to be reaped)."""
    return leftover_processes(wait_s=60.0) == []


@pytest.fixture(scope="module")
def spec():
    try:
        scorer = CodeSandboxScorer(timeout_s=2.0, concurrency=1)
    except IsolationUnavailable as err:
        pytest.skip(f"this host cannot isolate the sandbox: {err}")
    scorer.close()
    if scorer.spec.bwrap is None or scorer.spec.seccomp is None:
        pytest.skip("sandboxes are reused only with bubblewrap and the system-call filter")
    return scorer.spec


def stdio(spec, code: str, stdin: bytes = b"") -> dict:
    return {"mode": "stdio", "code": code, "limits": spec.limits.for_job()}


def test_nothing_a_run_leaves_reaches_the_next_run(spec):
    pool = SandboxPool(spec, concurrency=1)
    try:
        reports = []
        for _ in range(6):
            output = pool.run(stdio(spec, RESIDUE))
            assert output.status == EXITED and output.exit_code == 0, output.stderr[-500:]
            reports.append(json.loads(output.stdout))
        started = pool.started
    finally:
        pool.close()
    assert reports == [CLEAN] * 6
    # The same sandboxes served the runs (the pool keeps two; a third may be starting): reuse was tested.
    assert started <= 3
    assert no_leftovers()


def test_strict_isolation_starts_a_sandbox_per_run(spec):
    pool = SandboxPool(spec, concurrency=1, reuse=False)
    try:
        reports = [json.loads(pool.run(stdio(spec, RESIDUE)).stdout) for _ in range(4)]
        started = pool.started
    finally:
        pool.close()
    assert reports == [CLEAN] * 4
    assert started >= 4  # one per run
    assert no_leftovers()


ATTACKS_THE_ZYGOTE = r"""
import os, signal
results = []
for attempt in (
    lambda: open("/proc/1/mem", "r+b"),
    lambda: open("/proc/1/environ", "rb").read(),
    lambda: os.listdir("/proc/1/fd"),
    lambda: os.kill(1, signal.SIGKILL),
    lambda: os.kill(1, signal.SIGSTOP),
    lambda: os.kill(-1, signal.SIGKILL),
):
    try:
        attempt()
        results.append("done")
    except OSError as err:
        results.append(type(err).__name__)
print(results, flush=True)
"""


def test_a_run_cannot_read_change_or_stop_its_zygote(spec):
    pool = SandboxPool(spec, concurrency=1)
    try:
        attacked = pool.run(stdio(spec, ATTACKS_THE_ZYGOTE))
        after = [pool.run(stdio(spec, "print(6 * 7)")) for _ in range(3)]
        started = pool.started
    finally:
        pool.close()
    # The zygote is not dumpable: its memory, environment and descriptors are closed to the run. Signals sent to
    # PID 1 from inside its namespace are dropped (the calls succeed and do nothing); kill(-1) finds no process
    # it may signal (ESRCH): the zygote is not one of them.
    assert attacked.stdout.decode().strip() == str(
        ["PermissionError", "PermissionError", "PermissionError", "done", "done", "ProcessLookupError"]
    )
    assert [o.stdout for o in after] == [b"42\n"] * 3
    assert started <= 3, "an attacked zygote was replaced, so reuse after the attack was not tested"


def test_a_run_that_times_out_or_floods_costs_its_sandbox(spec):
    pool = SandboxPool(spec, concurrency=1)
    try:
        pool.run(stdio(spec, "print(1)"))
        deadline = time.monotonic() + 30.0
        while pool.started < pool.size and time.monotonic() < deadline:
            time.sleep(0.01)  # the pool's own sandboxes all started
        before = pool.started
        looped = pool.run(stdio(spec, "while True:\n    pass\n"), timeout_s=0.5)
        flooded = pool.run(stdio(spec, "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n"))
        fine = pool.run(stdio(spec, "print(2)"))
        # Each killed sandbox is replaced by a new one (started in the background; the deadline bounds a hang).
        deadline = time.monotonic() + 30.0
        while pool.started < before + 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        started = pool.started
    finally:
        pool.close()
    assert looped.status == TIMEOUT and flooded.status == "output_limit"
    assert fine.stdout == b"2\n"
    assert started == before + 2
    assert no_leftovers()


def zygote_pids(uid: int) -> list[int]:
    """Host pids of this process's zygotes running as ``uid`` (their command line is the harness's loader, entry
    zygote; their bubblewraps' holds the same after ``bwrap``'s own arguments). Only those under this process:
    another test worker's are not this test's to kill."""
    import psutil

    pids = []
    for child in psutil.Process().children(recursive=True):
        proc = Path(f"/proc/{child.pid}")
        try:
            if proc.stat().st_uid != uid:
                continue
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if LOAD_HARNESS.encode() in argv and b"zygote" in argv and not argv[0].endswith(b"bwrap"):
            pids.append(int(proc.name))
    return pids


def parent_pid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def alive(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_sandbox_that_died_waiting_is_replaced_not_scored(spec):
    pool = SandboxPool(spec, concurrency=1)
    try:
        assert pool.run(stdio(spec, "print(1)")).stdout == b"1\n"
        deadline = time.monotonic() + 30.0
        while len(zygote_pids(spec.effective_uid())) < pool.size and time.monotonic() < deadline:
            time.sleep(0.01)
        killed = zygote_pids(spec.effective_uid())
        bubblewraps = [parent_pid(pid) for pid in killed]
        for pid in killed:
            os.kill(pid, signal.SIGKILL)  # from the host: as if something outside killed the waiting sandboxes
        # Until their bubblewraps have exited too (zombies, unreaped by the pool), so that each hand-over finds
        # the socket closed rather than racing the exit.
        deadline = time.monotonic() + 30.0
        while any(alive(pid) for pid in killed + bubblewraps) and time.monotonic() < deadline:
            time.sleep(0.01)
        outputs = [pool.run(stdio(spec, "print(2)")) for _ in range(3)]
    finally:
        pool.close()
    assert len(killed) == 2
    assert [o.stdout for o in outputs] == [b"2\n"] * 3
    assert no_leftovers()


def test_a_zygote_killed_mid_run_is_retried_not_scored(spec):
    pool = SandboxPool(spec, concurrency=1)
    killed = []

    def kill_the_busy_zygote() -> None:
        deadline = time.monotonic() + 30.0
        while not killed and time.monotonic() < deadline:
            for pid in zygote_pids(spec.effective_uid()):
                if Path(f"/proc/{pid}/task/{pid}/children").read_text().split():  # the one running the program
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
                    break
            time.sleep(0.01)

    try:
        pool.run(stdio(spec, "print(1)"))
        killer = threading.Thread(target=kill_the_busy_zygote)
        killer.start()
        # Sleeps so that the killer finds it running; the first attempt's sandbox dies under it.
        output = pool.run(stdio(spec, "import time\ntime.sleep(1)\nprint(3)"))
        killer.join()
    finally:
        pool.close()
    assert len(killed) == 1
    # Retried in another sandbox: an infrastructure failure is never the program's verdict.
    assert output.status == EXITED and output.stdout == b"3\n"
    assert no_leftovers()


def test_checked_runs_reuse_sandboxes_and_keep_their_verdicts(spec):
    scorer = CodeSandboxScorer(timeout_s=2.0, concurrency=1)
    asserts = json.dumps({"asserts": ["assert square(2) == 4", "assert square(3) == 9"]})
    try:
        right = [scorer.score("def square(x):\n    return x * x\n", "", test_cases=asserts) for _ in range(5)]
        wrong = scorer.score("def square(x):\n    return x + x\n", "", test_cases=asserts)
        crashed = scorer.score("def square(x):\n    raise SystemExit(0)\n", "", test_cases=asserts)
        again = scorer.score("def square(x):\n    return x * x\n", "", test_cases=asserts)
        started = scorer._executor.started
    finally:
        scorer.close()
    assert all(r.correct for r in right) and again.correct
    assert wrong.score == 0.5 and crashed.score == 0.0
    assert started <= 5, f"{started} sandboxes for 8 checked runs: the zygotes were not reused"


def test_sysv_ipc_is_refused(spec):
    # A System V segment would outlive the run in the reused sandbox's IPC namespace.
    code = (
        "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "print(libc.shmget(0, 4096, 0o1600), ctypes.get_errno(), libc.semget(0, 1, 0o1600), ctypes.get_errno())\n"
    )
    pool = SandboxPool(spec, concurrency=1)
    try:
        output = pool.run(stdio(spec, code))
    finally:
        pool.close()
    assert output.stdout == b"-1 1 -1 1\n"


def test_the_isolation_option_is_checked():
    with pytest.raises(ValueError, match="isolation must be one of"):
        CodeSandboxScorer(isolation="shared")


def test_runs_reuse_sandboxes_only_where_the_clean_up_is_confined(spec):
    scorer = CodeSandboxScorer(timeout_s=2.0, concurrency=1)
    try:
        assert scorer.reuses()
        for layer in ("pid_namespace", "mount_namespace", "ipc_namespace", "seccomp"):
            available = {**scorer.layers.available, layer: False}
            scorer.layers = LayerReport(available)
            assert not scorer.reuses(), layer
            scorer.layers = LayerReport({**available, layer: True})
        assert scorer.reuses()
        assert not CodeSandboxScorer(timeout_s=2.0, concurrency=1, isolation="strict").reuses()
    finally:
        scorer.close()


def test_the_zygote_refuses_to_run_outside_a_pid_namespace(spec):
    # Started as a plain process (no job is ever sent, so a zygote that did not refuse would only wait).
    mine, theirs = socket.socketpair()
    with mine:
        with theirs:
            proc = subprocess.Popen(
                spec.interpreter(HARNESS_SOURCE, theirs.fileno(), entry="zygote"),
                pass_fds=[theirs.fileno()],
                stderr=subprocess.PIPE,
                env={},
            )
        try:
            assert proc.wait(timeout=60) == 3
        finally:
            proc.kill()
            proc.wait()
        mine.settimeout(1.0)
        assert mine.recv(100) == b""  # no ready signal: the worker's wait for it fails
    assert b"PID 1" in proc.stderr.read()

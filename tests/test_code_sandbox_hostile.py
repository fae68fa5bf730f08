"""Hostile programs: for each, the worker survives, the machine is untouched, and the score is 0.

Each test runs real programs in the real sandbox. "Untouched" is checked from the host: no process of the run is
left (the pool is closed first, so its idle sandboxes do not count), the canary directory (world-writable, so
only the sandbox stands between it and the program) is as it was, no connection reached the host's listener.
Programs that try to read or exfiltrate something return what they found; the expected value is what a leak would
look like, so a leak would score 1, and the failure kind must be ``wrong_answer`` (the program ran to the end).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pytest

from workers.rewards.code_sandbox import CodeSandboxScorer
from workers.rewards.sandbox import cgroup
from workers.rewards.sandbox.isolation import LOAD_HARNESS
from workers.rewards.sandbox.layers import IsolationUnavailable
from workers.rewards.sandbox.prestarted import SandboxPool
from workers.rewards.sandbox.process import HARNESS_SOURCE, kill_orphaned_sandboxes

MARKER = f"7{os.getpid() % 1000:03d}.4242"
#: A new file in the host's /etc: the program must not be able to create it (removed again if it does).
PLANTED = f"/etc/roll-sandbox-planted-{os.getpid()}"
SQUARE_ASSERTS = json.dumps({"asserts": ["assert square(2) == 4", "assert square(3) == 9"]})
SQUARE_CALLS = json.dumps({"fn_name": "square", "inputs": [[2], [3]], "outputs": [4, 9]})
SUM_STDIO = json.dumps({"inputs": ["1 2\n", "20 22\n"], "outputs": ["3\n", "42\n"]})


@pytest.fixture(scope="module")
def scorer():
    try:
        scorer = CodeSandboxScorer(timeout_s=2.0, concurrency=2)
    except IsolationUnavailable as err:
        pytest.skip(f"this host cannot isolate the sandbox: {err}")
    yield scorer
    scorer.close()


@pytest.fixture(scope="module")
def roomy_scorer():
    """A scorer whose wall-clock limit stays out of the way of the memory limits. A memory bomb meets its limit in
    0.21-0.36 s on an idle 2-core AMD EPYC (5 runs, also with three busy loops beside it), yet CI's full suite once
    took the 2 s limit first ('timeout' for the gradual bomb, 2779dab); 15 s leaves a margin, and a bomb that the
    memory limits failed to stop still ends."""
    try:
        scorer = CodeSandboxScorer(timeout_s=15.0, concurrency=2)
    except IsolationUnavailable as err:
        pytest.skip(f"this host cannot isolate the sandbox: {err}")
    yield scorer
    scorer.close()


@pytest.fixture
def canary():
    """A world-writable directory in the host's /tmp with one file in it: only the sandbox protects it."""
    directory = Path(tempfile.mkdtemp(prefix="roll-sandbox-canary-", dir="/tmp"))
    (directory / "keep.txt").write_text("original")
    directory.chmod(0o777)
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


def runs_elsewhere(pid: int, workers: frozenset[int] = frozenset()) -> bool:
    """Whether a sandbox process belongs to a run that is not this test's (`make test` runs two pytest workers,
    and other tests' pipelines have reward workers of their own, some in a Ray cluster started detached, some in
    processes of a scoring pool). ``workers``: other scoring processes whose sandboxes count as this test's (ones
    it started, maybe killed).

    A sandbox's harness and every process its program starts are in a memory cgroup named for the worker that
    made it (workers/rewards/sandbox/cgroup.py; born inside, they cannot leave), so that cgroup, the process's own
    or that of a process below it (a bubblewrap stays in its worker's cgroup, its child is inside), names the run.
    Without one (a bubblewrap caught in its set-up, a host without memory cgroups), the ancestry decides, sandbox
    processes (bubblewraps, processes inside a sandbox's PID namespace) aside: under this process or one of
    ``workers`` -> this test's; under any other process (the other pytest worker, a Ray worker, another run's
    scoring process) -> another run's. Left: orphans, adopted by init or a subreaper above this test (a process
    that dies hands its children to one of its own ancestors). This test's bubblewraps are its children until it
    reaps them, so an orphan is this test's only if a worker of its own was killed (``workers``) or the host has
    no cgroups to tell runs apart.
"""
    me = os.getpid()
    mine = workers | {me}
    try:
        proc = psutil.Process(pid)
        worker = cgroup.process_creator(pid)
        if worker is None:
            below = (cgroup.process_creator(child.pid) for child in proc.children(recursive=True))
            worker = next((owner for owner in below if owner is not None), None)
        if worker is not None:
            return worker not in mine
        ancestors = proc.parents()
        above_me = {p.pid for p in psutil.Process(me).parents()}
    except psutil.Error:
        return False
    foreign = False
    for ancestor in ancestors:
        if ancestor.pid in mine:
            return False
        if ancestor.pid in above_me:
            break
        foreign = foreign or not in_sandbox(ancestor)
    return foreign or (not workers and sandbox_cgroups())


def in_sandbox(proc: psutil.Process) -> bool:
    """Whether ``proc`` is part of a sandbox: a bubblewrap, or a process in a PID namespace below the host's (its
    ``NSpid`` line names more than one pid). One that is gone counts as part of one: it proves nothing."""
    try:
        if proc.name() == "bwrap":
            return True
        status = Path(f"/proc/{proc.pid}/status").read_text()
    except (psutil.Error, OSError):
        return True
    nspid = next((line.split()[1:] for line in status.splitlines() if line.startswith("NSpid:")), [])
    return len(nspid) > 1


@functools.cache
def sandbox_cgroups() -> bool:
    """Whether this host gives each sandbox a memory cgroup (then a sandbox's processes name their worker)."""
    return cgroup.find_memory_cgroups()[0] is not None


def lineage(pid: int) -> str:
    """A process and its ancestors, each with its name, state and the worker named by its sandbox cgroup: what
    an assertion shows of a leftover, so that its owner can be found after it is gone."""
    links = []
    with contextlib.suppress(psutil.Error):
        proc = psutil.Process(pid)
        for member in [proc, *proc.parents()]:
            with contextlib.suppress(psutil.Error):
                name, status = member.name(), member.status()
                title = " ".join(member.cmdline())[:60]
                links.append(f"{member.pid} {name} ({status}, cgroup of {cgroup.process_creator(member.pid)}) {title!r}")
    return " <- ".join(links) + f" [this test: {os.getpid()}, its parent {os.getppid()}]"


def sandbox_processes(workers: frozenset[int] = frozenset()) -> list[tuple[int, str, bytes]]:
    """This run's sandbox processes still on the host, as (pid, /proc stat, command line): harness copies, our
    marked sleepers, unreaped bubblewraps (those of other runs aside, ``runs_elsewhere``)."""
    # A sandbox's command line carries the harness's source, or the loader of its compiled form (the usual case).
    signatures = (HARNESS_SOURCE[:200].encode(), LOAD_HARNESS.encode(), MARKER.encode())
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes()
            stat = (proc / "stat").read_text()
        except OSError:
            continue
        state, parent = stat.rsplit(")", 1)[1].split()[:2]
        # A bubblewrap its worker did not reap; one whose worker is gone is init's to reap (this machine's init
        # does it late: make test once found 32 such zombies, parent 1, left by a worker that had exited)
        zombie_bwrap = stat.split(" ", 2)[1] == "(bwrap)" and state == "Z" and parent != "1"
        pid = int(proc.name)
        # Still there after the check: one that exited in between (another run's bubblewrap ending as it was
        # read) is gone, not left; the check cannot place it and calls it this test's. CI failed on one, stop 87.
        if ((any(signature in cmdline for signature in signatures) or zombie_bwrap)
                and not runs_elsewhere(pid, workers) and psutil.pid_exists(pid)):
            found.append((pid, stat, cmdline))
    return found


def leftover_processes(workers: frozenset[int] = frozenset(), wait_s: float = 0.0) -> list[str]:
    """This run's sandbox processes still there after at most ``wait_s`` (they go as soon as they are reaped;
    the wait bounds a hang only), each described with its lineage."""
    deadline = time.monotonic() + wait_s
    while sandbox_processes(workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [f"{pid}: {stat[:40]} {cmdline[:80]!r}; lineage {lineage(pid)}"
            for pid, stat, cmdline in sandbox_processes(workers)]


def score_hostile(scorer, code, test_cases):
    """Score ``code``, then check that the run left no process behind (after closing the pool)."""
    start = time.monotonic()
    result = scorer.score(code, "", test_cases=test_cases)
    elapsed = time.monotonic() - start
    scorer.close()
    assert leftover_processes(wait_s=60.0) == []
    assert result.score == 0.0 and not result.correct
    return result, elapsed


def first_failure(result) -> str:
    return next(k for k, v in result.metrics.items() if k != "pass_rate" and v == 1.0)


def assert_scorer_still_works(scorer):
    assert scorer.score("def square(x):\n    return x * x\n", "", test_cases=SQUARE_ASSERTS).correct


# ---- resource exhaustion and escapes ----


@pytest.mark.slow
def test_infinite_loop(scorer):
    # the loop never ends: that the scorer returned at all, with this verdict, is the timeout at work
    result, _ = score_hostile(scorer, "def square(x):\n    while True:\n        pass\n", SQUARE_ASSERTS)
    assert first_failure(result) == "timeout"


@pytest.mark.slow
def test_sleep_past_the_timeout_holding_children(scorer):
    code = f"""
import os, time
def square(x):
    for _ in range(3):
        if os.fork() == 0:
            os.execv("/bin/sleep", ["sleep", "{MARKER}"])
    time.sleep(100)
"""
    result, elapsed = score_hostile(scorer, code, SQUARE_CALLS)
    assert first_failure(result) == "timeout"
    # The children sleep over 7000 s holding the output pipe: a scorer that waited for them would take that long.
    # The bound is far from both that and the 2 s timeout, so no machine's speed decides it.
    assert elapsed < 600


def test_child_that_calls_setsid_to_escape(scorer):
    code = f"""
import os
def square(x):
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            os.execv("/bin/sleep", ["sleep", "{MARKER}"])
        os._exit(0)
    return -1
"""
    score_hostile(scorer, code, SQUARE_CALLS)


@pytest.mark.slow
def test_fork_bomb(scorer):
    code = """
import os
def square(x):
    while True:
        try:
            os.fork()
        except OSError:
            pass
"""
    result, _ = score_hostile(scorer, code, SQUARE_CALLS)
    assert first_failure(result) == "timeout"


def test_process_count_is_limited(scorer):
    # Count how many children can exist at once; the harness itself takes one of the 16 slots.
    code = """
import os, time
n = 0
try:
    while n < 1000:
        if os.fork() == 0:
            time.sleep(30)
            os._exit(0)
        n += 1
except OSError:
    pass
print(n)
"""
    pool = SandboxPool(scorer.spec, concurrency=1)
    try:
        output = pool.run({"mode": "stdio", "code": code, "limits": scorer.spec.limits.for_job()})
    finally:
        pool.close()
    assert 0 < int(output.stdout) <= 15


@pytest.mark.parametrize(
    "code",
    [
        "x = bytearray(8 * 1024 ** 3)\ndef square(x):\n    return x * x\n",
        "chunks = []\nwhile True:\n    chunks.append(bytearray(10 ** 7))\n",
        "def square(x):\n    return len([0] * (10 ** 10))\n",
    ],
    ids=["one-allocation", "gradual", "in-the-call"],
)
def test_memory_bomb(scorer, roomy_scorer, code):
    scorer.close()  # the module's other scorer: its idle sandboxes would count as this run's leftovers
    result, _ = score_hostile(roomy_scorer, code, SQUARE_CALLS)
    assert first_failure(result) == "memory_limit"


def test_endless_output(scorer):
    """A program that writes without end: only the output limit can end it before the timeout, so the verdict
    shows the limit cut it (no duration is compared)."""
    code = "import sys\nwhile True:\n    sys.stdout.write('x' * (1 << 20))\n"
    result, _ = score_hostile(scorer, code, SUM_STDIO)
    assert first_failure(result) == "output_limit"


def test_filling_the_disk(scorer):
    code = """
import os
def fill():
    total = 0
    block = b"x" * (1 << 20)
    for directory in ("/tmp", ".", "/", "/dev", "/dev/shm", "/usr", "/var/tmp", "/home"):
        for i in range(2000):
            try:
                with open(os.path.join(directory, f"fill{i}"), "wb") as f:
                    for _ in range(64):
                        f.write(block)
                        f.flush()
                        total += len(block)
            except (OSError, ValueError):
                break
    return total
"""
    score_hostile(scorer, code, json.dumps({"fn_name": "fill", "inputs": [[]], "outputs": [-1]}))
    # The same program, with its total shown: only the two size-limited tmpfs mounts took data.
    pool = SandboxPool(scorer.spec, concurrency=1)
    try:
        job = {"mode": "stdio", "code": code + "\nprint(fill())\n", "limits": scorer.spec.limits.for_job()}
        output = pool.run(job)
    finally:
        pool.close()
    written = int(output.stdout)
    assert 0 < written <= (64 + 8) * 1024 * 1024


def test_writing_and_deleting_files_outside_the_temp_dir(scorer, canary):
    code = f"""
import os, shutil
def square(x):
    for action in (
        lambda: os.remove({str(canary / "keep.txt")!r}),
        lambda: open({str(canary / "keep.txt")!r}, "w").write("changed"),
        lambda: open({str(canary / "new.txt")!r}, "w").write("planted"),
        lambda: shutil.rmtree({str(canary)!r}),
        lambda: open({PLANTED!r}, "w").write("planted"),
    ):
        try:
            action()
        except OSError:
            pass
    return -1
"""
    try:
        score_hostile(scorer, code, SQUARE_CALLS)
        assert not os.path.exists(PLANTED)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(PLANTED)
    assert sorted(p.name for p in canary.iterdir()) == ["keep.txt"]
    assert (canary / "keep.txt").read_text() == "original"


# ---- reading what it should not ----


def test_reading_shadow_environment_and_proc(scorer, monkeypatch):
    monkeypatch.setenv("ROLL_SANDBOX_TEST_SECRET", "s3cr3t-value")
    code = """
import glob, os
def shadow():
    try:
        with open("/etc/shadow") as f:
            return len(f.read()) > 0
    except OSError:
        return False
def environ():
    return "ROLL_SANDBOX_TEST_SECRET" in os.environ or any(v == "s3cr3t-value" for v in os.environ.values())
def proc_environ(pattern):
    for path in glob.glob(pattern):
        try:
            with open(path, "rb") as f:
                if b"ROLL_SANDBOX_TEST_SECRET" in f.read():
                    return True
        except OSError:
            pass
    return False
"""
    asserts = [
        "assert shadow()",
        "assert environ()",
        "assert proc_environ('/proc/1/environ')",
        "assert proc_environ('/proc/*/environ')",
        "import os\nassert os.system('cat /etc/shadow > /tmp/s 2>/dev/null') == 0",
    ]
    result, _ = score_hostile(scorer, code, json.dumps({"asserts": asserts}))
    assert first_failure(result) == "wrong_answer"


def test_expected_outputs_never_enter_the_sandbox(scorer):
    # The program searches everything it can reach for the expected value; finding it would score 1.
    search = """
import gc, os, sys
def find():
    prefix = "canary" + "-"
    for obj in gc.get_objects():
        for text in (obj if isinstance(obj, (list, tuple)) else obj.values() if isinstance(obj, dict) else [obj]):
            if isinstance(text, str) and prefix in text and text != prefix:
                return text[text.index(prefix):text.index(prefix) + 11]
    for frame in sys._current_frames().values():
        while frame:
            for value in list(frame.f_locals.values()) + list(frame.f_globals.values()):
                if isinstance(value, str) and prefix in value and value != prefix:
                    return value[value.index(prefix):value.index(prefix) + 11]
            frame = frame.f_back
    for path in ("/proc/self/cmdline", "/proc/self/environ", "/proc/1/cmdline"):
        data = open(path, "rb").read().decode(errors="replace")
        if prefix + "4" in data:
            return data[data.index(prefix):data.index(prefix) + 11]
    return None
"""
    calls = json.dumps({"fn_name": "find", "inputs": [[]], "outputs": ["canary-4711"]})
    asserts = json.dumps({"asserts": ["assert find() == 'canary-4711'"]})
    stdio = json.dumps({"inputs": ["x\n"], "outputs": ["canary-4711\n"]})
    for tests, program in ((calls, search), (asserts, search), (stdio, search + "\nprint(find())\n")):
        result, _ = score_hostile(scorer, program, tests)
        assert first_failure(result) == "wrong_answer"


def test_host_loopback_is_unreachable(scorer):
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.settimeout(0.2)
    port = listener.getsockname()[1]
    accepted = []
    stop = threading.Event()

    def accept():
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                accepted.append(listener.accept()[0])

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    code = f"""
import socket
def reach():
    for host in ("127.0.0.1", "localhost", "::1"):
        try:
            socket.create_connection((host, {port}), timeout=0.5).close()
            return True
        except OSError:
            pass
    return False
"""
    try:
        result, _ = score_hostile(
            scorer, code, json.dumps({"fn_name": "reach", "inputs": [[]], "outputs": [True]})
        )
    finally:
        stop.set()
        thread.join()
        listener.close()
    assert first_failure(result) == "wrong_answer"
    assert accepted == []


def test_the_sandbox_sees_only_its_own_loopback(scorer):
    code = "import socket\ndef interfaces():\n    return sorted(name for _, name in socket.if_nameindex())\n"
    tests = json.dumps({"fn_name": "interfaces", "inputs": [[]], "outputs": [["lo"]]})
    assert scorer.score(code, "", test_cases=tests).correct


# ---- attacking the worker ----


def test_killing_the_parent_and_kill_minus_one(scorer):
    code = f"""
import os, signal
for pid in (os.getppid(), 1, {os.getpid()}, -1):
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass
def square(x):
    return -1
"""
    score_hostile(scorer, code, SQUARE_ASSERTS)
    assert_scorer_still_works(scorer)


@pytest.mark.parametrize("module", ["os", "posix"])
def test_os_system_and_posix_system(scorer, canary, module):
    code = f"""
import {module}
{module}.system("rm -rf {canary}; echo planted > {canary}/new.txt; kill -9 -1 {os.getpid()}")
{module}.system("echo '{{\\"t\\": 0, \\"passed\\": true}}' >&3; echo '{{\\"ev\\": \\"done\\", \\"ok\\": true}}'")
def square(x):
    return -1
"""
    score_hostile(scorer, code, SQUARE_CALLS)
    assert sorted(p.name for p in canary.iterdir()) == ["keep.txt"]
    assert_scorer_still_works(scorer)


# ---- reward hacks ----


@pytest.mark.parametrize(
    "code",
    [
        "import sys\nsys.exit(0)\ndef square(x):\n    return x * x\n",
        "import os\nos._exit(0)\ndef square(x):\n    return x * x\n",
        "raise SystemExit(0)\n",
    ],
    ids=["sys.exit", "os._exit", "SystemExit"],
)
@pytest.mark.parametrize("tests", [SQUARE_ASSERTS, SQUARE_CALLS], ids=["asserts", "calls"])
def test_exit_before_the_tests_run(scorer, code, tests):
    result, _ = score_hostile(scorer, code, tests)
    assert first_failure(result) == "runtime_error"


@pytest.mark.parametrize("tests", [SQUARE_ASSERTS, SQUARE_CALLS], ids=["asserts", "calls"])
def test_object_whose_eq_is_always_true(scorer, tests):
    code = """
class Anything(int):
    def __eq__(self, other):
        return True
    def __ne__(self, other):
        return False
    __hash__ = int.__hash__
def square(x):
    return Anything(0)
"""
    result, _ = score_hostile(scorer, code, tests)
    assert first_failure(result) == "wrong_answer"


def test_atexit_hooks(scorer):
    code = """
import atexit, os, sys
def forge():
    print("All tests passed")
    for fd in (1, 2, 3):
        try:
            os.write(fd, b'{"t": 0, "p": [{"v": true}]}\\n{"t": 1, "ok": true}\\n{"ev": "done"}\\n')
        except OSError:
            pass
atexit.register(forge)
sys.exitfunc = forge
def square(x):
    return -1
"""
    score_hostile(scorer, code, SQUARE_ASSERTS)


def test_monkeypatching_the_harness_and_the_assert_machinery(scorer):
    code = """
import builtins, json, sys
harness = sys.modules["__main__"]
harness.encode = lambda value, depth=0: True
real_emit = harness._emit
harness._emit = lambda event: real_emit(dict(event, ok=True, passed=True))
harness._error_name = lambda err: "Passed"
builtins.AssertionError = type("NeverRaised", (Exception,), {})
builtins.isinstance = lambda *a: True
json.dumps = lambda *a, **k: '{"t": 0, "passed": true}'
def square(x):
    return -1
"""
    for tests in (SQUARE_ASSERTS, SQUARE_CALLS):
        score_hostile(scorer, code, tests)


def test_walking_stack_frames_to_edit_the_result(scorer):
    code = """
import sys
def square(x):
    frame = sys._getframe(1)
    while frame is not None:
        for value in list(frame.f_locals.values()):
            if isinstance(value, list):
                value[:] = [{"t": i, "v": True, "passed": True} for i in range(len(value))]
            elif isinstance(value, dict):
                for key in list(value):
                    if isinstance(value[key], (list, bool)):
                        value[key] = True
        frame = frame.f_back
    return -1
"""
    for tests in (SQUARE_ASSERTS, SQUARE_CALLS):
        score_hostile(scorer, code, tests)


def test_printing_the_expected_output_then_crashing(scorer):
    stdio = "a, b = map(int, input().split())\nprint(a + b, flush=True)\nraise RuntimeError('crash')\n"
    result, _ = score_hostile(scorer, stdio, SUM_STDIO)
    assert first_failure(result) == "runtime_error"
    signal_crash = (
        "import ctypes\na, b = map(int, input().split())\nprint(a + b, flush=True)\nctypes.string_at(0)\n"
    )
    result, _ = score_hostile(scorer, signal_crash, SUM_STDIO)
    assert first_failure(result) == "runtime_error"
    calls = "def square(x):\n    print(x * x)\n    raise RuntimeError('crash')\n"
    result, _ = score_hostile(scorer, calls, SQUARE_CALLS)
    assert first_failure(result) == "runtime_error"


def test_fake_result_lines_do_not_pass(scorer):
    fake = json.dumps({"syntax_error": False, "runtime_error": False, "passed": [True, True]})
    code = (
        "import os, sys\n"
        f"for line in ({fake!r}, '@@roll-sandbox-result:' + '0' * 32 + '@@' + {fake!r}, '{{\"ev\": \"done\"}}'):\n"
        "    print(line)\n"
        "    os.write(3, (line + '\\n').encode())\n"
        "sys.stdout.flush()\n"
        "os._exit(0)\n"
    )
    for tests in (SQUARE_ASSERTS, SQUARE_CALLS):
        score_hostile(scorer, code, tests)


# ---- reward hacks on the formats real datasets use (must score 0, unmasked) ----

#: HumanEval's own shape: the asserts sit inside check(candidate), with loops and comprehensions.
NESTED_CHECK = json.dumps(
    {
        "test": (
            "def check(candidate):\n"
            "    assert candidate(2) == 4\n"
            "    for x in range(-3, 4):\n"
            "        assert candidate(x) == x * x, x\n"
            "    if True:\n"
            "        assert all(candidate(x) == x * x for x in [5, 6])\n"
            "    assert all([candidate(x) == x * x for x in [7, 8]])\n"
            "    assert sum(candidate(x) for x in range(3)) == 5\n"
        ),
        "entry_point": "square",
    }
)
#: The same checks as assert-style strings: loops, comprehensions, computed expected values.
LOOPED_ASSERTS = json.dumps(
    {
        "asserts": [
            "for x in range(4):\n    assert square(x) == x * x",
            "assert all(square(x) == x * x for x in [5, 6])",
            "assert all([square(x) == x * x for x in [7, 8]])",
            "assert square(3) == len(range(9))",
            "assert list(map(square, [1, 2])) == list(map(lambda v: v * v, [1, 2]))",
            "def check(candidate):\n    assert candidate(10) == 100\ncheck(square)",
        ]
    }
)
ALWAYS_EQUAL = """
class Anything:
    def __eq__(self, other):
        return True
    def __ne__(self, other):
        return False
    __hash__ = object.__hash__
def square(x):
    return Anything()
"""
FORGED_CHANNEL = """
import json, os
for fd in range(3, 64):
    for line in ({"t": 0, "r": "passed"}, {"t": 0, "p": []}, {"id": 0, "v": 4}, {"ev": "done"}):
        try:
            os.write(fd, (json.dumps(line) + "\\n").encode())
        except OSError:
            pass
def square(x):
    return None
"""
PATCHED_HARNESS = """
import builtins, sys
builtins.AssertionError = type("AssertionError", (Exception,), {})
builtins.all = lambda xs: True
builtins.len = lambda x: 0
builtins.range = lambda *a: [0]
builtins.map = lambda f, xs: []
main = sys.modules["__main__"]
for name in dir(main):
    if callable(getattr(main, name, None)) and not name.startswith("__"):
        try:
            setattr(main, name, lambda *a, **k: None)
        except Exception:
            pass
def square(x):
    return -1
"""
READS_THE_JOB = """
import sys, gc
found = [o for o in gc.get_objects() if isinstance(o, dict) and "tests" in o]
def square(x):
    # Whatever it finds, it can only return data; the checks are not in its interpreter.
    return found[0]["tests"] if found else -1
"""


@pytest.mark.parametrize("tests", [NESTED_CHECK, LOOPED_ASSERTS], ids=["check-function", "asserts"])
@pytest.mark.parametrize(
    "code",
    [
        "def square(x):\n    return None\n",
        ALWAYS_EQUAL,
        FORGED_CHANNEL,
        PATCHED_HARNESS,
        READS_THE_JOB,
        "def square(x):\n    raise SystemExit(0)\n",
        "import os\ndef square(x):\n    os._exit(0)\n",
        "square = None\n",
        "range = lambda *a: [0]\nlen = lambda x: 1\nmap = lambda *a: [1, 1]\ndef square(x):\n    return 1\n",
    ],
    ids=[
        "none",
        "always-equal",
        "forged-channel",
        "patched-harness",
        "reads-job",
        "exit",
        "os-exit",
        "no-fn",
        "shadows-builtins",
    ],
)
def test_checks_inside_functions_loops_and_comprehensions_are_not_gameable(scorer, tests, code):
    result = scorer.score(code, "", test_cases=tests)
    assert result is not None and result.score == 0.0 and not result.correct, result
    assert result.metrics["pass_rate"] == 0.0


@pytest.mark.parametrize("tests", [NESTED_CHECK, LOOPED_ASSERTS], ids=["check-function", "asserts"])
def test_honest_square_passes_the_same_checks(scorer, tests):
    assert scorer.score("def square(x):\n    return x * x\n", "", test_cases=tests).correct


@pytest.mark.parametrize(
    ("code", "tests"),
    [
        ("def f():\n    return 8888889.0\n", {"fn_name": "f", "inputs": [[]], "outputs": [8888888]}),
        ("def f():\n    return 4000001.0\n", {"fn_name": "f", "inputs": [[]], "outputs": [4000000]}),
        ("def f():\n    return 4000000.000001\n", {"fn_name": "f", "inputs": [[]], "outputs": [4000000]}),
        ("print(8888889.0)\n", {"inputs": [""], "outputs": ["8888888\n"]}),
        ("print('4000000.000001')\n", {"inputs": [""], "outputs": ["4000000\n"]}),
        ("print('1.0000000000001e400')\n", {"inputs": [""], "outputs": ["1" + "0" * 400 + "\n"]}),
    ],
)
def test_integer_answers_are_not_judged_with_a_float_tolerance(scorer, code, tests):
    result = scorer.score(code, "", test_cases=json.dumps(tests))
    assert (result.score, first_failure(result)) == (0.0, "wrong_answer")


def test_integral_floats_equal_to_the_integer_pass(scorer):
    calls = {"fn_name": "f", "inputs": [[]], "outputs": [4000000]}
    assert scorer.score("def f():\n    return 4000000.0\n", "", test_cases=json.dumps(calls)).correct
    stdio = {"inputs": [""], "outputs": ["4000000\n"]}
    assert scorer.score("print(4000000.0)\n", "", test_cases=json.dumps(stdio)).correct


@pytest.mark.parametrize("digits", [5000, 20000])
def test_huge_integers_in_the_output_are_scored_not_masked(scorer, digits):
    right = "7" * digits
    tests = json.dumps({"inputs": [""], "outputs": [right + "\n"]})
    # sys.set_int_max_str_digits lifts the program's own limit; the judge compares digit strings either way.
    wrong = f"import sys\nsys.set_int_max_str_digits(0)\nprint(int('7' * {digits}) + 1)\n"
    result = scorer.score(wrong, "", test_cases=tests)
    assert (result.score, first_failure(result)) == (0.0, "wrong_answer")
    assert scorer.score(f"print('7' * {digits})\n", "", test_cases=tests).correct


@pytest.mark.slow
def test_slow_stdio_tests_share_one_budget_and_end_as_timeouts():
    # 8 tests x 1.2 s each would pass a 4 s budget: the tests left when it is spent are timeouts, scored 0.
    scorer = CodeSandboxScorer(timeout_s=1.5, sample_timeout_s=4.0, concurrency=1)
    try:
        tests = json.dumps({"inputs": [""] * 8, "outputs": ["ok\n"] * 8})
        result = scorer.score("import time\ntime.sleep(1.2)\nprint('ok')\n", "", test_cases=tests)
    finally:
        scorer.close()
    assert result is not None and first_failure(result) == "timeout"
    # A count, not a clock: 4 s hold at most three 1.2 s runs, so at most 3 of the 8 tests passed (all 8 would
    # pass without the shared budget; each run alone is within its 1.5 s).
    assert result.metrics["pass_rate"] <= 3 / 8


SLOW_AND_WRONG = """
import ctypes, time
ctypes.CDLL(None, use_errno=True).prctl(1, 0, 0, 0, 0)  # clear the parent-death signal (refused: harmless)
input()
time.sleep(1.8)  # each test under the run's 2 s limit, all four together past the worker's 6 s
print(0)
"""


@pytest.mark.slow
def test_slow_stdio_tests_end_in_a_score_before_the_reward_workers_limit_masks_them(scorer):
    """Under a reward worker whose limit (6 s) is below the scorer's default sample budget (20 s), tests that are
    each within their run's limit but together slow were masked (worker timeout): an answer a policy could learn
    to prefer to a wrong one. The worker fits the budget inside its limit (4 s), so the sample is scored 0."""
    from workers.rewards.worker import RewardWorker

    tests = json.dumps({"inputs": ["1\n"] * 4, "outputs": ["2\n"] * 4})
    with RewardWorker("code", "code_sandbox", {"timeout_s": 2.0, "concurrency": 1}, timeout_s=6.0, processes=1) as w:
        (record,) = w.score_batch([{"response": SLOW_AND_WRONG, "ground_truth": "", "test_cases": tests}])
        stats = w.stats()
        workers = frozenset(p.pid for p in psutil.Process().children(recursive=True))  # its scoring processes
    assert record.mask_reason is None, record
    assert (record.score, record.correct) == (0.0, False)
    assert record.metrics["timeout"] == 1.0 or record.metrics["wrong_answer"] == 1.0
    assert stats["scored"] == 1 and stats["masked_timeout"] == 0
    # The worker's scoring processes are stopped with a kill: a spare sandbox caught in bubblewrap's set-up goes
    # when the next scorer starts (as after a killed worker, below); then nothing of the run is left (the module's
    # scorer closed too, so that its idle sandboxes do not count).
    scorer.close()
    CodeSandboxScorer(concurrency=1).close()
    assert leftover_processes(workers, wait_s=30.0) == []


# ---- honest programs (must score 1) ----


@pytest.mark.parametrize(
    "code",
    [
        "print(int(input()) * 2)\nexit()\n",
        "print(int(input()) * 2)\nquit()\n",
        "print(int(input()) * 2)\nexit(0)\n",
        "import sys\nprint(int(input()) * 2)\nsys.exit()\n",
    ],
    ids=["exit", "quit", "exit-0", "sys-exit"],
)
def test_exit_and_quit_end_a_correct_program(scorer, code):
    assert scorer.score(code, "", test_cases=json.dumps({"inputs": ["21\n"], "outputs": ["42\n"]})).correct


@pytest.mark.parametrize(
    ("code", "tests"),
    [
        (
            "import sys\nsys.setrecursionlimit(100000)\ndef depth(n):\n    return 0 if n == 0 else 1 + depth(n - 1)\n"
            "import threading\nthreading.stack_size(256 * 1024 * 1024)\nout = []\n"
            "t = threading.Thread(target=lambda: out.append(depth(50000)))\nt.start()\nt.join()\nprint(out[0])\n",
            {"inputs": [""], "outputs": ["50000\n"]},
        ),
        (
            "print('\\n'.join(str(i) for i in range(100000)))\n",
            {"inputs": [""], "outputs": ["\n".join(str(i) for i in range(100000)) + "\n"]},
        ),
        ("print(input().strip() + ' x')\n", {"inputs": ["abc\r\n"], "outputs": ["abc x  \r\n\r\n"]}),
        ("print(input()[::-1])\n", {"inputs": ["héllo wörld ✓\n"], "outputs": ["✓ dlröw olléh\n"]}),
    ],
    ids=["deep-recursion-in-a-thread", "600kb-output", "crlf", "non-ascii"],
)
def test_honest_programs_pass(scorer, code, tests):
    assert scorer.score(code, "", test_cases=json.dumps(tests)).correct


@pytest.mark.parametrize(
    "test",
    [
        "assert all(f(x) == x * x for x in range(5))",
        "assert sum(f(x) for x in range(4)) == 14",
        "assert f(3) == len(range(9))",
        "assert list(map(f, [1, 2])) == [1, 4]",
        "xs = [3, 1, 2]\nsort_in_place(xs)\nassert xs == [1, 2, 3]",
        "try:\n    f(-1)\n    assert False\nexcept ValueError:\n    pass",
        "assert sorted(pairs(2)) == [(0, 1), (1, 0)]",
        "assert list(gen(3)) == [0, 1, 2]",
        "assert Solution().twice(4) == 8",
        "acc = Counter()\nacc.add(2)\nacc.add(3)\nassert acc.total == 5",
    ],
)
def test_honest_code_passes_checks_the_old_split_refused(scorer, test):
    code = """
def f(x):
    if x < 0:
        raise ValueError("negative")
    return x * x
def sort_in_place(xs):
    xs.sort()
def pairs(n):
    return [(i, n - 1 - i) for i in range(n)]
def gen(n):
    yield from range(n)
class Solution:
    def twice(self, x):
        return 2 * x
class Counter:
    def __init__(self):
        self.total = 0
    def add(self, x):
        self.total += x
"""
    result = scorer.score(code, "", test_cases=json.dumps({"asserts": [test]}))
    assert result.correct, result


# ---- host effects ----

SCORING_PROCESS = """
import json, sys
sys.path.insert(0, {root!r})
from workers.rewards.code_sandbox import CodeSandboxScorer
scorer = CodeSandboxScorer(timeout_s=60.0, sample_timeout_s=60.0, concurrency=1)
tests = json.dumps({{"fn_name": "square", "inputs": [[2]], "outputs": [4]}})
print("scoring", flush=True)
scorer.score({code!r}, "", test_cases=tests)
"""
DISARMS_AND_HIDES = f"""
import ctypes, os, time
libc = ctypes.CDLL(None, use_errno=True)
libc.prctl(1, 0, 0, 0, 0)  # clear the parent-death signal bubblewrap set (refused under the filter)
if os.fork() == 0:
    os.setsid()
    libc.prctl(1, 0, 0, 0, 0)
    os.execv("/bin/sleep", ["sleep", "{MARKER}"])
def square(x):
    time.sleep(100)
"""


def marked_processes(workers: frozenset[int]) -> list[int]:
    return [pid for pid, _, cmdline in sandbox_processes(workers) if MARKER.encode() in cmdline]


@pytest.mark.slow
def test_nothing_outlives_a_scoring_process_killed_mid_run(scorer):
    scorer.close()
    root = str(Path(__file__).resolve().parent.parent)
    script = SCORING_PROCESS.format(root=root, code=DISARMS_AND_HIDES)
    process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE)
    worker = frozenset({process.pid})
    try:
        assert process.stdout.readline() == b"scoring\n"
        deadline = time.monotonic() + 60.0
        while not marked_processes(worker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marked_processes(worker), "the program's hidden child never started"
        process.kill()  # SIGKILL: no finalizer, no atexit, no pool.close()
        process.wait()
        # The program's processes die with the worker, at once: nothing they do can keep them.
        deadline = time.monotonic() + 30.0
        while marked_processes(worker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marked_processes(worker) == [], leftover_processes(worker)
        # What the dead worker could not clean up itself (a spare sandbox caught in bubblewrap's set-up, the empty
        # cgroups) goes when the next scorer starts.
        CodeSandboxScorer(concurrency=1).close()
        assert leftover_processes(worker, wait_s=30.0) == []
        base = scorer.spec.memory_cgroups.base
        assert not [n for n in os.listdir(base) if n.startswith(f"roll-sandbox-{process.pid}-")]
    finally:
        process.kill()
        process.wait()


@pytest.mark.parametrize(
    ("call", "args"),
    [
        ("keyctl", "0, -3, 0, 0, 0"),  # KEYCTL_GET_KEYRING_ID of the session keyring
        ("add_key", "b'user', b'roll-planted', b'x', 1, -3"),
        ("io_uring_setup", "8, ctypes.create_string_buffer(120)"),
        ("userfaultfd", "0"),
        ("perf_event_open", "ctypes.create_string_buffer(128), 0, -1, -1, 0"),
        ("bpf", "0, ctypes.create_string_buffer(64), 64"),
        ("ptrace", "0, 0, 0, 0"),
        ("unshare", "0x20000000"),
        ("mount", "b'none', b'/tmp', b'tmpfs', 0, 0"),
        ("prctl", "1, 0, 0, 0, 0"),
    ],
)
def test_dangerous_system_calls_are_refused(scorer, call, args):
    numbers = {
        "keyctl": 250,
        "add_key": 248,
        "io_uring_setup": 425,
        "userfaultfd": 323,
        "perf_event_open": 298,
        "bpf": 321,
        "ptrace": 101,
        "unshare": 272,
        "mount": 165,
        "prctl": 157,
    }
    if os.uname().machine != "x86_64":
        pytest.skip("syscall numbers of x86_64")
    code = (
        "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        f"result = libc.syscall({numbers[call]}, {args})\n"
        "print(result, ctypes.get_errno())\n"
    )
    # -1 with EPERM (1): refused by the filter, whatever the call would have done.
    result = scorer.score(code, "", test_cases=json.dumps({"inputs": [""], "outputs": ["-1 1\n"]}))
    assert result.correct, f"{call} was not refused"


def test_keys_do_not_cross_runs(scorer):
    plant = (
        "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "print(libc.syscall(248, b'user', b'roll-planted', b'secret', 6, -3) > 0)\n"
    )
    assert scorer.score(plant, "", test_cases=json.dumps({"inputs": [""], "outputs": ["False\n"]})).correct


CHILDREN_HOLDING_MEMORY = """
import os, time
children = []
for _ in range(3):
    pid = os.fork()
    if pid == 0:
        block = bytearray(b"\\x01") * (150 * 1024 * 1024)  # written, so the pages are really held
        time.sleep(1.0)
        os._exit(0)
    children.append(pid)
print(sum(os.waitpid(pid, 0)[1] == 0 for pid in children))
"""


@pytest.mark.slow
def test_processes_share_one_memory_bound():
    # Each child stays under memory_mb (RLIMIT_AS, per process); together they pass total_memory_mb.
    # The program needs about 1 s; with a 10 s limit the roomy run came out "timeout" twice under a loaded make test
    # (2026-11-30 and 2026-12-03, while test_learning's clusters started) and passed alone. Time is not what this
    # test asks about: the limit is 120 s, which no load seen here comes near; both runs end in about 1 s (the
    # bounded one with a child killed), so neither waits on it.
    tests = json.dumps({"inputs": [""], "outputs": ["3\n"]})
    bounded = CodeSandboxScorer(timeout_s=120.0, sample_timeout_s=120.0, memory_mb=256, total_memory_mb=256,
                                concurrency=1)
    roomy = CodeSandboxScorer(timeout_s=120.0, sample_timeout_s=120.0, memory_mb=256, total_memory_mb=1024,
                              concurrency=1)

    def score(scorer):
        return scorer.score(CHILDREN_HOLDING_MEMORY, "", test_cases=tests)

    try:
        assert score(roomy).correct
        result = score(bounded)
    finally:
        bounded.close()
        roomy.close()
    assert result.score == 0.0 and first_failure(result) in ("wrong_answer", "memory_limit")


@pytest.mark.slow
def test_a_run_killed_for_memory_is_a_memory_limit():
    code = "block = bytearray(b'\\x01') * (200 * 1024 * 1024)\nprint('held')\n"
    scorer = CodeSandboxScorer(timeout_s=10.0, memory_mb=512, total_memory_mb=128, concurrency=1)
    try:
        result = scorer.score(code, "", test_cases=json.dumps({"inputs": [""], "outputs": ["held\n"]}))
    finally:
        scorer.close()
    assert (result.score, first_failure(result)) == (0.0, "memory_limit")


EXITS_WITHOUT_CLOSING = """
import json, sys
sys.path.insert(0, {root!r})
from workers.rewards.code_sandbox import CodeSandboxScorer
scorer = CodeSandboxScorer(concurrency=2, pool_size=6)
tests = json.dumps({{"fn_name": "f", "inputs": [[2]], "outputs": [4]}})
assert scorer.score("def f(x):\\n    return x * x\\n", "", test_cases=tests).correct
print(__import__("os").getpid(), flush=True)
# No close(): the interpreter exits while the pool is still starting sandboxes.
"""


@pytest.mark.slow
def test_a_worker_that_exits_without_closing_leaves_nothing(scorer):
    scorer.close()
    root = str(Path(__file__).resolve().parent.parent)
    base = scorer.spec.memory_cgroups.base
    for _ in range(3):
        done = subprocess.run(
            [sys.executable, "-c", EXITS_WITHOUT_CLOSING.format(root=root)], capture_output=True, timeout=120
        )
        assert done.returncode == 0, done.stderr[-2000:]
        pid = int(done.stdout)
        assert leftover_processes(frozenset({pid})) == []
        assert not [n for n in os.listdir(base) if n.startswith(f"roll-sandbox-{pid}-")]


#: The orphans below run as a uid of their own, not the sandboxes' (nobody): a scorer starting in another test
#: worker sweeps that user's orphans and would take these from under the test.
ORPHAN_UID = 61000


def start_orphan(python: str, uid: int, argv: list[str]) -> int:
    """Start `argv` as `uid` from a parent that exits at once, so that the host's init adopts it; its pid."""
    spawner = subprocess.run(
        [python, "-c", "import subprocess as s, sys; print(s.Popen(sys.argv[1:], stdout=s.DEVNULL, stderr=s.DEVNULL).pid)", *argv],
        capture_output=True,
        user=uid,
        check=True,
        timeout=60,
    )
    return int(spawner.stdout)


@pytest.mark.skipif(os.getuid() != 0, reason="starts processes as the sandbox user")
def test_orphaned_sandbox_processes_are_killed_at_start_and_live_ones_are_not(scorer):
    uid = ORPHAN_UID
    python = scorer.spec.python  # an interpreter every user can run
    sleeper = [python, "-c", "import time; time.sleep(600)", LOAD_HARNESS]
    # An orphan (its parent exits at once, so the host's init adopts it) and a live worker's child.
    orphan = start_orphan(python, uid, sleeper)
    live = subprocess.Popen(sleeper, user=uid)
    try:
        deadline = time.monotonic() + 10.0
        while kill_orphaned_sandboxes(uid) != [orphan] and time.monotonic() < deadline:
            time.sleep(0.05)  # until the orphan is adopted
        assert live.poll() is None
        deadline = time.monotonic() + 10.0
        while Path(f"/proc/{orphan}").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not Path(f"/proc/{orphan}").exists() or "Z" in Path(f"/proc/{orphan}/stat").read_text().split()[2]
    finally:
        live.kill()
        live.wait()
        with contextlib.suppress(ProcessLookupError):
            os.kill(orphan, 9)


@pytest.mark.skipif(os.getuid() != 0, reason="starts processes as the sandbox user")
def test_an_orphan_and_the_sandbox_process_it_leaves_go_in_one_sweep(scorer):
    """A scoring process killed while bubblewrap set a sandbox up leaves bubblewrap's outer process adopted by init,
    and under it the namespace's first process (still bubblewrap, not yet the harness): init adopts that one only
    once the outer one is dead. One sweep, as a new scorer makes at its start, must take both (a sweep that killed
    the outer one alone left the inner one on the host until the next scorer started)."""
    uid = ORPHAN_UID
    python = scorer.spec.python
    inner = [python, "-c", "import time; time.sleep(600)", LOAD_HARNESS]
    # The outer one holds 1 GiB: a process that is killed frees its memory before its children are adopted, so
    # they stay its children for a while after the kill (as a loaded machine's bubblewrap does).
    outer = [python, "-c", "import subprocess as s, sys, time; b = bytearray(1 << 30); s.Popen(sys.argv[1:]); time.sleep(600)", *inner]
    orphan = psutil.Process(start_orphan(python, uid, outer))
    try:
        deadline = time.monotonic() + 30.0
        while not orphan.children() and time.monotonic() < deadline:
            time.sleep(0.05)
        (child,) = orphan.children()
        assert orphan.ppid() == 1 and child.ppid() == orphan.pid  # the spawner has exited: init adopted the outer one
        assert set(kill_orphaned_sandboxes(uid)) >= {orphan.pid, child.pid}
        for process in (orphan, child):
            assert not process.is_running() or process.status() == psutil.STATUS_ZOMBIE
    finally:
        left = [orphan]
        with contextlib.suppress(psutil.NoSuchProcess):
            left += orphan.children()
        for process in left:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()


# ---- the leftover check itself ----


def test_a_sandbox_process_under_a_live_process_of_another_run_is_not_this_tests(monkeypatch):
    """A marked sleeper whose parent is alive and outside this test (adopted by init, as another run's scoring
    process is as far as this test can tell) is another run's, even where no cgroup tells runs apart."""
    monkeypatch.setattr(sys.modules[__name__], "sandbox_cgroups", lambda: False)
    program = f"import subprocess, time; subprocess.Popen(['sleep', '{MARKER}']); time.sleep(600)"
    parent = psutil.Process(start_orphan(sys.executable, os.getuid(), [sys.executable, "-c", program]))
    try:
        deadline = time.monotonic() + 30.0
        while not parent.children() and time.monotonic() < deadline:
            time.sleep(0.05)
        (sleeper,) = parent.children()
        assert parent.pid not in {p.pid for p in psutil.Process().children(recursive=True)}
        assert runs_elsewhere(sleeper.pid)
        assert sleeper.pid not in [pid for pid, _, _ in sandbox_processes()]
        # the same sleeper under a worker of this test's is this test's
        assert not runs_elsewhere(sleeper.pid, frozenset({parent.pid}))
    finally:
        for process in [*parent.children(), parent]:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()


def test_a_sandbox_process_that_ends_while_it_is_checked_is_not_left(monkeypatch):
    """A process found in /proc that exits before its owner is known (another run's bubblewrap, ending) is gone,
    not this test's leftover; one of this test's that stays is found."""
    ending = subprocess.Popen(["sleep", MARKER])
    staying = subprocess.Popen(["sleep", MARKER])
    check = runs_elsewhere

    def ends_while_checked(pid, workers=frozenset()):
        if pid == ending.pid:
            ending.kill()
            ending.wait()
        return check(pid, workers)

    monkeypatch.setattr(sys.modules[__name__], "runs_elsewhere", ends_while_checked)
    try:
        found = [pid for pid, _, _ in sandbox_processes()]
        assert ending.poll() is not None and ending.pid not in found
        assert staying.pid in found
    finally:
        for process in (ending, staying):
            process.kill()
            process.wait()

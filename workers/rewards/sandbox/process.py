"""One local sandbox process: start it, hand it one job, read what comes back within the limits, kill its tree.

A sandbox is single use. It is started ahead of time (see ``pool.py``): the interpreter loads, applies nothing
yet, announces ``ready`` on its channel and blocks on stdin. ``Sandbox.run`` then writes the job (and the program's
stdin), starts the wall clock, and reads stdout, stderr and the channel, each cut at ``output_bytes``. Whatever
happens (done, timeout, too much output), the whole tree is killed and reaped before ``run`` returns: under
bubblewrap, killing the sandbox's PID 1 takes every process of its PID namespace with it, ``setsid`` or not.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import queue
import selectors
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from workers.rewards.sandbox import cgroup
from workers.rewards.sandbox.isolation import LOAD_HARNESS, SandboxSpec

logger = logging.getLogger(__name__)

HARNESS_SOURCE = (Path(__file__).parent / "harness.py").read_text(encoding="utf-8")

#: Run statuses.
EXITED = "exited"
TIMEOUT = "timeout"
OUTPUT_LIMIT = "output_limit"


class SandboxUnavailable(RuntimeError):
    """The sandbox itself failed (could not start, service down): an infrastructure failure, never a verdict."""


@dataclass(frozen=True)
class RunOutput:
    """What one program run produced, as the worker saw it."""

    #: ``exited``, ``timeout`` (wall clock or CPU limit) or ``output_limit``.
    status: str
    #: The program's stdout (at most ``output_bytes``).
    stdout: bytes = b""
    #: The start of its stderr, for debugging.
    stderr: bytes = b""
    #: The harness's events (JSON objects), in the order they arrived; forgeable, so claims only.
    events: list[dict] = field(default_factory=list)
    #: Exit status of the sandbox process (negative: killed by that signal), when it exited by itself.
    exit_code: int | None = None
    #: The kernel killed a process of the run for passing the sandbox's memory cgroup limit.
    oom_killed: bool = False


def parse_events(data: bytes) -> list[dict]:
    """The JSON objects among ``data``'s lines; anything else (the program's own garbage) is skipped."""
    events = []
    for line in data.split(b"\n"):
        if not line.strip():
            continue
        try:
            event = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if isinstance(event, dict):
            events.append(event)
    return events


def kill_orphaned_sandboxes(uid: int, settle_s: float = 5.0) -> list[int]:
    """Kill the sandbox processes of workers that are gone: those of ``uid`` whose command line is a sandbox's
    (the harness or its loader) and whose parent is the host's init. A live worker's sandboxes always have their
    bubblewrap as parent. Returns the pids killed.

    A worker killed by SIGKILL while bubblewrap was still setting a sandbox up leaves bubblewrap's outer process as
    the orphan, and under it the namespace's first process (bubblewrap too, not yet the harness). Killing the
    orphan orphans that child, but init adopts it only once the orphan has exited. So after each kill the sweep
    waits for the killed processes to be gone (at most ``settle_s`` in all) and sweeps again, until a sweep finds
    none."""
    signatures = (HARNESS_SOURCE[:200], LOAD_HARNESS)
    killed: list[int] = []
    deadline = time.monotonic() + settle_s
    while True:
        found = []
        for proc in psutil.process_iter():
            if proc.pid in killed:
                continue
            try:
                if proc.uids().real != uid or proc.ppid() != 1:
                    continue
                argv = proc.cmdline()
            except psutil.Error:
                continue
            if any(signature in arg for arg in argv for signature in signatures):
                with contextlib.suppress(psutil.Error):
                    proc.kill()
                    found.append(proc.pid)
        killed += found
        if not found:
            break
        while any(_running(pid) for pid in found) and time.monotonic() < deadline:
            time.sleep(0.01)
        if time.monotonic() >= deadline:
            break
    if killed:
        logger.warning(
            "code sandbox: killed %d sandbox process(es) left by workers that are gone", len(killed)
        )
    return killed


def job_message(job: dict, stdin: bytes = b"") -> bytes:
    """What the harness reads on stdin: the job's length, a newline, the job as JSON, then the program's stdin."""
    body = json.dumps(job).encode()
    return str(len(body)).encode() + b"\n" + body + stdin


_to_reap: queue.SimpleQueue[Sandbox] = queue.SimpleQueue()
_reaper: threading.Thread | None = None
_reaper_lock = threading.Lock()
_unreaped = 0


def _reap_later(sandbox: Sandbox) -> None:
    global _reaper, _unreaped
    with _reaper_lock:
        _unreaped += 1
        if _reaper is None or not _reaper.is_alive():
            _reaper = threading.Thread(target=_reap_queued, name="sandbox-reaper", daemon=True)
            _reaper.start()
    _to_reap.put(sandbox)


def _reap_queued() -> None:
    global _unreaped
    while True:
        sandbox = _to_reap.get()
        try:
            sandbox._reap()
        except Exception:  # noqa: BLE001 - one sandbox's clean-up must not stop the others'
            logger.exception("code sandbox: cleaning up a killed sandbox failed")
        finally:
            with _reaper_lock:
                _unreaped -= 1


def drain_reaper(timeout_s: float = 10.0) -> bool:
    """Wait until every sandbox killed with ``reap=False`` is reaped; whether that happened in time."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with _reaper_lock:
            if _unreaped == 0:
                return True
        time.sleep(0.005)
    return False


_harness_fds: dict[tuple[int, bytes], int] = {}
_harness_lock = threading.Lock()


def _harness_fd(bytecode: bytes) -> int:
    """A read-only descriptor holding the compiled harness, one per process, shared by every sandbox it starts
    (each reads it with ``pread``, so no offset is shared)."""
    key = (os.getpid(), bytecode)
    with _harness_lock:
        if key not in _harness_fds:
            fd = _filter_fd(bytecode, "roll-sandbox-harness", os.MFD_ALLOW_SEALING)
            # Sealed: nothing can change what later sandboxes (checkers included) run, whoever holds it.
            seals = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
            _harness_fds[key] = fd
        return _harness_fds[key]


def _filter_fd(bpf: bytes, name: str = "roll-sandbox-seccomp", flags: int = 0) -> int:
    """A file descriptor from which bubblewrap reads the compiled system-call filter."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | flags)
    try:
        view = memoryview(bpf)
        while view:
            view = view[os.write(fd, view) :]
        os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _running(pid: int) -> bool:
    """Whether ``pid`` is a process that has not exited (gone, or a zombie waiting to be reaped, is not)."""
    try:
        return psutil.Process(pid).status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.Error:
        return False


def _parent_pid(pid: int) -> int | None:
    try:
        return psutil.Process(pid).ppid()
    except psutil.Error:
        return None


class Sandbox:
    """A started, not yet used sandbox. Create it from a long-lived thread: bubblewrap's ``--die-with-parent``
    kills it when the thread that started it exits."""

    def __init__(self, spec: SandboxSpec, entry: str = "serve") -> None:
        self.spec = spec
        #: ``serve`` (one job, then it is used up) or ``zygote`` (a forked child per job: ``zygote.py``).
        self.entry = entry
        self._workdir = None
        if entry == "zygote":
            # The zygote's control channel: descriptors travel over it, so a socket rather than a pipe.
            mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            channel_r, channel_w = mine.detach(), theirs.detach()
        else:
            channel_r, channel_w = os.pipe()
        info_r, info_w = os.pipe() if spec.bwrap else (None, None)
        seccomp_fd = _filter_fd(spec.seccomp) if spec.bwrap and spec.seccomp else None
        code_fd = _harness_fd(spec.harness_bytecode) if spec.harness_bytecode else None
        pass_fds = [fd for fd in (channel_w, info_w, seccomp_fd, code_fd) if fd is not None]
        kwargs: dict = {}
        if spec.uid is not None:
            kwargs.update(user=spec.uid, group=spec.gid, extra_groups=[])
        if spec.bwrap is None:
            # Without a mount namespace the program's working directory is a private directory of the host.
            self._workdir = tempfile.mkdtemp(prefix="roll-sandbox-")
            if spec.uid is not None:
                os.chown(self._workdir, spec.uid, spec.gid)
            kwargs["cwd"] = self._workdir
        try:
            self.proc = subprocess.Popen(
                spec.argv(HARNESS_SOURCE, channel_w, info_w, seccomp_fd, code_fd, entry),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=pass_fds,
                env={},
                start_new_session=True,
                **kwargs,
            )
        except BaseException:
            for fd in (channel_r, channel_w, info_r, info_w, seccomp_fd):
                if fd is not None:
                    os.close(fd)
            self._remove_workdir()
            raise
        for fd in (channel_w, info_w, seccomp_fd):
            if fd is not None:
                os.close(fd)
        self._channel = channel_r
        self._info_fd = info_r
        self._channel_head = b""
        self._control_buffer = b""
        self._pidfd: int | None = None
        #: What bubblewrap reported about the sandbox (child pid, namespace inodes); empty without bubblewrap.
        self.info: dict = {}
        #: Jobs handed over so far (only a checker sandbox serves more than one).
        self.jobs = 0
        self._cgroup: str | None = None
        self._oom_killed: bool | None = None

    def prepare(self, timeout_s: float) -> None:
        """Learn the sandbox's PID 1 from bubblewrap and put it in its memory cgroup: the slow part of the set-up
        after the start, which the pool's starter thread does ahead (``wait_ready`` does it otherwise)."""
        if self._info_fd is not None:
            self._read_info(time.monotonic() + timeout_s)
        if self.spec.memory_cgroups is not None and self._cgroup is None:
            self._enter_cgroup()

    def wait_ready(self, timeout_s: float) -> None:
        """Block until the harness is up; raise ``SandboxUnavailable`` (with bubblewrap's message) if it is not."""
        deadline = time.monotonic() + timeout_s
        if self._info_fd is not None:
            self._read_info(deadline)
        self._channel_head = self._read_until(self._channel, b"\n", deadline)
        events = parse_events(self._channel_head)
        if not events or events[0].get("ev") != "ready":
            # bubblewrap explains itself on stderr and exits; a hung start gets a second, then the kill.
            stderr = self._read_until(self.proc.stderr.fileno(), None, time.monotonic() + 1.0)
            self.kill()
            err = stderr[-2000:].decode(errors="replace").strip()
            raise SandboxUnavailable(f"the sandbox did not start: {err or 'no ready signal'}")
        if self.spec.memory_cgroups is not None and self._cgroup is None:
            self._enter_cgroup()

    def _enter_cgroup(self) -> None:
        """Put the harness (the only process that will start the program's) in a cgroup of its own."""
        cgroups = self.spec.memory_cgroups
        try:
            self._cgroup = cgroups.create(self.spec.limits.total_memory_mb * 1024 * 1024)
            cgroup.add(self._cgroup, self.info.get("child-pid", self.proc.pid))
        except OSError as err:
            self.kill()
            raise SandboxUnavailable(f"the sandbox's memory cgroup could not be set up: {err}") from err

    @property
    def cgroup(self) -> str | None:
        """The sandbox's memory cgroup, once it is ready (``None`` without cgroups)."""
        return self._cgroup

    def oom_killed(self) -> bool:
        """Whether the kernel killed one of the sandbox's processes for passing ``total_memory_mb``."""
        if self._oom_killed is None:
            cgroups = self.spec.memory_cgroups
            return bool(self._cgroup and cgroups is not None and cgroups.oom_killed(self._cgroup))
        return self._oom_killed

    def _read_info(self, deadline: float) -> None:
        data = self._read_until(self._info_fd, None, deadline)
        os.close(self._info_fd)
        self._info_fd = None
        with contextlib.suppress(ValueError):
            self.info = json.loads(data)
        self._open_pidfd()

    def _read_until(self, fd: int, end: bytes | None, deadline: float) -> bytes:
        data = b""
        with selectors.DefaultSelector() as selector:
            selector.register(fd, selectors.EVENT_READ)
            while end is None or not data.endswith(end):
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not selector.select(remaining):
                    break
                chunk = os.read(fd, 4096)
                if not chunk:
                    break
                data += chunk
        return data

    def _open_pidfd(self) -> None:
        child = self.info.get("child-pid")
        if not isinstance(child, int):
            return
        try:
            pidfd = os.pidfd_open(child)
        except OSError:
            return
        # Only bubblewrap's own child, which it has not reaped while we hold bubblewrap unreaped, is the sandbox's
        # PID 1; a recycled pid would have another parent.
        if _parent_pid(child) == self.proc.pid:
            self._pidfd = pidfd
        else:
            os.close(pidfd)

    def host_uid(self) -> int | None:
        """The real uid, on the host, of the sandbox's first process (from the host's own /proc)."""
        pid = self.info.get("child-pid", self.proc.pid)
        try:
            return psutil.Process(pid).uids().real
        except psutil.Error:
            return None

    def control_fd(self) -> int:
        """A zygote's control socket (the worker's end)."""
        return self._channel

    def read_control_line(self, deadline: float) -> bytes | None:
        """A zygote's next line on its control socket: ``None`` if none came by ``deadline``, ``b""`` if the
        socket ended (the zygote is gone)."""
        while b"\n" not in self._control_buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            with selectors.DefaultSelector() as selector:
                selector.register(self._channel, selectors.EVENT_READ)
                if not selector.select(remaining):
                    return None
            try:
                chunk = os.read(self._channel, 4096)
            except OSError:
                chunk = b""
            if not chunk:
                self._control_buffer = b""
                return b""
            self._control_buffer += chunk
        line, self._control_buffer = self._control_buffer.split(b"\n", 1)
        return line

    def alive(self) -> bool:
        """Whether bubblewrap (or the plain interpreter) is still running."""
        return self._channel is not None and self.proc.poll() is None

    def fds(self) -> tuple[int, int, int, int]:
        """The sandbox's stdin, stdout, stderr and channel, for a caller that drives them itself (``relay``)."""
        return self.proc.stdin.fileno(), self.proc.stdout.fileno(), self.proc.stderr.fileno(), self._channel

    @property
    def channel_head(self) -> bytes:
        """What the channel said before the job (the ``ready`` event)."""
        return self._channel_head

    def run(self, job: dict, stdin: bytes, output_bytes: int, timeout_s: float) -> RunOutput:
        """Hand over ``job`` (and ``stdin``), collect the output, kill the tree. The sandbox is used up."""
        deadline = time.monotonic() + timeout_s
        stdin_fd, out_fd, err_fd, channel_fd = self.fds()
        try:
            status, buffers = collect(
                job_message(job, stdin),
                stdin_fd,
                self.proc.stdin.close,
                (out_fd, err_fd, channel_fd),
                self._channel_head,
                output_bytes,
                deadline,
            )
            # Every copy of the pipes is closed: the processes are ending; give bubblewrap its last moments.
            if status == EXITED and not self.wait_exit(max(0.1, deadline - time.monotonic())):
                status = TIMEOUT
        finally:
            exit_code = self.kill()
        return run_output(
            status, buffers, (out_fd, err_fd, channel_fd), output_bytes, exit_code, self.oom_killed()
        )

    def exit_code(self) -> int | None:
        """How the sandbox ended, once it has (bubblewrap's status, or the interpreter's without it)."""
        return self.proc.returncode

    def release(self, wait_s: float = 0.0) -> None:
        """Done with this sandbox: kill it, reaping in the background (a reused run's ``release`` differs)."""
        self.kill(reap=False)

    def wait_exit(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for bubblewrap (or the plain interpreter) to exit and reap it; whether it did.
        Waits on a pidfd, so it wakes the moment the process ends (``Popen.wait`` with a timeout polls)."""
        if self.proc.poll() is not None:
            return True
        try:
            pidfd = os.pidfd_open(self.proc.pid)
        except OSError:
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                return False
            return True
        try:
            with selectors.DefaultSelector() as selector:
                selector.register(pidfd, selectors.EVENT_READ)
                selector.select(timeout_s)
        finally:
            os.close(pidfd)
        return self.proc.poll() is not None

    def kill(self, reap: bool = True) -> int | None:
        """Kill every process of the sandbox and reap bubblewrap; returns the exit status if it had already ended.
        ``reap=False`` leaves the waiting for bubblewrap (which exits once the kernel has torn the namespaces down,
        a few milliseconds) and the clean-up to a background thread (``drain_reaper`` waits for it)."""
        already = self.proc.poll()
        if self._info_fd is not None and already is None:
            # Never used: learn its PID 1 first, since killing bubblewrap alone while it sets up the namespaces
            # can leave that process behind.
            self._read_info(time.monotonic() + 2.0)
        if self._pidfd is not None:
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
            if not reap:
                if self._cgroup is not None:
                    self._oom_killed = self.oom_killed()
                _reap_later(self)
                return already
            # bubblewrap reaps its child and exits by itself; the host's init need not.
            self.wait_exit(2.0)
        self._reap()
        return already

    def _reap(self) -> None:
        if self._pidfd is not None:
            self.wait_exit(2.0)
        elif self.spec.bwrap is None and self.proc.returncode is None:
            # No PID namespace: the session is the best handle (a program that calls setsid leaves it).
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
        if self.spec.bwrap is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            with contextlib.suppress(OSError):
                stream.close()
        for fd in (self._channel, self._info_fd, self._pidfd):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._channel = self._info_fd = self._pidfd = None
        self._remove_workdir()
        if self._cgroup is not None:
            if self._oom_killed is None:
                self._oom_killed = self.oom_killed()
            cgroup.remove_later(self._cgroup)
            self._cgroup = None

    def _remove_workdir(self) -> None:
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None


def collect(
    pending: bytes,
    stdin_fd: int,
    close_stdin: Callable[[], None],
    outputs: tuple[int, int, int],
    channel_head: bytes,
    output_bytes: int,
    deadline: float,
) -> tuple[str, dict[int, bytearray]]:
    """Write ``pending`` to ``stdin_fd`` (then ``close_stdin``) while reading ``outputs`` (stdout, stderr, channel)
    until each ends, one passes ``output_bytes`` (``output_limit``) or ``deadline`` passes (``timeout``); the status
    and what was read."""
    buffers = {fd: bytearray() for fd in outputs}
    buffers[outputs[2]] += channel_head
    status = EXITED
    os.set_blocking(stdin_fd, False)
    with selectors.DefaultSelector() as selector:
        for fd in buffers:
            selector.register(fd, selectors.EVENT_READ)
        selector.register(stdin_fd, selectors.EVENT_WRITE)
        readers = len(buffers)
        while readers:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return TIMEOUT, buffers
            for key, _ in selector.select(remaining):
                if key.fd == stdin_fd:
                    pending = _feed(stdin_fd, pending)
                    if not pending:
                        selector.unregister(stdin_fd)
                        close_stdin()
                    continue
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    selector.unregister(key.fd)
                    readers -= 1
                    continue
                buffers[key.fd] += chunk
                if len(buffers[key.fd]) > output_bytes:
                    return OUTPUT_LIMIT, buffers
    return status, buffers


def run_output(
    status: str,
    buffers: dict[int, bytearray],
    outputs: tuple[int, int, int],
    output_bytes: int,
    exit_code: int | None,
    oom_killed: bool,
) -> RunOutput:
    """The ``RunOutput`` of a collected run (a CPU-time kill is a timeout)."""
    if status == EXITED and exit_code in (-signal.SIGXCPU, 128 + signal.SIGXCPU):
        status = TIMEOUT
    out_fd, err_fd, channel_fd = outputs
    return RunOutput(
        status=status,
        stdout=bytes(buffers[out_fd][:output_bytes]),
        stderr=bytes(buffers[err_fd][:output_bytes]),
        events=parse_events(bytes(buffers[channel_fd][:output_bytes])),
        exit_code=exit_code if status == EXITED else None,
        oom_killed=oom_killed,
    )


def _feed(fd: int, pending: bytes) -> bytes:
    try:
        return pending[os.write(fd, pending[: 1 << 16]) :]
    except BlockingIOError:
        return pending
    except BrokenPipeError:
        # The program stopped reading (or ended): the rest of its stdin is of no use.
        return b""

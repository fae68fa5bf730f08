"""One local sandbox process: start it, hand it one job, read what comes back within the limits, kill its tree.

A sandbox is single use. It is started ahead of time (see ``pool.py``): the interpreter loads, applies nothing
yet, announces ``ready`` on its channel and blocks on stdin. ``Sandbox.run`` then writes the job (and the program's
stdin), starts the wall clock, and reads stdout, stderr and the channel, each cut at ``output_bytes``. Whatever
happens (done, timeout, too much output), the whole tree is killed and reaped before ``run`` returns: under
bubblewrap, killing the sandbox's PID 1 takes every process of its PID namespace with it, ``setsid`` or not.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import selectors
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from workers.rewards.sandbox.isolation import SandboxSpec

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


def _parent_pid(pid: int) -> int | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ')'.
    return int(text.rsplit(")", 1)[1].split()[1])


class Sandbox:
    """A started, not yet used sandbox. Create it from a long-lived thread: bubblewrap's ``--die-with-parent``
    kills it when the thread that started it exits."""

    def __init__(self, spec: SandboxSpec) -> None:
        self.spec = spec
        self._workdir = None
        channel_r, channel_w = os.pipe()
        info_r, info_w = os.pipe() if spec.bwrap else (None, None)
        pass_fds = [channel_w] + ([info_w] if info_w is not None else [])
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
                spec.argv(HARNESS_SOURCE, channel_w, info_w),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=pass_fds,
                env={},
                start_new_session=True,
                **kwargs,
            )
        except BaseException:
            for fd in (channel_r, channel_w, info_r, info_w):
                if fd is not None:
                    os.close(fd)
            self._remove_workdir()
            raise
        os.close(channel_w)
        if info_w is not None:
            os.close(info_w)
        self._channel = channel_r
        self._info_fd = info_r
        self._channel_head = b""
        self._pidfd: int | None = None
        #: What bubblewrap reported about the sandbox (child pid, namespace inodes); empty without bubblewrap.
        self.info: dict = {}

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
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("Uid:"):
                    return int(line.split()[1])
        except OSError:
            return None
        return None

    def run(self, job: dict, stdin: bytes, output_bytes: int, timeout_s: float) -> RunOutput:
        """Hand over ``job`` (and ``stdin``), collect the output, kill the tree. The sandbox is used up."""
        body = json.dumps(job).encode()
        pending = str(len(body)).encode() + b"\n" + body + stdin
        out_fd, err_fd, channel_fd = self.proc.stdout.fileno(), self.proc.stderr.fileno(), self._channel
        buffers = {out_fd: bytearray(), err_fd: bytearray(), channel_fd: bytearray(self._channel_head)}
        status = EXITED
        stdin_fd = self.proc.stdin.fileno()
        os.set_blocking(stdin_fd, False)
        deadline = time.monotonic() + timeout_s
        try:
            with selectors.DefaultSelector() as selector:
                for fd in buffers:
                    selector.register(fd, selectors.EVENT_READ)
                selector.register(stdin_fd, selectors.EVENT_WRITE)
                readers = len(buffers)
                while readers:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        status = TIMEOUT
                        break
                    for key, _ in selector.select(remaining):
                        if key.fd == stdin_fd:
                            pending = self._feed(stdin_fd, pending)
                            if not pending:
                                selector.unregister(stdin_fd)
                                self.proc.stdin.close()
                            continue
                        chunk = os.read(key.fd, 1 << 16)
                        if not chunk:
                            selector.unregister(key.fd)
                            readers -= 1
                            continue
                        buffers[key.fd] += chunk
                        if len(buffers[key.fd]) > output_bytes:
                            status = OUTPUT_LIMIT
                            readers = 0
                            break
            if status == EXITED:
                # Every copy of the pipes is closed: the processes are ending; give bubblewrap its last moments.
                try:
                    self.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    status = TIMEOUT
        finally:
            exit_code = self.kill()
        if status == EXITED and exit_code in (-signal.SIGXCPU, 128 + signal.SIGXCPU):
            status = TIMEOUT
        return RunOutput(
            status=status,
            stdout=bytes(buffers[out_fd][:output_bytes]),
            stderr=bytes(buffers[err_fd][:output_bytes]),
            events=parse_events(bytes(buffers[channel_fd][:output_bytes])),
            exit_code=exit_code if status == EXITED else None,
        )

    @staticmethod
    def _feed(fd: int, pending: bytes) -> bytes:
        try:
            return pending[os.write(fd, pending[: 1 << 16]) :]
        except BlockingIOError:
            return pending
        except BrokenPipeError:
            # The program stopped reading (or ended): the rest of its stdin is of no use.
            return b""

    def kill(self) -> int | None:
        """Kill every process of the sandbox and reap bubblewrap; returns the exit status if it had already ended."""
        already = self.proc.poll()
        if self._info_fd is not None and already is None:
            # Never used: learn its PID 1 first, since killing bubblewrap alone while it sets up the namespaces
            # can leave that process behind.
            self._read_info(time.monotonic() + 2.0)
        if self._pidfd is not None:
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
            # bubblewrap reaps its child and exits by itself; the host's init need not.
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=2.0)
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
        return already

    def _remove_workdir(self) -> None:
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None

"""One run in a reused sandbox: the sandbox's zygote forks a child for it, and is the same again after it.

A zygote sandbox (``Sandbox(spec, entry="zygote")``) is started like a single-use one (same bubblewrap namespaces,
filter, memory cgroup and user), but its PID 1 is the harness's ``zygote``: it has loaded the harness and common
modules once, and forks a child per job (``harness.zygote`` says what it does between runs). ``ZygoteRun`` is the
worker's side of one such child, with the same surface as a single-use ``Sandbox`` (``run``, ``fds``, ``kill``,
``wait_exit``, ``exit_code``, ``oom_killed``), so the pool and the checked-run relay drive either alike.

Reuse is decided here: a run that ended by itself and that the zygote reports clean (nothing left running, its
temporary files gone) leaves the zygote ``reusable``; a run that timed out, wrote too much, or was killed for any
reason kills the whole sandbox, as a single-use one would be, and the pool starts another.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time

from workers.rewards.sandbox.process import (
    EXITED,
    TIMEOUT,
    RunOutput,
    Sandbox,
    SandboxUnavailable,
    collect,
    job_message,
    run_output,
)


class ZygoteGone(SandboxUnavailable):
    """The zygote ended before it reported the run's end, and not for memory the run used: nothing the program
    does can cause that (it can neither signal nor trace its zygote), so it is an infrastructure failure."""


class ZygoteRun:
    """The worker's side of one child of a started, ready zygote sandbox."""

    def __init__(self, zygote: Sandbox) -> None:
        self.zygote = zygote
        self.spec = zygote.spec
        #: Jobs handed to this run (a checker run serves several, as a single-use checker sandbox does).
        self.jobs = 0
        self.channel_head = b""
        self._code: int | None = None
        self._ended = False
        self._clean = False
        self._zygote_killed = False
        cgroups, path = self.spec.memory_cgroups, zygote.cgroup
        self._oom_before = cgroups.oom_kills(path) if cgroups is not None and path is not None else 0
        pipes = [os.pipe() for _ in range(4)]
        # The child reads stdin's read end and writes the other three's write ends.
        theirs = [pipes[0][0], pipes[1][1], pipes[2][1], pipes[3][1]]
        self._stdin: int | None = pipes[0][1]
        self._outputs = (pipes[1][0], pipes[2][0], pipes[3][0])
        try:
            control = socket.socket(fileno=zygote.control_fd())
            try:
                socket.send_fds(control, [b"run"], theirs)
            finally:
                control.detach()
        except OSError:
            self._close_own()
            raise
        finally:
            for fd in theirs:
                os.close(fd)

    def fds(self) -> tuple[int, int, int, int]:
        """The run's stdin, stdout, stderr and channel."""
        return (-1 if self._stdin is None else self._stdin, *self._outputs)

    def run(self, job: dict, stdin: bytes, output_bytes: int, timeout_s: float) -> RunOutput:
        """Hand over ``job`` (and ``stdin``) and collect the output; a run that did not end by itself in time (or
        wrote too much) is killed with its zygote."""
        self.jobs += 1
        deadline = time.monotonic() + timeout_s
        outputs = self._outputs
        try:
            status, buffers = collect(
                job_message(job, stdin), self._stdin, self._close_stdin, outputs, b"", output_bytes, deadline
            )
            if status == EXITED and not self.wait_exit(max(0.1, deadline - time.monotonic())):
                status = TIMEOUT
        finally:
            exit_code = self.kill()
        oom_killed = self.oom_killed()
        if status == EXITED and self._ended and self._code is None and not oom_killed:
            raise ZygoteGone("the sandbox's zygote ended before it reported the run's end")
        return run_output(status, buffers, outputs, output_bytes, exit_code, oom_killed)

    def _close_stdin(self) -> None:
        if self._stdin is not None:
            os.close(self._stdin)
            self._stdin = None

    def wait_exit(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the zygote's word that the run has ended; whether it came (or the zygote
        itself ended, which ends the run too)."""
        if self._ended:
            return True
        line = self.zygote.read_control_line(time.monotonic() + timeout_s)
        if line is None:
            return False
        # An empty line: the zygote itself is gone (the run is then over, not clean).
        self._ended = True
        message: object = None
        with contextlib.suppress(ValueError):
            message = json.loads(line)
        if isinstance(message, dict) and message.get("ev") == "exit":
            code = message.get("code")
            self._code = code if type(code) is int else None
            self._clean = message.get("clean") is True
        return True

    def exit_code(self) -> int | None:
        """The child's exit status (negative: killed by that signal), once the zygote has reported it."""
        return self._code

    @property
    def reusable(self) -> bool:
        """Whether the zygote reported this run ended and its sandbox clean, and is itself still there."""
        return self._ended and self._clean and self.zygote.exit_code() is None and self.zygote.alive()

    def oom_killed(self) -> bool:
        """Whether the kernel killed a process of the sandbox for memory since this run began."""
        cgroups, path = self.spec.memory_cgroups, self.zygote.cgroup
        if cgroups is None or path is None:
            return self.zygote.oom_killed()
        return cgroups.oom_kills(path) > self._oom_before

    def release(self, wait_s: float = 0.0) -> None:
        """Done with this run: close its stdin (a program serving requests, or a checker waiting for its next job,
        then ends by itself) and wait up to ``wait_s`` for it to end; if it has not, kill it with its zygote."""
        self._close_stdin()
        if not self._ended and wait_s > 0:
            self.wait_exit(wait_s)
        self.kill(reap=False)

    def kill(self, reap: bool = True) -> int | None:
        """End the run: nothing to do if it ended by itself; otherwise kill the whole sandbox (every process of the
        run goes with its PID 1). Returns the exit status if the run had ended."""
        self._close_stdin()
        self._close_own()
        if (not self._ended or not self._clean) and not self._zygote_killed:
            self._zygote_killed = True  # once: the relay's release and the pool's settling both end a run
            self.zygote.kill(reap=reap)
        return self._code

    def _close_own(self) -> None:
        outputs, self._outputs = self._outputs, (-1, -1, -1)
        for fd in outputs:
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)

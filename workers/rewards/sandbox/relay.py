"""A checked run: the program in one sandbox, the dataset's tests in another, the worker relaying between them.

The checker sandbox runs the test code (``harness`` mode ``check``); each time a test needs something of the
program (a function, a call's result, an attribute), it writes a request on its channel. The worker forwards the
request to the program's sandbox (mode ``serve``), and forwards that sandbox's answer, plain data or a handle,
back. The checker's verdicts are believed: the program never runs in its interpreter and can only send it data.
The program's answers are claims, read from its channel only while a request is outstanding and only under that
request's id; anything else it writes there is dropped.

Both sandboxes share one wall-clock budget. When the program's side ends (its module failed, it crashed, it wrote
too much, the clock ran out), every request still to come is answered ``gone`` with the reason, which becomes the
verdict of each test not yet decided.
"""

from __future__ import annotations

import json
import logging
import os
import selectors
import signal
import time
from pathlib import Path

from workers.rewards.sandbox.process import OUTPUT_LIMIT, TIMEOUT, Sandbox, job_message
from workers.rewards.sandbox.verdicts import MEMORY_LIMIT, RUNTIME_ERROR, module_failure

logger = logging.getLogger(__name__)

CHECKER_SOURCE = (Path(__file__).parent / "checker.py").read_text(encoding="utf-8")
#: How long the program's side of a checked run in a reused sandbox may take to end once its stdin is closed.
RELEASE_S = 0.5


class _Side:
    """One sandbox's pipes: what is still to be written to its stdin, and its channel cut into lines."""

    def __init__(self, sandbox: Sandbox, job: dict, output_bytes: int | None) -> None:
        self.sandbox = sandbox
        self.stdin, self.stdout, self.stderr, self.channel = sandbox.fds()
        os.set_blocking(self.stdin, False)
        if sandbox.jobs == 0:
            self.pending = bytearray(job_message(job))
            self.partial = bytearray(sandbox.channel_head)
        else:
            # A checker sandbox that served a job before: the next one comes as a line of its protocol.
            self.pending = bytearray(json.dumps({"job": job}, separators=(",", ":")).encode() + b"\n")
            self.partial = bytearray()
        sandbox.jobs += 1
        #: Bytes read from each output; the program's side ends when one passes ``output_bytes``.
        self.read = {self.stdout: 0, self.stderr: 0, self.channel: len(self.partial)}
        self.output_bytes = output_bytes
        self.open = set(self.read)
        self.stderr_tail = b""

    def lines(self) -> list[tuple[dict, bytes]]:
        """The complete lines read so far, each parsed and as it came (forwarded as it came: no re-encoding)."""
        if b"\n" not in self.partial:
            return []
        *complete, rest = self.partial.split(b"\n")
        self.partial = bytearray(rest)
        events = []
        for line in complete:
            try:
                event = json.loads(line)
            except (ValueError, RecursionError):
                continue
            if isinstance(event, dict):
                events.append((event, line))
        return events

    def send(self, message: dict) -> None:
        self.pending += json.dumps(message, separators=(",", ":")).encode() + b"\n"

    def forward(self, line: bytes) -> None:
        self.pending += line + b"\n"


class _Relay:
    def __init__(self, program: _Side, checker: _Side, count: int) -> None:
        self.program, self.checker = program, checker
        self.count = count
        self.verdicts: dict[int, str] = {}
        #: Why the program's side ended, once it has.
        self.gone: str | None = None
        self.outstanding: object = None
        self.finished = False

    def end_program(self, reason: str) -> None:
        if self.gone is None:
            self.gone = reason
        if self.outstanding is not None:
            self.checker.send({"id": self.outstanding, "gone": self.gone})
            self.outstanding = None

    def from_program(self, event: dict, line: bytes) -> None:
        failure = module_failure(event)
        if failure is not None:
            self.end_program(failure)
        elif self.outstanding is not None and "id" in event and event["id"] == self.outstanding:
            # The program's line goes on unchanged: the checker parses it as strictly as this relay did.
            self.checker.forward(line)
            self.outstanding = None

    def from_checker(self, event: dict, line: bytes) -> None:
        if "op" in event:
            if self.gone is not None:
                self.checker.send({"id": event.get("id"), "gone": self.gone})
            else:
                self.outstanding = event.get("id")
                self.program.forward(line)
        elif type(event.get("t")) is int and isinstance(event.get("r"), str):
            self.verdicts.setdefault(event["t"], event["r"])
        elif event.get("ev") == "done":
            self.finished = True


def run_checked(
    program: Sandbox,
    checker: Sandbox,
    program_job: dict,
    checker_job: dict,
    output_bytes: int,
    timeout_s: float,
) -> tuple[list[str], bool]:
    """Run the checked pair: one outcome per test (``passed``, a failure kind, or ``unsupported: ...``), and
    whether the checker may serve another job (it reported every verdict and ``done``; otherwise it is killed).
    The program's sandbox is used up."""
    if checker.jobs == 0:
        checker_job = {**checker_job, "checker": CHECKER_SOURCE}
    sides = (_Side(program, program_job, output_bytes), _Side(checker, checker_job, None))
    relay = _Relay(*sides, count=len(checker_job["tests"]))
    deadline = time.monotonic() + timeout_s
    timed_out = program_ended = reusable = False
    try:
        with selectors.DefaultSelector() as selector:
            for side in sides:
                for fd in side.read:
                    selector.register(fd, selectors.EVENT_READ, side)
            writing: set[int] = set()
            while not relay.finished:
                for side in sides:
                    # Write at once what the pipe takes; wait for it to drain only when it is full.
                    if side.pending and side.stdin not in writing and side.stdin >= 0 and _feed(side):
                        selector.register(side.stdin, selectors.EVENT_WRITE, side)
                        writing.add(side.stdin)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    timed_out = True
                    break
                for key, _ in selector.select(remaining):
                    side = key.data
                    if key.fd in writing:
                        if not _feed(side):
                            selector.unregister(key.fd)
                            writing.discard(key.fd)
                        continue
                    _read(side, key.fd, selector)
                # The program's last words first: a module error it reported says more than its exit.
                for event, line in sides[0].lines():
                    relay.from_program(event, line)
                if not program_ended and (not sides[0].open or _over(sides[0])):
                    program_ended = True
                    relay.end_program(OUTPUT_LIMIT if _over(sides[0]) else _ended(program))
                    for fd in list(sides[0].open):
                        selector.unregister(fd)
                        sides[0].open.discard(fd)
                for event, line in sides[1].lines():
                    relay.from_checker(event, line)
                if not sides[1].open:
                    break
        reusable = relay.finished and len(sides[1].open) == 3 and len(relay.verdicts) == relay.count
    finally:
        # The verdicts are in: bubblewrap's exit and the clean-up need not hold up the sample. A reused sandbox's
        # program, done or waiting for requests, ends by itself when its stdin closes (not when it timed out).
        program.release(0.0 if timed_out else RELEASE_S)
        if not reusable:
            checker.kill(reap=False)
    if not relay.finished and not timed_out:
        logger.warning(
            "code sandbox: the checker ended before its verdicts: %s",
            sides[1].stderr_tail.decode(errors="replace").strip() or "(no message)",
        )
    missing = TIMEOUT if timed_out else relay.gone or RUNTIME_ERROR
    return [relay.verdicts.get(i, missing) for i in range(relay.count)], reusable


def _feed(side: _Side) -> bool:
    """Write what the side's stdin can take; whether more is pending."""
    try:
        written = os.write(side.stdin, side.pending[: 1 << 16])
    except BlockingIOError:
        return True
    except BrokenPipeError:
        side.pending.clear()
        side.stdin = -1
        return False
    del side.pending[:written]
    return bool(side.pending)


def _read(side: _Side, fd: int, selector: selectors.BaseSelector) -> None:
    chunk = os.read(fd, 1 << 16)
    if not chunk:
        selector.unregister(fd)
        side.open.discard(fd)
        return
    side.read[fd] += len(chunk)
    if fd == side.channel:
        side.partial += chunk
    elif fd == side.stderr:
        side.stderr_tail = (side.stderr_tail + chunk)[-2000:]


def _over(side: _Side) -> bool:
    return side.output_bytes is not None and max(side.read.values()) > side.output_bytes


def _ended(sandbox: Sandbox) -> str:
    """Why the program's sandbox ended by itself: out of memory (its cgroup's OOM kill), out of CPU time, or
    anything else (a crash, an exit)."""
    sandbox.wait_exit(0.5)
    code = sandbox.exit_code()
    if sandbox.oom_killed():
        return MEMORY_LIMIT
    return TIMEOUT if code in (-signal.SIGXCPU, 128 + signal.SIGXCPU) else RUNTIME_ERROR

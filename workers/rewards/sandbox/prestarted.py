"""A pool of pre-started local sandboxes, so that starting bubblewrap and the interpreter is off the critical path.

One long-lived thread keeps ``size`` sandboxes started and waiting for a job (it must be long-lived: bubblewrap's
``--die-with-parent`` follows the thread that started it). ``run`` takes a ready sandbox, uses it once and tells
the thread to start another; at most ``concurrency`` runs go on at once. Nothing is shared between runs: each
sandbox is discarded after its job, so a hostile program cannot leave anything behind for the next one.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import weakref

from workers.rewards.sandbox import cgroup
from workers.rewards.sandbox.isolation import SandboxSpec
from workers.rewards.sandbox.process import RunOutput, Sandbox, SandboxUnavailable, drain_reaper
from workers.rewards.sandbox.relay import run_checked

logger = logging.getLogger(__name__)

#: How long a run waits for a sandbox to be started and ready before the sample is masked.
START_TIMEOUT_S = 30.0
#: Jobs one checker sandbox serves before it is replaced (bounds what a long-lived interpreter accumulates).
CHECKER_JOBS = 200


class SandboxPool:
    """Runs jobs in single-use, pre-started sandboxes described by ``spec``."""

    def __init__(self, spec: SandboxSpec, concurrency: int, size: int | None = None) -> None:
        if concurrency < 1:
            raise ValueError(f"sandbox concurrency must be at least 1, got {concurrency}")
        self.spec = spec
        self.concurrency = concurrency
        # Starting a sandbox takes several times longer than a typical run (mostly kernel namespace set-up, not
        # CPU), so a pool only as deep as the concurrency leaves runs waiting for a start. Deeper pools keep up
        # better but hold ~13 MiB per idle sandbox, in every scoring process (README "Code sandbox").
        self.size = 2 * concurrency if size is None else size
        if self.size < 1:
            raise ValueError(f"sandbox pool size must be at least 1, got {self.size}")
        self._slots = threading.BoundedSemaphore(concurrency)
        self._ready: queue.SimpleQueue[Sandbox | BaseException] = queue.SimpleQueue()
        #: Checker sandboxes waiting for their next job (at most ``concurrency``: one per run at a time).
        self._checkers: queue.SimpleQueue[Sandbox] = queue.SimpleQueue()
        self._wanted = threading.Semaphore(self.size)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._keep_started, name="sandbox-pool", daemon=True)
        self._thread.start()
        # Idle sandboxes die with the pool (or at interpreter exit) rather than wait forever on stdin.
        # At interpreter exit too: the starter thread is let finish the sandbox it is starting, since bubblewrap
        # killed (by its parent's exit) in the middle of its set-up can leave its namespace's first process waiting
        # for ever.
        self._finalizer = weakref.finalize(
            self, _discard_all, self._ready, self._checkers, self._closed, self._wanted, self._thread
        )

    def _keep_started(self) -> None:
        while True:
            self._wanted.acquire()
            if self._closed.is_set():
                _drain(self._ready)
                return
            try:
                sandbox = Sandbox(self.spec)
                sandbox.prepare(START_TIMEOUT_S)
                self._ready.put(sandbox)
            except (OSError, SandboxUnavailable) as err:
                logger.error("code sandbox: could not start a sandbox: %s", err)
                self._ready.put(err)
                time.sleep(1.0)

    def run(self, job: dict, stdin: bytes = b"", timeout_s: float | None = None) -> RunOutput:
        """Run ``job`` in a fresh sandbox; raises ``SandboxUnavailable`` when no sandbox could be had.
        ``timeout_s`` (at most the limits' own) is the run's wall-clock limit."""
        limits = self.spec.limits
        with self._slots:
            sandbox = self._take()
            return sandbox.run(job, stdin, limits.output_bytes, _within(limits.timeout_s, timeout_s))

    def run_checked(self, program_job: dict, checker_job: dict, timeout_s: float | None = None) -> list[str]:
        """Run a checked pair (``relay.run_checked``): the program in a fresh sandbox, the tests in a checker
        sandbox that served earlier jobs cleanly (at most ``CHECKER_JOBS``) or a fresh one; one outcome per test."""
        limits = self.spec.limits
        with self._slots:
            program = self._take()
            try:
                checker = self._idle_checker() or self._take()
            except BaseException:
                program.kill()
                raise
            timeout = _within(limits.timeout_s, timeout_s)
            outcomes, reusable = run_checked(
                program, checker, program_job, checker_job, limits.output_bytes, timeout
            )
            if reusable and checker.jobs < CHECKER_JOBS and not self._closed.is_set():
                self._checkers.put(checker)
            elif reusable:
                checker.kill()
            return outcomes

    def _idle_checker(self) -> Sandbox | None:
        try:
            return self._checkers.get_nowait()
        except queue.Empty:
            return None

    def _take(self) -> Sandbox:
        if self._closed.is_set():
            raise SandboxUnavailable("the sandbox pool is closed")
        try:
            item = self._ready.get(timeout=START_TIMEOUT_S)
        except queue.Empty:
            raise SandboxUnavailable(f"no sandbox was ready within {START_TIMEOUT_S:.0f}s") from None
        self._wanted.release()
        if isinstance(item, BaseException):
            raise SandboxUnavailable(f"the sandbox could not be started: {item}") from item
        try:
            item.wait_ready(START_TIMEOUT_S)
        except BaseException:
            item.kill()
            raise
        return item

    def close(self) -> None:
        """Stop starting sandboxes and kill the idle ones (the one being started too, once it is up), then wait for
        the killed ones to be reaped and their cgroups removed. Also done at interpreter exit."""
        self._finalizer()


def _within(limit: float, budget: float | None) -> float:
    return limit if budget is None else min(limit, budget)


def _discard_all(
    ready: queue.SimpleQueue,
    checkers: queue.SimpleQueue,
    closed: threading.Event,
    wanted: threading.Semaphore,
    starter: threading.Thread,
) -> None:
    closed.set()
    wanted.release()
    if starter is not threading.current_thread():
        starter.join(START_TIMEOUT_S)
    _drain(ready)
    _drain(checkers)
    drain_reaper(10.0)
    cgroup.drain_removals(10.0)


def _drain(ready: queue.SimpleQueue) -> None:
    while True:
        try:
            item = ready.get_nowait()
        except queue.Empty:
            return
        if isinstance(item, Sandbox):
            item.kill()

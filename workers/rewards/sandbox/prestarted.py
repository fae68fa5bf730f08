"""A pool of pre-started local sandboxes, so that starting bubblewrap and the interpreter is off the critical path.

One long-lived thread keeps ``size`` sandboxes started and waiting for a job (it must be long-lived: bubblewrap's
``--die-with-parent`` follows the thread that started it); at most ``concurrency`` runs go on at once.

Two ways to use them (``reuse``):

* reused (the default where bubblewrap and the system-call filter work; ``isolation: zygote``): each sandbox is a
  zygote (``zygote.py``) that forks a child per run and is reused while its runs end cleanly; a run that times
  out, writes too much or leaves what cannot be cleaned kills its sandbox, and the thread starts another. Runs
  share the sandbox's namespaces one after another, never at once, and nothing a run leaves (processes, files in
  ``/tmp`` or ``/dev/shm``, IPC objects) reaches the next.
* single use (``isolation: strict``, and always without bubblewrap or the filter): ``run`` takes a ready sandbox,
  uses it once and tells the thread to start another, so each run has namespaces of its own.
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
from workers.rewards.sandbox.relay import RELEASE_S, run_checked
from workers.rewards.sandbox.zygote import ZygoteGone, ZygoteRun

logger = logging.getLogger(__name__)

#: How long a run waits for a sandbox to be started and ready before the sample is masked.
START_TIMEOUT_S = 30.0
#: Jobs one checker sandbox serves before it is replaced (bounds what a long-lived interpreter accumulates).
CHECKER_JOBS = 200
#: Runs one zygote serves before it is replaced (bounds what its memory cgroup's counters and the kernel's
#: bookkeeping of its namespaces accumulate).
ZYGOTE_RUNS = 1000


class SandboxPool:
    """Runs jobs in single-use, pre-started sandboxes described by ``spec``."""

    def __init__(
        self, spec: SandboxSpec, concurrency: int, size: int | None = None, reuse: bool = True
    ) -> None:
        if concurrency < 1:
            raise ValueError(f"sandbox concurrency must be at least 1, got {concurrency}")
        self.spec = spec
        self.concurrency = concurrency
        #: Whether sandboxes are zygotes reused across runs: only inside bubblewrap (the zygote cleans up as its
        #: namespace's PID 1) with the system-call filter (which keeps IPC objects from outliving a run).
        self.reuse = reuse and spec.bwrap is not None and spec.seccomp is not None
        # Starting a sandbox takes several times longer than a typical run (mostly kernel namespace set-up, not
        # CPU), so a pool only as deep as the concurrency leaves runs waiting for a start. Deeper pools keep up
        # better but hold ~13 MiB per idle sandbox, in every scoring process (docs/code-sandbox.md).
        self.size = 2 * concurrency if size is None else size
        if self.size < 1:
            raise ValueError(f"sandbox pool size must be at least 1, got {self.size}")
        if self.reuse:
            # A checked run holds two (the program's and a checker's, which stays for the next run).
            self.size = max(self.size, 2 * concurrency)
        #: Sandboxes started so far.
        self.started = 0
        self._slots = threading.BoundedSemaphore(concurrency)
        self._ready: queue.SimpleQueue[Sandbox | BaseException] = queue.SimpleQueue()
        #: Checker sandboxes (or checker runs of zygotes) waiting for their next job (at most ``concurrency``).
        self._checkers: queue.SimpleQueue[Sandbox | ZygoteRun] = queue.SimpleQueue()
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
                sandbox = Sandbox(self.spec, "zygote" if self.reuse else "serve")
                self.started += 1
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
        return self._run(job, stdin, limits.output_bytes, _within(limits.timeout_s, timeout_s))

    def run_tests(self, job: dict, output_bytes: int, timeout_s: float) -> RunOutput:
        """Run a job that runs several tests one after another, each within the limits' wall clock
        (``stdio_tests``, reused sandboxes only): the whole run gets ``timeout_s`` and ``output_bytes``."""
        if not self.reuse:
            raise ValueError("a run of several tests needs reused sandboxes")
        return self._run(job, b"", output_bytes, timeout_s)

    def _run(self, job: dict, stdin: bytes, output_bytes: int, timeout_s: float) -> RunOutput:
        with self._slots:
            for attempt in range(2):
                sandbox = self._take()
                try:
                    return sandbox.run(job, stdin, output_bytes, timeout_s)
                except ZygoteGone:
                    # The sandbox ended without the program's doing (it was gone before the run, or its zygote
                    # failed): once more in another; then it is the infrastructure failure it is.
                    if attempt == 1:
                        raise
                finally:
                    self._settle(sandbox)
        raise AssertionError("unreachable")

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
                self._settle(program)
                raise
            timeout = _within(limits.timeout_s, timeout_s)
            try:
                outcomes, reusable = run_checked(
                    program, checker, program_job, checker_job, limits.output_bytes, timeout
                )
            finally:
                self._settle(program)
            if reusable and checker.jobs < CHECKER_JOBS and not self._closed.is_set():
                self._checkers.put(checker)
            else:
                if reusable:
                    checker.release(RELEASE_S)
                self._settle(checker)
            return outcomes

    def _settle(self, run: Sandbox | ZygoteRun) -> None:
        """After a run: its zygote back to the ready ones if the run left it reusable, else (and for every
        single-use sandbox, which ``_take`` already replaced) a replacement is started."""
        if not isinstance(run, ZygoteRun):
            return
        if run.reusable and run.zygote.jobs < ZYGOTE_RUNS and not self._closed.is_set():
            self._ready.put(run.zygote)
        else:
            run.kill(reap=False)  # kills the zygote unless the run ended cleanly
            if run.reusable:
                run.zygote.kill(reap=False)  # retired: its runs are spent, or the pool is closing
            self._wanted.release()

    def _idle_checker(self) -> Sandbox | None:
        try:
            return self._checkers.get_nowait()
        except queue.Empty:
            return None

    def _take(self) -> Sandbox | ZygoteRun:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self._closed.is_set():
                raise SandboxUnavailable("the sandbox pool is closed")
            try:
                item = self._ready.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise SandboxUnavailable(f"no sandbox was ready within {START_TIMEOUT_S:.0f}s") from None
            if isinstance(item, BaseException):
                self._wanted.release()
                raise SandboxUnavailable(f"the sandbox could not be started: {item}") from item
            if not self.reuse:
                self._wanted.release()
            try:
                if not item.channel_head:
                    item.wait_ready(START_TIMEOUT_S)
                if not self.reuse:
                    return item
                item.jobs += 1
                return ZygoteRun(item)
            except (OSError, SandboxUnavailable) as err:
                if not self.reuse:
                    item.kill()
                    raise
                # A zygote that ended while it waited (no ready signal, or the hand-over found its socket
                # closed): take another; one that cannot start at all shows as the starter's error in the queue.
                logger.warning("code sandbox: a waiting sandbox was gone (%s); taking another", err)
                item.kill()
                self._wanted.release()
            except BaseException:
                item.kill()
                if self.reuse:
                    self._wanted.release()
                raise

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
        if not isinstance(item, BaseException):
            item.kill()

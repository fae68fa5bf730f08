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

from workers.rewards.sandbox.isolation import SandboxSpec
from workers.rewards.sandbox.process import RunOutput, Sandbox, SandboxUnavailable

logger = logging.getLogger(__name__)

#: How long a run waits for a sandbox to be started and ready before the sample is masked.
START_TIMEOUT_S = 30.0


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
        self._wanted = threading.Semaphore(self.size)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._keep_started, name="sandbox-pool", daemon=True)
        self._thread.start()
        # Idle sandboxes die with the pool (or at interpreter exit) rather than wait forever on stdin.
        self._finalizer = weakref.finalize(self, _discard_all, self._ready, self._closed, self._wanted)

    def _keep_started(self) -> None:
        while True:
            self._wanted.acquire()
            if self._closed.is_set():
                _drain(self._ready)
                return
            try:
                self._ready.put(Sandbox(self.spec))
            except OSError as err:
                logger.error("code sandbox: could not start a sandbox: %s", err)
                self._ready.put(err)
                time.sleep(1.0)

    def run(self, job: dict, stdin: bytes = b"") -> RunOutput:
        """Run ``job`` in a fresh sandbox; raises ``SandboxUnavailable`` when no sandbox could be had."""
        if self._closed.is_set():
            raise SandboxUnavailable("the sandbox pool is closed")
        limits = self.spec.limits
        with self._slots:
            try:
                item = self._ready.get(timeout=START_TIMEOUT_S)
            except queue.Empty:
                raise SandboxUnavailable(f"no sandbox was ready within {START_TIMEOUT_S:.0f}s") from None
            self._wanted.release()
            if isinstance(item, BaseException):
                raise SandboxUnavailable(f"the sandbox could not be started: {item}") from item
            item.wait_ready(START_TIMEOUT_S)
            return item.run(job, stdin, limits.output_bytes, limits.timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        """Kill the idle sandboxes and stop starting new ones; waits (up to ``timeout_s``) for the starter thread,
        which kills the sandbox it was starting when the pool closed."""
        self._finalizer()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout_s)


def _discard_all(ready: queue.SimpleQueue, closed: threading.Event, wanted: threading.Semaphore) -> None:
    closed.set()
    wanted.release()
    _drain(ready)


def _drain(ready: queue.SimpleQueue) -> None:
    while True:
        try:
            item = ready.get_nowait()
        except queue.Empty:
            return
        if isinstance(item, Sandbox):
            item.kill()

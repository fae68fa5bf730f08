"""A pool of scoring processes: every sample is scored in a child process, under a time limit of its own.

Why processes: a scorer call that hangs (sympy expanding ``10^{10^{10}}``, a judge that never answers) cannot
be stopped in a thread, and math-verify's own timeout is signal-based, so it only works in a main thread. Each
child here scores one sample at a time; a child that runs past the limit is killed and replaced, and a child
that dies (a segfault, the out-of-memory killer) is replaced too, so the pool goes on serving the next
samples.

The children start from a fork server where the platform has one: the server imports the scorer's modules
once, and every child (the first ones and each replacement) is forked from it with them already loaded, which
is fast and safe in a parent that runs threads (a Ray actor), where a plain ``fork`` is not. ``spawn`` is the
fallback. As with any multiprocessing start method but ``fork``, a script that builds a pool must keep its
top-level code under ``if __name__ == "__main__":``.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import sys
import threading
import time
import traceback
import weakref
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.context import BaseContext
from multiprocessing.process import BaseProcess
from typing import Any, Literal

from roll_core.rewards.scorer import RewardScorer

logger = logging.getLogger(__name__)

#: Children that fail to start one after the other, with none starting in between, before the pool gives up.
MAX_START_FAILURES = 3
#: Samples sent ahead to each child. With one, a child would sit idle from sending a result until the parent
#: (on a busy machine, after a scheduling delay) sends the next sample; with more, a batch's tail is spread
#: less evenly. A queued sample's time limit starts when the child reaches it.
QUEUE_DEPTH = 2

OutcomeKind = Literal["ok", "error", "crash", "timeout"]


@dataclass(frozen=True)
class Outcome:
    """How the scoring of one sample ended.

    ``ok``: ``value`` is what ``score`` returned; ``error``: ``score`` raised (``detail`` is the traceback);
    ``crash``: the child died while scoring (``detail`` says how); ``timeout``: it ran past the time limit.
    """

    kind: OutcomeKind
    value: Any = None
    detail: str = ""


class PoolStartError(RuntimeError):
    """The pool's children cannot start (the scorer cannot be imported or built in a child)."""


def _die_with_the_worker() -> None:
    """Linux: have the kernel kill this child when the reward worker's process dies. A child busy with a hung
    verification would otherwise outlive a worker that was killed (a Ray actor is), since it reads its pipe
    only between samples, and a thread could not help: a long C-level computation (a huge integer power)
    holds the GIL."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    from multiprocessing import forkserver

    # The child's parent is the fork server (or, under spawn, the worker's process). A fork server lives as
    # long as any process holds its "alive" pipe, and multiprocessing hands that pipe to every child it forks;
    # dropping this child's copy lets the server exit with the worker's process, and the parent-death signal
    # then takes this child down with it.
    server = forkserver._forkserver
    alive_fd = getattr(server, "_forkserver_alive_fd", None)
    if alive_fd is not None:
        os.close(alive_fd)
        server._forkserver_alive_fd = None
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


def _serve(conn: Connection, scorer_cls: type[RewardScorer], options: dict[str, Any]) -> None:
    """A child's life: build the scorer, warm it up, say ready, then score one sample per message till EOF."""
    # Should the worker die before this takes effect, the child has no sample yet and exits at EOF.
    _die_with_the_worker()
    # Ctrl-C reaches the whole process group; the parent decides what stops, and closes the pool.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        _score_forever(conn, scorer_cls, options)
    except OSError:
        # The parent closed the pipe (the pool was closed, or the parent died): nothing left to do.
        return


def _score_forever(conn: Connection, scorer_cls: type[RewardScorer], options: dict[str, Any]) -> None:
    try:
        scorer = scorer_cls(**options)
        scorer.warm_up()
    except BaseException:
        conn.send(("failed", None, traceback.format_exc()))
        return
    conn.send(("ready", None, os.getpid()))
    while True:
        try:
            index, sample = conn.recv()
        except EOFError:  # the pool closed its end
            return
        fields = {k: v for k, v in sample.items() if k not in ("response", "ground_truth")}
        try:
            reply = ("ok", index, scorer.score(sample["response"], sample["ground_truth"], **fields))
        # Any failure of a scorer, SystemExit included, is reported for its sample and the child goes on.
        except BaseException:
            reply = ("error", index, traceback.format_exc())
        try:
            conn.send(reply)
        except (pickle.PicklingError, TypeError, AttributeError):
            # send() pickles before it writes, so nothing of the failed reply reached the pipe.
            conn.send(("error", index, f"the scorer's result cannot be sent back:\n{traceback.format_exc()}"))


@dataclass(eq=False)
class _Child:
    process: BaseProcess
    conn: Connection
    started: float
    ready: bool = False
    #: Tokens of the samples sent to this child, in order: the first is being scored, the others wait in its
    #: pipe (so that the child never waits for the parent between samples).
    queue: deque[int] = field(default_factory=deque)
    #: When the first of ``queue`` runs out of time.
    deadline: float = math.inf
    failure: str = ""


@dataclass(eq=False)
class _Job:
    """One caller's batch: its samples, their outcomes as they come, and how it ended."""

    samples: Sequence[dict[str, Any]]
    outcomes: list[Outcome | None]
    left: int
    error: BaseException | None = None
    cancelled: bool = False

    @property
    def finished(self) -> bool:
        return self.left == 0 or self.error is not None or self.cancelled


def _context(preload: Sequence[str]) -> BaseContext:
    if "forkserver" in multiprocessing.get_all_start_methods():
        context = multiprocessing.get_context("forkserver")
        # One fork server per process: this takes effect only if no pool has started it yet. "__main__" keeps
        # multiprocessing's default, so that the children do not each import the main script again.
        context.set_forkserver_preload(["__main__", *preload])
        return context
    return multiprocessing.get_context("spawn")


def _shutdown(children: list[_Child], grace_s: float) -> None:
    """Close every child's pipe (an idle child exits at EOF), then kill what is still running."""
    for child in children:
        child.conn.close()
    deadline = time.monotonic() + grace_s
    for child in children:
        child.process.join(max(0.0, deadline - time.monotonic()))
        if child.process.is_alive():
            child.process.kill()
            child.process.join(5.0)
    children.clear()


class ScoringPool:
    """``size`` child processes, each holding its own ``scorer_cls(**options)``; see the module docstring.

    ``timeout_s`` limits each sample's running time, counted from when a child takes it (time spent waiting
    for a free child does not count). ``start_timeout_s`` limits a child's start-up (building the scorer and
    ``warm_up``). Children start in the background as soon as the pool is built.
    """

    def __init__(
        self,
        scorer_cls: type[RewardScorer],
        options: dict[str, Any],
        *,
        size: int,
        timeout_s: float,
        name: str,
        start_timeout_s: float = 120.0,
    ) -> None:
        if size < 1:
            raise ValueError(f"{name}: the pool needs at least 1 process, got {size!r}")
        try:
            pickle.dumps((scorer_cls, options))
        except Exception as err:
            raise TypeError(
                f"{name}: {scorer_cls.__module__}:{scorer_cls.__qualname__} must be importable by that path "
                f"(a class defined at module level) and its options plain data, to be built in each scoring "
                f"process: {err}"
            ) from err
        self.size = size
        self.timeout_s = timeout_s
        self.start_timeout_s = start_timeout_s
        self.name = name
        self._scorer_cls = scorer_cls
        self._options = dict(options)
        self._context = _context([scorer_cls.__module__, *scorer_cls.preload_modules])
        self._cond = threading.Condition()
        #: The thread that drives the pool now (see ``run``), None when no caller does.
        self._driver: int | None = None
        self._start_failures = 0
        #: (batch, index) of the samples not yet sent to a child, in the order they came.
        self._waiting: deque[tuple[_Job, int]] = deque()
        #: token -> (batch, index) of each sample sent to a child and not yet answered.
        self._sent: dict[int, tuple[_Job, int]] = {}
        self._tokens = itertools.count()
        self._wake_r, self._wake_w = multiprocessing.Pipe(duplex=False)
        #: Cumulative counts since the pool was built: samples cut at the timeout, children that died while
        #: scoring, and children started to replace one that was killed or died.
        self.stats = {"timeouts": 0, "crashes": 0, "restarts": 0}
        self._children: list[_Child] = []
        self._finalizer = weakref.finalize(self, _shutdown, self._children, 1.0)
        for _ in range(size):
            self._children.append(self._start())

    def close(self) -> None:
        """Stop every child; the pool cannot be used afterwards."""
        self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def pids(self) -> list[int | None]:
        """Process ids of the current children (None for one not started yet)."""
        return [child.process.pid for child in self._children]

    def run(self, samples: Sequence[dict[str, Any]]) -> list[Outcome]:
        """Score every ``{"response", "ground_truth", **fields}`` sample; outcomes in the samples' order.

        Callers in several threads (a reward worker serving several groups at once) share the children: their
        samples are dispatched as they come, and no batch waits for another to finish. One caller at a time
        drives the pool (sends samples, reads results, enforces time limits) for every batch until its own is
        done, then hands over to a caller still waiting. Raises ``PoolStartError`` when no child can be started.
        """
        job = _Job(samples, [None] * len(samples), len(samples))
        with self._cond:
            if self.closed:
                raise RuntimeError(f"{self.name}: the scoring pool is closed")
            if not samples:
                return []
            self._waiting.extend((job, i) for i in range(len(samples)))
            self._wake()
        try:
            while True:
                with self._cond:
                    while not job.finished and self._driver is not None:
                        self._cond.wait()
                    if job.finished:
                        break
                    self._driver = threading.get_ident()
                try:
                    while not job.finished:
                        self._dispatch()
                        self._collect()
                        self._drop_cancelled()
                except PoolStartError as err:
                    with self._cond:
                        for other in {j for j, _ in self._waiting} | {job}:
                            other.error = err
                    raise
                finally:
                    with self._cond:
                        self._driver = None
                        self._cond.notify_all()
        except BaseException:
            # Interrupted (Ctrl-C, a cancelled task): the job's samples leave the queue, and a child still busy
            # with one is replaced by whoever drives the pool next, so that no stale work holds a child.
            with self._cond:
                job.cancelled = True
                self._waiting = deque(item for item in self._waiting if item[0] is not job)
                self._cond.notify_all()
                free = self._driver is None and not self.closed
                if free:
                    self._driver = threading.get_ident()
            if free:
                try:
                    with contextlib.suppress(Exception):
                        self._drop_cancelled()
                finally:
                    with self._cond:
                        self._driver = None
                        self._cond.notify_all()
            raise
        if job.error is not None:
            raise job.error
        return [outcome for outcome in job.outcomes if outcome is not None]

    # ------------------------------------------------------------------------------------------- internals

    def _wake(self) -> None:
        """Wake the caller that drives the pool from its wait on the children (new samples are queued)."""
        with contextlib.suppress(OSError):
            self._wake_w.send_bytes(b"x")

    def _finish(self, token: int, outcome: Outcome) -> None:
        job, index = self._sent.pop(token)
        if job.cancelled or job.outcomes[index] is not None:
            return
        job.outcomes[index] = outcome
        job.left -= 1
        if job.left == 0:
            with self._cond:
                self._cond.notify_all()

    def _drop_cancelled(self) -> None:
        """Replace the children busy with a cancelled batch's sample; forget its queued ones."""
        for child in list(self._children):
            if child.queue and self._sent[child.queue[0]][0].cancelled:
                for token in child.queue:
                    self._sent.pop(token, None)
                child.queue.clear()
                self._replace(child)

    def _start(self) -> _Child:
        parent_conn, child_conn = self._context.Pipe(duplex=True)
        process = self._context.Process(
            target=_serve,
            args=(child_conn, self._scorer_cls, self._options),
            name=f"{self.name}-scorer",
            daemon=True,
        )
        process.start()
        # The child holds its own end now; keeping ours open would hide the child's death from recv().
        child_conn.close()
        return _Child(process=process, conn=parent_conn, started=time.monotonic())

    def _dispatch(self) -> None:
        """Send waiting samples to the ready children, level by level: every child gets one before any gets two.
        A child's "ready" may wait unread in its pipe (no caller drove the pool since it came): read first, so that
        a sample does not queue behind another's on a busy child while an idle one is there."""
        for child in [c for c in self._children if not c.ready]:
            if child.conn.poll():
                self._read(child)
        for depth in range(1, QUEUE_DEPTH + 1):
            for child in list(self._children):
                if not child.ready or len(child.queue) >= depth:
                    continue
                with self._cond:
                    if not self._waiting:
                        return
                    job, index = self._waiting.popleft()
                token = next(self._tokens)
                self._sent[token] = (job, index)
                try:
                    child.conn.send((token, job.samples[index]))
                except (pickle.PicklingError, TypeError, AttributeError) as err:
                    self._finish(token, Outcome("error", detail=f"the sample cannot be sent to a scoring process: {err}"))
                    continue
                except OSError:
                    # The child is gone; this sample never reached it.
                    del self._sent[token]
                    with self._cond:
                        self._waiting.appendleft((job, index))
                    self._lost(child)
                    continue
                if not child.queue:
                    child.deadline = time.monotonic() + self.timeout_s
                child.queue.append(token)

    def _collect(self) -> None:
        now = time.monotonic()
        deadlines = [c.deadline for c in self._children if c.queue]
        deadlines += [c.started + self.start_timeout_s for c in self._children if not c.ready]
        timeout = max(0.0, min(deadlines) - now) if deadlines else None
        handles = [c.conn for c in self._children] + [c.process.sentinel for c in self._children] + [self._wake_r]
        ready = set(multiprocessing.connection.wait(handles, timeout))
        if self._wake_r in ready:
            while self._wake_r.poll():
                self._wake_r.recv_bytes()
        for child in list(self._children):
            if child.conn in ready or child.process.sentinel in ready:
                self._read(child)
        now = time.monotonic()
        for child in list(self._children):
            if child.queue and now >= child.deadline:
                logger.warning(
                    "%s: a sample ran past %.1fs; its scoring process (pid %s) is killed and replaced",
                    self.name,
                    self.timeout_s,
                    child.process.pid,
                )
                self._finish(child.queue.popleft(), Outcome("timeout"))
                self.stats["timeouts"] += 1
                self._replace(child)
            elif not child.ready and now >= child.started + self.start_timeout_s:
                child.failure = f"did not start within {self.start_timeout_s:.0f}s"
                self._replace(child)

    def _read(self, child: _Child) -> None:
        try:
            while child.conn.poll():
                kind, token, payload = child.conn.recv()
                if kind == "ready":
                    child.ready = True
                    self._start_failures = 0
                elif kind == "failed":
                    child.failure = payload
                elif child.queue and token == child.queue[0]:
                    child.queue.popleft()
                    self._finish(token, Outcome(kind, value=payload) if kind == "ok" else Outcome(kind, detail=payload))
                    # The next queued sample starts now (give or take the time this message took to read).
                    child.deadline = time.monotonic() + self.timeout_s if child.queue else math.inf
        except (EOFError, OSError):
            self._lost(child)
            return
        if not child.process.is_alive():
            self._lost(child)

    def _lost(self, child: _Child) -> None:
        """A child died on its own: its sample (if any) is a crash; one that never started is a failure."""
        child.process.join(5.0)
        how = f"exit code {child.process.exitcode}"
        if child.queue:
            logger.warning("%s: a scoring process died while scoring (%s); replaced", self.name, how)
            self._finish(child.queue.popleft(), Outcome("crash", detail=f"the scoring process died ({how})"))
            self.stats["crashes"] += 1
        elif not child.ready:
            child.failure = child.failure or f"the scoring process died while starting ({how})"
        self._replace(child)

    def _replace(self, child: _Child) -> None:
        """Kill ``child`` if it still runs and start another; samples it had not started go back to the queue."""
        with self._cond:
            self._waiting.extendleft(reversed([self._sent.pop(token) for token in child.queue]))
        child.queue.clear()
        if child.process.is_alive():
            child.process.kill()
        child.process.join(5.0)
        child.conn.close()
        self._children.remove(child)
        if not child.ready:
            self._start_failures += 1
            if self._start_failures >= MAX_START_FAILURES:
                self.close()
                raise PoolStartError(
                    f"{self.name}: {self._start_failures} scoring processes in a row failed to start; "
                    f"the last one: {child.failure}"
                )
        self.stats["restarts"] += 1
        self._children.append(self._start())

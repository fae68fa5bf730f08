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

from workers.rewards.base import RewardScorer

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
    #: Indices of the samples sent to this child, in order: the first is being scored, the others wait in its
    #: pipe (so that the child never waits for the parent between samples).
    queue: deque[int] = field(default_factory=deque)
    #: When the first of ``queue`` runs out of time.
    deadline: float = math.inf
    failure: str = ""


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
        self._lock = threading.Lock()
        self._start_failures = 0
        #: Indices of the running batch's samples not yet sent to a child.
        self._waiting: deque[int] = deque()
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

        Raises ``PoolStartError`` when no child can be started.
        """
        with self._lock:
            if self.closed:
                raise RuntimeError(f"{self.name}: the scoring pool is closed")
            outcomes: list[Outcome | None] = [None] * len(samples)
            self._waiting = deque(range(len(samples)))
            try:
                while self._waiting or any(child.queue for child in self._children):
                    self._dispatch(samples, outcomes)
                    self._collect(outcomes)
            except BaseException:
                # Interrupted (Ctrl-C, a cancelled task): a child still busy would answer a later batch with
                # this batch's indices, so it goes.
                for child in [c for c in self._children if c.queue]:
                    child.queue.clear()
                    self._replace(child)
                raise
            finally:
                self._waiting = deque()
            return [outcome for outcome in outcomes if outcome is not None]

    # ------------------------------------------------------------------------------------------- internals

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

    def _dispatch(self, samples: Sequence[dict], outcomes: list[Outcome | None]) -> None:
        """Send waiting samples to the ready children, level by level: every child gets one before any gets two."""
        for depth in range(1, QUEUE_DEPTH + 1):
            for child in list(self._children):
                if not self._waiting:
                    return
                if not child.ready or len(child.queue) >= depth:
                    continue
                index = self._waiting.popleft()
                try:
                    child.conn.send((index, samples[index]))
                except (pickle.PicklingError, TypeError, AttributeError) as err:
                    outcomes[index] = Outcome(
                        "error", detail=f"the sample cannot be sent to a scoring process: {err}"
                    )
                    continue
                except OSError:
                    # The child is gone; this sample never reached it.
                    self._waiting.appendleft(index)
                    self._lost(child, outcomes)
                    continue
                if not child.queue:
                    child.deadline = time.monotonic() + self.timeout_s
                child.queue.append(index)

    def _collect(self, outcomes: list[Outcome | None]) -> None:
        now = time.monotonic()
        deadlines = [c.deadline for c in self._children if c.queue]
        deadlines += [c.started + self.start_timeout_s for c in self._children if not c.ready]
        timeout = max(0.0, min(deadlines) - now) if deadlines else None
        handles = [c.conn for c in self._children] + [c.process.sentinel for c in self._children]
        ready = set(multiprocessing.connection.wait(handles, timeout))
        for child in list(self._children):
            if child.conn in ready or child.process.sentinel in ready:
                self._read(child, outcomes)
        now = time.monotonic()
        for child in list(self._children):
            if child.queue and now >= child.deadline:
                logger.warning(
                    "%s: a sample ran past %.1fs; its scoring process (pid %s) is killed and replaced",
                    self.name,
                    self.timeout_s,
                    child.process.pid,
                )
                outcomes[child.queue.popleft()] = Outcome("timeout")
                self.stats["timeouts"] += 1
                self._replace(child)
            elif not child.ready and now >= child.started + self.start_timeout_s:
                child.failure = f"did not start within {self.start_timeout_s:.0f}s"
                self._replace(child)

    def _read(self, child: _Child, outcomes: list[Outcome | None]) -> None:
        try:
            while child.conn.poll():
                kind, index, payload = child.conn.recv()
                if kind == "ready":
                    child.ready = True
                    self._start_failures = 0
                elif kind == "failed":
                    child.failure = payload
                elif child.queue and index == child.queue[0]:
                    child.queue.popleft()
                    outcomes[index] = (
                        Outcome(kind, value=payload) if kind == "ok" else Outcome(kind, detail=payload)
                    )
                    # The next queued sample starts now (give or take the time this message took to read).
                    child.deadline = time.monotonic() + self.timeout_s if child.queue else math.inf
        except (EOFError, OSError):
            self._lost(child, outcomes)
            return
        if not child.process.is_alive():
            self._lost(child, outcomes)

    def _lost(self, child: _Child, outcomes: list[Outcome | None]) -> None:
        """A child died on its own: its sample (if any) is a crash; one that never started is a failure."""
        child.process.join(5.0)
        how = f"exit code {child.process.exitcode}"
        if child.queue:
            logger.warning("%s: a scoring process died while scoring (%s); replaced", self.name, how)
            outcomes[child.queue.popleft()] = Outcome("crash", detail=f"the scoring process died ({how})")
            self.stats["crashes"] += 1
        elif not child.ready:
            child.failure = child.failure or f"the scoring process died while starting ({how})"
        self._replace(child)

    def _replace(self, child: _Child) -> None:
        """Kill ``child`` if it still runs and start another; samples it had not started go back to the queue."""
        self._waiting.extendleft(reversed(child.queue))
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

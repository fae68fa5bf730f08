"""Dynamic batching of concurrent generation requests for actor_infer.

Schedulers of several domains send small requests (one prompt's group, or a few validation prompts) at the same
time. One background thread takes whatever is pending, joins the requests that share generating arguments into
one batch of at most ``max_sequences`` sequences, and runs it; requests that arrive meanwhile wait for the next
batch. So concurrency turns into batches, not into one-at-a-time generation. Before a batch starts, the batcher
gathers: it waits until no request has come for `gather_s` (a burst of Ray calls is over), until a batch is full,
or until every source it was told of (actor_infer: the domains) has all the requests of one wave pending (a
scheduler sends a wave of draws as a few requests at once and names the wave in each: `Request.wave`), so a
step's rollout does not wait out the window when everything it will send is in.

``call(fn)`` runs other work on the same thread, between two batches (weight loads, the model's own load), so that
every torch operation of the worker runs on one thread: GNU OpenMP, which torch's CPU kernels use, keeps a team of
threads per thread that ever ran a parallel operation, and once the process holds more team threads than it has cores
it stops spinning between operations and puts every team thread to sleep after each one. Measured on 2 cores
(2026-12-07, the tiny model sampling 16 prompts x 8): one other thread that had run a single parallel operation made
each decoding step 35-40% slower (23-24 against 17-18 ms), and in bench_trl's pipeline the generation each group
waits for took 0.27 s where it takes 0.20 s with the model's load and the weight syncs moved onto this thread.

``abort`` drops pending requests at once and asks a running batch to stop their rows: the batch function gets an
``is_aborted(i)`` callback (the generation strategy turns it into a stopping criterion), and when every row of a
batch is aborted the batch ends early. An aborted request's caller gets ``None``, never a partial result.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Hashable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)


@dataclass
class Request:
    request_id: str
    prompts: list[list[int]]
    num_return_sequences: int
    key: Hashable
    """Requests are batched together only when their keys (the generating arguments) are equal."""
    payload: Any = None
    wave: tuple[str, Hashable, int] | None = None
    """(source, wave, requests in it): the request is one of a wave its source (a domain's scheduler) sent at once;
    the batcher need not wait for more once every source it knows has a whole wave pending."""
    future: Future = field(default_factory=Future)
    aborted: bool = False

    @property
    def sequences(self) -> int:
        return len(self.prompts) * self.num_return_sequences


RunBatch = Callable[[list[Request], Callable[[int], bool]], list[Any]]
"""Runs requests as one batch; gets `is_aborted(request_index)`; returns one result per request."""


class RequestBatcher:
    def __init__(
        self,
        run_batch: RunBatch,
        max_sequences: int,
        gather_s: float = 0.01,
        max_gather_s: float = 0.05,
        name: str = "batcher",
        sources: Iterable[str] = (),
    ) -> None:
        self.run_batch = run_batch
        self.max_sequences = max_sequences
        self.gather_s = gather_s
        """Before a batch starts, wait until no request has arrived for this long..."""
        self.max_gather_s = max_gather_s
        """...but no longer than this in all, or until the waiting requests fill a batch, or until each of
        `sources` has a whole wave pending (`Request.wave`)."""
        self.sources = frozenset(sources)
        self.generation_lock = threading.Lock()
        """Held while a batch runs (holding it keeps the next batch from starting); the model is changed between
        batches through `call`, on the serving thread, not under this lock."""
        self._cond = threading.Condition()
        self._pending: list[Request] = []
        self._running: dict[str, Request] = {}
        # Ids aborted before their request arrived (an abort can overtake its request): refused on arrival.
        self._aborted_unseen: dict[str, None] = {}
        self._calls: list[tuple[Callable[[], Any], Future]] = []
        self.batches_run = 0
        self.sizes: list[int] = []
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, request: Request) -> Future:
        with self._cond:
            if self._aborted_unseen.pop(request.request_id, 0) is None:
                request.aborted = True
                request.future.set_result(None)
                return request.future
            self._pending.append(request)
            self._cond.notify()
        return request.future

    def defer(self, fn: Callable[[], Any]) -> Future:
        """Have `fn` run on the serving thread before the next batch starts (at once when none runs); its future
        gives what it returns or raised."""
        future: Future = Future()
        with self._cond:
            self._calls.append((fn, future))
            self._cond.notify()
        return future

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the serving thread (at once when called there, else as `defer` does) and return what it
        returns, or raise what it raised."""
        if threading.current_thread() is self._thread:
            return fn()
        return self.defer(fn).result()

    def abort(self, request_ids: Iterable[str]) -> int:
        """Abort the named requests, pending or running; returns how many were still unfinished."""
        ids = set(request_ids)
        found: set[str] = set()
        with self._cond:
            keep = []
            for request in self._pending:
                if request.request_id in ids:
                    request.aborted = True
                    request.future.set_result(None)
                    found.add(request.request_id)
                else:
                    keep.append(request)
            self._pending = keep
            for request_id in ids & self._running.keys():
                self._running[request_id].aborted = True
                found.add(request_id)
            for request_id in ids - found:
                self._aborted_unseen[request_id] = None
            while len(self._aborted_unseen) > 10_000:
                self._aborted_unseen.pop(next(iter(self._aborted_unseen)))
        return len(found)

    def _next_batch(self) -> list[Request]:
        while True:
            with self._cond:
                while not self._pending and not self._calls:
                    self._cond.wait()
            self._run_calls()
            if not self._pending:
                continue
            self._gather()
            with self._cond:
                if not self._pending:
                    continue  # everything that was waiting got aborted meanwhile
                key = self._pending[0].key
                batch, rest, total = [], [], 0
                for request in self._pending:
                    fits = not batch or total + request.sequences <= self.max_sequences
                    if request.key == key and fits:
                        batch.append(request)
                        total += request.sequences
                    else:
                        rest.append(request)
                self._pending = rest
                self._running = {r.request_id: r for r in batch}
                return batch

    def _run_calls(self) -> None:
        while True:
            with self._cond:
                if not self._calls:
                    return
                fn, future = self._calls.pop(0)
            try:
                future.set_result(fn())
            except BaseException as err:  # the caller raises it; serving goes on
                future.set_exception(err)

    def _loop(self) -> None:
        while True:
            try:
                self._serve_one_batch()
            except BaseException:  # never let the serving thread die: every caller would wait forever
                logger.exception("request batcher: unexpected error; serving goes on")

    def _gather(self) -> None:
        """Requests of a burst (every domain starting a step) arrive one Ray call at a time: wait for the burst
        to end, so that it forms one batch instead of a small one followed by a large one."""
        if self.gather_s <= 0:
            return
        deadline = time.monotonic() + self.max_gather_s
        with self._cond:
            while sum(r.sequences for r in self._pending) < self.max_sequences and not self._waves_in():
                left = deadline - time.monotonic()
                # wait() returns False when gather_s passed with no new request: the burst is over.
                if left <= 0 or not self._cond.wait(min(self.gather_s, left)):
                    return

    def _waves_in(self) -> bool:
        """Whether every known source has all the requests of one of its waves pending (the caller holds _cond)."""
        if not self.sources:
            return False
        waves = Counter(r.wave for r in self._pending if r.wave is not None)
        whole = {wave[0] for wave, count in waves.items() if count >= wave[2]}
        return self.sources <= whole

    def _serve_one_batch(self) -> None:
        batch = self._next_batch()
        try:
            with self.generation_lock:
                results = self.run_batch(batch, lambda i, batch=batch: batch[i].aborted)
            error = None
        except BaseException as err:  # the caller of each request gets the error, the loop goes on
            logger.exception("generation batch failed")
            results, error = [None] * len(batch), err
        with self._cond:
            self._running = {}
            self.batches_run += 1
            self.sizes.append(sum(r.sequences for r in batch))
        for request, result in zip(batch, results, strict=True):
            if request.future.done():
                continue
            if error is not None:
                request.future.set_exception(error)
            else:
                request.future.set_result(None if request.aborted else result)

"""Scoring for I/O-bound scorers (a judge over HTTP, a remote sandbox): many samples in flight on an asyncio loop.

A scorer that spends its time waiting on the network gains nothing from a process of its own per sample: the
reward worker runs its samples on an asyncio event loop (in a thread of its own), up to ``in_flight`` at once
across every batch that calls, each scorer call in a thread of a pool with one scorer per thread (built and
warmed up in that thread, so scorers need not be thread-safe), under the per-sample time limit. A call past the
limit is masked as a timeout at once; its thread cannot be killed and ends with the scorer's own request
timeout, its slot counted free (the pool has room for as many again). A scorer declares itself I/O-bound with
``RewardScorer.io_bound(options)``: llm_judge always, code_sandbox with ``backend: remote``.
"""

from __future__ import annotations

import asyncio
import threading
import traceback
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from roll_core.rewards.scorer import RewardScorer
from workers.rewards.pool import Outcome


class IOScoringLoop:
    """See the module's docstring; ``run`` may be called from several threads at once."""

    def __init__(
        self, scorer_cls: type[RewardScorer], options: dict[str, Any], *, in_flight: int, timeout_s: float, name: str
    ) -> None:
        if in_flight < 1:
            raise ValueError(f"{name}: in_flight must be >= 1, got {in_flight!r}")
        self.name, self.timeout_s, self.in_flight = name, timeout_s, in_flight
        self._scorer_cls, self._options = scorer_cls, dict(options)
        self._local = threading.local()
        # Built and warmed up once here: a bad option or an unreachable shared resource shows at start-up.
        first = scorer_cls(**self._options)
        first.warm_up()
        self._local.scorer = first
        self._executor = ThreadPoolExecutor(max_workers=2 * in_flight, thread_name_prefix=name)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"{name}-loop", daemon=True)
        self._thread.start()
        self._slots = asyncio.run_coroutine_threadsafe(self._make_slots(), self._loop).result()
        self._closed = False
        self.stats = {"timeouts": 0, "crashes": 0, "restarts": 0, "peak_in_flight": 0}
        self._running = 0

    async def _make_slots(self) -> asyncio.Semaphore:
        return asyncio.Semaphore(self.in_flight)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5.0)
        self._executor.shutdown(wait=False, cancel_futures=True)

    @property
    def closed(self) -> bool:
        return self._closed

    def run(self, samples: Sequence[dict[str, Any]]) -> list[Outcome]:
        """Every sample's outcome, in order; samples of other callers' batches share the `in_flight` slots."""
        if self._closed:
            raise RuntimeError(f"{self.name}: the scoring loop is closed")
        return asyncio.run_coroutine_threadsafe(self._run(samples), self._loop).result()

    async def _run(self, samples: Sequence[dict[str, Any]]) -> list[Outcome]:
        return list(await asyncio.gather(*(self._one(sample) for sample in samples)))

    async def _one(self, sample: dict[str, Any]) -> Outcome:
        async with self._slots:
            self._running += 1
            self.stats["peak_in_flight"] = max(self.stats["peak_in_flight"], self._running)
            call = self._loop.run_in_executor(self._executor, self._score, sample)
            try:
                value = await asyncio.wait_for(asyncio.shield(call), self.timeout_s)
            except TimeoutError:
                self.stats["timeouts"] += 1
                return Outcome("timeout")
            except Exception:
                return Outcome("error", detail=traceback.format_exc())
            finally:
                self._running -= 1
            return Outcome("ok", value=value)

    def _score(self, sample: dict[str, Any]) -> Any:
        scorer = getattr(self._local, "scorer", None)
        if scorer is None:
            scorer = self._scorer_cls(**self._options)
            scorer.warm_up()
            self._local.scorer = scorer
        fields = {k: v for k, v in sample.items() if k not in ("response", "ground_truth")}
        return scorer.score(sample["response"], sample["ground_truth"], **fields)

"""The generic reward worker: one per domain, wrapping that domain's pure scorer.

The pipeline wraps ``RewardWorker`` in ``ray.remote`` itself, so this module stays importable and testable
without Ray. The worker scores a batch concurrently, gives each sample ``timeout_s`` seconds of running time,
and masks (never zeroes) a sample whose scorer returned ``None``, raised, or ran out of time.

How samples are run is kept behind ``_ThreadRunner.run``: a later change swaps in a process pool, whose
workers can be killed on timeout, without touching the scoring or the result format.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from workers.rewards.base import RewardResult, RewardScorer
from workers.rewards.registry import get_reward_scorer_cls

logger = logging.getLogger(__name__)

#: Why a sample was masked; also the suffix of its ``reward/<domain>/masked_<reason>`` count.
MASK_NOT_APPLICABLE = "not_applicable"
MASK_ERROR = "error"
MASK_TIMEOUT = "timeout"
_MASK_REASONS = (MASK_NOT_APPLICABLE, MASK_ERROR, MASK_TIMEOUT)


@dataclass(frozen=True)
class _Outcome:
    """How one call ended: a value, an exception, or no answer in time."""

    value: Any = None
    error: BaseException | None = None
    timed_out: bool = False


class _ThreadRunner:
    """Runs calls on at most ``num_threads`` live threads, each call limited to ``timeout_s`` of running time.

    A thread cannot be killed, so a call that runs out of time is abandoned: its (daemon) thread keeps running
    until the call returns, its result is dropped, and its slot goes to the next call. A fixed
    ``ThreadPoolExecutor`` would instead let hung calls hold every slot, and would block interpreter exit.
    """

    def __init__(self, num_threads: int, timeout_s: float, name: str) -> None:
        self.num_threads = num_threads
        self.timeout_s = timeout_s
        self.name = name
        self._abandoned: list[threading.Thread] = []

    def run(self, fn: Callable[[Any], Any], items: list[Any]) -> list[_Outcome]:
        outcomes: list[_Outcome | None] = [None] * len(items)
        waiting = deque(range(len(items)))
        deadlines: dict[int, float] = {}
        threads: dict[int, threading.Thread] = {}
        finished: queue.SimpleQueue[tuple[int, _Outcome]] = queue.SimpleQueue()

        def call(index: int) -> None:
            try:
                outcome = _Outcome(value=fn(items[index]))
            # Any failure of a scorer, SystemExit included, masks its sample rather than killing the worker.
            except BaseException as err:
                outcome = _Outcome(error=err)
            finished.put((index, outcome))

        while waiting or deadlines:
            while waiting and len(deadlines) < self.num_threads:
                index = waiting.popleft()
                thread = threading.Thread(
                    target=call, args=(index,), name=f"{self.name}-{index}", daemon=True
                )
                deadlines[index] = time.monotonic() + self.timeout_s
                threads[index] = thread
                thread.start()
            try:
                index, outcome = finished.get(timeout=max(0.0, min(deadlines.values()) - time.monotonic()))
            except queue.Empty:
                pass
            else:
                # A late answer from an abandoned call has no deadline left and is dropped.
                if deadlines.pop(index, None) is not None:
                    outcomes[index] = outcome
            now = time.monotonic()
            for index, deadline in list(deadlines.items()):
                if now >= deadline:
                    del deadlines[index]
                    outcomes[index] = _Outcome(timed_out=True)
                    self._abandoned.append(threads[index])
        self._abandoned = [t for t in self._abandoned if t.is_alive()]
        if self._abandoned:
            logger.warning(
                "%s: %d timed-out scorer call(s) still running in the background",
                self.name,
                len(self._abandoned),
            )
        return [outcome for outcome in outcomes if outcome is not None]


class RewardWorker:
    """Scores batches of one domain's samples with the scorer named by ``worker_spec``.

    ``worker_spec`` is a registered name (``math_rule``, ``code_sandbox``), an entry-point name, or a
    ``package.module:Class`` path; ``options`` are the scorer's options (``rewards.<domain>.options``).
    """

    def __init__(
        self,
        domain: str,
        worker_spec: str,
        options: dict,
        timeout_s: float = 30.0,
        num_threads: int = 2,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"reward worker timeout_s must be positive, got {timeout_s!r}")
        if num_threads < 1:
            raise ValueError(f"reward worker num_threads must be at least 1, got {num_threads!r}")
        self.domain = domain
        self.timeout_s = timeout_s
        self.scorer: RewardScorer = get_reward_scorer_cls(worker_spec)(**(options or {}))
        self._runner = _ThreadRunner(num_threads, timeout_s, name=f"reward-{domain}")

    def _score_sample(self, sample: dict) -> RewardResult | None:
        fields = {k: v for k, v in sample.items() if k not in ("response", "ground_truth")}
        return self.scorer.score(sample["response"], sample["ground_truth"], **fields)

    def score_batch(self, samples: list[dict]) -> list[dict]:
        """Score each ``{"response", "ground_truth", **fields}`` sample.

        Returns, per sample and in order, ``{"score", "correct", "masked", "mask_reason", "metrics"}``;
        a masked sample has ``score`` and ``correct`` set to ``None`` and ``mask_reason`` set to one of
        ``not_applicable``, ``error``, ``timeout``.
        """
        for i, sample in enumerate(samples):
            missing = {"response", "ground_truth"} - sample.keys()
            if missing:
                raise KeyError(f"reward worker {self.domain!r}: sample {i} lacks {sorted(missing)}")
        outcomes = self._runner.run(self._score_sample, samples)
        return [self._to_record(sample, outcome) for sample, outcome in zip(samples, outcomes, strict=True)]

    def _to_record(self, sample: dict, outcome: _Outcome) -> dict:
        if outcome.timed_out:
            logger.warning(
                "reward worker %r: sample %r timed out after %.1fs; masked",
                self.domain,
                sample.get("id"),
                self.timeout_s,
            )
            return _masked(MASK_TIMEOUT)
        if outcome.error is not None:
            logger.warning(
                "reward worker %r: scorer failed on sample %r; masked",
                self.domain,
                sample.get("id"),
                exc_info=outcome.error,
            )
            return _masked(MASK_ERROR)
        result = outcome.value
        if result is None:
            return _masked(MASK_NOT_APPLICABLE)
        if not isinstance(result, RewardResult):
            logger.warning(
                "reward worker %r: scorer returned %s, not a RewardResult; masked",
                self.domain,
                type(result).__name__,
            )
            return _masked(MASK_ERROR)
        return {
            "score": float(result.score),
            "correct": bool(result.correct),
            "masked": False,
            "mask_reason": None,
            "metrics": dict(result.metrics),
        }

    def domain_metrics(self, results: list[dict]) -> dict[str, float]:
        """Aggregate ``score_batch`` results into ``reward/<domain>/...`` metrics (see `domain_metrics`)."""
        return domain_metrics(self.domain, results)


def domain_metrics(domain: str, results: list[dict]) -> dict[str, float]:
    """Aggregate ``score_batch`` results into ``reward/<domain>/...`` metrics; a pure function, so the caller that
    holds the results aggregates them where they are instead of sending them back to a worker.

    ``count``, ``masked`` and ``masked_<reason>`` are counts over all samples; ``score``, ``correct`` (a
    rate) and the mean of each scorer metric are over unmasked samples only, and absent when there are none.
    """
    prefix = f"reward/{domain}"
    scored = [r for r in results if not r["masked"]]
    metrics: dict[str, float] = {
        f"{prefix}/count": float(len(results)),
        f"{prefix}/masked": float(len(results) - len(scored)),
    }
    for reason in _MASK_REASONS:
        metrics[f"{prefix}/masked_{reason}"] = float(
            sum(1 for r in results if r["masked"] and r.get("mask_reason") == reason)
        )
    if scored:
        metrics[f"{prefix}/score"] = sum(r["score"] for r in scored) / len(scored)
        metrics[f"{prefix}/correct"] = sum(1.0 for r in scored if r["correct"]) / len(scored)
    values: dict[str, list[float]] = {}
    for r in scored:
        for name, value in r["metrics"].items():
            values.setdefault(name, []).append(float(value))
    for name, vals in sorted(values.items()):
        metrics[f"{prefix}/{name}"] = sum(vals) / len(vals)
    return metrics


def _masked(reason: str) -> dict:
    return {"score": None, "correct": None, "masked": True, "mask_reason": reason, "metrics": {}}

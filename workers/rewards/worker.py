"""The generic reward worker: one per domain, wrapping that domain's pure scorer.

The pipeline wraps ``RewardWorker`` in ``ray.remote`` itself, so this module stays importable and testable
without Ray. The worker scores a batch on a pool of processes (``workers.rewards.pool``), gives each sample
``timeout_s`` seconds of running time, and masks (never zeroes) a sample whose scorer returned ``None``,
raised, ran out of time, or took its process down with it. The reward is a number per response; the pipeline
puts it at the response's last valid token (``roll_core.algorithms.advantages.place_at_last_token``), and
a masked sample leaves the loss.
"""

from __future__ import annotations

import logging
import threading
import traceback
from collections.abc import Sequence

from roll_core.rewards.scored import (
    MASK_CRASH,
    MASK_ERROR,
    MASK_NOT_APPLICABLE,
    MASK_REASONS,
    MASK_TIMEOUT,
    MASK_WORKER_LOST,
    ScoredSample,
)
from roll_core.rewards.scorer import RewardResult
from workers.rewards.io_loop import IOScoringLoop
from workers.rewards.pool import Outcome, ScoringPool
from workers.rewards.registry import get_reward_scorer_cls

logger = logging.getLogger(__name__)


class RewardWorker:
    """Scores batches of one domain's samples with the scorer named by ``worker_spec``.

    ``worker_spec`` is a registered name (``math_rule``, ``code_sandbox``), an entry-point name, or a
    ``package.module:Class`` path; ``options`` are the scorer's options (``rewards.<domain>.options``),
    checked here by building the scorer once. ``processes`` is the number of samples scored at once: each in
    its own process of the worker's pool (started in the background when the worker is built;
    ``start_timeout_s`` bounds a process's start-up), or, for a scorer that is I/O-bound with these options,
    requests in flight on an asyncio loop (workers/rewards/io_loop.py); a batched scorer (a reward model) scores
    whole batches in this process. ``score_batch`` may be called from several threads at once (the Ray actor
    serves several groups at a time): no batch waits for another to finish.
    """

    MAX_CONCURRENT_BATCHES = 16
    """score_batch calls the Ray actor serves at once (threads): the groups of a step that land together are
    scored together, sharing the worker's processes (or in-flight slots)."""

    def __init__(
        self,
        domain: str,
        worker_spec: str,
        options: dict,
        timeout_s: float = 30.0,
        processes: int = 2,
        start_timeout_s: float = 120.0,
        num_gpus: float = 0.0,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"reward worker timeout_s must be positive, got {timeout_s!r}")
        if processes < 1:
            raise ValueError(f"reward worker processes must be at least 1, got {processes!r}")
        self.domain = domain
        self.timeout_s = timeout_s
        scorer_cls = get_reward_scorer_cls(worker_spec)
        options = scorer_cls.within_timeout(dict(options or {}), timeout_s)
        # worker_lost is the scheduler's finding (this worker died), never this worker's own.
        self._masked_total = dict.fromkeys((r for r in MASK_REASONS if r != MASK_WORKER_LOST), 0)
        self._scored_total = 0
        self._lock = threading.Lock()  # counters, and a batched scorer's model: calls come from several threads
        if scorer_cls.batched:
            # A model scores whole batches in this process, on this worker's device (see BatchedRewardScorer).
            from workers.devices import gpu_or_cpu  # torch: only a model-scoring worker needs it

            self._scorer = scorer_cls(**options)
            self._scorer.load(gpu_or_cpu(num_gpus, f"reward worker {domain!r}"))
            self._pool = None
            return
        if scorer_cls.io_bound(options):
            self._pool = IOScoringLoop(scorer_cls, options, in_flight=processes, timeout_s=timeout_s,
                                       name=f"reward-{domain}")
            return
        # Built here only to report a bad option at once, in the caller's process; the pool's children build
        # their own.
        scorer_cls(**options)
        self._pool = ScoringPool(
            scorer_cls,
            options,
            size=processes,
            timeout_s=timeout_s,
            name=f"reward-{domain}",
            start_timeout_s=start_timeout_s,
        )

    def close(self) -> None:
        """Stop the scoring processes (also done when the worker is garbage-collected or the run exits)."""
        if self._pool is not None:
            self._pool.close()

    def __enter__(self) -> RewardWorker:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def score_batch(self, samples: list[dict]) -> list[ScoredSample]:
        """Score each ``{"response", "ground_truth", **fields}`` sample (``fields``: the row's other columns).

        Returns a ``ScoredSample`` per sample, in order; a masked one has ``mask_reason`` set to one of
        ``not_applicable``, ``error``, ``crash``, ``timeout``.
        """
        for i, sample in enumerate(samples):
            missing = {"response", "ground_truth"} - sample.keys()
            if missing:
                raise KeyError(f"reward worker {self.domain!r}: sample {i} lacks {sorted(missing)}")
        outcomes = self._pool.run(samples) if self._pool is not None else self._score_in_process(samples)
        records = [
            self._to_record(sample, outcome) for sample, outcome in zip(samples, outcomes, strict=True)
        ]
        with self._lock:
            for record in records:
                if record.masked:
                    self._masked_total[record.mask_reason] += 1
                else:
                    self._scored_total += 1
        return records

    def stats(self) -> dict[str, int]:
        """Counts since the worker was built: ``scored``, ``masked_<reason>``, and the pool's ``timeouts``,
        ``crashes`` and ``restarts`` (scoring processes started to replace one that was killed or died)."""
        masked = {f"masked_{reason}": n for reason, n in self._masked_total.items()}
        return {"scored": self._scored_total, **masked, **(self._pool.stats if self._pool is not None else {})}

    def _score_in_process(self, samples: list[dict]) -> list[Outcome]:
        """A batched scorer's outcomes: its values, or an error for every sample when the batch call raised."""
        try:
            with self._lock:  # one batch at a time on the model
                values = self._scorer.score_batch(samples)
        except Exception:
            return [Outcome("error", detail=traceback.format_exc()) for _ in samples]
        if len(values) != len(samples):
            detail = f"score_batch returned {len(values)} results for {len(samples)} samples"
            return [Outcome("error", detail=detail) for _ in samples]
        return [Outcome("ok", value=value) for value in values]

    def _to_record(self, sample: dict, outcome: Outcome) -> ScoredSample:
        if outcome.kind == "timeout":
            logger.warning(
                "reward worker %r: sample %r timed out after %.1fs; masked",
                self.domain,
                sample.get("id"),
                self.timeout_s,
            )
            return ScoredSample.masked_as(MASK_TIMEOUT)
        if outcome.kind == "crash":
            logger.warning(
                "reward worker %r: sample %r: %s; masked", self.domain, sample.get("id"), outcome.detail
            )
            return ScoredSample.masked_as(MASK_CRASH)
        if outcome.kind == "error":
            logger.warning(
                "reward worker %r: scorer failed on sample %r; masked\n%s",
                self.domain,
                sample.get("id"),
                outcome.detail.rstrip(),
            )
            return ScoredSample.masked_as(MASK_ERROR)
        result = outcome.value
        if result is None:
            return ScoredSample.masked_as(MASK_NOT_APPLICABLE)
        if not isinstance(result, RewardResult):
            logger.warning(
                "reward worker %r: scorer returned %s, not a RewardResult; masked",
                self.domain,
                type(result).__name__,
            )
            return ScoredSample.masked_as(MASK_ERROR)
        return ScoredSample(score=float(result.score), correct=bool(result.correct), metrics=dict(result.metrics))

    def domain_metrics(self, results: Sequence[ScoredSample]) -> dict[str, float]:
        """Aggregate ``score_batch`` results into ``reward/<domain>/...`` metrics (see `domain_metrics`)."""
        return domain_metrics(self.domain, results)


def domain_metrics(domain: str, results: Sequence[ScoredSample]) -> dict[str, float]:
    """Aggregate ``score_batch`` results into ``reward/<domain>/...`` metrics; a pure function, so the caller that
    holds the results aggregates them where they are instead of sending them back to a worker.

    ``count``, ``masked`` and ``masked_<reason>`` are counts over all samples, and ``timed_out`` the share of
    all samples cut at the timeout; ``score``, ``correct`` (a rate) and the mean of each scorer metric are
    over unmasked samples only, and absent when there are none.
    """
    prefix = f"reward/{domain}"
    scored = [r for r in results if not r.masked]
    metrics: dict[str, float] = {
        f"{prefix}/count": float(len(results)),
        f"{prefix}/masked": float(len(results) - len(scored)),
    }
    for reason in MASK_REASONS:
        metrics[f"{prefix}/masked_{reason}"] = float(sum(1 for r in results if r.mask_reason == reason))
    if results:
        metrics[f"{prefix}/timed_out"] = metrics[f"{prefix}/masked_{MASK_TIMEOUT}"] / len(results)
    if scored:
        metrics[f"{prefix}/score"] = sum(r.score for r in scored) / len(scored)
        metrics[f"{prefix}/correct"] = sum(1.0 for r in scored if r.correct) / len(scored)
    values: dict[str, list[float]] = {}
    for r in scored:
        for name, value in r.metrics.items():
            values.setdefault(name, []).append(float(value))
    for name, vals in sorted(values.items()):
        metrics[f"{prefix}/{name}"] = sum(vals) / len(vals)
    return metrics


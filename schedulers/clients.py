"""The scheduler's two ways out of its process: generation on actor_infer and scoring on the domain's reward
workers, each with what it does when a worker fails. What a failure costs is counted on the step's StepStats
(schedulers/step.py), which the caller passes in; the clients keep no per-step counters.

- InferClient sends a generation request to the next actor_infer worker. A worker that Ray is restarting
  (unavailable), or that came back with its starting weights, gets the current weights and the request again, for
  up to RESTART_WAIT_S; a worker dead for good ends the step with its error.
- RewardClient scores samples with every reward of the domain and combines their judgements
  (workers/rewards/combine.py). Identical responses to one prompt are scored once. A dead reward worker passes
  the batch to the next; when none answers, the samples are masked as `worker_lost`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

from ray.exceptions import ActorUnavailableError, RayActorError

from roll_core.config import DataConfig, GeneratingArgs
from roll_core.data.loading import prompt_messages
from roll_core.rewards.scored import MASK_WORKER_LOST, ScoredSample
from roll_core.rewards.scorer import reward_sample
from workers.actor_infer import StaleWeightsError
from workers.rewards.combine import Component, combine

logger = logging.getLogger(__name__)


class InferClient:
    """actor_infer's workers, taken in turn, and the weights a restarted one must be given."""

    RESTART_WAIT_S = 300.0
    """How long a request waits for a restarting actor_infer worker before the step fails."""

    def __init__(self, domain: str, workers: list[Any]) -> None:
        self.domain, self.workers = domain, workers
        self._next = itertools.cycle(range(len(workers)))
        self.weights_version, self.weights_ref = 0, None
        self.pinned: tuple[int, int | None] | None = None
        """Deterministic partial rollouts (partial_rollout_token): the version this fill's requests name and the
        token at which they go on with the next one (None: they do not), set by the scheduler for one fill."""

    def next_worker(self) -> int:
        return next(self._next)

    def set_weights(self, version: int, weights_ref: Any) -> None:
        self.weights_version, self.weights_ref = version, weights_ref

    async def generate(
        self, worker: int, request_id: str, prompts: list[list[int]], args: GeneratingArgs, n: int,
        seed: int | None, stats: Any, wave: tuple[str, str, int] | None = None,
    ) -> dict[str, Any] | None:
        """One generation request to actor_infer[worker] (one of `wave`'s: `Request.wave` in
        schedulers/rollout.py); a lost request counts once in stats.infer_retries."""
        deadline = time.monotonic() + self.RESTART_WAIT_S
        resync = False
        for attempt in itertools.count():
            try:
                if resync and self.weights_ref is not None:
                    await self.workers[worker].update_weights.remote(self.weights_ref, self.weights_version)
                version, switch_at = self.pinned if self.pinned is not None else (self.weights_version, None)
                return await self.workers[worker].generate_request.remote(
                    request_id, prompts, args, n, seed, version, switch_at, wave=wave
                )
            except (ActorUnavailableError, StaleWeightsError) as exc:
                if isinstance(exc, StaleWeightsError) and self.weights_ref is None:
                    raise RuntimeError(
                        f"domain {self.domain!r}: actor_infer[{worker}] came back from a restart with its starting "
                        f"weights, and with a weight_transport no copy of version {self.weights_version} is kept to "
                        "send it again: resume the run from its last checkpoint (or use weight_transport rpc)"
                    ) from exc
                if time.monotonic() > deadline:
                    raise
                if not resync:
                    stats.infer_retries += 1
                    logger.warning(
                        "domain %r: actor_infer[%d] lost request %s (%s); sending it the current weights and the "
                        "request again",
                        self.domain, worker, request_id, type(exc).__name__,
                    )
                resync = True
                await asyncio.sleep(min(0.1 * 2**attempt, 2.0))

    async def abort(self, requests: Sequence[tuple[int, str]]) -> None:
        """Abort generation requests, given as (worker, request id)."""
        by_worker: dict[int, list[str]] = {}
        for worker, request_id in requests:
            by_worker.setdefault(worker, []).append(request_id)
        await asyncio.gather(*(self.workers[w].abort.remote(ids) for w, ids in by_worker.items()))


class RewardClient:
    """The domain's rewards (one or several components), each on its reward workers taken in turn."""

    def __init__(self, domain: str, components: list[Component], workers: Any, data: DataConfig) -> None:
        if not isinstance(workers, Mapping):  # one reward: its workers
            workers = {components[0].name: workers}
        if set(workers) != {c.name for c in components}:
            raise ValueError(
                f"domain {domain!r}: reward workers for {sorted(workers)}, but its rewards are "
                f"{[c.name for c in components]}"
            )
        self.domain, self.components, self.workers, self.data = domain, components, dict(workers), data
        self._next = {name: itertools.cycle(range(len(w))) for name, w in self.workers.items()}

    def workers_per_component(self) -> int:
        """Reward calls that can run at once: the most workers any of the domain's rewards has."""
        return max(len(workers) for workers in self.workers.values())

    async def score(self, rows: list[dict[str, Any]], texts: list[str], stats: Any) -> list[ScoredSample]:
        """One result per (row, response text). Identical responses to the same prompt are scored once (policies
        often repeat themselves, and a code sample costs a sandbox run); every copy gets the same result. A
        multi-turn response is identical only with its whole trajectory (the row's `trajectory` column). Only
        those first copies are built into samples: the reward contract gives the scorer every column of the row
        (reward_sample), and a group's responses share one row. Counted in stats.scored_unique/scored_total."""
        keys = [
            (str(row.get("id", row.get("_source"))), text, repr(row.get("trajectory")))
            for row, text in zip(rows, texts, strict=True)
        ]
        unique: dict[tuple[str, str, str], int] = {}
        firsts: list[dict[str, Any]] = []
        for key, row, text in zip(keys, rows, texts, strict=True):
            if key not in unique:
                unique[key] = len(firsts)
                firsts.append(reward_sample(row, text, prompt_messages(row, self.data)))
        names = [c.name for c in self.components]
        judged = await asyncio.gather(*(self._score_component(name, firsts, stats) for name in names))
        scored = combine(self.components, dict(zip(names, judged, strict=True)))
        stats.scored_unique += len(unique)
        stats.scored_total += len(keys)
        return [scored[unique[key]] for key in keys]

    async def _score_component(self, name: str, samples: list[dict[str, Any]], stats: Any) -> list[ScoredSample]:
        """Score on the component's next reward worker. Ray restarts a dead one and sends the batch again; when
        the workers stay dead (every one tried), the samples are masked as `worker_lost` and the step goes on."""
        workers = self.workers[name]
        label = self.domain if len(self.components) == 1 else f"{self.domain}/{name}"
        for _ in range(len(workers)):
            worker = next(self._next[name])
            try:
                return await workers[worker].score_batch.remote(samples)
            except RayActorError as exc:
                stats.reward_failures += 1
                logger.warning(
                    "domain %r: reward worker %d failed (%s)", label, worker, str(exc).splitlines()[0][:200]
                )
        logger.warning("domain %r: no reward worker answered; %d sample(s) masked", label, len(samples))
        return [ScoredSample.masked_as(MASK_WORKER_LOST) for _ in samples]

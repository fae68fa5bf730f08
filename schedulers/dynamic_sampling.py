"""DynamicSamplingScheduler: one Ray actor per domain that fills the domain's share of each step.

It owns the domain's rows and walks them in a seeded shuffled order. For a step it keeps up to
`dynamic_sampling.max_running_requests` prompts in flight: the prompts drawn together go to actor_infer as one
request per prompt (continuous batching, deterministic runs) or as requests of a batch's worth of prompts
(`request_mode`), and as soon as a request is generated its groups go to the domain's reward worker while other
prompts are still generating. A scored group passes the response filters (which mask single responses) and the group
filters (which drop the group; another prompt takes its slot). When `share` groups have passed, the requests
still in flight are aborted and the batch is returned, groups in the order their prompts were drawn.

A bound stops endless redraws: at most ceil(max_prompts_factor * share) prompts per step. At the bound the
scheduler either trains on what passed (the empty slots are filled with dropped groups whose samples are masked
out of the loss, so batch shapes stay fixed; a warning and scheduler/<domain>/bound_hit say so) or raises
`SamplingBoundError`, as `dynamic_sampling.on_bound` says.

With `deterministic: true` the step no longer depends on timing: the scheduler draws in rounds, waits for every
prompt of a round (nothing is aborted), keeps the passing groups in draw order, and gives each request a
sampling seed made from the run's seed, the domain, the call and the draw number (`request_seed`).

The parts, each in its own module: the rollout of one group, chosen per domain by `rewards.<domain>.rollout`
(schedulers/rollout.py: draw, generate, score, filter, account); the fill loop of one step and what it counted
(schedulers/step.py, its metrics in step_metrics.py); generation and scoring with their failure handling
(schedulers/clients.py); the seeded walk over the rows (schedulers/draws.py) and the difficulty ledger
(schedulers/ledger.py). This module holds what lasts from step to step, and validation.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import zlib
from typing import Any

import ray

from roll_core.batch import Batch
from roll_core.config import GeneratingArgs, PipelineConfig
from schedulers.clients import InferClient, RewardClient
from schedulers.draws import PromptSampler
from schedulers.ledger import DifficultyLedger
from schedulers.multi_turn import ROLLOUTS  # the multi-turn kind registers beside the single-turn one
from schedulers.step import FillStep, SamplingBoundError, StepOutcome, StepStats
from schedulers.step_metrics import step_metrics
from workers.rewards.combine import Component

__all__ = ["DynamicSamplingScheduler", "start_scheduler"]

logger = logging.getLogger(__name__)


class DynamicSamplingScheduler:
    """The per-domain scheduler actor (asyncio: its calls await actor_infer and the reward workers). It holds
    what lasts from step to step (the data position, the pass-rate estimate, the ledger, the bound-hit count) and
    the domain's rollout (rewards.<domain>.rollout, schedulers/rollout.py); a step is a FillStep over it."""

    VAL_PROMPTS_PER_REQUEST = 16

    def __init__(
        self,
        *,
        domain: str,
        rows: list[dict[str, Any]],
        prompt_ids: list[list[int]],
        val_rows: list[dict[str, Any]],
        val_prompt_ids: list[list[int]],
        pipeline_config: PipelineConfig,
        infer_workers: list[Any],
        reward_workers: list[Any],
    ) -> None:
        from workers.strategies.loading import load_tokenizer

        cfg = pipeline_config
        reward_cfg = cfg.rewards[domain]
        self.domain = domain
        self.rows, self.prompt_ids = rows, prompt_ids
        self.val_rows, self.val_prompt_ids = val_rows, val_prompt_ids
        self.sampling = cfg.dynamic_sampling
        factor = reward_cfg.max_prompts_factor
        self.max_prompts_factor = factor if factor is not None else cfg.dynamic_sampling.max_prompts_factor
        self.group_filters = {k: dict(v or {}) for k, v in reward_cfg.group_filters.items()}
        self.components = [Component(c.label, c.weight, c.on_masked) for c in reward_cfg.components()]
        self.infer = InferClient(domain, infer_workers)
        self.rewards = RewardClient(domain, self.components, reward_workers, cfg.data)
        mode = cfg.dynamic_sampling.request_mode
        self.wave_requests = mode == "wave" or (
            mode == "auto" and cfg.actor_infer.strategy_args.strategy_name != "vllm"
        )
        """Send a wave of draws as requests of several prompts (engines that batch statically) or one request per
        prompt (continuous batching)."""
        self.seed, self.deterministic = cfg.seed, cfg.deterministic
        self.sampler = PromptSampler(len(rows), seed=cfg.seed + zlib.crc32(domain.encode()))
        self.pass_rate = 1.0
        """Running estimate of the share of groups that pass the filters; sizes the speculative draws."""
        self._calls_made = 0
        """get_batch and validate calls so far; part of request ids and seeds."""
        self.bound_hits = 0
        self._fills: collections.deque[int] = collections.deque()
        """The call numbers of the fills reserved and not ended, in the order reserved; the first one runs. One
        step fills at a time, in the order the driver launched them (reserve_fill): Ray runs an async actor's
        calls in any order, so two get_batch calls sent together (rollouts launched several steps ahead) may
        arrive swapped, and draws, ledger and call numbers must still go in step order."""
        self._turn = asyncio.Condition()
        ledger = cfg.dynamic_sampling.ledger
        self.ledger = (
            DifficultyLedger(
                len(rows), streak=ledger.streak, retest_prob=ledger.retest_prob, seed=cfg.seed, domain=domain
            )
            if ledger.enabled
            else None
        )
        self.rollout = ROLLOUTS.get(reward_cfg.rollout.type)(
            domain=domain, rows=rows, prompt_ids=prompt_ids, tokenizer=load_tokenizer(cfg.actor_infer.model_args),
            infer=self.infer, rewards=self.rewards, sampler=self.sampler, ledger=self.ledger,
            response_filters={k: dict(v or {}) for k, v in reward_cfg.response_filters.items()},
            group_filters=self.group_filters, wave_requests=self.wave_requests,
            infer_batch_size=cfg.actor_infer.infer_batch_size, seed=cfg.seed, deterministic=cfg.deterministic,
            config=reward_cfg.rollout,
        )

    # ------------------------------------------------------------------------------------------- a step

    async def reserve_fill(self) -> int:
        """The call number of the next fill, reserved in the order these calls come (the driver waits for each
        before it sends the get_batch that names it): fills run in reservation order, whatever order Ray delivers
        their get_batch calls in."""
        call = self._next_call()
        self._fills.append(call)
        return call

    async def get_batch(
        self, num_prompts: int, group_size: int, args: GeneratingArgs, pin: tuple[int, int | None] | None = None,
        call: int | None = None,
    ) -> tuple[Batch, dict[str, float]]:
        """`num_prompts` groups of `group_size` scored responses that passed the filters, and the step's metrics
        (scheduler/<domain>/... and reward/<domain>/... over every group scored this step). Fills run one after
        the other: in the order of their reserved `call` numbers (reserve_fill), else (no `call`) in the order
        they came. `pin` (partial_rollout_token): every request of this fill names that (weights version, token
        at which it goes on with the next version)."""
        if call is None:
            call = await self.reserve_fill()
        elif call not in self._fills:
            raise ValueError(f"scheduler[{self.domain}]: fill {call} was not reserved (reserved: {list(self._fills)})")
        try:
            async with self._turn:
                await self._turn.wait_for(lambda: self._fills[0] == call)
            self.infer.pinned = pin
            try:
                return await self._fill(call, num_prompts, group_size, args)
            finally:
                self.infer.pinned = None
        finally:
            self._fills.remove(call)
            async with self._turn:
                self._turn.notify_all()

    async def _fill(
        self, call: int, num_prompts: int, group_size: int, args: GeneratingArgs
    ) -> tuple[Batch, dict[str, float]]:
        bound = max(num_prompts, math.ceil(self.max_prompts_factor * num_prompts))
        step = FillStep(
            self.rollout, call=call, share=num_prompts, group_size=group_size, args=args, bound=bound,
            max_in_flight=self.sampling.max_running_requests, pass_rate=self.pass_rate,
            deterministic=self.deterministic,
        )
        outcome = await step.run()
        self.pass_rate = outcome.pass_rate
        if self.ledger is not None:
            # Every scored group counts (kept, dropped or surplus), applied in draw order so that the ledger does
            # not depend on which group's scoring finished first.
            for g in outcome.scored:
                self.ledger.record(g.index, [r.correct for r in g.results])
        metrics = step_metrics(
            self.domain, outcome, share=num_prompts, bound=bound, group_filters=list(self.group_filters),
            components=self.components, ledger=self.ledger,
        )
        filler = self._filler(outcome, num_prompts) if len(outcome.kept) < num_prompts else []
        batch = Batch.concat(
            [self.rollout.account(g, group_size) for g in outcome.kept]
            + [self.rollout.account(g, group_size, filler=True) for g in filler]
        )
        return batch, metrics

    def _filler(self, outcome: StepOutcome, share: int) -> list:
        """At the bound: raise SamplingBoundError, or (dynamic_sampling.on_bound: train) the dropped groups that
        fill the empty slots, their samples left out of the loss, with a warning on the first hit and every
        fiftieth (the metric counts every hit)."""
        message = (
            f"domain {self.domain!r}: only {len(outcome.kept)} of {share} groups passed the filters "
            f"{list(self.group_filters)} after drawing {outcome.stats.drawn} prompts (the bound: "
            f"max_prompts_factor {self.max_prompts_factor:g}, from rewards.{self.domain}.max_prompts_factor or "
            "dynamic_sampling.max_prompts_factor)"
        )
        if self.sampling.on_bound == "error":
            raise SamplingBoundError(message)
        self.bound_hits += 1
        if self.bound_hits == 1 or self.bound_hits % 50 == 0:
            logger.warning(
                "%s; training on the groups that passed, the rest left out of the loss (bound hit %d time(s) so far; "
                "see scheduler/%s/bound_hit)",
                message, self.bound_hits, self.domain,
            )
        return sorted(outcome.dropped, key=lambda g: g.order)[: share - len(outcome.kept)]

    def set_weights(self, version: int, weights: list[ray.ObjectRef]) -> None:
        """The policy actor_infer should hold (the version and, in a list so Ray passes the reference on, the
        weights), for a worker that comes back from a restart."""
        self.infer.set_weights(version, weights[0])

    # ------------------------------------------------------------------------------------------- validation

    async def validate(self, args: GeneratingArgs, max_prompts: int = 0, num_samples: int = 1) -> Batch:
        """`num_samples` responses per validation prompt (the first `max_prompts` prompts when it is > 0), scored,
        rows grouped by prompt; no filters.

        The prompts go out at once in requests of a few prompts each; actor_infer batches them."""
        n = len(self.val_rows) if max_prompts <= 0 else min(max_prompts, len(self.val_rows))
        call = self._next_call()
        step = max(1, self.VAL_PROMPTS_PER_REQUEST // num_samples)
        stats = StepStats()  # validation's retries and failures are logged, not counted in a step's metrics
        chunks = await asyncio.gather(
            *(
                self.rollout.evaluate(
                    call, start, self.val_rows[chunk], self.val_prompt_ids[chunk], args, num_samples, stats
                )
                for start in range(0, n, step)
                for chunk in [slice(start, min(start + step, n))]
            )
        )
        return Batch.concat([b for parts in chunks for b in parts])

    # ------------------------------------------------------------------------------------------- state

    def _next_call(self) -> int:
        self._calls_made += 1
        return self._calls_made - 1

    def state_dict(self) -> dict[str, Any]:
        """The data position and everything the next draws depend on: the sampler, the pass-rate estimate, the
        call counter (request ids and seeds) and the bound-hit count."""
        return {
            "domain": self.domain,
            "sampler": self.sampler.state_dict(),
            "pass_rate": self.pass_rate,
            "calls": self._calls_made,
            "bound_hits": self.bound_hits,
            "ledger": None if self.ledger is None else self.ledger.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["domain"] != self.domain:
            raise ValueError(f"scheduler state of domain {state['domain']!r} given to domain {self.domain!r}")
        self.sampler.load_state_dict(state["sampler"])
        self.pass_rate = state["pass_rate"]
        self._calls_made = state["calls"]
        self.bound_hits = state["bound_hits"]
        if self.ledger is not None and state.get("ledger") is not None:
            self.ledger.load_state_dict(state["ledger"])


def start_scheduler(domain: str, **kwargs: Any):
    """The domain's scheduler as a Ray actor (asyncio; it mostly waits, so it asks for ray.scheduler_num_cpus, a
    fraction of a CPU)."""
    cpus = kwargs["pipeline_config"].ray.scheduler_num_cpus
    return ray.remote(DynamicSamplingScheduler).options(num_cpus=cpus, name=None).remote(domain=domain, **kwargs)

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
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import math
import time
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ray
import torch
from ray.exceptions import ActorUnavailableError, RayActorError

from roll_core.batch import Batch
from roll_core.config import GeneratingArgs, PipelineConfig
from roll_core.data.loading import prompt_messages
from roll_core.rewards.scored import MASK_WORKER_LOST, ScoredSample
from roll_core.rewards.scorer import reward_sample
from schedulers.filters import filter_group
from schedulers.ledger import DifficultyLedger
from workers.actor_infer import StaleWeightsError
from workers.rewards.combine import Component, combine
from workers.rewards.worker import domain_metrics

logger = logging.getLogger(__name__)


class SamplingBoundError(RuntimeError):
    """A domain drew its maximum number of prompts in a step and too few groups passed its filters."""


class PromptSampler:
    """Walks a domain's rows in a seeded shuffled order, epoch after epoch; its position is checkpointable."""

    def __init__(self, size: int, seed: int) -> None:
        if size == 0:
            raise ValueError("a domain with no rows cannot be sampled")
        self.size, self.seed = size, seed
        self.epoch, self.position = 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.size)

    def take(self, k: int) -> list[int]:
        out: list[int] = []
        while len(out) < k:
            if self.position == self.size:
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            n = min(k - len(out), self.size - self.position)
            out.extend(int(i) for i in self._order[self.position : self.position + n])
            self.position += n
        return out

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "size": self.size}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if (state["seed"], state["size"]) != (self.seed, self.size):
            raise ValueError(
                f"sampler state is for seed {state['seed']} over {state['size']} rows, "
                f"not seed {self.seed} over {self.size} rows: the data or the seed changed"
            )
        self.epoch, self.position = state["epoch"], state["position"]
        self._order = self._permutation(self.epoch)


def request_seed(seed: int, domain: str, call: int, draw: int | str) -> int:
    """The sampling seed of one request: a stable hash, the same in every process and on every run."""
    digest = hashlib.blake2b(f"{seed}/{domain}/{call}/{draw}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


@dataclass
class Group:
    """One prompt's generated and scored group."""

    index: int
    """The prompt's row index in the domain's data."""
    order: int
    """The draw order within the step: the batch lists kept groups in this order."""
    output: dict[str, Any]
    texts: list[str]
    results: list[ScoredSample]
    generate_s: float
    reward_s: float
    rejected: list[str | None] = field(default_factory=list)
    """Per response: the response filter that masked it, or None."""
    dropped_by: str | None = None


class DynamicSamplingScheduler:
    """The per-domain scheduler actor (asyncio: its calls await actor_infer and the reward workers)."""

    VAL_PROMPTS_PER_REQUEST = 16
    RESTART_WAIT_S = 300.0
    """How long a request waits for a restarting actor_infer worker before the step fails."""

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
        self.data = cfg.data
        self.max_prompts_factor = (
            reward_cfg.max_prompts_factor
            if reward_cfg.max_prompts_factor is not None
            else cfg.dynamic_sampling.max_prompts_factor
        )
        self.group_filters = {k: dict(v or {}) for k, v in reward_cfg.group_filters.items()}
        self.response_filters = {k: dict(v or {}) for k, v in reward_cfg.response_filters.items()}
        self.tokenizer = load_tokenizer(cfg.actor_infer.model_args)
        self.infer_workers = infer_workers
        self.components = [Component(c.label, c.weight, c.on_masked) for c in reward_cfg.components()]
        if not isinstance(reward_workers, Mapping):  # one reward: its workers
            reward_workers = {self.components[0].name: reward_workers}
        if set(reward_workers) != {c.name for c in self.components}:
            raise ValueError(
                f"domain {domain!r}: reward workers for {sorted(reward_workers)}, but its rewards are "
                f"{[c.name for c in self.components]}"
            )
        self.reward_workers = dict(reward_workers)
        self._next_infer = itertools.cycle(range(len(infer_workers)))
        mode = cfg.dynamic_sampling.request_mode
        self.wave_requests = mode == "wave" or (
            mode == "auto" and cfg.actor_infer.strategy_args.strategy_name != "vllm"
        )
        """Send a wave of draws as requests of several prompts (engines that batch statically) or one request per
        prompt (continuous batching)."""
        self.infer_batch_size = cfg.actor_infer.infer_batch_size
        self._next_reward = {name: itertools.cycle(range(len(w))) for name, w in self.reward_workers.items()}
        self.seed, self.deterministic = cfg.seed, cfg.deterministic
        self.weights_version, self.weights_ref = 0, None
        self.infer_retries = self.reward_failures = 0
        self.sampler = PromptSampler(len(rows), seed=cfg.seed + zlib.crc32(domain.encode()))
        self.pass_rate = 1.0
        """Running estimate of the share of groups that pass the filters; sizes the speculative draws."""
        self._calls_made = 0
        """get_batch and validate calls so far; part of request ids and seeds."""
        self.bound_hits = 0
        self.scored_unique = self.scored_total = 0
        ledger = cfg.dynamic_sampling.ledger
        self.ledger = (
            DifficultyLedger(
                len(rows), streak=ledger.streak, retest_prob=ledger.retest_prob, seed=cfg.seed, domain=domain
            )
            if ledger.enabled
            else None
        )

    # ------------------------------------------------------------------------------------------- a step

    async def get_batch(
        self, num_prompts: int, group_size: int, args: GeneratingArgs
    ) -> tuple[Batch, dict[str, float]]:
        """`num_prompts` groups of `group_size` scored responses that passed the filters, and the step's metrics
        (scheduler/<domain>/... and reward/<domain>/... over every group scored this step)."""
        start = time.perf_counter()
        call = self._next_call()
        self.scored_unique = self.scored_total = 0
        self.infer_retries = self.reward_failures = 0
        bound = max(num_prompts, math.ceil(self.max_prompts_factor * num_prompts))
        kept: list[Group] = []
        dropped: list[Group] = []
        # A prompt holds a generation slot only while actor_infer works on it; scoring runs beside new requests.
        # Each request: (request id, actor_infer rank, its draws as (row index, draw order), start time).
        generating: dict[asyncio.Task, tuple[str, int, list[tuple[int, int]], float]] = {}
        scoring: dict[asyncio.Task, None] = {}
        drawn = peak = 0
        checks = skipped = 0

        def draw() -> int:
            # The next row, passing over those the ledger says are uniform (but never more than a whole epoch of
            # them in one step: when every row is, they are drawn anyway).
            nonlocal checks, skipped
            while True:
                (index,) = self.sampler.take(1)
                checks += 1
                if self.ledger is None or skipped >= len(self.rows) or not self.ledger.skip(index, call, checks):
                    return index
                skipped += 1

        def in_flight() -> int:
            return sum(len(draws) for _, _, draws, _ in generating.values())

        def want_more(wave: int) -> bool:
            if self.deterministic and (generating or scoring):
                return False  # the next round starts when this one is resolved, whatever the timing
            expected = len(kept) + self.pass_rate * (in_flight() + wave + len(scoring))
            return (
                in_flight() + wave < self.sampling.max_running_requests
                and drawn < bound
                and expected < num_prompts
            )

        def unresolved() -> bool:
            return len(kept) < num_prompts or (self.deterministic and bool(generating or scoring))

        try:
            while unresolved():
                wave: list[tuple[int, int]] = []
                while want_more(len(wave)):
                    index = draw()
                    wave.append((index, drawn))
                    drawn += 1
                for draws in self._requests_of(wave, group_size):
                    worker = next(self._next_infer)
                    first = draws[0][1]
                    request_id = f"{self.domain}/{call}/{first}"
                    seed = request_seed(self.seed, self.domain, call, first) if self.deterministic else None
                    prompts = [self.prompt_ids[index] for index, _ in draws]
                    request = self._generate(worker, request_id, prompts, args, group_size, seed)
                    generating[asyncio.ensure_future(request)] = (request_id, worker, draws, time.perf_counter())
                peak = max(peak, in_flight())
                if not generating and not scoring:
                    break  # the bound is reached and every drawn prompt is resolved
                done, _ = await asyncio.wait([*generating, *scoring], return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    if task in generating:
                        request_id, _, draws, t0 = generating.pop(task)
                        output = task.result()
                        if output is None:
                            raise RuntimeError(f"generation request {request_id} was aborted by someone else")
                        for k, (index, order) in enumerate(draws):
                            part = prompt_rows(output, k, group_size)
                            scoring[asyncio.ensure_future(self._scored_group(index, order, part, t0))] = None
                    else:
                        scoring.pop(task)
                        group = task.result()
                        (kept if group.dropped_by is None else dropped).append(group)
                        resolved = len(kept) + len(dropped)
                        self.pass_rate = max(0.05, (len(kept) + 1) / (resolved + 1))
        finally:
            aborted = await self._abort(generating, scoring)
        # Groups that finished together can overfill the share: the earliest drawn ones go in, and groups drawn
        # after the last of those are surplus (neither in the batch nor counted as dropped by a filter).
        kept.sort(key=lambda g: g.order)
        surplus = kept[num_prompts:]
        kept = kept[:num_prompts]
        if len(kept) == num_prompts:
            last = kept[-1].order
            surplus += [g for g in dropped if g.order > last]
            dropped = [g for g in dropped if g.order < last]
        wall_s = time.perf_counter() - start
        metrics = self._metrics(kept, dropped, surplus, drawn, peak, aborted, bound, num_prompts, wall_s)
        if self.ledger is not None:
            # Every scored group counts (kept, dropped or surplus), applied in draw order so that the ledger does
            # not depend on which group's scoring finished first.
            for g in sorted(kept + dropped + surplus, key=lambda g: g.order):
                self.ledger.record(g.index, [r.correct for r in g.results])
            metrics[f"scheduler/{self.domain}/skipped_by_ledger"] = float(skipped)
            # What generating them would have cost at this step's rate: an estimate, from seconds per drawn prompt.
            metrics[f"scheduler/{self.domain}/ledger_s_saved_est"] = skipped * wall_s / max(drawn, 1)
            metrics[f"scheduler/{self.domain}/ledger_uniform_rows"] = float(self.ledger.uniform_rows())
        metrics[f"scheduler/{self.domain}/infer_retries"] = float(self.infer_retries)
        metrics[f"scheduler/{self.domain}/reward_worker_failures"] = float(self.reward_failures)
        metrics[f"scheduler/{self.domain}/scored_unique_frac"] = self.scored_unique / max(self.scored_total, 1)
        self.scored_unique = self.scored_total = 0
        if len(kept) < num_prompts:
            message = (
                f"domain {self.domain!r}: only {len(kept)} of {num_prompts} groups passed the filters "
                f"{list(self.group_filters)} after drawing {drawn} prompts (the bound: "
                f"max_prompts_factor {self.max_prompts_factor:g}, from rewards.{self.domain}.max_prompts_factor or "
                "dynamic_sampling.max_prompts_factor)"
            )
            if self.sampling.on_bound == "error":
                raise SamplingBoundError(message)
            self.bound_hits += 1
            if self.bound_hits == 1 or self.bound_hits % 50 == 0:  # the metric counts every hit; the log samples
                logger.warning(
                    "%s; training on the groups that passed, the rest left out of the loss (bound hit %d time(s) so far; "
                    "see scheduler/%s/bound_hit)",
                    message, self.bound_hits, self.domain,
                )
            filler = sorted(dropped, key=lambda g: g.order)[: num_prompts - len(kept)]
        else:
            filler = []
        batch = Batch.concat(
            [self._group_batch(g, group_size) for g in kept]
            + [self._group_batch(g, group_size, masked=True) for g in filler]
        )
        return batch, metrics

    def _requests_of(self, wave: list[tuple[int, int]], group_size: int) -> list[list[tuple[int, int]]]:
        """How a wave of draws goes to actor_infer: one request per prompt where the engine batches continuously
        (vLLM) or the run is deterministic (each seeded request is its own batch); else requests of as many
        prompts as fill one of actor_infer's batches, so the worker starts at once, without waiting out its
        gather window for the rest of the wave (request_mode, docs/dynamic-sampling.md)."""
        if not self.wave_requests or self.deterministic:
            return [[draw] for draw in wave]
        per_request = max(1, self.infer_batch_size // group_size)
        return [wave[i : i + per_request] for i in range(0, len(wave), per_request)]

    async def _scored_group(self, index: int, order: int, output: dict[str, Any], t0: float) -> Group:
        t1 = time.perf_counter()
        texts = self._decode(output)
        results = await self._score([self.rows[index]] * len(texts), texts)
        group = Group(index, order, output, texts, results, generate_s=t1 - t0, reward_s=time.perf_counter() - t1)
        group.rejected, group.dropped_by = filter_group(self._records(group), self.response_filters, self.group_filters)
        return group

    async def _score(self, rows: list[dict[str, Any]], texts: list[str]) -> list[ScoredSample]:
        # Identical responses to the same prompt are scored once (policies often repeat themselves, and a code
        # sample costs a sandbox run); every copy gets the same result. Only those first copies are built into
        # samples: the reward contract gives the scorer every column of the row (reward_sample), and a group's
        # responses share one row.
        keys = [(str(row.get("id", row.get("_source"))), text) for row, text in zip(rows, texts, strict=True)]
        unique: dict[tuple[str, str], int] = {}
        firsts: list[dict[str, Any]] = []
        for key, row, text in zip(keys, rows, texts, strict=True):
            if key not in unique:
                unique[key] = len(firsts)
                firsts.append(reward_sample(row, text, prompt_messages(row, self.data)))
        scored = await self._score_unique(firsts)
        self.scored_unique += len(unique)
        self.scored_total += len(keys)
        return [scored[unique[key]] for key in keys]

    async def _generate(
        self, worker: int, request_id: str, prompts: list[list[int]], args: GeneratingArgs, n: int, seed: int | None
    ) -> dict[str, Any] | None:
        """One generation request to actor_infer[worker]. A worker that Ray is restarting (unavailable) or that came
        back with its starting weights gets the current weights and the request again, for up to
        RESTART_WAIT_S; a worker that is dead for good (no restarts left) ends the step with its error."""
        deadline = time.monotonic() + self.RESTART_WAIT_S
        resync = False
        for attempt in itertools.count():
            try:
                if resync and self.weights_ref is not None:
                    await self.infer_workers[worker].update_weights.remote(self.weights_ref, self.weights_version)
                return await self.infer_workers[worker].generate_request.remote(
                    request_id, prompts, args, n, seed, self.weights_version
                )
            except (ActorUnavailableError, StaleWeightsError) as exc:
                if time.monotonic() > deadline:
                    raise
                if not resync:
                    self.infer_retries += 1
                    logger.warning(
                        "domain %r: actor_infer[%d] lost request %s (%s); sending it the current weights and the "
                        "request again",
                        self.domain, worker, request_id, type(exc).__name__,
                    )
                resync = True
                await asyncio.sleep(min(0.1 * 2**attempt, 2.0))

    async def _score_unique(self, samples: list[dict[str, Any]]) -> list[ScoredSample]:
        """Every reward of the domain scores the samples at once; their judgements are combined per sample
        (workers/rewards/combine.py)."""
        names = [c.name for c in self.components]
        judged = await asyncio.gather(*(self._score_component(name, samples) for name in names))
        return combine(self.components, dict(zip(names, judged, strict=True)))

    async def _score_component(self, name: str, samples: list[dict[str, Any]]) -> list[ScoredSample]:
        """Score on the component's next reward worker. Ray restarts a dead one and sends the batch again; when
        the workers stay dead (every one tried), the samples are masked as `worker_lost` and the step goes on."""
        workers = self.reward_workers[name]
        label = self.domain if len(self.components) == 1 else f"{self.domain}/{name}"
        for _ in range(len(workers)):
            worker = next(self._next_reward[name])
            try:
                return await workers[worker].score_batch.remote(samples)
            except RayActorError as exc:
                self.reward_failures += 1
                logger.warning(
                    "domain %r: reward worker %d failed (%s)", label, worker, str(exc).splitlines()[0][:200]
                )
        logger.warning("domain %r: no reward worker answered; %d sample(s) masked", label, len(samples))
        return [ScoredSample.masked_as(MASK_WORKER_LOST) for _ in samples]

    def set_weights(self, version: int, weights: list[ray.ObjectRef]) -> None:
        """The policy actor_infer should hold (the version and, in a list so Ray passes the reference on, the
        weights), for a worker that comes back from a restart."""
        self.weights_version, self.weights_ref = version, weights[0]

    async def _abort(self, generating: dict[asyncio.Task, tuple], scoring: dict[asyncio.Task, None]) -> int:
        """Abort what is still in flight: generation requests on actor_infer, and groups being scored (their
        results are dropped). Returns the number of prompts aborted."""
        by_worker: dict[int, list[str]] = {}
        for request_id, worker, *_ in generating.values():
            by_worker.setdefault(worker, []).append(request_id)
        for task in [*generating, *scoring]:
            task.cancel()
        await asyncio.gather(*(self.infer_workers[w].abort.remote(ids) for w, ids in by_worker.items()))
        await asyncio.gather(*generating, *scoring, return_exceptions=True)
        return sum(len(draws) for _, _, draws, _ in generating.values()) + len(scoring)

    # ------------------------------------------------------------------------------------------- validation

    async def validate(self, args: GeneratingArgs, max_prompts: int = 0, num_samples: int = 1) -> Batch:
        """`num_samples` responses per validation prompt (the first `max_prompts` prompts when it is > 0), scored,
        rows grouped by prompt; no filters.

        The prompts go out at once in requests of a few prompts each; actor_infer batches them."""
        n = len(self.val_rows) if max_prompts <= 0 else min(max_prompts, len(self.val_rows))
        call = self._next_call()
        step = max(1, self.VAL_PROMPTS_PER_REQUEST // num_samples)

        async def one(start: int) -> list[Batch]:
            worker = next(self._next_infer)
            ids = self.val_prompt_ids[start : min(start + step, n)]
            rows = self.val_rows[start : min(start + step, n)]
            seed = request_seed(self.seed, self.domain, call, f"val{start}") if self.deterministic else None
            request_id = f"{self.domain}/val{call}/{start}"
            output = await self._generate(worker, request_id, ids, args, num_samples, seed)
            texts = self._decode(output)
            results = await self._score([row for row in rows for _ in range(num_samples)], texts)
            parts = []
            for k, row in enumerate(rows):
                rows_k = slice(k * num_samples, (k + 1) * num_samples)
                group = {
                    "response_ids": output["response_ids"][rows_k],
                    "response_mask": output["response_mask"][rows_k],
                    "finish_reason": output["finish_reason"][rows_k],
                }
                parts.append(self._batch(row, ids[k], group, texts[rows_k], results[rows_k], [None] * num_samples))
            return parts

        chunks = await asyncio.gather(*(one(s) for s in range(0, n, step)))
        return Batch.concat([b for parts in chunks for b in parts])

    # ------------------------------------------------------------------------------------------- helpers

    def _next_call(self) -> int:
        self._calls_made += 1
        return self._calls_made - 1

    def _decode(self, output: dict[str, Any]) -> list[str]:
        ids, mask = output["response_ids"], output["response_mask"]
        return [
            self.tokenizer.decode(row[m > 0].tolist(), skip_special_tokens=True)
            for row, m in zip(ids, mask, strict=True)
        ]

    @staticmethod
    def _records(group: Group) -> list[ScoredSample]:
        lengths = group.output["response_mask"].sum(-1).long().tolist()
        return [
            r.but(response_length=lengths[i], finish_reason=group.output["finish_reason"][i])
            for i, r in enumerate(group.results)
        ]

    def _group_batch(self, group: Group, n: int, masked: bool = False) -> Batch:
        rejected = [True] * n if masked else [why is not None for why in group.rejected]
        return self._batch(
            self.rows[group.index], self.prompt_ids[group.index], group.output, group.texts, group.results, rejected
        )

    def _batch(
        self,
        row: dict[str, Any],
        prompt: list[int],
        output: dict[str, Any],
        texts: list[str],
        results: list[ScoredSample],
        rejected: list[bool | None],
    ) -> Batch:
        n = len(texts)
        prompt_ids = torch.tensor([prompt] * n, dtype=torch.long)
        scores = torch.tensor([0.0 if r.masked else r.score for r in results], dtype=torch.float32)
        in_loss = torch.tensor(
            [0.0 if (r.masked or bool(rej)) else 1.0 for r, rej in zip(results, rejected, strict=True)],
            dtype=torch.float32,
        )
        return Batch(
            {
                "prompt_ids": prompt_ids,
                "prompt_mask": torch.ones_like(prompt_ids),
                "response_ids": output["response_ids"],
                "response_mask": output["response_mask"],
                "scores": scores,
                "in_loss": in_loss,
                **({"infer_log_probs": output["infer_log_probs"]} if "infer_log_probs" in output else {}),
            },
            {
                "id": [row.get("id", row.get("_source"))] * n,
                "domain": [self.domain] * n,
                "tag": [row["tag"]] * n,
                "ground_truth": [row.get("ground_truth")] * n,
                "finish_reason": list(output["finish_reason"]),
                "response_text": list(texts),
                "correct": [r.correct for r in results],
                "mask_reason": [r.mask_reason for r in results],
            },
        )

    def _metrics(
        self,
        kept: list[Group],
        dropped: list[Group],
        surplus: list[Group],
        drawn: int,
        peak: int,
        aborted: int,
        bound: int,
        share: int,
        wall_s: float,
    ) -> dict[str, float]:
        p = f"scheduler/{self.domain}"
        scored = kept + dropped + surplus  # every group scored this step, in the batch or not
        metrics = {
            f"{p}/prompts_drawn": float(drawn),
            f"{p}/groups_kept": float(len(kept)),
            f"{p}/groups_dropped": float(len(dropped)),
            f"{p}/surplus": float(len(surplus)),
            f"{p}/redraws": float(max(0, drawn - share)),
            f"{p}/aborted": float(aborted),
            f"{p}/peak_in_flight": float(peak),
            f"{p}/bound": float(bound),
            f"{p}/bound_hit": float(len(kept) < share),
            f"{p}/generate_s": sum(g.generate_s for g in scored),
            f"{p}/reward_s": sum(g.reward_s for g in scored),
            f"{p}/wall_s": wall_s,
            f"{p}/responses_masked_by_filters": float(sum(1 for g in kept for w in g.rejected if w is not None)),
        }
        for name in [*self.group_filters, "response_filters"]:
            metrics[f"{p}/dropped_{name}"] = float(sum(1 for g in dropped if g.dropped_by == name))
        scores = [r.score for g in scored for r in g.results if not r.masked]
        if scores:
            metrics[f"{p}/reward_mean"] = sum(scores) / len(scores)
        results = [r for g in scored for r in g.results]
        if len(self.components) > 1:
            for c in self.components:
                metrics |= domain_metrics(f"{self.domain}/{c.name}", [r.components[c.name] for r in results])
        return metrics | domain_metrics(self.domain, results)

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


def prompt_rows(output: dict[str, Any], k: int, group_size: int) -> dict[str, Any]:
    """The `k`-th prompt's rows of a request's output (rows come grouped by prompt, `group_size` each)."""
    rows = slice(k * group_size, (k + 1) * group_size)
    return {key: value[rows] for key, value in output.items()}


def start_scheduler(domain: str, **kwargs: Any):
    """The domain's scheduler as a Ray actor (asyncio; it mostly waits, so it asks for ray.scheduler_num_cpus, a
    fraction of a CPU)."""
    cpus = kwargs["pipeline_config"].ray.scheduler_num_cpus
    return ray.remote(DynamicSamplingScheduler).options(num_cpus=cpus, name=None).remote(domain=domain, **kwargs)

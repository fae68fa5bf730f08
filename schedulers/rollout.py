"""One prompt's group, from draw to batch rows: the rollout object a domain's scheduler fills its share with.

A rollout kind is a class registered in ROLLOUTS (roll_core/registry.py) and chosen per domain by `rewards.<domain>.rollout`; the fill
loop (schedulers/step.py) calls it and never asks which kind it has. Its interface:

- draw: the next row of the domain's data (the seeded sampler, passing over rows the ledger calls uniform);
- requests / request / generate: how a wave of draws goes to actor_infer, and one generation request;
- score_chunks / score: generated groups decoded and judged by the domain's rewards, a request's groups in as few
  reward calls as its reward workers allow;
- filter: the response filters (a rejected response leaves the loss) and the group filters (a dropped group's
  slot goes to a fresh prompt);
- account: a group's rows in the step's batch (a filler group's rows all left out of the loss);
- evaluate: validation of a few prompts, generated and scored as the kind generates and scores (no filters).

SingleTurnRollout, the one kind so far: one generation per group, scored once. A multi-turn kind (tool calls
between turns) is another class beside it, with the same interface.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from roll_core.batch import Batch
from roll_core.config import GeneratingArgs
from roll_core.config.rewards import RolloutConfig
from roll_core.registry import ROLLOUTS
from roll_core.rewards.scored import ScoredSample
from schedulers.clients import InferClient, RewardClient
from schedulers.draws import PromptSampler, request_seed
from schedulers.filters import filter_group
from schedulers.ledger import DifficultyLedger


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


Part = tuple[int, int, dict[str, Any]]
"""One prompt's generated group before it is scored: (row index, draw order, output)."""


@dataclass(frozen=True)
class Request:
    """One generation request: its id, the actor_infer worker it went to, its draws as (row index, draw order),
    its sampling seed (deterministic runs) and when it was sent; `wave`: (domain, wave, requests in it) when it is
    one of the requests a wave of draws went out as (actor_infer starts a batch once it has them all)."""

    id: str
    worker: int
    draws: list[tuple[int, int]]
    seed: int | None
    started: float
    wave: tuple[str, str, int] | None = None


@ROLLOUTS.register("single_turn")
class SingleTurnRollout:
    """A group is one generation request's responses to one prompt, scored once by the domain's rewards."""

    def __init__(
        self, *, domain: str, rows: list[dict[str, Any]], prompt_ids: list[list[int]], tokenizer: Any,
        infer: InferClient, rewards: RewardClient, sampler: PromptSampler, ledger: DifficultyLedger | None,
        response_filters: dict[str, dict], group_filters: dict[str, dict], wave_requests: bool,
        infer_batch_size: int, seed: int, deterministic: bool, config: RolloutConfig | None = None,
    ) -> None:
        self.config = config or RolloutConfig()
        """rewards.<domain>.rollout (its multi-turn keys are a multi-turn kind's)."""
        self.domain, self.rows, self.prompt_ids, self.tokenizer = domain, rows, prompt_ids, tokenizer
        self.infer, self.rewards, self.sampler, self.ledger = infer, rewards, sampler, ledger
        self.response_filters, self.group_filters = response_filters, group_filters
        self.wave_requests, self.infer_batch_size = wave_requests, infer_batch_size
        self.seed, self.deterministic = seed, deterministic

    def draw(self, call: int, stats: Any) -> int:
        """The next row, passing over those the ledger says are uniform (but never more than a whole epoch of them
        in one step: when every row is, they are drawn anyway)."""
        while True:
            (index,) = self.sampler.take(1)
            stats.ledger_checks += 1
            skip_limit = stats.skipped_by_ledger >= len(self.rows)
            if self.ledger is None or skip_limit or not self.ledger.skip(index, call, stats.ledger_checks):
                return index
            stats.skipped_by_ledger += 1

    def requests(self, wave: list[tuple[int, int]], group_size: int) -> list[list[tuple[int, int]]]:
        """How a wave of draws goes to actor_infer: one request per prompt where the engine batches continuously
        (vLLM) or the run is deterministic (each seeded request is its own batch); else requests of as many
        prompts as fill one of actor_infer's batches, so the worker starts at once, without waiting out its
        gather window for the rest of the wave (request_mode, docs/dynamic-sampling.md)."""
        if not self.wave_requests or self.deterministic:
            return [[draw] for draw in wave]
        per_request = max(1, self.infer_batch_size // group_size)
        return [wave[i : i + per_request] for i in range(0, len(wave), per_request)]

    def request(self, call: int, draws: list[tuple[int, int]]) -> Request:
        first = draws[0][1]
        seed = request_seed(self.seed, self.domain, call, first) if self.deterministic else None
        return Request(f"{self.domain}/{call}/{first}", self.infer.next_worker(), draws, seed, time.perf_counter())

    async def generate(self, request: Request, args: GeneratingArgs, group_size: int, stats: Any) -> dict | None:
        rows = [self.rows[index] for index, _ in request.draws]
        prompts = [self.prompt_ids[index] for index, _ in request.draws]
        return await self.sample(
            request.worker, request.id, rows, prompts, args, group_size, request.seed, stats, request.wave
        )

    async def sample(
        self, worker: int, request_id: str, rows: list[dict[str, Any]], prompts: list[list[int]],
        args: GeneratingArgs, n: int, seed: int | None, stats: Any, wave: tuple[str, str, int] | None = None,
    ) -> dict | None:
        """`n` responses to each of `prompts` (the data `rows` they come from), rows grouped by prompt, as
        actor_infer returns them; None if aborted. One generation request (of `wave`, if any: `Request.wave`)."""
        return await self.infer.generate(worker, request_id, prompts, args, n, seed, stats, wave)

    async def abort(self, requests: list[Request]) -> None:
        await self.infer.abort([(r.worker, r.id) for r in requests])

    def score_chunks(self, parts: list[Part]) -> list[list[Part]]:
        """How the groups of one generated request go to scoring: in as many reward calls as the domain's reward
        has workers (each call fans out over its worker's pool), consecutive groups together. A call per group
        cost a Ray round trip and a pool dispatch each for what math_rule scores in microseconds."""
        calls = min(len(parts), self.rewards.workers_per_component())
        size = -(-len(parts) // calls)
        return [parts[i : i + size] for i in range(0, len(parts), size)]

    async def score(self, parts: list[Part], started: float, stats: Any) -> list[Group]:
        """Generated groups, given as (row index, draw order, output), decoded and judged in one reward call."""
        t1 = time.perf_counter()
        texts = [self.decode(output) for _, _, output in parts]
        rows = [r for index, _, output in parts for r in self.reward_rows(self.rows[index], output)]
        results = await self.rewards.score(rows, [t for group in texts for t in group], stats)
        reward_s = time.perf_counter() - t1
        groups, start = [], 0
        for (index, order, output), group_texts in zip(parts, texts, strict=True):
            end = start + len(group_texts)
            judged = self.checked(output, results[start:end])
            groups.append(Group(index, order, output, group_texts, judged, generate_s=t1 - started, reward_s=reward_s))
            start = end
        return groups

    def filter(self, group: Group) -> Group:
        lengths = group.output["response_mask"].sum(-1).long().tolist()
        records = [
            r.but(response_length=lengths[i], finish_reason=group.output["finish_reason"][i])
            for i, r in enumerate(group.results)
        ]
        group.rejected, group.dropped_by = filter_group(records, self.response_filters, self.group_filters)
        return group

    def account(self, group: Group, group_size: int, filler: bool = False) -> Batch:
        rejected = [True] * group_size if filler else [why is not None for why in group.rejected]
        row = self.rows[group.index]
        return group_batch(
            self.domain, row, self.prompt_ids[group.index], group.output, group.texts, group.results, rejected
        )

    async def evaluate(
        self, call: int, start: int, rows: list[dict[str, Any]], prompt_ids: list[list[int]], args: GeneratingArgs,
        num_samples: int, stats: Any,
    ) -> list[Batch]:
        """Validation of a few prompts (validation rows `start`, `start + 1`, ...) in one request: `num_samples`
        responses each, scored, one batch per prompt; no filters (every response is in)."""
        seed = request_seed(self.seed, self.domain, call, f"val{start}") if self.deterministic else None
        request_id = f"{self.domain}/val{call}/{start}"
        output = await self.sample(
            self.infer.next_worker(), request_id, rows, prompt_ids, args, num_samples, seed, stats
        )
        kept = {key: value for key, value in output.items() if key != "infer_log_probs"}
        parts = [prompt_rows(kept, k, num_samples) for k in range(len(rows))]
        texts = [self.decode(part) for part in parts]
        scored_rows = [r for row, part in zip(rows, parts, strict=True) for r in self.reward_rows(row, part)]
        results = await self.rewards.score(scored_rows, [t for group in texts for t in group], stats)
        results = self.checked(kept, results)
        return [
            group_batch(
                self.domain, row, ids, part, texts[k], results[k * num_samples : (k + 1) * num_samples],
                [False] * num_samples,
            )
            for k, (row, ids, part) in enumerate(zip(rows, prompt_ids, parts, strict=True))
        ]

    def reward_rows(self, row: dict[str, Any], output: dict[str, Any]) -> list[dict[str, Any]]:
        """The data row each response of one prompt's group is scored with (all the same one here)."""
        return [row] * len(output["finish_reason"])

    def checked(self, output: dict[str, Any], results: list[ScoredSample]) -> list[ScoredSample]:
        """The judgements of an output's responses, with what the generation itself says overriding them (nothing
        here; a multi-turn response whose environment failed is masked)."""
        return results

    def decode(self, output: dict[str, Any]) -> list[str]:
        ids, mask = output["response_ids"], output["response_mask"]
        return [
            self.tokenizer.decode(row[m > 0].tolist(), skip_special_tokens=True)
            for row, m in zip(ids, mask, strict=True)
        ]


#: What a multi-turn output adds to its rows (schedulers/trajectory.py; roll_core/batch.py declares them).
TRAJECTORY_TENSORS = ("tool_mask", "turns", "tool_calls", "tool_errors", "tool_s")


def group_batch(
    domain: str, row: dict[str, Any], prompt: list[int], output: dict[str, Any], texts: list[str],
    results: list[ScoredSample], rejected: list[bool],
) -> Batch:
    """One prompt's responses as batch rows: a response is in the loss unless its judgement is masked or it was
    rejected (by a response filter, or as a filler group's)."""
    n = len(texts)
    prompt_ids = torch.tensor([prompt] * n, dtype=torch.long)
    scores = torch.tensor([0.0 if r.masked else r.score for r in results], dtype=torch.float32)
    in_loss = torch.tensor(
        [0.0 if (r.masked or rej) else 1.0 for r, rej in zip(results, rejected, strict=True)], dtype=torch.float32
    )
    return Batch(
        {
            "prompt_ids": prompt_ids,
            "prompt_mask": torch.ones_like(prompt_ids),
            "response_ids": output["response_ids"],
            "response_mask": output["response_mask"],
            "scores": scores,
            "in_loss": in_loss,
            **{key: output[key] for key in ("infer_log_probs", "token_versions", *TRAJECTORY_TENSORS) if key in output},
        },
        {
            "id": [row.get("id", row.get("_source"))] * n,
            "domain": [domain] * n,
            "tag": [row["tag"]] * n,
            "ground_truth": [row.get("ground_truth")] * n,
            "finish_reason": list(output["finish_reason"]),
            "response_text": list(texts),
            "correct": [r.correct for r in results],
            "mask_reason": [r.mask_reason for r in results],
            **({"trajectory": list(output["trajectory"])} if "trajectory" in output else {}),
        },
    )


def prompt_rows(output: dict[str, Any], k: int, group_size: int) -> dict[str, Any]:
    """The `k`-th prompt's rows of a request's output (rows come grouped by prompt, `group_size` each)."""
    rows = slice(k * group_size, (k + 1) * group_size)
    return {key: value[rows] for key, value in output.items()}

"""One step of a domain's scheduler: fill the share with groups that pass the filters (FillStep), and what the
step counted (StepStats), returned with its groups as a StepOutcome; nothing of a step is left on the scheduler.

FillStep keeps up to `dynamic_sampling.max_running_requests` prompts in flight. A prompt holds a generation slot
only while actor_infer works on it; as soon as a request is generated its groups are scored beside new requests, in
as many reward calls as the domain has reward workers (schedulers/rollout.py: score_chunks).
Draws are speculative: enough are in flight that, at the running pass rate, the share should fill. When the share
is full the requests still in flight are aborted. A bound stops endless redraws: at most
ceil(max_prompts_factor * share) prompts per step. With `deterministic` the step draws in rounds and waits for
every prompt of a round (nothing is aborted), so the outcome does not depend on timing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass
from typing import Any

from roll_core.config import GeneratingArgs
from schedulers.rollout import Group, Part, Request, prompt_rows


class SamplingBoundError(RuntimeError):
    """A domain drew its maximum number of prompts in a step and too few groups passed its filters."""


@dataclass
class StepStats:
    """What one step counted; the step's metrics are made from it (schedulers/step_metrics.py)."""

    drawn: int = 0
    peak_in_flight: int = 0
    aborted: int = 0
    """Prompts aborted when the share filled: generating, or generated and being scored."""
    ledger_checks: int = 0
    """Rows the draws looked at (each a ledger check, with a retest draw of its own)."""
    skipped_by_ledger: int = 0
    infer_retries: int = 0
    reward_failures: int = 0
    scored_unique: int = 0
    scored_total: int = 0


@dataclass
class StepOutcome:
    """The step's groups, in draw order: `kept` fill the share, `dropped` failed a filter, `surplus` were scored
    after the share was full (neither in the batch nor counted as dropped); and the step's counts."""

    kept: list[Group]
    dropped: list[Group]
    surplus: list[Group]
    stats: StepStats
    pass_rate: float
    wall_s: float
    scored: list[Group]
    """Every group scored this step (kept, dropped or surplus), in draw order."""


class FillStep:
    """The fill loop of one step over a rollout (schedulers/rollout.py)."""

    def __init__(
        self, rollout: Any, *, call: int, share: int, group_size: int, args: GeneratingArgs, bound: int,
        max_in_flight: int, pass_rate: float, deterministic: bool,
    ) -> None:
        self.rollout, self.call, self.share, self.group_size, self.args = rollout, call, share, group_size, args
        self.bound, self.max_in_flight, self.deterministic = bound, max_in_flight, deterministic
        self.pass_rate = pass_rate
        self.stats = StepStats()
        self.kept: list[Group] = []
        self.dropped: list[Group] = []
        self.generating: dict[asyncio.Task, Request] = {}
        self.scoring: dict[asyncio.Task, int] = {}
        """Reward calls in flight, each with the number of groups it scores."""

    async def run(self) -> StepOutcome:
        start = time.perf_counter()
        try:
            while self.unresolved():
                self.send(self.next_wave())
                self.stats.peak_in_flight = max(self.stats.peak_in_flight, self.in_flight())
                if not self.generating and not self.scoring:
                    break  # the bound is reached and every drawn prompt is resolved
                done, _ = await asyncio.wait([*self.generating, *self.scoring], return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    self.land(task)
        finally:
            self.stats.aborted = await self.abort()
        return self.split(wall_s=time.perf_counter() - start)

    def in_flight(self) -> int:
        return sum(len(request.draws) for request in self.generating.values())

    def being_scored(self) -> int:
        return sum(self.scoring.values())

    def want_more(self, wave: int) -> bool:
        if self.deterministic and (self.generating or self.scoring):
            return False  # the next round starts when this one is resolved, whatever the timing
        expected = len(self.kept) + self.pass_rate * (self.in_flight() + wave + self.being_scored())
        return (
            self.in_flight() + wave < self.max_in_flight and self.stats.drawn < self.bound and expected < self.share
        )

    def unresolved(self) -> bool:
        return len(self.kept) < self.share or (self.deterministic and bool(self.generating or self.scoring))

    def next_wave(self) -> list[tuple[int, int]]:
        """The prompts to draw now, as (row index, draw order)."""
        wave: list[tuple[int, int]] = []
        while self.want_more(len(wave)):
            wave.append((self.rollout.draw(self.call, self.stats), self.stats.drawn))
            self.stats.drawn += 1
        return wave

    def send(self, wave: list[tuple[int, int]]) -> None:
        if not wave:
            return
        parts = self.rollout.requests(wave, self.group_size)
        tag = (self.rollout.domain, f"{self.call}/{wave[0][1]}", len(parts))  # the wave's first draw names it
        for draws in parts:
            request = dataclasses.replace(self.rollout.request(self.call, draws), wave=tag)
            task = self.rollout.generate(request, self.args, self.group_size, self.stats)
            self.generating[asyncio.ensure_future(task)] = request

    def land(self, task: asyncio.Task) -> None:
        """A finished task: a generated request sends its groups to scoring; a scored group is kept or dropped."""
        if task in self.generating:
            request = self.generating.pop(task)
            output = task.result()
            if output is None:
                raise RuntimeError(f"generation request {request.id} was aborted by someone else")
            parts = [
                (index, order, prompt_rows(output, k, self.group_size))
                for k, (index, order) in enumerate(request.draws)
            ]
            for chunk in self.rollout.score_chunks(parts):
                self.scoring[asyncio.ensure_future(self.scored(chunk, request.started))] = len(chunk)
            return
        self.scoring.pop(task)
        for group in task.result():
            (self.kept if group.dropped_by is None else self.dropped).append(group)
        resolved = len(self.kept) + len(self.dropped)
        self.pass_rate = max(0.05, (len(self.kept) + 1) / (resolved + 1))

    async def scored(self, parts: list[Part], started: float) -> list[Group]:
        groups = await self.rollout.score(parts, started, self.stats)
        return [self.rollout.filter(group) for group in groups]

    async def abort(self) -> int:
        """Abort what is still in flight: generation requests on actor_infer, and groups being scored (their
        results are dropped). Returns the number of prompts aborted."""
        for task in [*self.generating, *self.scoring]:
            task.cancel()
        await self.rollout.abort(list(self.generating.values()))
        await asyncio.gather(*self.generating, *self.scoring, return_exceptions=True)
        return self.in_flight() + self.being_scored()

    def split(self, wall_s: float) -> StepOutcome:
        """Groups that finished together can overfill the share: the earliest drawn ones go in, and groups drawn
        after the last of those are surplus (neither in the batch nor counted as dropped by a filter)."""
        kept = sorted(self.kept, key=lambda g: g.order)
        surplus, kept, dropped = kept[self.share :], kept[: self.share], self.dropped
        if len(kept) == self.share:
            last = kept[-1].order
            surplus += [g for g in dropped if g.order > last]
            dropped = [g for g in dropped if g.order < last]
        scored = sorted(kept + dropped + surplus, key=lambda g: g.order)
        return StepOutcome(kept, dropped, surplus, self.stats, self.pass_rate, wall_s, scored)

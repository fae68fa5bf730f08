"""The per-domain scheduler's step logic run in this process, without Ray: the same DynamicSamplingScheduler class
on an asyncio loop, with actor_infer and the reward workers replaced by objects whose methods answer `.remote()`
as a Ray actor handle does (an awaitable). The test holds every request until it releases it, so which requests
are in flight when a group lands is set by the test, not by a machine's speed; tests/test_dynamic_sampling.py
runs the scheduler as the Ray actor it is in a run.

These are the fast tests that mutation testing runs on schedulers/dynamic_sampling.py (mutation/targets.toml)."""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import logging
import math
import zlib
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from ray.exceptions import ActorUnavailableError, RayActorError
from transformers import AutoTokenizer

from roll_core.config import GeneratingArgs
from roll_core.data.loading import encode_prompts
from roll_core.registry import ROLLOUTS
from roll_core.rewards.scored import ScoredSample
from schedulers import clients as clients_module
from schedulers import rollout as rollout_module
from schedulers import step as step_module
from schedulers.draws import PromptSampler, request_seed
from schedulers.dynamic_sampling import DynamicSamplingScheduler
from schedulers.filters import RESPONSE_FILTERS
from schedulers.rollout import SingleTurnRollout, prompt_rows
from schedulers.step import SamplingBoundError
from tests.conftest import TINY_MODEL
from tests.test_dynamic_sampling import PATTERNS, config, draw_order, filtered_in_order, rows_of
from workers.actor_infer import StaleWeightsError

N = 4
ARGS = GeneratingArgs(max_new_tokens=4)
TOK = AutoTokenizer.from_pretrained(str(TINY_MODEL))


class Handle:
    """A Ray actor handle's face: `handle.method.remote(...)` starts the object's method (plain or async) as a task
    on the running loop and gives it back to await."""

    def __init__(self, obj) -> None:
        self.obj = obj

    def __getattr__(self, name):
        method = getattr(self.obj, name)

        async def call(*args, **kwargs):
            out = method(*args, **kwargs)
            return await out if inspect.isawaitable(out) else out

        return SimpleNamespace(remote=lambda *a, **k: asyncio.ensure_future(call(*a, **k)))


class Infer:
    """actor_infer: answers a prompt by the pattern word in it (PATTERNS), one row per response. Requests wait at
    `gate` while it is closed (the test opens it); request k >= `hold_from` answers only when aborted; the first
    `unavailable` calls raise ActorUnavailableError (a worker Ray is restarting)."""

    def __init__(self, hold_from: int | None = None, unavailable: int = 0, log_probs: bool = False,
                 stale: int = 0, hold_each: bool = False, clock=None, tick_s: float = 0.0) -> None:
        self.clock, self.tick_s = clock, tick_s
        """A FakeTime that each answer moves by `tick_s`."""
        self.gate = asyncio.Event()
        self.gate.set()
        self.hold_from, self.unavailable, self.log_probs = hold_from, unavailable, log_probs
        self.stale = stale
        """The first `stale` calls raise StaleWeightsError (a worker back from a restart with its first weights)."""
        self.hold_each = hold_each
        """Each request waits until the test calls `release(k)` for it."""
        self.released: dict[int, asyncio.Event] = {}
        self.requests: list[tuple[str, int, int | None, int | None]] = []
        """(request id, prompts, seed, weights version) per call."""
        self.aborted: list[str] = []
        self.weights: list[tuple[object, int]] = []
        self.waves: list[tuple[str, str, int] | None] = []
        """Per call, the wave it said it is one of."""
        self.versions: int | None = None
        """When set: answers carry token_versions, this version on each row's first token and the next on the rest."""

    async def generate_request(
        self, request_id, prompts, args, n, seed=None, weights_version=None, switch_at=None, wave=None
    ):
        self.requests.append((request_id, len(prompts), seed, weights_version))
        self.waves.append(wave)
        if self.unavailable:
            self.unavailable -= 1
            raise ActorUnavailableError("restarting", None)
        if self.stale:
            self.stale -= 1
            raise StaleWeightsError("restarted with its first weights")
        await self.gate.wait()
        k = int(request_id.rsplit("/", 1)[1])
        if self.hold_each:
            await self.released.setdefault(k, asyncio.Event()).wait()
        if self.hold_from is not None and k >= self.hold_from:
            await asyncio.Event().wait()  # until the scheduler cancels it
        rows, finish = [], []
        for prompt in prompts:
            pattern = next(p for p in PATTERNS if p in TOK.decode(prompt))
            for j, answer in enumerate(PATTERNS[pattern][:n]):
                rows.append(TOK.encode(answer, add_special_tokens=False) + [TOK.eos_token_id] * (1 + j % 2))
                finish.append("length" if pattern == "cut" and j < 2 else "stop")
        width = max(len(r) for r in rows)
        out = {
            "response_ids": torch.tensor([r + [TOK.pad_token_id] * (width - len(r)) for r in rows]),
            "response_mask": torch.tensor([[1.0] * len(r) + [0.0] * (width - len(r)) for r in rows]),
            "finish_reason": finish,
        }
        if self.clock is not None:
            self.clock.now += self.tick_s
        if self.log_probs:
            out["infer_log_probs"] = -out["response_mask"] * torch.arange(1, len(rows) + 1)[:, None]
        if self.versions is not None:  # the versions that sampled each token: the next one from the second on
            out["token_versions"] = torch.full_like(out["response_ids"], self.versions)
            out["token_versions"][:, 1:] += 1
        return out

    def release(self, *ks):
        for k in ks:
            self.released.setdefault(k, asyncio.Event()).set()

    def abort(self, request_ids):
        self.aborted.extend(request_ids)
        return len(request_ids)

    def update_weights(self, ref, version):
        self.weights.append((ref, version))


class Reward:
    """A reward worker: scores like math_rule with ground truth "1"; "lost" raises RayActorError (the actor
    died) on every call; `masked` masks responses that are exactly that text."""

    def __init__(self, lost: bool = False, masked: str | None = None, clock=None, tick_s: float = 0.0,
                 hold_rows: tuple[str, ...] = ()) -> None:
        self.lost, self.masked = lost, masked
        self.clock, self.tick_s = clock, tick_s
        self.hold_rows = hold_rows
        """Calls for these rows' responses never answer: scoring still under way when cancelled."""
        self.samples: list[dict] = []
        self.calls = 0
        self.rows_per_call: list[list[str]] = []

    def score_batch(self, samples):
        self.calls += 1
        self.rows_per_call.append(sorted({s["id"] for s in samples}, key=lambda i: int(i[1:])))
        if samples[0]["id"] in self.hold_rows:
            return asyncio.Event().wait()
        if self.clock is not None:
            self.clock.now += self.tick_s
        if self.lost:
            raise RayActorError(error_msg="the actor died: " + "x" * 300 + "\n(its traceback follows)")
        self.samples.extend(samples)
        return [
            ScoredSample.masked_as("error")
            if s["response"] == self.masked
            else ScoredSample(score=float(s["response"].strip() == "1"), correct=s["response"].strip() == "1",
                              metrics={"len": float(len(s["response"]))})
            for s in samples
        ]


def make(cfg, rows, infer, rewards=None, val_rows=()):
    rewards = rewards if rewards is not None else [Reward()]
    workers = (
        {name: [Handle(r) for r in rs] for name, rs in rewards.items()}
        if isinstance(rewards, dict)
        else [Handle(r) for r in rewards]
    )
    return DynamicSamplingScheduler(
        domain="math",
        rows=rows,
        prompt_ids=encode_prompts(TOK, rows, cfg.data),
        val_rows=list(val_rows),
        val_prompt_ids=encode_prompts(TOK, list(val_rows), cfg.data),
        pipeline_config=cfg,
        infer_workers=[Handle(infer)],
        reward_workers=workers,
    )


def step(scheduler, share, group_size=N):
    return asyncio.run(scheduler.get_batch(share, group_size, ARGS))


async def released_together(scheduler, infer, share, in_flight):
    """A step whose first `in_flight` requests are held until all are out, then answer in one loop turn."""
    infer.gate.clear()
    task = asyncio.ensure_future(scheduler.get_batch(share, N, ARGS))
    while len(infer.requests) < in_flight:
        await asyncio.sleep(0)
    infer.gate.set()
    return await task


async def sent_after(scheduler, infer, share, releases):
    """Start a step, then release each tuple of request numbers in turn; returns the step's task and how many
    requests had gone out when nothing was released yet and after each release."""
    task = asyncio.ensure_future(scheduler.get_batch(share, N, ARGS))
    await settle()
    sent = [len(infer.requests)]
    for ks in releases:
        infer.release(*ks)
        await settle()
        sent.append(len(infer.requests))
    return task, sent


async def settle():
    """Let every task on the loop run until it waits on something the test controls."""
    for _ in range(200):
        await asyncio.sleep(0)


class FakeTime:
    """The scheduler's clock and sleep (the module's `time` and `asyncio.sleep`): sleeping moves the clock, and
    every sleep is recorded; the loop itself keeps its real clock."""

    def __init__(self, monkeypatch) -> None:
        self.now, self.slept = 0.0, []
        real = asyncio

        class Asyncio:
            def __getattr__(_, name):
                return getattr(real, name)

            async def sleep(_, seconds):
                self.slept.append(seconds)
                self.now += seconds
                await real.sleep(0)

        clock = SimpleNamespace(perf_counter=lambda: self.now, monotonic=lambda: self.now)
        for module in (clients_module, rollout_module, step_module):  # the modules of the scheduler that read the clock or sleep
            monkeypatch.setattr(module, "time", clock)
        monkeypatch.setattr(clients_module, "asyncio", Asyncio())


def ids(batch):
    return [int(i[1:]) for i in batch.meta["id"][::N]]


# ---------------------------------------------------------------------------------------------- the step


def test_filters_counts_and_the_batch_one_prompt_at_a_time():
    patterns = ["same1", "same0", "half", "low", "cut"] * 4
    cfg = config(
        ["dynamic_sampling.max_running_requests=1"],
        group_filters="{std_filter: {}, mean_filter: {low: 0.3, high: 1.0}}",
        response_filters="{truncated: {}}",
    )
    infer = Infer()
    s = make(cfg, rows_of(patterns), infer)
    batch, m = step(s, 5)
    order = draw_order(cfg, len(patterns), 40)
    kept, dropped = filtered_in_order(patterns, order, 5)
    resolved = len(kept) + sum(dropped.values())
    assert ids(batch) == kept
    assert m["scheduler/math/groups_kept"] == 5
    assert m["scheduler/math/dropped_std_filter"] == dropped["std_filter"]
    assert m["scheduler/math/dropped_mean_filter"] == dropped["mean_filter"]
    assert m["scheduler/math/dropped_response_filters"] == 0
    assert m["scheduler/math/groups_dropped"] == sum(dropped.values())
    extra = m["scheduler/math/aborted"] + m["scheduler/math/surplus"]
    assert m["scheduler/math/prompts_drawn"] == resolved + extra and extra <= 1
    assert m["scheduler/math/redraws"] == m["scheduler/math/prompts_drawn"] - 5
    assert m["scheduler/math/peak_in_flight"] == 1 and m["scheduler/math/bound_hit"] == 0
    assert batch["scores"].tolist() == [float(a == "1") for i in kept for a in PATTERNS[patterns[i]]]
    mask = [0.0 if patterns[i] == "cut" and j < 2 else 1.0 for i in kept for j in range(N)]
    assert batch["in_loss"].tolist() == mask
    assert m["scheduler/math/responses_masked_by_filters"] == mask.count(0.0)
    # The truncated filter read each response's finish reason; its length is the mask's (1 or 2 EOS here).
    assert batch.meta["finish_reason"][: 2 * N] == [
        "length" if patterns[i] == "cut" and j < 2 else "stop" for i in kept[:2] for j in range(N)
    ]
    # The groups each draw produced, scored once per distinct response, every score over the step's groups.
    scored = [PATTERNS[patterns[i]] for i in order[: int(m["scheduler/math/prompts_drawn"] - extra)]]
    flat = [float(a == "1") for answers in scored for a in answers]
    assert m["reward/math/count"] == len(flat)
    assert m["scheduler/math/reward_mean"] == pytest.approx(sum(flat) / len(flat))
    assert m["reward/math/len"] == 1.0  # the scorer's own metric, averaged


def test_a_response_filters_options_reach_it(monkeypatch):
    def shorter_than(response, *, tokens):
        return response.response_length < tokens

    monkeypatch.setitem(RESPONSE_FILTERS._items, "shorter_than", shorter_than)
    monkeypatch.setitem(RESPONSE_FILTERS._traits, "shorter_than", {})
    cfg = config(response_filters="{shorter_than: {tokens: 3}}")
    batch, m = step(make(cfg, rows_of(["half"] * 2), Infer()), 1)
    # the stand-in's responses are 2 and 3 tokens long by turns (1 or 2 EOS)
    assert batch["in_loss"].tolist() == [1.0, 0.0, 1.0, 0.0] and m["scheduler/math/responses_masked_by_filters"] == 2


def test_no_filters_draw_exactly_the_share(caplog):
    s = make(config(), rows_of(["same1", "half"] * 5), Infer())
    with caplog.at_level(logging.WARNING, logger="schedulers.dynamic_sampling"):
        batch, m = step(s, 6)
    assert caplog.records == [] and s.state_dict()["bound_hits"] == 0  # a full share is no bound hit
    assert len(batch) == 6 * N and m["scheduler/math/prompts_drawn"] == 6
    assert m["scheduler/math/groups_dropped"] == 0 and m["scheduler/math/redraws"] == 0
    assert m["scheduler/math/surplus"] == 0 and m["scheduler/math/aborted"] == 0
    assert m["scheduler/math/bound"] == 6 * 2  # max_prompts_factor 2 of math_code.yaml
    assert s.state_dict()["pass_rate"] == 1.0  # (6 + 1) / (6 + 1)


def test_steps_asked_for_at_once_fill_one_after_the_other_in_the_order_asked():
    """Rollouts launched several steps ahead (async_generation_ratio >= 2) reach the scheduler before the one in
    front of them is full: each waits for the step before, so the draws, call numbers and ledger go in step order."""
    infer = Infer()
    infer.gate.clear()
    s = make(config(), rows_of(["same1", "half"] * 10), infer)

    async def both():
        first = asyncio.ensure_future(s.get_batch(2, N, ARGS))
        second = asyncio.ensure_future(s.get_batch(3, N, ARGS))
        await settle()
        calls_while_held = {r[0].split("/")[1] for r in infer.requests}
        infer.gate.set()
        return calls_while_held, await first, await second

    calls_while_held, (a, _), (b, _) = asyncio.run(both())
    assert calls_while_held == {"0"}  # the second step sent nothing while the first was filling
    calls = [r[0].split("/")[1] for r in infer.requests]
    assert calls == sorted(calls) and set(calls) == {"0", "1"}
    # the same prompts as two steps asked for one after the other
    one_by_one = make(config(), rows_of(["same1", "half"] * 10), Infer())
    assert (ids(a), ids(b)) == (ids(step(one_by_one, 2)[0]), ids(step(one_by_one, 3)[0]))


def test_reserved_fills_run_in_reservation_order_whatever_order_their_calls_come_in():
    """Ray runs an async actor's calls in any order: two rollouts launched together may reach the scheduler
    swapped. The driver reserves each fill's call number first (reserve_fill), and the fills run in that order:
    the second reserved fill, asked for first, waits and then gives what a second fill asked for in order gives.
    (What this guards failed in CI, stop 73: test_resume's k = 3 variant, two runs of one config apart from step
    2 on.)"""
    infer = Infer()
    s = make(config(), rows_of(["same1", "half"] * 10), infer)

    state = s.state_dict()
    s.load_state_dict(state | {"calls": 300})  # a long run's calls: numbers past 256 are distinct int objects

    async def swapped():
        first, second = await s.reserve_fill(), await s.reserve_fill()
        # each call number as Ray hands it over: a new object of equal value
        late = asyncio.ensure_future(s.get_batch(3, N, ARGS, None, int(str(second))))
        await settle()
        sent_before_the_first = list(infer.requests)
        early = asyncio.ensure_future(s.get_batch(2, N, ARGS, None, int(str(first))))
        return (first, second), sent_before_the_first, await early, await late

    calls, sent_before_the_first, (a, _), (b, _) = asyncio.run(swapped())
    assert calls == (300, 301)
    assert sent_before_the_first == []  # the second fill waited for the first
    assert [r[0].split("/")[1] for r in infer.requests] == ["300"] * 2 + ["301"] * 3
    one_by_one = make(config(), rows_of(["same1", "half"] * 10), Infer())
    assert (ids(a), ids(b)) == (ids(step(one_by_one, 2)[0]), ids(step(one_by_one, 3)[0]))
    assert s.state_dict()["calls"] == 302 and not s._fills
    with pytest.raises(ValueError, match="fill 7 was not reserved"):
        asyncio.run(s.get_batch(2, N, ARGS, None, 7))


def test_the_batch_keeps_the_version_that_sampled_each_token():
    infer = Infer()
    infer.versions = 4
    batch, _ = step(make(config(), rows_of(["half"] * 4), infer), 2)
    versions, mask = batch["token_versions"], batch["response_mask"]
    assert versions.shape == mask.shape
    assert versions[:, 0].eq(4).all() and versions[:, 1:][mask[:, 1:] > 0].eq(5).all()


def test_the_in_flight_cap_and_the_expected_pass_rate_size_the_draws():
    """max_running_requests caps the prompts generating at once; the pass-rate estimate says how many more than the
    share to draw at first: 0.5 for a share of 2 draws 4, 0.34 and 0.2 up to the cap (what is drawn after the first
    groups land depends on the estimate they update)."""
    cfg = config(["dynamic_sampling.max_running_requests=5", "dynamic_sampling.max_prompts_factor=8"])
    for rate, drawn in ((1.0, 2), (0.75, 3), (0.5, 4), (0.34, 5), (0.2, 5)):
        infer = Infer()
        s = make(cfg, rows_of(["half"] * 20), infer)
        s.load_state_dict({**s.state_dict(), "pass_rate": rate})
        _, m = asyncio.run(released_together(s, infer, 2, drawn))
        assert m["scheduler/math/peak_in_flight"] == drawn, rate
        assert [r[0] for r in infer.requests[:drawn]] == [f"math/0/{k}" for k in range(drawn)]
        assert m["scheduler/math/prompts_drawn"] == drawn or rate < 0.5, rate


def test_each_resolved_group_tops_up_the_prompts_in_flight_as_the_estimate_says():
    """Request by request: with a cap of 3 and a share of 2, each group that lands updates the pass-rate estimate,
    and the scheduler draws while (in flight + new) < 3 and kept + rate * (in flight + new + scoring) < 2."""
    patterns = ["same1"] * 30  # every group dropped by std_filter until the test lets "half" rows in
    cfg = config(["dynamic_sampling.max_running_requests=3", "dynamic_sampling.max_prompts_factor=10"],
                 group_filters="{std_filter: {}}")
    rows = rows_of(patterns)
    infer = Infer(hold_each=True)
    s = make(cfg, rows, infer)
    s.load_state_dict({**s.state_dict(), "pass_rate": 0.25})

    async def run():
        # At first 0.25 * (0 + 2) < 2 draws a third, and the cap stops there.
        # Release 0: its slot is free at once (0.25 * (2 + 0 + 1 scoring) < 2: a 4th); then it is dropped and the
        # estimate becomes (0 + 1) / (1 + 1) = 0.5, with 3 in flight again.
        # Release 1 and 2: 1 in flight, 2 scoring, 0.5 * (1 + 0 + 2) < 2 draws a 5th, 0.5 * (1 + 1 + 2) does not;
        # both dropped: the estimate 1 / 4, 0.25 * (2 + 0) < 2 and the cap leave room for a 6th only.
        task, sent = await sent_after(s, infer, 2, [(0,), (1, 2)])
        infer.release(*range(3, 30))
        return sent, await task

    sent, (batch, m) = asyncio.run(run())
    assert sent == [3, 4, 6]
    assert m["scheduler/math/peak_in_flight"] == 3 and m["scheduler/math/prompts_drawn"] == 20  # the bound
    assert m["scheduler/math/bound_hit"] == 1 and len(batch) == 2 * N


def test_one_request_per_prompt_never_goes_past_the_cap():
    """Requests of one prompt each, answered one at a time: a slot freed while another prompt generates is filled
    once, never twice (cap 2, every group dropped, so the scheduler keeps drawing to the bound)."""
    cfg = config(["dynamic_sampling.request_mode=prompt", "dynamic_sampling.max_running_requests=2",
                  "dynamic_sampling.max_prompts_factor=8"], group_filters="{std_filter: {}}")
    infer = Infer(hold_each=True)
    s = make(cfg, rows_of(["same1"] * 8), infer)
    s.load_state_dict({**s.state_dict(), "pass_rate": 0.05})

    async def run():
        task, sent = await sent_after(s, infer, 1, [(k,) for k in range(5)])  # in draw order, one at a time
        infer.release(*range(5, 8))
        return sent, await task

    counts, (_, m) = asyncio.run(run())
    assert counts == [2, 3, 4, 5, 6, 7] and m["scheduler/math/peak_in_flight"] == 2


def test_a_prompt_generating_and_a_group_scoring_are_both_expected_to_pass():
    """A share of 2, every group passing so far: with one prompt still generating and the other's group still
    being scored, 1.0 * (1 + 1) groups are expected, so nothing more is drawn (the scoring one never answers here)."""
    patterns = ["half"] * 8
    first = draw_order(config([]), len(patterns), 1)[0]
    infer = Infer(hold_each=True)
    s = make(config(["dynamic_sampling.request_mode=prompt"]), rows_of(patterns), infer,
             [Reward(hold_rows=(f"r{first}",))])

    async def run():
        task, sent = await sent_after(s, infer, 2, [(0,)])  # 0's group is scoring, 1 is generating
        task.cancel()
        return sent

    assert asyncio.run(run()) == [2, 2]


def test_groups_that_land_together_past_the_share_are_surplus():
    """Six prompts answered in one turn for a share of 2: the two earliest drawn passing groups are the batch; the
    passing and dropped groups drawn after the last of them are surplus, and only drops before it count."""
    patterns = ["half", "same1", "half", "same0", "half", "same1"] * 3
    cfg = config(["dynamic_sampling.max_running_requests=6", "dynamic_sampling.max_prompts_factor=3"],
                 group_filters="{std_filter: {}}")  # a bound of 6: nothing drawn after the first six
    infer = Infer()
    s = make(cfg, rows_of(patterns), infer)
    s.load_state_dict({**s.state_dict(), "pass_rate": 0.2})
    batch, m = asyncio.run(released_together(s, infer, 2, 6))
    order = draw_order(cfg, len(patterns), 6)
    passing = [i for i in order if patterns[i] == "half"]
    last = order.index(passing[1])
    assert ids(batch) == passing[:2]
    assert m["scheduler/math/groups_kept"] == 2 and m["scheduler/math/prompts_drawn"] == 6
    assert m["scheduler/math/groups_dropped"] == sum(patterns[i] != "half" for i in order[:last])
    assert m["scheduler/math/surplus"] == 6 - 1 - last
    assert m["scheduler/math/aborted"] == 0
    assert infer.aborted == []
    assert m["reward/math/count"] == 6 * N  # every group scored counts in the reward metrics, surplus too


def test_requests_in_flight_when_the_share_fills_are_aborted():
    cfg = config(["dynamic_sampling.max_running_requests=6", "dynamic_sampling.max_prompts_factor=3"],
                 group_filters="{std_filter: {}}")
    infer = Infer(hold_from=2)
    s = make(cfg, rows_of(["half"] * 20), infer)
    s.load_state_dict({**s.state_dict(), "pass_rate": 0.2})
    batch, m = step(s, 2)
    assert [r[0] for r in infer.requests] == [f"math/0/{k}" for k in range(6)]
    assert sorted(infer.aborted) == [f"math/0/{k}" for k in range(2, 6)]
    assert m["scheduler/math/aborted"] == 4 and m["scheduler/math/surplus"] == 0
    assert m["scheduler/math/peak_in_flight"] == 6
    assert len(batch) == 2 * N and batch["in_loss"].sum() == 2 * N
    # The next step's requests are its own (call 1) and nothing of the aborted ones reaches it.
    infer.hold_from = None
    batch2, m2 = step(s, 2)
    assert m2["scheduler/math/groups_kept"] == 2 and len(batch2) == 2 * N
    assert all(r[0].startswith("math/1/") for r in infer.requests[6:])


def test_the_aborted_count_is_prompts_generating_plus_groups_scoring():
    cfg = config(["dynamic_sampling.max_running_requests=3", "dynamic_sampling.max_prompts_factor=3"])
    infer = Infer(hold_each=True)
    first, second = draw_order(cfg, 6, 2)
    s = make(cfg, rows_of(["half"] * 6), infer, [Reward(hold_rows=(f"r{second}",))])
    s.load_state_dict({**s.state_dict(), "pass_rate": 0.2})

    async def run():
        task = asyncio.ensure_future(s.get_batch(1, N, ARGS))
        await settle()
        infer.release(0, 1)  # the first drawn group is kept; the second's scoring never ends; request 2 generates
        return await task

    batch, m = asyncio.run(run())
    assert m["scheduler/math/prompts_drawn"] == 3 and m["scheduler/math/aborted"] == 2
    assert infer.aborted == ["math/0/2"] and ids(batch) == [first]


def test_a_request_aborted_by_someone_else_fails_the_step():
    class Aborted(Infer):
        async def generate_request(self, request_id, *args, **kwargs):
            return None

    s = make(config(), rows_of(["half"] * 4), Aborted())
    with pytest.raises(RuntimeError, match="generation request math/0/0 was aborted by someone else"):
        step(s, 1)


def test_waves_go_out_as_requests_of_one_batch_each():
    patterns = ["same1", "half", "same0", "low", "half", "same0"] * 3
    cfg = config(["dynamic_sampling.request_mode=wave", "dynamic_sampling.max_running_requests=6",
                  "actor_infer.infer_batch_size=8"])
    infer = Infer()
    s = make(cfg, rows_of(patterns), infer)
    batch, m = step(s, 6)
    assert [(r[0], r[1]) for r in infer.requests] == [("math/0/0", 2), ("math/0/2", 2), ("math/0/4", 2)]
    assert infer.waves == [("math", "0/0", 3)] * 3  # one wave of three requests: actor_infer need not wait for more
    order = draw_order(cfg, len(patterns), 6)
    assert ids(batch) == order
    assert batch["scores"].tolist() == [float(a == "1") for i in order for a in PATTERNS[patterns[i]]]
    # A batch smaller than a group still sends one prompt a request; deterministic runs always do.
    for overrides in (["actor_infer.infer_batch_size=3"], ["deterministic=true"]):
        infer = Infer()
        step(make(config([*cfg_overrides_wave(), *overrides]), rows_of(patterns), infer), 6)
        assert [r[1] for r in infer.requests] == [1] * 6, overrides
        assert infer.waves == [("math", "0/0", 6)] * 6, overrides


def test_a_requests_groups_are_scored_in_one_call_per_reward_worker():
    """A request of two prompts: one reward worker scores both groups in one call; two workers one group each."""
    patterns = ["same1", "half", "same0", "low", "half", "same0"] * 3
    cfg = config(cfg_overrides_wave())
    one = Reward()
    batch, _ = step(make(cfg, rows_of(patterns), Infer(), [one]), 6)
    order = draw_order(cfg, len(patterns), 6)  # the six drawn, every group kept (no filters)
    assert [len(rows) for rows in one.rows_per_call] == [2, 2, 2]  # a request's two groups in one call
    assert sorted(i for rows in one.rows_per_call for i in rows) == sorted(f"r{i}" for i in order)
    two = [Reward(), Reward()]
    again, _ = step(make(cfg, rows_of(patterns), Infer(), two), 6)
    assert [[len(rows) for rows in r.rows_per_call] for r in two] == [[1, 1, 1]] * 2  # a group on each worker
    assert sorted(i for r in two for rows in r.rows_per_call for i in rows) == sorted(f"r{i}" for i in order)
    for b in (batch, again):  # every group's rows with its own scores, in draw order
        assert ids(b) == order
        assert b["scores"].tolist() == [float(a == "1") for i in order for a in PATTERNS[patterns[i]]]


def cfg_overrides_wave():
    return ["dynamic_sampling.request_mode=wave", "dynamic_sampling.max_running_requests=6",
            "actor_infer.infer_batch_size=8"]


def test_auto_request_mode_batches_on_hf_and_not_on_vllm():
    s = make(config(["dynamic_sampling.request_mode=auto"]), rows_of(["half"] * 4), Infer())
    assert s.wave_requests is True
    vllm = config(["dynamic_sampling.request_mode=auto", "actor_infer.strategy_args.strategy_name=vllm"])
    assert make(vllm, rows_of(["half"] * 4), Infer()).wave_requests is False
    s = make(config(["dynamic_sampling.request_mode=prompt"]), rows_of(["half"] * 4), Infer())
    assert s.wave_requests is False


def test_the_scheduler_takes_keywords_only():
    cfg = config()
    rows = rows_of(["half"] * 2)
    ids = encode_prompts(TOK, rows, cfg.data)
    with pytest.raises(TypeError, match="positional"):
        DynamicSamplingScheduler("math", rows, ids, [], [], cfg, [Handle(Infer())], [Handle(Reward())])


# ---------------------------------------------------------------------------------------------- the bound


def test_the_bound_trains_on_what_passed_and_masks_the_filler(caplog):
    cfg = config(["dynamic_sampling.max_prompts_factor=4", "rewards.math.max_prompts_factor=2.5"],
                 group_filters="{std_filter: {}}")
    patterns = ["same1"] * 9 + ["half"]
    s = make(cfg, rows_of(patterns), Infer())
    with caplog.at_level(logging.WARNING, logger="schedulers.dynamic_sampling"):
        batch, m = step(s, 4)
    assert m["scheduler/math/bound"] == 10 and m["scheduler/math/prompts_drawn"] == 10
    assert m["scheduler/math/bound_hit"] == 1 and m["scheduler/math/redraws"] == 6
    assert m["scheduler/math/groups_kept"] == 1 and m["scheduler/math/dropped_std_filter"] == 9
    assert len(batch) == 4 * N
    assert batch["in_loss"].tolist() == [1.0] * N + [0.0] * (3 * N)
    assert ids(batch)[0] == 9
    # The filler: the earliest drawn dropped groups, scores kept (left out of the loss, not zeroed).
    order = [i for i in draw_order(cfg, 10, 10) if i != 9]
    assert ids(batch)[1:] == order[:3] and batch["scores"][N:].tolist() == [1.0] * (3 * N)
    assert [r.getMessage() for r in caplog.records if "bound hit" in r.getMessage()] == [
        "domain 'math': only 1 of 4 groups passed the filters ['std_filter'] after drawing 10 prompts (the bound: "
        "max_prompts_factor 2.5, from rewards.math.max_prompts_factor or dynamic_sampling.max_prompts_factor); "
        "training on the groups that passed, the rest left out of the loss (bound hit 1 time(s) so far; see "
        "scheduler/math/bound_hit)"
    ]
    assert s.state_dict()["bound_hits"] == 1
    assert s.state_dict()["pass_rate"] == pytest.approx(2 / 11)


def test_the_bound_warning_is_logged_on_the_first_hit_and_every_fiftieth(caplog):
    cfg = config(["dynamic_sampling.max_prompts_factor=1"], group_filters="{std_filter: {}}")
    s = make(cfg, rows_of(["same0"] * 3), Infer())
    with caplog.at_level(logging.WARNING, logger="schedulers.dynamic_sampling"):
        for _ in range(100):
            _, m = step(s, 1)
            assert m["scheduler/math/bound_hit"] == 1
    hits = [r.getMessage() for r in caplog.records if "bound hit" in r.getMessage()]
    assert [h.split("bound hit ")[1].split(" ")[0] for h in hits] == ["1", "50", "100"]
    assert s.state_dict()["pass_rate"] == 0.5  # (0 kept + 1) / (1 resolved + 1): the estimate is the step's


def test_the_pass_rate_estimate_has_a_floor():
    cfg = config(["dynamic_sampling.max_prompts_factor=25"], group_filters="{std_filter: {}}")
    s = make(cfg, rows_of(["same0"] * 30), Infer())
    _, m = step(s, 1)
    assert m["scheduler/math/prompts_drawn"] == 25
    assert s.state_dict()["pass_rate"] == 0.05  # 1 / 26 is below the floor


def test_the_bound_can_stop_the_run():
    cfg = config(["dynamic_sampling.max_prompts_factor=2", "dynamic_sampling.on_bound=error"],
                 group_filters="{std_filter: {}}")
    s = make(cfg, rows_of(["same0"] * 6), Infer())
    with pytest.raises(SamplingBoundError, match=r"domain 'math': only 0 of 3 groups passed .* drawing 6 prompts"):
        step(s, 3)


# ---------------------------------------------------------------------------------------------- determinism


def test_deterministic_rounds_resolve_every_draw_in_order_with_seeded_requests():
    """Deterministic mode draws a round, waits for all of it (nothing aborted), keeps the first passing groups in
    draw order and seeds each request from (seed, domain, call, draw)."""
    patterns = ["same1", "half", "same0", "half", "low", "half"] * 4
    cfg = config(["deterministic=true", "dynamic_sampling.max_running_requests=8"],
                 group_filters="{std_filter: {}, mean_filter: {low: 0.3, high: 1.0}}")
    infer = Infer()
    s = make(cfg, rows_of(patterns), infer)
    batch, m = step(s, 3)
    order = draw_order(cfg, len(patterns), 24)
    drawn = int(m["scheduler/math/prompts_drawn"])
    passing = [i for i in order[:drawn] if patterns[i] == "half"]
    assert ids(batch) == passing[:3]
    assert infer.aborted == [] and m["scheduler/math/aborted"] == 0
    assert m["scheduler/math/groups_kept"] + m["scheduler/math/groups_dropped"] + m["scheduler/math/surplus"] == drawn
    assert [r[2] for r in infer.requests] == [request_seed(cfg.seed, "math", 0, k) for k in range(drawn)]
    # The first round is the share (pass rate 1), the next ones sized by the estimate at their start.
    assert [r[0] for r in infer.requests][:3] == ["math/0/0", "math/0/1", "math/0/2"]
    assert len(passing) >= 3


def test_a_deterministic_step_waits_for_its_round_after_the_share_is_full():
    cfg = config(["deterministic=true", "dynamic_sampling.max_running_requests=4",
                  "dynamic_sampling.max_prompts_factor=4"])
    infer = Infer(hold_each=True)
    s = make(cfg, rows_of(["half"] * 8), infer)
    s.load_state_dict({**s.state_dict(), "pass_rate": 0.25})  # a round of 4 for a share of 1

    async def run():
        task = asyncio.ensure_future(s.get_batch(1, N, ARGS))
        await settle()
        infer.release(0)  # the share is full; 1-3 still generate
        await settle()
        waiting = not task.done()
        infer.release(1, 2, 3)
        return waiting, await task

    waiting, (batch, m) = asyncio.run(run())
    assert waiting and infer.aborted == [] and m["scheduler/math/aborted"] == 0
    assert m["scheduler/math/surplus"] == 3 and ids(batch) == draw_order(cfg, 8, 1)


def test_a_deterministic_round_draws_nothing_new_until_it_is_resolved():
    cfg = config(["deterministic=true", "dynamic_sampling.max_running_requests=4",
                  "dynamic_sampling.max_prompts_factor=8"], group_filters="{std_filter: {}}")
    patterns = ["half"] * 32
    patterns[draw_order(cfg, 32, 1)[0]] = "same0"  # the first drawn row is dropped
    infer = Infer(hold_each=True)
    s = make(cfg, rows_of(patterns), infer)

    async def run():
        task = asyncio.ensure_future(s.get_batch(4, N, ARGS))  # a round of 4 (the cap) for a share of 4
        await settle()
        # The first group is dropped: a slot is free and 0.5 * 3 in flight < 4 wanted, but the round is not over.
        infer.release(0)
        await settle()
        mid_round = len(infer.requests)
        infer.release(*range(1, 40))
        await task
        return mid_round

    assert asyncio.run(run()) == 4


def test_non_deterministic_requests_carry_no_seed_and_the_current_weights_version():
    infer = Infer()
    s = make(config(), rows_of(["half"] * 4), infer)
    step(s, 1)
    s.set_weights(7, ["ref"])
    step(s, 2)
    assert [r[2:] for r in infer.requests] == [(None, 0), (None, 7), (None, 7)]  # the starting weights: 0


def test_request_seeds_are_a_fixed_hash_of_their_parts():
    digest = hashlib.blake2b(b"42/math/3/val16", digest_size=8).digest()
    assert request_seed(42, "math", 3, "val16") == int.from_bytes(digest, "little") & (2**63 - 1)
    assert request_seed(1, "code", 0, 5) == 6711401011419582302  # the same on every machine and every release
    assert request_seed(2, "code", 0, 5) == 3378775997363216055  # (an odd one: the low bit is kept)
    seeds = {request_seed(s, d, c, k) for s in (1, 2) for d in ("math", "code") for c in (0, 1) for k in (0, 1)}
    assert len(seeds) == 16 and all(0 <= x < 2**63 for x in seeds)
    assert max(seeds) >= 2**62  # 63 bits used, not fewer


# ---------------------------------------------------------------------------------------------- workers


def test_a_restarting_infer_worker_gets_the_weights_and_the_request_again(monkeypatch):
    clock = FakeTime(monkeypatch)
    infer = Infer(unavailable=3)
    s = make(config(), rows_of(["half"] * 4), infer)
    s.set_weights(3, ["weights-3"])
    batch, m = step(s, 1)
    assert len(batch) == N and m["scheduler/math/infer_retries"] == 1  # one request lost, counted once
    assert infer.weights == [("weights-3", 3)] * 3
    assert [r[0] for r in infer.requests] == ["math/0/0"] * 4 and clock.slept == [0.1, 0.2, 0.4]
    # Before any weights were sent, a restarted worker already has the starting ones: no sync.
    infer = Infer(unavailable=1)
    s = make(config(), rows_of(["half"] * 4), infer)
    step(s, 1)
    assert infer.weights == []
    # A worker that came back before the scheduler noticed says its weights are stale: the same resync, once.
    clock.slept.clear()
    infer = Infer(stale=1)
    s = make(config(), rows_of(["half"] * 4), infer)
    s.set_weights(2, ["weights-2"])
    batch, m = step(s, 1)
    assert infer.weights == [("weights-2", 2)] and clock.slept == [0.1]
    assert m["scheduler/math/infer_retries"] == 1 and len(batch) == N


def test_a_restarted_infer_worker_with_no_weights_kept_to_resend_fails_the_step_at_once(monkeypatch):
    """With a weight_transport actor_train sends the weights itself and the scheduler keeps none: a worker back
    from a restart (stale weights) cannot be given them again, so the step fails at once, saying what to do,
    instead of waiting RESTART_WAIT_S. A worker still restarting (unavailable) is waited for as before."""
    clock = FakeTime(monkeypatch)
    infer = Infer(unavailable=1, stale=1)
    s = make(config(), rows_of(["half"] * 4), infer)
    s.set_weights(2, [None])
    with pytest.raises(RuntimeError, match="no copy of version 2 is kept to send it again: resume the run"):
        step(s, 1)
    assert clock.slept == [0.1] and infer.weights == []


def test_an_infer_worker_that_stays_away_past_the_wait_fails_the_step(monkeypatch):
    """The retries back off 0.1 s, doubling up to 2 s, for RESTART_WAIT_S (300 s) on the scheduler's clock."""
    clock = FakeTime(monkeypatch)
    infer = Infer(unavailable=10_000)
    s = make(config(), rows_of(["half"] * 4), infer)
    with pytest.raises(ActorUnavailableError):
        step(s, 1)
    assert clock.slept[:6] == [0.1, 0.2, 0.4, 0.8, 1.6, 2.0] and set(clock.slept[5:]) == {2.0}
    assert sum(clock.slept[:-1]) <= 300.0 < sum(clock.slept)  # the last try came after the wait ran out
    assert len(infer.requests) == len(clock.slept) + 1


def test_the_wait_for_a_restarting_worker_ends_past_300_s_not_on_it(monkeypatch):
    """A try that fails exactly RESTART_WAIT_S after the first is tried again; one that fails half a second later
    ends the step."""
    clock = FakeTime(monkeypatch)
    fail_at = iter([300.0, 300.5, 400.0, 500.0])

    class Away(Infer):
        async def generate_request(self, *args, **kwargs):
            clock.now = next(fail_at)  # the moment this try's failure is seen
            return await super().generate_request(*args, **kwargs)

    infer = Away(unavailable=4)
    with pytest.raises(ActorUnavailableError):
        step(make(config(), rows_of(["half"] * 4), infer), 1)
    assert len(infer.requests) == 2 and clock.slept == [0.1]


def test_a_dead_reward_worker_passes_the_batch_on_and_all_dead_masks_it(caplog):
    cfg = config()
    first, second = Reward(lost=True), Reward()
    s = make(cfg, rows_of(["half"] * 4), Infer(), [first, second])
    with caplog.at_level(logging.WARNING, logger="schedulers.dynamic_sampling"):
        batch, m = step(s, 1)
    # the error's first line, cut at 200 characters
    detail = ("the actor died: " + "x" * 300)[:200]
    assert [r.getMessage() for r in caplog.records] == [f"domain 'math': reward worker 0 failed ({detail})"]
    assert m["scheduler/math/reward_worker_failures"] == 1
    assert batch["scores"].tolist() == [1.0, 0.0, 1.0, 0.0] and first.calls == 1
    dead = [Reward(lost=True), Reward(lost=True)]
    s = make(cfg, rows_of(["half"] * 4), Infer(), dead)
    batch, m = step(s, 1)
    assert [r.calls for r in dead] == [1, 1] and m["scheduler/math/reward_worker_failures"] == 2
    assert batch.meta["mask_reason"] == ["worker_lost"] * N
    assert batch["scores"].tolist() == [0.0] * N and batch["in_loss"].tolist() == [0.0] * N
    assert m["reward/math/masked_worker_lost"] == N and "scheduler/math/reward_mean" not in m


def test_reward_workers_take_batches_in_turn():
    rewards = [Reward(), Reward()]
    s = make(config(["dynamic_sampling.max_running_requests=1"]), rows_of(["half"] * 8), Infer(), rewards)
    step(s, 4)
    assert [r.calls for r in rewards] == [2, 2]


def test_several_rewards_are_combined_and_reported_each(caplog):
    cfg = config([
        "rewards.math.worker=null",
        "rewards.math.workers=[{worker: math_rule, weight: 1.0}, {worker: math_rule, name: second, weight: 0.5}]",
    ])
    a, b = Reward(), Reward(masked="0")
    s = make(cfg, rows_of(["half"] * 4), Infer(), {"math_rule": [a], "second": [b]})
    batch, m = step(s, 1)
    lost = make(cfg, rows_of(["half"] * 4), Infer(), {"math_rule": [Reward()], "second": [Reward(lost=True)]})
    with caplog.at_level(logging.WARNING, logger="schedulers.dynamic_sampling"):
        step(lost, 1)
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == [
        "domain 'math/second': reward worker 0 failed",
        "domain 'math/second': no reward worker answered; 2 sample(s) masked",  # the 2 distinct responses
    ]
    assert a.calls == 1 and b.calls == 1
    assert m["reward/math/math_rule/count"] == N and m["reward/math/second/masked_error"] == 2
    assert m["reward/math/second/score"] == 1.0 and m["reward/math/math_rule/score"] == 0.5
    assert m["reward/math/count"] == N
    for workers in ({"math_rule": [a]}, {"math_rule": [a], "second": [b], "third": [b]}, {"first": [a], "x": [b]}):
        with pytest.raises(ValueError, match=r"reward workers for \[.*\], but its rewards are \['math_rule', 'second'\]"):
            make(cfg, rows_of(["half"] * 4), Infer(), workers)


def test_identical_responses_to_a_prompt_are_scored_once():
    reward = Reward()
    s = make(config(), rows_of(["same1", "half"] * 4), Infer(), [reward])
    batch, m = step(s, 8)
    assert m["scheduler/math/scored_unique_frac"] == 12 / 32 and len(reward.samples) == 12
    patterns = [PATTERNS[["same1", "half"][i % 2]] for i in ids(batch)]
    assert batch["scores"].tolist() == [float(a == "1") for answers in patterns for a in answers]
    _, m = step(make(config(), rows_of(["half"]), Infer()), 1, group_size=1)
    assert m["scheduler/math/scored_unique_frac"] == 1.0  # one response, scored once
    # The samples carry the row and the prompt's messages (the reward contract).
    assert reward.samples[0]["prompt_messages"][-1]["role"] == "user" and "ground_truth" in reward.samples[0]


# ---------------------------------------------------------------------------------------------- the batch


def test_the_batch_carries_the_generators_log_probs_and_the_rows_meta():
    rows = rows_of(["half"] * 2)
    rows[0]["tag"], rows[1]["tag"] = "arith", "add"
    s = make(config(), rows, Infer(log_probs=True), [Reward(masked="0")])
    batch, m = step(s, 2)
    assert "infer_log_probs" in batch.tensors
    assert batch["infer_log_probs"][:, 0].tolist() == [-1.0, -2.0, -3.0, -4.0] * 2
    first = ids(batch)[0]
    assert batch.meta["tag"] == [rows[first]["tag"]] * N + [rows[1 - first]["tag"]] * N
    assert batch.meta["ground_truth"] == ["1"] * (2 * N) and batch.meta["domain"] == ["math"] * (2 * N)
    assert batch.meta["response_text"][:2] == ["1", "0"] and batch.meta["correct"][:2] == [True, None]
    assert batch["scores"].tolist()[:2] == [1.0, 0.0] and batch["in_loss"].tolist()[:2] == [1.0, 0.0]
    assert batch["prompt_ids"][0].tolist() == s.prompt_ids[first] and batch["prompt_mask"].min() == 1
    assert batch["response_mask"].sum(-1).tolist()[:2] == [2.0, 3.0]
    assert "infer_log_probs" not in step(make(config(), rows, Infer()), 1)[0].tensors


def test_the_domain_config_chooses_the_rollout_class(monkeypatch):
    """rewards.<domain>.rollout names the class that makes the domain's groups (ROLLOUTS); the fill loop calls
    whatever class that is."""

    class Counting(SingleTurnRollout):
        calls: list[str] = []

        def draw(self, call, stats):
            Counting.calls.append("draw")
            return super().draw(call, stats)

        def filter(self, group):
            Counting.calls.append("filter")
            return super().filter(group)

        async def evaluate(self, call, start, rows, prompt_ids, args, num_samples, stats):
            Counting.calls.append("evaluate")
            return await super().evaluate(call, start, rows, prompt_ids, args, num_samples, stats)

    monkeypatch.setitem(ROLLOUTS._items, "counting", Counting)
    monkeypatch.setitem(ROLLOUTS._traits, "counting", {})
    assert type(make(config(), rows_of(["half"] * 4), Infer()).rollout) is SingleTurnRollout
    s = make(config(["rewards.math.rollout=counting", "dynamic_sampling.max_running_requests=1"]),
             rows_of(["half"] * 4), Infer())
    assert type(s.rollout) is Counting
    batch, _ = step(s, 2)
    assert sorted(Counting.calls) == ["draw", "draw", "filter", "filter"] and len(batch) == 2 * N
    # validation goes through the same class (a multi-turn domain is validated multi-turn)
    Counting.calls.clear()
    s.val_rows, s.val_prompt_ids = s.rows[:2], s.prompt_ids[:2]
    assert len(asyncio.run(s.validate(GeneratingArgs(max_new_tokens=4)))) == 2
    assert Counting.calls == ["evaluate"]


def test_prompt_rows_picks_one_prompts_group():
    out = {"a": torch.arange(6), "b": ["x", "y", "z", "u", "v", "w"]}
    part = prompt_rows(out, 1, 2)
    assert part["a"].tolist() == [2, 3] and part["b"] == ["z", "u"]
    assert prompt_rows(out, 2, 2)["b"] == ["v", "w"] and prompt_rows(out, 0, 3)["a"].tolist() == [0, 1, 2]


def test_seconds_are_the_groups_generation_and_scoring_time(monkeypatch):
    """generate_s is from a group's request to its answer, reward_s its scoring, wall_s the step's: on the
    scheduler's clock, which the stand-ins move by 3 s per answer and 10 s per scoring call."""
    clock = FakeTime(monkeypatch)
    infer, reward = Infer(clock=clock, tick_s=3.0), Reward(clock=clock, tick_s=10.0)
    s = make(config(), rows_of(["half"] * 4), infer, [reward])
    _, m = step(s, 1)
    assert (m["scheduler/math/generate_s"], m["scheduler/math/reward_s"], m["scheduler/math/wall_s"]) == (3, 10, 13)
    clock.now = 100.0
    _, m = step(s, 1)  # measured from where the clock is, not from 0
    assert (m["scheduler/math/generate_s"], m["scheduler/math/reward_s"], m["scheduler/math/wall_s"]) == (3, 10, 13)


def test_counts_past_256_prompts():
    """Counts above CPython's small-int cache (where `is` on equal numbers stops holding): a cap of 300 in flight,
    a share of 260, 300 rows wrapped into their next epoch, a bound of 260 reached."""
    rows = rows_of(["half"] * 300)  # with one response a group, every group scores 1
    cfg = config(["dynamic_sampling.max_running_requests=300", "dynamic_sampling.max_prompts_factor=2"])
    s = make(cfg, rows, Infer())
    _, m = step(s, 260, group_size=1)
    assert m["scheduler/math/prompts_drawn"] == 260 and m["scheduler/math/peak_in_flight"] == 260
    assert m["scheduler/math/bound_hit"] == 0 and s.state_dict()["bound_hits"] == 0
    s.load_state_dict({**s.state_dict(), "pass_rate": 0.5})
    _, m = step(s, 260, group_size=1)  # 0.5 * 520 would be the share, but 300 may be in flight
    assert m["scheduler/math/peak_in_flight"] == 300
    assert m["scheduler/math/groups_kept"] == 260 and m["scheduler/math/aborted"] > 0  # the rest stopped once full
    total = 260 + int(m["scheduler/math/prompts_drawn"])
    assert total > 300 and s.state_dict()["sampler"] == {
        "epoch": total // 300, "position": total % 300, "seed": cfg.seed + zlib.crc32(b"math"), "size": 300
    }
    dropping = config(["dynamic_sampling.max_running_requests=300", "dynamic_sampling.max_prompts_factor=2"],
                      group_filters="{std_filter: {}}")  # a group of one response has no spread: all dropped
    _, m = step(make(dropping, rows, Infer()), 130, group_size=1)
    assert m["scheduler/math/prompts_drawn"] == 260 and m["scheduler/math/bound_hit"] == 1


# ---------------------------------------------------------------------------------------------- validation


def test_validation_is_every_prompt_unfiltered_in_requests_of_sixteen():
    cfg = config(group_filters="{std_filter: {}}")
    val = rows_of(["same1", "same0", "half"] * 7)
    infer = Infer()
    s = make(cfg, rows_of(["half"] * 3), infer, val_rows=val)
    batch = asyncio.run(s.validate(GeneratingArgs(do_sample=False, max_new_tokens=4), 0))
    assert batch.meta["id"] == [r["id"] for r in val]
    assert batch["scores"].tolist() == [float(PATTERNS[p][0] == "1") for p in ["same1", "same0", "half"] * 7]
    assert [(r[0], r[1], r[2]) for r in infer.requests] == [("math/val0/0", 16, None), ("math/val0/16", 5, None)]
    assert batch["in_loss"].tolist() == [1.0] * len(val)


def test_validation_with_k_samples_groups_them_and_a_cap_takes_the_first_prompts():
    cfg = config(["deterministic=true"])
    val = rows_of(["half", "low", "same0"] * 3)
    infer = Infer()
    s = make(cfg, rows_of(["half"] * 3), infer, val_rows=val)
    step(s, 1)  # call 0
    batch = asyncio.run(s.validate(GeneratingArgs(max_new_tokens=4), 5, N))
    assert batch.meta["id"] == [r["id"] for r in val[:5] for _ in range(N)]
    patterns = ["half", "low", "same0"] * 3
    assert batch["scores"].tolist() == [float(a == "1") for p in patterns[:5] for a in PATTERNS[p]]
    assert [r[:3] for r in infer.requests[1:]] == [
        ("math/val1/0", 4, request_seed(cfg.seed, "math", 1, "val0")),
        ("math/val1/4", 1, request_seed(cfg.seed, "math", 1, "val4")),
    ]
    assert len(asyncio.run(s.validate(GeneratingArgs(max_new_tokens=4), 100, 1))) == len(val)
    assert len(asyncio.run(s.validate(GeneratingArgs(max_new_tokens=4)))) == len(val)  # by default, all of them
    assert len(asyncio.run(s.validate(GeneratingArgs(max_new_tokens=4), -1))) == len(val)  # as any cap <= 0
    assert asyncio.run(s.validate(GeneratingArgs(max_new_tokens=4), 1)).meta["id"] == [val[0]["id"]]
    # more samples a prompt than a request holds prompts: still one prompt a request
    infer.requests.clear()
    s.VAL_PROMPTS_PER_REQUEST = 3
    asyncio.run(s.validate(GeneratingArgs(max_new_tokens=4), 2, N))
    assert {r[0].split("/")[1] for r in infer.requests} == {"val6"}  # the seventh call of this scheduler
    assert [r[1] for r in infer.requests] == [1, 1]


# ---------------------------------------------------------------------------------------------- state


def test_state_round_trips_and_refuses_another_domain():
    cfg = config(["dynamic_sampling.ledger.enabled=true"])
    s = make(cfg, rows_of(["same1", "half"] * 4), Infer())
    step(s, 3)
    state = s.state_dict()
    assert state["calls"] == 1 and state["sampler"]["position"] == 3 and state["ledger"] is not None
    other = make(cfg, rows_of(["same1", "half"] * 4), Infer())
    other.load_state_dict({**state, "domain": "".join(["ma", "th"])})  # an equal name, not the same object
    assert other.state_dict() == state
    assert other.ledger.state_dict() == s.ledger.state_dict()
    plain = make(config(), rows_of(["same1", "half"] * 4), Infer())
    plain.load_state_dict(state)  # a ledger state without a ledger is ignored
    assert plain.state_dict()["ledger"] is None and plain.state_dict()["calls"] == 1
    for other in ("code", "zeta"):  # sorting before and after
        with pytest.raises(ValueError, match=f"scheduler state of domain '{other}' given to domain 'math'"):
            s.load_state_dict({**state, "domain": other})


def test_the_ledger_skips_uniform_rows_and_reports_them():
    cfg = config(["dynamic_sampling.ledger.enabled=true", "dynamic_sampling.ledger.streak=1",
                  "dynamic_sampling.ledger.retest_prob=1e-9"])
    patterns = ["same1", "half", "half", "half"]
    s = make(cfg, rows_of(patterns), Infer())
    _, m1 = step(s, 4)  # the first epoch: every row drawn once, the same1 row now uniform
    assert m1["scheduler/math/skipped_by_ledger"] == 0 and m1["scheduler/math/ledger_uniform_rows"] == 1
    assert m1["scheduler/math/ledger_saved_est_s"] == 0
    _, m2 = step(s, 4)  # past the second epoch: the same1 row comes up at least once, and is passed over
    skipped, kept = 0, 0
    for i in draw_order(cfg, 4, 20)[4:]:
        if patterns[i] == "same1":
            skipped += 1
            continue
        kept += 1
        if kept == 4:
            break
    assert m2["scheduler/math/skipped_by_ledger"] == skipped >= 1 and m2["scheduler/math/prompts_drawn"] == 4
    assert m2["scheduler/math/ledger_saved_est_s"] == pytest.approx(skipped * m2["scheduler/math/wall_s"] / 4)
    assert s.ledger.streaks == {patterns.index("same1"): 1}
    # One row, uniform: passed over once, then drawn anyway (the whole epoch was); the saving is per drawn prompt.
    s = make(cfg, rows_of(["same1"]), Infer())
    step(s, 1)
    _, m = step(s, 1)
    assert m["scheduler/math/skipped_by_ledger"] == 1 and m["scheduler/math/prompts_drawn"] == 1
    assert m["scheduler/math/ledger_saved_est_s"] == m["scheduler/math/wall_s"]
    # Every row uniform: they are drawn anyway rather than skipped forever.
    s = make(cfg, rows_of(["same1"] * 3), Infer())
    step(s, 3)
    _, m = step(s, 3)
    assert m["scheduler/math/prompts_drawn"] == 3 and m["scheduler/math/skipped_by_ledger"] == 3


def test_each_ledger_check_of_a_step_has_a_retest_draw_of_its_own():
    """With retest_prob 0.5, which uniform rows come back is the ledger's draw for (call, check number): every
    check of the step a draw of its own, counted from 1."""
    cfg = config(["dynamic_sampling.ledger.enabled=true", "dynamic_sampling.ledger.streak=1",
                  "dynamic_sampling.ledger.retest_prob=0.5", "dynamic_sampling.max_running_requests=1"])
    patterns = ["same1"] * 12 + ["half"] * 4
    s = make(cfg, rows_of(patterns), Infer())
    step(s, 16)  # every row once: the same1 rows are uniform now
    _, m = step(s, 8)
    order = draw_order(cfg, 16, 80)[16:]
    skipped, drawn = 0, 0
    for check, i in enumerate(order, start=1):
        if patterns[i] == "same1" and s.ledger._draw(1, check) >= 0.5:
            skipped += 1
            continue
        drawn += 1
        if drawn == m["scheduler/math/prompts_drawn"]:
            break
    assert m["scheduler/math/skipped_by_ledger"] == skipped and 2 <= skipped <= 10


def test_prompt_sampler_refuses_no_rows_and_another_datas_state():
    with pytest.raises(ValueError, match="a domain with no rows cannot be sampled"):
        PromptSampler(0, seed=1)
    s = PromptSampler(5, seed=3)
    s.take(7)
    again = PromptSampler(5, seed=3)
    again.load_state_dict(s.state_dict())
    assert again.take(6) == s.take(6)
    # A take across an epoch's end: the rest of this epoch, then the start of the next.
    part = PromptSampler(5, seed=3)
    assert part.take(3) + part.take(4) == np.random.default_rng([3, 0]).permutation(5).tolist() + (
        np.random.default_rng([3, 1]).permutation(5).tolist()[:2]
    )
    # Each epoch is the seeded permutation of its own number, and the epochs are counted.
    walk = PromptSampler(5, seed=3)
    epochs = [walk.take(5) for _ in range(4)]
    assert epochs == [np.random.default_rng([3, e]).permutation(5).tolist() for e in range(4)]
    assert len({tuple(e) for e in epochs}) == 4 and walk.state_dict()["epoch"] == 3
    # Takes past 256 (CPython caches smaller ints, so only these tell a count from its identity).
    big = PromptSampler(300, seed=3)
    assert big.take(300) == np.random.default_rng([3, 0]).permutation(300).tolist()
    assert len(big.take(301)) == 301
    for other in ({"seed": 4}, {"size": 6}, {"seed": 2}, {"size": 4}):
        with pytest.raises(ValueError, match="sampler state is for seed .* the data or the seed changed"):
            PromptSampler(5, seed=3).load_state_dict({**s.state_dict(), **other})
    assert math.isclose(len(set(PromptSampler(100, seed=1).take(100))), 100)

"""I/O-bound scorers (a judge over HTTP, a remote sandbox) keep many samples in flight on the reward worker's
asyncio loop (workers/rewards/io_loop.py), across batches, each under the per-sample time limit."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

from roll_core.rewards.scorer import RewardResult, RewardScorer
from workers.rewards.code_sandbox import CodeSandboxScorer
from workers.rewards.io_loop import IOScoringLoop
from workers.rewards.llm_judge import LLMJudgeScorer
from workers.rewards.worker import RewardWorker

SPEC = "tests.test_reward_io_loop:WaitingScorer"


class Meeting:
    """How many scorer calls run at once, the most seen, and a wait until `need` run together."""

    lock = threading.Condition()
    running = most = 0

    @classmethod
    def reset(cls) -> None:
        cls.running = cls.most = 0

    @classmethod
    def meet(cls, need: int, limit_s: float = 20.0) -> bool:
        with cls.lock:
            cls.running += 1
            cls.most = max(cls.most, cls.running)
            cls.lock.notify_all()
            met = cls.lock.wait_for(lambda: cls.most >= need, timeout=limit_s)
        time.sleep(0.05)  # room for one more to show up if more than `need` could run
        with cls.lock:
            cls.running -= 1
        return met


class WaitingScorer(RewardScorer):
    """Stands in for a judge: waits on the network (here: for others, or a sleep), holds no CPU."""

    @classmethod
    def io_bound(cls, options) -> bool:
        return True

    def __init__(self, **options: object) -> None:
        super().__init__(**options)
        self.thread = None

    def score(self, response: str, ground_truth: str, **fields: object) -> RewardResult | None:
        self.thread = self.thread or threading.get_ident()
        assert self.thread == threading.get_ident(), "a scorer is used by one thread only"
        if fields.get("mode") == "meet":
            return RewardResult(score=float(Meeting.meet(int(fields["need"]))), correct=True)
        if fields.get("mode") == "sleep":
            time.sleep(float(fields["sleep_s"]))
        if fields.get("mode") == "raise":
            raise ConnectionError("the judge hung up")
        return RewardResult(score=float(response == ground_truth), correct=response == ground_truth)


def sample(response: str = "a", **fields: object) -> dict:
    return {"response": response, "ground_truth": "a", **fields}


def test_samples_run_in_flight_up_to_the_limit_and_never_beyond():
    Meeting.reset()
    with RewardWorker("open", SPEC, {}, timeout_s=30.0, processes=4) as worker:
        assert isinstance(worker._pool, IOScoringLoop)
        results = worker.score_batch([sample(mode="meet", need=4) for _ in range(8)])
        assert [r.score for r in results] == [1.0] * 8, "four samples never ran at once"
        assert Meeting.most == 4 and worker.stats()["peak_in_flight"] == 4


def test_batches_of_several_callers_share_the_slots_and_keep_their_own_results():
    Meeting.reset()
    with RewardWorker("open", SPEC, {}, timeout_s=30.0, processes=3) as worker, ThreadPoolExecutor(3) as callers:
        met = list(callers.map(lambda _: worker.score_batch([sample(mode="meet", need=3)]), range(3)))
        assert [r.score for (r,) in met] == [1.0] * 3, "the groups were scored one after another"
        mixed = list(callers.map(lambda n: worker.score_batch([sample("a" if i % 2 else "b") for i in range(n)]), (3, 5)))
    assert [[r.score for r in b] for b in mixed] == [[0.0, 1.0, 0.0], [0.0, 1.0, 0.0, 1.0, 0.0]]


def test_a_sample_past_the_limit_is_masked_at_the_limit_and_a_failure_is_masked_as_an_error():
    with RewardWorker("open", SPEC, {}, timeout_s=0.5, processes=2) as worker:
        results = worker.score_batch([sample(mode="sleep", sleep_s=600.0), sample(), sample(mode="raise")])
        # Returned at all: the batch did not wait out the slow call's 600 s (pytest's 600 s bound would fail it).
    assert [r.mask_reason for r in results] == ["timeout", None, "error"]
    assert results[1].score == 1.0 and worker.stats()["timeouts"] == 1


def test_the_judge_and_the_remote_sandbox_are_io_bound_the_local_sandbox_is_not():
    assert LLMJudgeScorer.io_bound({"base_url": "http://127.0.0.1:1/v1", "model": "m"})
    assert CodeSandboxScorer.io_bound({"backend": "remote", "remote_url": "http://127.0.0.1:1"})
    assert not CodeSandboxScorer.io_bound({}) and not RewardScorer.io_bound({})

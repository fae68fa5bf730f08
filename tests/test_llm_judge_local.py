"""The llm_judge reward's ``ray_actor`` backend: the tiny judge loaded in a Ray actor on a real local Ray cluster,
called by the reward worker's scoring processes through the worker's relay (workers/rewards/judge/local.py)."""

from __future__ import annotations

import json
import multiprocessing
import threading
import time

import pytest
import ray

from roll_pipeline.data.synthetic import TINY_JUDGE_TEMPLATE
from tests.conftest import EXAMPLES
from tests.judge_servers import assert_judges_own_verdicts
from workers.rewards.judge.errors import JudgeUnreachable
from workers.rewards.judge.local import LocalChatClient, LocalJudgeSpec, relay_address
from workers.rewards.llm_judge import LLMJudgeScorer
from workers.rewards.retry import RetryPolicy
from workers.rewards.worker import RewardWorker

JUDGE_MODEL = EXAMPLES / "models" / "tiny-qwen2-judge"
FAST_RETRY = {"backoff_s": 0.01, "backoff_max_s": 0.05}


def _options(name: str, **extra) -> dict:
    return {
        "backend": "ray_actor",
        "model_path": str(JUDGE_MODEL),
        "template": TINY_JUDGE_TEMPLATE,
        "max_tokens": 8,
        "actor": {"name": name, **extra.pop("actor", {})},
        **extra,
    }


def _known_verdicts(n: int) -> tuple[list[dict], list[dict]]:
    """The first ``n`` rows of the judge's validation set, and the reward samples made from them."""
    rows = [json.loads(line) for line in (EXAMPLES / "data" / "judge_val.jsonl").open()][:n]
    samples = [
        {"response": r["response"], "ground_truth": r["reference"], "question": r["question"], "id": r["id"]}
        for r in rows
    ]
    return rows, samples


@pytest.fixture(scope="module")
def judge_model():
    if not (JUDGE_MODEL / "config.json").exists():
        pytest.fail(f"{JUDGE_MODEL} is missing: run `make judge-model` (make test does it) before the tests")
    return JUDGE_MODEL


# --- without Ray --------------------------------------------------------------------------------------------


JUDGE = str(JUDGE_MODEL)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"backend": "ray_actor"}, "needs options.model_path"),
        ({"backend": "ray_actor", "model_path": "/no/such/judge"}, "does not exist"),
        ({"backend": "grpc", "base_url": "http://x/v1", "model": "m"}, "backend must be one of"),
        (
            {"base_url": "http://x/v1", "model": "m", "model_path": JUDGE},
            "['model_path'] do not apply to backend http",
        ),
        (
            {"backend": "ray_actor", "model_path": JUDGE, "base_url": "http://x/v1"},
            "['base_url'] do not apply",
        ),
        (
            {"backend": "ray_actor", "model_path": JUDGE, "requests_per_minute": 60},
            "do not apply to backend ray_actor",
        ),
        (
            {"backend": "ray_actor", "model_path": JUDGE, "actor": {"num_gpu": 1}},
            "unknown options.actor key(s)",
        ),
        (
            {"backend": "ray_actor", "model_path": JUDGE, "actor": {"max_batch_size": 0}},
            "must be an integer >= 1",
        ),
        ({"backend": "ray_actor", "model_path": JUDGE, "actor": {"dtype": "int8"}}, "actor.dtype must be"),
    ],
)
def test_bad_ray_actor_options_are_refused(judge_model, options, message):
    with pytest.raises(ValueError) as info:
        LLMJudgeScorer(**options)
    assert message in str(info.value)


def test_a_relative_model_path_is_taken_from_the_working_directory(judge_model, monkeypatch):
    # built as outside Ray (this process may be connected to the shared cluster): no judge actor is started
    monkeypatch.setattr("workers.rewards.judge.local.connected_to_ray", lambda: False)
    monkeypatch.chdir(judge_model.parent)
    scorer = LLMJudgeScorer(backend="ray_actor", model_path=judge_model.name)
    assert scorer.local.model_path == str(judge_model.resolve())


def _child_address(spec: LocalJudgeSpec, queue) -> None:
    queue.put(relay_address(spec))


def test_the_pools_processes_find_the_relay_address_of_their_parent(judge_model):
    """A process of the reward worker's pool (forked from its fork server) derives the relay's address that
    its parent listens on, with nothing passed to it; another judge gets another address."""
    spec = LocalJudgeSpec.from_options(str(judge_model), {})
    context = multiprocessing.get_context("forkserver")
    queue = context.Queue()
    child = context.Process(target=_child_address, args=(spec, queue))
    child.start()
    try:
        assert queue.get(timeout=60) == relay_address(spec)
    finally:
        child.join(10)
    assert relay_address(LocalJudgeSpec.from_options(str(judge_model), {"name": "other"})) != relay_address(
        spec
    )


def test_without_a_relay_the_judge_is_unreachable_at_once(judge_model):
    spec = LocalJudgeSpec.from_options(str(judge_model), {"name": "no-relay-anywhere"})
    client = LocalChatClient(spec, timeout_s=5.0, retry=RetryPolicy(max_retries=3, **FAST_RETRY))
    with pytest.raises(RuntimeError, match="must run in a process connected to Ray"):
        client.connect()
    # "after 1 attempt": none of the 3 retries was tried (nothing to retry against), so no backoff was waited
    with pytest.raises(JudgeUnreachable, match="after 1 attempt"):
        client.chat([{"role": "user", "content": "Same answer?"}], max_tokens=4)


# --- on a local Ray cluster ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def judge_worker(local_ray, judge_model):
    """A reward worker as a Ray actor, as `roll run` starts one, with its judge actor ``module-judge``."""
    worker = (
        ray.remote(RewardWorker)
        .options(num_cpus=1)
        .remote("open", "llm_judge", _options("module-judge"), timeout_s=60.0, processes=8)
    )
    ray.get(worker.stats.remote(), timeout=300)  # built: the judge has loaded its model
    yield worker
    ray.kill(worker)


@pytest.mark.slow
def test_actor_judge_rewards_for_known_verdicts(judge_worker):
    rows, samples = _known_verdicts(48)
    records = ray.get(judge_worker.score_batch.remote(samples), timeout=300)
    assert not any(r.masked for r in records), records
    for record in records:
        assert record.score == (1.0 if record.correct else 0.0)
        assert record.metrics["judge_attempts"] == 1.0
    assert_judges_own_verdicts(records, rows)


@pytest.mark.slow
def test_concurrent_samples_are_batched_by_the_judges_engine(judge_worker):
    judge = ray.get_actor("module-judge")
    before = ray.get(judge.stats.remote())
    _, samples = _known_verdicts(32)
    records = ray.get(judge_worker.score_batch.remote(samples), timeout=300)
    after = ray.get(judge.stats.remote())
    assert not any(r.masked for r in records)
    assert after["completed"] - before["completed"] == 32
    batches = after["batches"] - before["batches"]
    # 8 scoring processes call at once: their requests share generate calls rather than taking one each
    assert batches <= 32 / 2, after


@pytest.mark.slow
def test_the_judge_actor_lives_as_long_as_its_reward_worker(local_ray, judge_model):
    worker = (
        ray.remote(RewardWorker)
        .options(num_cpus=1)
        .remote("open", "llm_judge", _options("owned-judge"), timeout_s=60.0, processes=1)
    )
    ray.get(worker.stats.remote(), timeout=300)
    judge = ray.get_actor("owned-judge")
    assert ray.get(judge.ready.remote(), timeout=60)
    ray.kill(worker)
    with pytest.raises(ray.exceptions.RayActorError):
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            ray.get(judge.ready.remote(), timeout=10)
            time.sleep(0.2)


def _kill_mid_batch(
    worker: RewardWorker, judge, samples: list[dict], after: int, no_restart: bool
) -> list[dict]:
    """Score ``samples``, killing the judge once it has answered ``after`` of them."""
    result: dict = {}
    base = ray.get(judge.stats.remote())["completed"]
    step = threading.Thread(target=lambda: result.update(records=worker.score_batch(samples)))
    step.start()
    deadline = time.monotonic() + 120
    while ray.get(judge.stats.remote())["completed"] < base + after and time.monotonic() < deadline:
        time.sleep(0.02)
    ray.kill(judge, no_restart=no_restart)
    step.join(180)
    return result["records"]


@pytest.mark.slow
def test_a_killed_judge_actor_masks_and_counts_samples_and_scoring_goes_on(local_ray, judge_model):
    """The reward worker in this process (the relay runs here): a judge killed mid-batch masks the samples it
    had not answered, and counts them, never scoring them 0; restarted by Ray it judges again; killed for good,
    every later sample is masked at once and nothing raises."""
    _, samples = _known_verdicts(64)
    options = _options(
        "kill-judge", request_timeout_s=30.0, max_retries=1, **FAST_RETRY, actor={"max_batch_size": 4}
    )
    with RewardWorker("open", "llm_judge", options, timeout_s=90, processes=2) as worker:
        judge = ray.get_actor("kill-judge")
        assert not any(r.masked for r in worker.score_batch(samples[:2]))

        records = _kill_mid_batch(worker, judge, samples, after=8, no_restart=False)
        masked = [r for r in records if r.masked]
        assert sum(not r.masked for r in records) >= 6, "samples judged before the kill keep their rewards"
        assert masked and all(r.mask_reason == "error" and r.score is None for r in masked)
        assert worker.domain_metrics(records)["reward/open/masked_error"] == len(masked)
        # Ray restarts the judge (max_restarts): once it is back, the next batch is judged again
        assert ray.get(judge.ready.remote(), timeout=300)
        assert not any(r.masked for r in worker.score_batch(samples[:4]))

        records = _kill_mid_batch(worker, judge, samples, after=4, no_restart=True)
        killed = [r for r in records if r.masked]
        assert killed and all(r.mask_reason == "error" and r.score is None for r in killed)
        down = worker.score_batch(samples[:4])
        # masked as errors, not cut at the 90 s sample timeout: a dead judge is not waited for
        assert all(r.masked and r.mask_reason == "error" for r in down)
        assert worker.stats()["masked_error"] == len(masked) + len(killed) + 4


def test_a_dry_run_in_a_process_connected_to_ray_starts_no_judge(local_ray, judge_model, monkeypatch, capsys):
    """`roll run --dry-run` builds each reward scorer to check its options; an llm_judge scorer built in a process
    connected to Ray starts its judge actor, and a dry run must start nothing (one that did waited for ever on a
    judge that could not be placed: a config import's dry run, in a test process on the shared cluster)."""
    from roll_pipeline.driver.cli import main
    from tests.conftest import ROOT

    monkeypatch.chdir(ROOT)  # the judge's model_path is relative to the working directory
    before = ray.util.list_named_actors(all_namespaces=True)
    assert main(["run", str(EXAMPLES / "multi_domain_local_judge.yaml"), "--dry-run"]) == 0, capsys.readouterr().out
    assert ray.util.list_named_actors(all_namespaces=True) == before

"""Worker failures mid-step, on a real pipeline: reward and actor_infer workers killed (os.kill of the process,
ray.kill) are restarted by Ray and their in-flight calls sent again, and the step completes with every prompt's
group exactly once. The tests share one pipeline: each leaves it whole, so they pass in any order. Failures that
leave a pipeline broken are in test_worker_failures_fatal.py."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import ray
import yaml

from roll_core.config import load_config
from roll_pipeline.driver.pipeline import RLVRPipeline
from tests.conftest import EXAMPLES, shared_ray
from workers.rewards.math_rule import MathRuleScorer

SHARE, N = 6, 4


class SlowMathScorer(MathRuleScorer):
    """math_rule that leaves a mark in `mark_dir` when it starts a sample and then takes `sleep_s`: the test
    knows scoring is under way, and a kill lands while calls are in flight."""

    def __init__(self, *, mark_dir: str = "", sleep_s: float = 0.0, **options):
        super().__init__(**options)
        self.mark_dir, self.sleep_s = mark_dir, sleep_s

    def score(self, response, ground_truth, **fields):
        if self.mark_dir:
            Path(self.mark_dir, f"{os.getpid()}-{time.monotonic_ns()}").touch()
        time.sleep(self.sleep_s)
        return super().score(response, ground_truth, **fields)


def write_config(tmp_path: Path, tiny_model: Path, marks: Path, tracking_uri: str, **top) -> Path:
    cfg = yaml.safe_load((EXAMPLES / "grpo.yaml").read_text())
    rows = (EXAMPLES / "data" / "math_train.jsonl").read_text().splitlines()[:64]
    data = tmp_path / "math.jsonl"
    data.write_text("\n".join(rows) + "\n")
    cfg |= {
        "pretrain": str(tiny_model),
        "max_steps": 3,
        "eval_steps": 0,
        "save_steps": 0,
        "rollout_batch_size": SHARE,
        "num_return_sequences_in_group": N,
        "domain_interleave_probs": {"math": 1.0},
        "use_kl_loss": False,
        "output_dir": str(tmp_path / "run"),
        "rewards": {
            "math": {
                "worker": "tests.test_worker_failures:SlowMathScorer",
                "tag_included": ["add"],
                "num_processes": 2,
                "options": {"mark_dir": str(marks), "sleep_s": 0.05},
            }
        },
        **top,
    }
    cfg["data"] |= {"train_files": [str(data)], "val_files": []}
    cfg["validation"] = {"eval_at_start": False}
    cfg["dynamic_sampling"] = {"max_running_requests": 4}
    cfg["actor_infer"]["generating_args"]["max_new_tokens"] = 24
    cfg["actor_train"]["training_args"] |= {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 3}
    cfg["tracking"] = {"tracking_uri": tracking_uri, "experiment_name": "failures"}
    path = tmp_path / "failures.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def pid_of(actor) -> int:
    return ray.get(actor.__ray_call__.remote(lambda self: os.getpid()))


def during_rollout(pipeline: RLVRPipeline, marks: Path, kill) -> tuple:
    """Run a rollout; once a sample is being scored (generation of other prompts still in flight), `kill()`."""
    for mark in marks.iterdir():
        mark.unlink()
    out = {}

    def target():
        try:
            out["result"] = pipeline.rollout()
        except BaseException as exc:  # re-raised below, in the test's thread
            out["error"] = exc

    thread = threading.Thread(target=target)
    thread.start()
    deadline = time.monotonic() + 120
    while not any(marks.iterdir()):
        assert thread.is_alive() and time.monotonic() < deadline
        time.sleep(0.01)
    kill()
    thread.join(timeout=300)
    assert not thread.is_alive()
    if "error" in out:
        raise out["error"]
    return out["result"].batch, out["result"].metrics


def assert_every_group_once(batch) -> None:
    ids = batch.meta["id"]
    assert len(batch) == SHARE * N
    groups = [ids[i : i + N] for i in range(0, len(ids), N)]
    assert all(len(set(g)) == 1 for g in groups), groups
    assert len({g[0] for g in groups}) == SHARE, groups


def start_pipeline(tmp_path: Path, tiny_model: Path, mlflow_db, **top) -> RLVRPipeline:
    """A set-up pipeline for `write_config(..., **top)`; `pipeline.marks` is the folder its scorer marks."""
    marks = tmp_path / "marks"
    marks.mkdir()
    shared_ray()
    pipeline = RLVRPipeline(
        load_config(write_config(tmp_path, tiny_model, marks, mlflow_db(tmp_path / "mlflow.db"), **top), [])
    )
    try:
        pipeline.setup()
    except BaseException:
        pipeline.shutdown()
        raise
    pipeline.marks = marks
    return pipeline


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory, tiny_model, mlflow_db):
    pipeline = start_pipeline(tmp_path_factory.mktemp("failures"), tiny_model, mlflow_db)
    yield pipeline
    pipeline.shutdown()


@pytest.mark.slow
def test_a_reward_worker_killed_mid_step_is_restarted_and_scores_the_batch_again(pipeline):
    worker = pipeline.runtime.rewards["math"]["SlowMathScorer"].workers[0]
    before = pid_of(worker)
    batch, metrics = during_rollout(pipeline, pipeline.marks, lambda: os.kill(before, signal.SIGKILL))
    assert_every_group_once(batch)
    after = pid_of(worker)
    assert after != before  # a new process: Ray restarted the worker
    assert metrics["reward/math/masked"] == 0  # its in-flight batch was scored again, not masked
    assert metrics["scheduler/math/reward_worker_failures"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("how", ["os.kill", "ray.kill"])
def test_actor_infer_killed_mid_step_gets_the_current_weights_and_the_requests_again(pipeline, how):
    pipeline.loop.trained_version += 1  # as after an update: a newer policy than a restarted worker starts with
    pipeline.weights.sync()
    version = pipeline.weights.version
    assert version > 0
    worker = pipeline.runtime.actor_infer.workers[0]
    before = pid_of(worker)

    def kill():
        if how == "os.kill":
            os.kill(before, signal.SIGKILL)
        else:
            ray.kill(worker, no_restart=False)

    batch, metrics = during_rollout(pipeline, pipeline.marks, kill)
    assert_every_group_once(batch)
    assert pid_of(worker) != before
    assert metrics["scheduler/math/infer_retries"] >= 1
    assert ray.get(worker.__ray_call__.remote(lambda self: self.weights_version)) == version

    def checksum(module):
        return float(sum(p.double().sum() for p in module.parameters()))

    infer_sum = ray.get(worker.__ray_call__.remote(lambda self: checksum(self.strategy.model)))
    train_sum = ray.get(pipeline.runtime.actor_train.workers[0].__ray_call__.remote(lambda self: checksum(self.strategy.module)))
    assert infer_sum == train_sum


@pytest.mark.slow
def test_workers_run_at_the_drivers_priority(pipeline):
    """Ray would start them at niceness 15, where any busy process on a shared machine starves the run."""
    workers = [pipeline.runtime.actor_train.workers[0], pipeline.runtime.actor_infer.workers[0], pipeline.runtime.rewards["math"]["SlowMathScorer"].workers[0]]
    niceness = ray.get([w.__ray_call__.remote(lambda self: os.nice(0)) for w in workers])
    assert niceness == [os.nice(0)] * 3

"""Exact resume: a run killed with SIGKILL after a checkpoint and resumed with `roll run --resume` logs the same
metrics, bitwise, as the run that was never interrupted, into the same MLflow run, each step exactly once."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import ray
import torch
import yaml
from mlflow.tracking import MlflowClient

from roll_core.config import TrackingConfig, load_config
from roll_core.tracking.mlflow_tracker import MlflowTracker
from roll_pipeline.driver.checkpoint import STATE_FILE, checkpoint_root, latest_checkpoint
from roll_pipeline.driver.digests import DIGESTS_FILE, first_difference
from roll_pipeline.driver.pipeline import RLVRPipeline
from tests.conftest import EXAMPLES, ROOT, shared_ray
from tests.test_tracking import read_table
from workers.base import rng_states

STEPS = 6
SAVE_STEPS = 2
# Metrics that measure time or memory: they differ between any two runs.
TIMING = ("time/", "system/", "memory/")
TIMING_SUFFIXES = ("_s", "_mb")


# How each variant differs from the synchronous, deterministic GRPO run.
VARIANTS = {
    "sync": {},
    # Three steps ahead with partial rollouts: a checkpoint holds three rollouts generated ahead, oldest first, with
    # the versions that sampled their tokens. Where a sync lands inside a response follows the
    # partial_rollout_token rule, not timing: a rollout launched ahead with version v samples the first 2 tokens of
    # each response with v and the rest with v + 1 (the tiny model's math answers are 3 to 8 tokens long: most
    # responses are split). With the response-level corrections (sequence weights, geometric rejection), and the
    # KL penalty in the reward with an adaptive coefficient: what the resumed run must restore beyond the sync run
    # is the rollouts generated ahead (saved with the checkpoint) and the controller's coefficient, the difficulty
    # ledger's streaks (saved with the scheduler), the last validation's per-prompt outcomes (the validation at
    # step 6 is compared with step 3's), and reward audits every 2 steps. (Unseeded sampling cannot be compared
    # bitwise: which prompts a scheduler draws, and how many random draws a request aborted mid-generation takes
    # from actor_infer's RNG, follow timing. An unseeded variant with one request in flight failed that way, in a
    # fresh clone and once in two runs on another machine: resumed from step 2, its step-4 rollout drew 4 prompts
    # where the uninterrupted run drew 6. The RNG states are test_resume_restores_every_rng_state's.)
    # Until 2026-12-06 this was three variants: one step ahead with TIS and the adaptive KL, ledger and audits
    # (async_adaptive_kl), two steps ahead with these corrections (async_k2), and three steps ahead with TIS: k = 3
    # holds more rollouts ahead than k = 1 or 2 and goes through the same restore code, and token- and
    # sequence-level weights read the same saved log-probs, so they were merged to save two variants' three runs
    # each, about 2 x 140 s of the suite; docs/testing.md.
    "async_k3": {
        "async_generation_ratio": 3.0,
        "partial_rollout_token": 2,
        "offpolicy_correction": {"is_level": "sequence", "rs_level": "geometric", "rs_upper": 1.5},
        "add_token_level_kl": True,
        "kl_ctrl": "adaptive",
        "init_kl_coef": 0.05,
        "target_kl": 0.001,
        "kl_horizon": 100,
        "dynamic_sampling": {"ledger": {"enabled": True, "retest_prob": 0.5}},
        "reward_audit": {"every_steps": 2},
    },
}


def config(tmp_path: Path, tiny_model: Path, variant: str = "sync") -> Path:
    cfg = yaml.safe_load((EXAMPLES / "grpo.yaml").read_text())
    rows = (EXAMPLES / "data" / "math_train.jsonl").read_text().splitlines()[:24]
    data = tmp_path / "math.jsonl"
    data.write_text("\n".join(rows) + "\n")
    cfg |= {
        "exp_name": "resume_test",
        "pretrain": str(tiny_model),
        "deterministic": True,
        "max_steps": STEPS,
        "eval_steps": 3,
        "save_steps": SAVE_STEPS,
        "rollout_batch_size": 4,
        "num_return_sequences_in_group": 4,
        "domain_interleave_probs": {"math": 1.0},
        "rewards": {"math": cfg["rewards"]["math"] | {"group_filters": {"std_filter": {}}}},
    }
    cfg["data"] |= {"train_files": [str(data)], "val_files": [str(data)]}
    cfg["validation"] = {**cfg.get("validation", {}), "max_prompts": 8}
    cfg["actor_infer"]["generating_args"]["max_new_tokens"] = 16
    cfg["actor_train"]["training_args"] |= {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 2}
    changes = dict(VARIANTS[variant])
    cfg["dynamic_sampling"] = {**cfg.get("dynamic_sampling", {}), **changes.pop("dynamic_sampling", {})}
    cfg |= changes
    path = tmp_path / "resume.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


RAY_AGENTS = {"ray::DashboardAgent", "ray::RuntimeEnvAgent"}


def roll_run(cfg: Path, out: Path, *extra: str, **popen) -> subprocess.Popen:
    argv = [
        sys.executable, "-m", "roll_pipeline.driver.cli", "run", str(cfg),
        f"output_dir={out}", f"tracking.tracking_uri=sqlite:///{out}.db", "tracking.experiment_name=resume", *extra,
    ]
    log = open(f"{out}.log", "ab")  # noqa: SIM115 (the child holds it)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # Ray's workers import this tree too
    return subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, **popen)


def ray_is_up(proc: subprocess.Popen, timeout_s: float = 600) -> None:
    """Wait until the run's Ray node is up: a worker of it runs (the raylet starts its workers once its agents have
    reported their ports, the step that fails when two nodes start at once on a busy machine)."""
    deadline = time.monotonic() + timeout_s
    while not any(
        name.startswith("ray::") and name not in RAY_AGENTS for name in map(process_name, descendants(proc))
    ):
        assert proc.poll() is None, "the run ended before its Ray node was up"
        assert time.monotonic() < deadline, "the run's Ray node was not up in time"
        time.sleep(0.2)


def descendants(proc: subprocess.Popen) -> list[psutil.Process]:
    with contextlib.suppress(psutil.NoSuchProcess):
        return psutil.Process(proc.pid).children(recursive=True)
    return []


def process_name(p: psutil.Process) -> str:
    with contextlib.suppress(psutil.Error):
        return p.name()
    return ""


def finish(proc: subprocess.Popen, out: Path, timeout_s: float = 600) -> None:
    assert proc.wait(timeout=timeout_s) == 0, Path(f"{out}.log").read_text()[-4000:]


def kill_tree(proc: subprocess.Popen) -> int:
    """SIGKILL the run and every process under it (Ray's GCS, raylet and workers included)."""
    parent = psutil.Process(proc.pid)
    tree = [parent, *parent.children(recursive=True)]
    for p in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    psutil.wait_procs(tree, timeout=30)
    return len(tree)


def histories(out: Path) -> dict[str, list[tuple[int, float]]]:
    client = MlflowClient(tracking_uri=f"sqlite:///{out}.db")
    (experiment,) = [e for e in client.search_experiments() if e.name == "resume"]
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1, [r.info.run_id for r in runs]
    keys = runs[0].data.metrics
    return {
        k: sorted((m.step, m.value) for m in client.get_metric_history(runs[0].info.run_id, k)) for k in keys
    } | {"__status__": [(0, runs[0].info.status)]}


def mismatch_report(
    a: dict[str, list[tuple[int, float]]], b: dict[str, list[tuple[int, float]]], keys: list[str], killed_after: int,
    resumed_at: int,
) -> str:
    """Where the two runs part, in full (pytest would cut a dict of histories to its first entries): the first
    step each key differs at, with both values, and whether that step came before the checkpoint the run resumed
    from (logged by the killed process: then two runs of the same config differ, before any resume) or after it."""
    lines = [f"{len(keys)} metrics differ; killed after the step-{killed_after} checkpoint, resumed at step {resumed_at}"]
    for key in keys:
        step, x, y = next((s, x, y) for (s, x), (_, y) in zip(a[key], b[key], strict=True) if x != y)
        when = "before the checkpoint resumed from" if step <= resumed_at else "after the checkpoint resumed from"
        lines.append(f"  {key}: first at step {step}, {when}: uninterrupted {x!r}, killed and resumed {y!r}")
    return "\n".join(lines)


def is_timing(key: str) -> bool:
    return key.startswith(TIMING) or key.endswith(TIMING_SUFFIXES)


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_killed_run_resumes_into_the_same_metrics_and_mlflow_run(variant, tmp_path, tiny_model, mlflow_db):
    cfg = config(tmp_path, tiny_model, variant)
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    for out in (straight, crashed):  # roll_run's stores, made new and empty
        mlflow_db(Path(f"{out}.db"))
    # The uninterrupted run and the one to kill go side by side (each is deterministic, whatever the timing), the
    # second started once the first one's Ray node is up: two nodes starting at once on a busy 2-core machine once
    # kept one's dashboard agent past the raylet's fixed 15 s (roll_pipeline/distributed/starting.py).
    uninterrupted = roll_run(cfg, straight)
    try:
        ray_is_up(uninterrupted)
        # The same run, killed (the whole process tree) soon after a checkpoint that is not the last one, chosen at
        # random. The moment follows the run's own progress, not the clock: a fixed 0-3 s after the first checkpoint
        # once came after the last one on a fast machine (6 steps in under 3 s), leaving nothing to resume. After
        # the step-4 checkpoint the last one is still two steps, a validation and a save away.
        rng = random.Random(os.getpid())
        kill_after = rng.choice(range(SAVE_STEPS, STEPS, SAVE_STEPS))
        proc = roll_run(cfg, crashed, start_new_session=True)
        deadline = time.monotonic() + 600
        while (latest := latest_checkpoint(checkpoint_root(crashed))) is None or json.loads(
            (latest / STATE_FILE).read_text()
        )["step"] < kill_after:
            assert proc.poll() is None, Path(f"{crashed}.log").read_text()[-4000:]
            assert time.monotonic() < deadline
            time.sleep(0.02)
        time.sleep(rng.uniform(0.0, 0.2))
        assert proc.poll() is None, "the run finished before it could be killed"
        killed = kill_tree(proc)
        assert killed > 3  # the driver, Ray's own processes and its workers
        checkpoint = latest_checkpoint(checkpoint_root(crashed))
        resumed_at = json.loads((checkpoint / STATE_FILE).read_text())["step"]
        assert resumed_at < STEPS

        finish(roll_run(cfg, crashed, "--resume"), crashed)
        finish(uninterrupted, straight)
    finally:
        if uninterrupted.poll() is None:  # a failure above: no run outlives the test
            kill_tree(uninterrupted)
    assert f"resuming resume_test from {checkpoint}" in Path(f"{crashed}.log").read_text()

    a, b = histories(straight), histories(crashed)
    assert b["__status__"] == [(0, "FINISHED")]
    compared = [k for k in a if k != "__status__" and not is_timing(k)]
    assert {"val_correct/all/mean", "actor/pg_loss", "actor/entropy", "actor/lr", "reward/math/score"} <= set(compared)
    if "kl_ctrl" in VARIANTS[variant]:
        assert "kl_penalty/coef" in compared
        coefs = [v for _, v in a["kl_penalty/coef"]]
        assert len(set(coefs)) == len(coefs), f"the adaptive coefficient moves every step: {coefs}"
    if variant != "sync":
        k = int(VARIANTS[variant]["async_generation_ratio"])
        oldest = [float(min(step - 1, k)) for step in range(1, STEPS + 1)]
        assert [v for _, v in a["offpolicy/staleness_max"]] == oldest
        # Step 1's rollout is launched for itself (one version); every later one was launched ahead and took the
        # next version at token 2 of each response that went on past it (partial_rollout_token).
        partial = [v for _, v in a["offpolicy/partial_frac"]]
        assert [v for _, v in a["offpolicy/staleness_min"]] == [0.0] + [x - 1 for x in oldest[1:]]
        assert partial[0] == 0.0 and all(0.0 < x <= 1.0 for x in partial[1:]), partial
        staleness = [v for _, v in a["offpolicy/staleness"]]
        assert all(x - 1 < s < x for x, s in zip(oldest[1:], staleness[1:], strict=True)), staleness
        assert [v for _, v in a["offpolicy/buffered_rollouts"]] == [float(min(k, STEPS - s)) for s in range(1, STEPS + 1)]
    assert any(k.startswith("scheduler/math/prompts_drawn") for k in compared)
    for key in a:
        if key == "__status__":
            continue
        steps_b = [s for s, _ in b[key]]
        assert len(steps_b) == len(set(steps_b)), f"{key}: a step logged twice: {steps_b}"
        assert steps_b == [s for s, _ in a[key]], key
    # Bitwise: every step, before the crash and after the resume, has the uninterrupted run's values.
    mismatched = [k for k in compared if a[k] != b[k]]
    if mismatched:
        # The batch tensors' digests tell which side parted first: the tokens (the rollout) or one worker's
        # log-probs on equal tokens (that worker's forward pass).
        tensors = first_difference(straight / DIGESTS_FILE, crashed / DIGESTS_FILE)
        pytest.fail(mismatch_report(a, b, mismatched, kill_after, resumed_at) + f"\nbatch digests: {tensors}")
    # And the batch tensors themselves (tokens, masks, every worker's log-probs), each step's last line.
    assert first_difference(straight / DIGESTS_FILE, crashed / DIGESTS_FILE) == (
        f"the batch tensors of every step are equal ({STEPS} steps)"
    )
    # Checkpoints kept: max_checkpoints_to_keep (2 by default) of the ones saved.
    kept = sorted(p.name for p in checkpoint_root(crashed).glob("step_*"))
    assert kept == [f"step_{STEPS - SAVE_STEPS}", f"step_{STEPS}"]


def test_resumed_tracker_logs_each_step_once_into_the_same_run(tmp_path, mlflow_db):
    """The tracker side alone: steps 1-4 spooled and sent, a crash, a resume that computes 3-6 again."""
    uri = mlflow_db(tmp_path / "mlflow.db")
    cfg = TrackingConfig(tracking_uri=uri, experiment_name="resume", retry_interval_s=0.1, flush_timeout_s=10)
    first = MlflowTracker(cfg, tmp_path / "spool")
    for step in range(1, 5):
        first.log_metrics({"loss": float(step)}, step)
    first.log_table({"a": [1, 2]}, "validation/samples_step_3.json")
    first.sender.close(10)  # the process dies here: no terminate entry
    run_id = first.run_id

    resumed = MlflowTracker(cfg, tmp_path / "spool", resume_spool=first.spool.path)
    assert resumed.run_id == run_id
    for step in range(3, 7):
        resumed.log_metrics({"loss": float(step) + 100 * (step > 4)}, step)
    resumed.log_table({"a": [1, 2]}, "validation/samples_step_3.json")
    resumed.finish("FINISHED")

    client = MlflowClient(tracking_uri=uri)
    history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, "loss"))
    assert history == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0), (5, 105.0), (6, 106.0)]
    assert client.get_run(run_id).info.status == "FINISHED"
    assert len(client.search_runs([client.get_experiment_by_name("resume").experiment_id])) == 1
    table = read_table(client, run_id, "validation/samples_step_3.json", tmp_path)
    assert table == {"a": [1, 2]}  # not appended twice


def same_rng_states(a: dict, b: dict) -> bool:
    """Two `workers.base.rng_states()` dicts hold the same Python, NumPy and torch states."""
    numpy_equal = all(
        np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y
        for x, y in zip(a["numpy"], b["numpy"], strict=True)
    )
    return a["python"] == b["python"] and numpy_equal and torch.equal(a["torch"], b["torch"])


def train_rng(worker) -> dict:
    """An actor_train rank's global RNG states (actor_infer has `rng_state` for checkpoints; actor_train does not)."""
    return ray.get(worker.__ray_call__.remote(lambda self: rng_states()))


@pytest.mark.slow
def test_resume_restores_every_rng_state(tmp_path, tiny_model, mlflow_db):
    """What unseeded sampling draws from (actor_infer's global RNGs), actor_train's and the driver's RNGs come back
    from a checkpoint as they were when it was saved, whatever the processes drew since."""
    overrides = [
        "deterministic=false", "max_steps=1", "save_steps=1", "eval_steps=0", "validation.eval_at_start=false",
        f"output_dir={tmp_path / 'run'}", f"tracking.tracking_uri={mlflow_db(tmp_path / 'mlflow.db')}",
    ]
    shared_ray()
    pipeline = RLVRPipeline(load_config(config(tmp_path, tiny_model), overrides))
    try:
        pipeline.setup()
        infer, train = pipeline.runtime.actor_infer.workers[0], pipeline.runtime.actor_train.workers[0]
        started = ray.get(infer.rng_state.remote())
        pipeline.run()  # one unseeded step, then its checkpoint
        checkpoint = latest_checkpoint(checkpoint_root(tmp_path / "run"))
        saved = {"infer": ray.get(infer.rng_state.remote()), "train": train_rng(train), "driver": rng_states()}
        assert not same_rng_states(saved["infer"], started), "sampling drew from actor_infer's RNG"
        # Every process draws on: the states move away from the saved ones.
        args = pipeline.cfg.actor_infer.generating_args
        pipeline.runtime.actor_infer.call("generate_request", "draw", [[1, 2, 3]], args, 2)
        ray.get(train.__ray_call__.remote(lambda self: __import__("torch").rand(3)))
        random.random()
        np.random.rand()
        torch.rand(1)
        moved = {"infer": ray.get(infer.rng_state.remote()), "train": train_rng(train), "driver": rng_states()}
        assert not any(same_rng_states(saved[k], moved[k]) for k in saved)

        pipeline.restore(checkpoint)
        restored = {"infer": ray.get(infer.rng_state.remote()), "train": train_rng(train), "driver": rng_states()}
        assert {k: same_rng_states(saved[k], restored[k]) for k in saved} == dict.fromkeys(saved, True)
    finally:
        pipeline.shutdown()

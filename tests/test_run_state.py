"""The run's checkpoint as RLVRPipeline writes and reads it (run_state.py), in this process: every piece of loop
state saved by `save_checkpoint` comes back from `restore` into a fresh driver, and what goes to the clusters goes
to the right one. The clusters and schedulers are stand-ins that record what they are asked (the slow tests/test_resume.py
resumes real runs bitwise); everything else (the KL controller, the reward moments, the mixer, the validation
outcomes, the RNGs, the checkpoint folder) is the real thing.

These are the fast tests that mutation testing runs on roll_pipeline/driver/run_state.py (mutation/targets.toml)."""

from __future__ import annotations

import json
import logging
import random
from types import SimpleNamespace

import numpy as np
import torch

from roll_core.algorithms.kl import AdaptiveKLController
from roll_core.algorithms.mixing import MixState
from roll_core.batch import Batch
from roll_pipeline.driver.checkpoint import STATE_FILE, checkpoint_root, latest_checkpoint
from roll_pipeline.driver.loop_state import PENDING_ROLLOUT_FILE, FirstValidation, LoopState, Rollout
from roll_pipeline.driver.pipeline import RLVRPipeline
from roll_pipeline.driver.run_state import RNG_FILE, warn_config_changes
from roll_pipeline.driver.runtime import ClusterRuntime
from roll_pipeline.driver.significance import PromptOutcome


class Trained:
    """actor_train or the critic: `call` records the method and writes a file where it is told to save."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def call(self, method, *args):
        self.calls.append((method, *args))
        if method == "save_checkpoint":
            folder = args[0]
            __import__("os").makedirs(folder)
            open(f"{folder}/engine.pt", "w").write(json.dumps(args[1]))  # noqa: SIM115


class Remote:
    """A method's `.remote(...)`: records the call and gives back its result as the 'reference'."""

    def __init__(self, log, name, result=None) -> None:
        self.log, self.name, self.result = log, name, result

    def remote(self, *args):
        self.log.append((self.name, *args))
        return self.result if self.result is not None else args


class Infer:
    """actor_infer: `world_size` workers, each with an RNG state of its own."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.log: list[tuple] = []
        self.workers = [SimpleNamespace(load_rng_state=Remote(self.log, f"load_rng_state[{i}]"))
                        for i in range(world_size)]

    def call(self, method):
        assert method == "rng_state"
        return [{"worker": i, "state": 100 + i} for i in range(self.world_size)]

    def wait(self, refs, name):
        self.log.append(("wait", name, len(refs)))
        return refs


class Runtime(ClusterRuntime):
    """The clusters and schedulers stood in for; waits record the calls waited for."""

    def __init__(self, cfg, critic, infer_world, events) -> None:
        super().__init__(cfg)
        self.events = events
        self.actor_train = Trained()
        self.critic = Trained() if critic else None
        self.actor_infer = Infer(infer_world)
        self.schedulers = {
            d: SimpleNamespace(load_state_dict=Remote(self.events, f"scheduler[{d}].load_state_dict"))
            for d in ("math", "code")
        }

    def on_schedulers(self, method):
        assert method == "state_dict"
        return [{"domain": d, "position": i + 3} for i, d in enumerate(self.schedulers)]

    def wait_for(self, refs, names):
        self.events.append(("wait_for", names))
        return refs


class Driver(RLVRPipeline):
    """RLVRPipeline with its runtime stood in for; settling an async rollout and syncing the weights recorded."""

    def __init__(self, output_dir, critic=True, tracker=True, infer_world=2, config=None):
        self.cfg = SimpleNamespace(output_dir=str(output_dir), max_checkpoints_to_keep=2)
        self.resolved = SimpleNamespace(to_dict=lambda: config or {"seed": 1, "lr": 0.1})
        self.events: list[tuple] = []
        self.runtime = Runtime(self.cfg, critic, infer_world, self.events)
        self.tracker = (
            SimpleNamespace(run_id="run-7", spool=SimpleNamespace(path=output_dir / "spool")) if tracker else None
        )
        self.loop = LoopState(kl_ctrl=AdaptiveKLController(kl_coef=0.1, target_kl=0.05, horizon=100))
        self.resumed_from = None
        self.weights = SimpleNamespace(ensure=lambda: self.events.append(("ensure_synced", self.loop.trained_version)))

    def _settle(self):
        self.events.append(("settle",))


def played(driver: Driver) -> Driver:
    """A driver some steps into a run: every piece of loop state away from its start."""
    loop = driver.loop
    loop.trained_version = 5
    loop.history = {1: {"loss": 0.5}, 4: {"loss": 0.25}}
    loop.val_outcomes = {"p1": PromptOutcome("add", 1, 2), "p2": PromptOutcome("list", 0, 1)}
    loop.first_val = FirstValidation(0, {"p1": PromptOutcome("add", 0, 2)})
    loop.mixer = MixState(rate={"math": 2.5}, accuracy={"math": 0.4, "code": 0.2}, gain={"code": 0.1})
    loop.reward_moments["math"].update(torch.tensor([1.0, 0.0, 0.5]))
    loop.kl_ctrl.update(0.2, 8)
    loop.pending_rollouts = [
        Rollout(version=4, batch=Batch({"scores": torch.tensor([1.0, 0.0])}, {"id": ["a", "b"]}),
                metrics={"rollout/x": 3.0}),
        Rollout(version=5, batch=Batch({"scores": torch.tensor([0.5])}, {"id": ["c"]}), metrics={"rollout/x": 1.0}),
    ]
    return driver


def state_of(driver: Driver) -> dict:
    loop = driver.loop
    return {
        "trained_version": loop.trained_version,
        "global_step": loop.step,
        "history": loop.history,
        "val_outcomes": loop.val_outcomes,
        "first_val": (loop.first_val.step, loop.first_val.outcomes) if loop.first_val else (None, None),
        "mixer": loop.mixer.state_dict(),
        "moments": loop.reward_moments.state_dict(),
        "kl": loop.kl_ctrl.state_dict(),
    }


def draws():
    return random.random(), float(np.random.rand()), torch.rand(2).tolist()


def test_a_restored_driver_has_every_piece_of_state_the_saved_one_had(tmp_path):
    saved = played(Driver(tmp_path))
    random.seed(3), np.random.seed(3), torch.manual_seed(3)
    path = saved.save_checkpoint(7)
    after_save = draws()
    assert path == checkpoint_root(str(tmp_path)) / "step_7" == latest_checkpoint(checkpoint_root(str(tmp_path)))
    assert saved.events[0] == ("settle",)  # the pending rollout is settled before anything is written
    # written into the folder that becomes the checkpoint once complete (checkpoint.py: step_7.tmp, renamed)
    staged = path.with_name("step_7.tmp")
    assert saved.runtime.actor_train.calls == [("save_checkpoint", str(staged / "actor_train"), {"step": 7})]
    assert saved.runtime.critic.calls == [("save_checkpoint", str(staged / "critic"), {"step": 7})]
    assert json.loads((path / "actor_train" / "engine.pt").read_text()) == {"step": 7}

    fresh = Driver(tmp_path)
    state = fresh.restore(path)
    assert draws() == after_save  # the driver's RNGs continue where the saved run's were
    assert state["step"] == 7 and fresh.loop.step == 7 and fresh.resumed_from == path
    expected = {**state_of(saved), "global_step": 7}
    assert state_of(fresh) == expected
    assert isinstance(next(iter(fresh.loop.history)), int)
    first, second = fresh.loop.pending_rollouts
    assert first.version == 4 and first.metrics == {"rollout/x": 3.0} and first.refs is None
    assert first.batch["scores"].tolist() == [1.0, 0.0] and first.batch.meta["id"] == ["a", "b"]
    assert second.version == 5 and second.batch["scores"].tolist() == [0.5] and second.batch.meta["id"] == ["c"]
    # The clusters: weights first, then the synced version; schedulers, then each actor_infer worker's RNG.
    assert fresh.runtime.actor_train.calls == [("load_checkpoint", str(path / "actor_train"))]
    assert fresh.runtime.critic.calls == [("load_checkpoint", str(path / "critic"))]
    assert fresh.events == [
        ("ensure_synced", 5),
        ("scheduler[math].load_state_dict", {"domain": "math", "position": 3}),
        ("scheduler[code].load_state_dict", {"domain": "code", "position": 4}),
        ("wait_for", ["scheduler[math].load_state_dict", "scheduler[code].load_state_dict"]),
    ]
    assert fresh.runtime.actor_infer.log == [
        ("load_rng_state[0]", {"worker": 0, "state": 100}),
        ("load_rng_state[1]", {"worker": 1, "state": 101}),
        ("wait", "load_rng_state", 2),
    ]
    assert state["mlflow_run_id"] == "run-7" and state["mlflow_spool"] == str((tmp_path / "spool").resolve())
    assert state["config"] == {"seed": 1, "lr": 0.1}
    assert torch.load(path / RNG_FILE, weights_only=False)["actor_infer"][1] == {"worker": 1, "state": 101}


def test_the_state_file_is_plain_json_with_string_keys(tmp_path):
    path = played(Driver(tmp_path)).save_checkpoint(2)
    state = json.loads((path / STATE_FILE).read_text())
    assert state["history"] == {"1": {"loss": 0.5}, "4": {"loss": 0.25}}
    assert state["val_outcomes"] == {"prompt": ["p1", "p2"], "tag": ["add", "list"], "correct": [1, 0], "scored": [2, 1]}
    assert state["first_val"] == {"step": 0, "outcomes": {"prompt": ["p1"], "tag": ["add"], "correct": [0], "scored": [2]}}
    assert state["schedulers"] == {"math": {"domain": "math", "position": 3}, "code": {"domain": "code", "position": 4}}
    assert state["trained_version"] == 5 and state["step"] == 2


def test_a_run_without_critic_tracker_pending_rollout_or_outcomes(tmp_path):
    saved = Driver(tmp_path, critic=False, tracker=False)
    path = saved.save_checkpoint(1)
    assert not (path / PENDING_ROLLOUT_FILE).exists() and not (path / "critic").exists()
    fresh = Driver(tmp_path, critic=False, tracker=False)
    fresh.loop.pending_rollouts = [Rollout(version=1)]
    state = fresh.restore(path)
    assert fresh.loop.pending_rollouts == [] and fresh.loop.val_outcomes is None and fresh.loop.first_val is None
    assert state["mlflow_run_id"] is None and state["mlflow_spool"] is None


def test_a_checkpoint_from_before_the_mixer_and_outcomes_were_kept_still_restores(tmp_path):
    path = played(Driver(tmp_path)).save_checkpoint(3)
    state = json.loads((path / STATE_FILE).read_text())
    del state["mixer"], state["val_outcomes"], state["first_val"]
    (path / STATE_FILE).write_text(json.dumps(state))
    fresh = Driver(tmp_path)
    fresh.loop.mixer = MixState(rate={"code": 9.0})
    fresh.restore(path)
    assert fresh.loop.mixer.state_dict()["rate"] == {"code": 9.0} and fresh.loop.val_outcomes is None
    assert fresh.loop.first_val is None  # the run's end then has no first validation to pair with


def test_actor_infer_of_another_size_starts_with_fresh_rngs(tmp_path):
    path = Driver(tmp_path).save_checkpoint(1)
    for world in (3, 1):  # more workers than the checkpoint has states for, and fewer
        fresh = Driver(tmp_path, infer_world=world)
        fresh.restore(path)
        assert fresh.runtime.actor_infer.log == [], world


def test_only_the_newest_checkpoints_are_kept(tmp_path):
    driver = Driver(tmp_path)
    for step in (1, 2, 3):
        driver.save_checkpoint(step)
    assert sorted(p.name for p in checkpoint_root(str(tmp_path)).glob("step_*")) == ["step_2", "step_3"]


def test_a_resumed_config_that_differs_is_named_in_a_warning(tmp_path, caplog):
    saved = {"seed": 1, "lr": 0.1, **{f"k{i:02d}": i for i in range(25)}}
    with caplog.at_level(logging.WARNING, logger="roll_pipeline.driver.run_state"):
        warn_config_changes(saved, saved)
        assert caplog.records == []
        changed = {**saved, "lr": 0.2, **{f"k{i:02d}": -1 for i in range(25)}}
        warn_config_changes(saved, changed)
    (record,) = caplog.records
    named = record.getMessage().split(": ", 1)[1].split(", ")
    assert record.getMessage().startswith("resuming with a config that differs from the checkpoint's in: ")
    assert named == [f"k{i:02d}" for i in range(20)]  # the first 20 of the 26 changes, sorted


def test_scheduler_states_are_keyed_by_domain(tmp_path):
    assert Driver(tmp_path).runtime.scheduler_states() == {
        "math": {"domain": "math", "position": 3}, "code": {"domain": "code", "position": 4}
    }

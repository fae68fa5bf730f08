"""The loop's state is saved and restored whole: every field of LoopState comes back from a checkpoint as it was,
and a field added without a way into the checkpoint, or not exercised here, fails this file."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from roll_core.algorithms.kl import AdaptiveKLController
from roll_core.algorithms.mixing import MixState
from roll_core.algorithms.shaping import DomainRewardMoments
from roll_core.batch import Batch
from roll_pipeline.driver.loop_state import (
    CODECS,
    PENDING_ROLLOUT_FILE,
    FirstValidation,
    LoopState,
    Rollout,
    pending_rollout_file,
)
from roll_pipeline.driver.significance import PromptOutcome


def kl_controller() -> AdaptiveKLController:
    return AdaptiveKLController(kl_coef=0.1, target_kl=0.05, horizon=100)


def moments() -> DomainRewardMoments:
    m = DomainRewardMoments()
    m["math"].update(torch.tensor([1.0, 0.0, 0.5]))
    return m


def moved_kl() -> AdaptiveKLController:
    c = kl_controller()
    c.update(0.2, 8)
    return c


#: A value away from the default for every field: a new field must be given one here.
PLAYED = {
    "kl_ctrl": moved_kl,
    "step": lambda: 7,
    "trained_version": lambda: 5,
    "history": lambda: {1: {"loss": 0.5}, 4: {"loss": 0.25}},
    "val_outcomes": lambda: {"p1": PromptOutcome("add", 1, 2), "p2": PromptOutcome("list", 0, 1)},
    "first_val": lambda: FirstValidation(0, {"p1": PromptOutcome("add", 0, 2)}),
    "mixer": lambda: MixState(rate={"math": 2.5}, accuracy={"math": 0.4, "code": 0.2}, gain={"code": 0.1}),
    "reward_moments": moments,
    "pending_rollouts": lambda: [
        Rollout(version=4, batch=Batch({"scores": torch.tensor([1.0, 0.0])}, {"id": ["a", "b"]}),
                metrics={"rollout/x": 3.0}),
        Rollout(version=5, batch=Batch({"scores": torch.tensor([0.5])}, {"id": ["c"]}), metrics={"rollout/x": 1.0}),
    ],
}


def comparable(name: str, value):
    """A field's value in a form == compares (objects by their state)."""
    if name in ("kl_ctrl", "mixer", "reward_moments"):
        return value.state_dict()
    if name == "pending_rollouts":
        return [(r.version, r.refs, r.batch.tensors["scores"].tolist(), r.batch.meta, r.metrics) for r in value]
    return value


def played() -> LoopState:
    return LoopState(**{name: make() for name, make in PLAYED.items()})


def test_every_field_has_a_codec_and_a_played_value():
    names = [f.name for f in dataclasses.fields(LoopState)]
    assert sorted(CODECS) == sorted(names) == sorted(PLAYED)


def test_every_field_played_differs_from_a_fresh_loop():
    fresh, loop = LoopState(kl_ctrl=kl_controller()), played()
    same = [f.name for f in dataclasses.fields(LoopState)
            if comparable(f.name, getattr(fresh, f.name)) == comparable(f.name, getattr(loop, f.name))]
    assert same == []


def test_every_field_round_trips_through_a_checkpoint(tmp_path):
    saved = played()
    state = json.loads(json.dumps(saved.checkpoint(tmp_path)))  # the state file is plain JSON
    restored = LoopState(kl_ctrl=kl_controller())
    restored.load_checkpoint(state, tmp_path)
    for f in dataclasses.fields(LoopState):
        assert comparable(f.name, getattr(restored, f.name)) == comparable(f.name, getattr(saved, f.name)), f.name
    assert isinstance(next(iter(restored.history)), int)


def test_without_pending_rollouts_no_file_is_written_and_none_come_back(tmp_path):
    loop = played()
    loop.pending_rollouts = []
    state = loop.checkpoint(tmp_path)
    assert not any(tmp_path.iterdir())
    restored = LoopState(kl_ctrl=kl_controller(), pending_rollouts=PLAYED["pending_rollouts"]())
    restored.load_checkpoint(state, tmp_path)
    assert restored.pending_rollouts == []


def test_pending_rollouts_come_back_in_their_order_each_from_its_file(tmp_path):
    state = played().checkpoint(tmp_path)
    assert state["pending_rollouts"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == [PENDING_ROLLOUT_FILE, pending_rollout_file(1)]
    restored = LoopState(kl_ctrl=kl_controller())
    restored.load_checkpoint(state, tmp_path)
    assert [r.version for r in restored.pending_rollouts] == [4, 5]


def test_a_fresh_loop_starts_before_step_one_with_nothing_trained():
    """The run's loop begins at step 1 (step + 1), and actor_infer's weights (version 0) need no sync before it."""
    fresh = LoopState(kl_ctrl=kl_controller())
    assert (fresh.step, fresh.trained_version, fresh.history) == (0, 0, {})
    assert fresh.val_outcomes is None and fresh.first_val is None and fresh.pending_rollouts == []


def test_checkpoints_of_one_step_ahead_runs_load_their_one_pending_rollout(tmp_path):
    """Before rollouts went several steps ahead, the state file said `pending_rollout: true` (or false), and
    before the loop state, nothing: the file alone said."""
    loop = played()
    loop.pending_rollouts = loop.pending_rollouts[:1]
    state = loop.checkpoint(tmp_path)
    expected = comparable("pending_rollouts", loop.pending_rollouts)
    del state["pending_rollouts"]
    for old in ({"pending_rollout": True}, {}):
        restored = LoopState(kl_ctrl=kl_controller())
        restored.load_checkpoint({**state, **old}, tmp_path)
        assert comparable("pending_rollouts", restored.pending_rollouts) == expected, old
    (tmp_path / PENDING_ROLLOUT_FILE).unlink()
    restored = LoopState(kl_ctrl=kl_controller())
    restored.load_checkpoint({**state, "pending_rollout": False}, tmp_path)
    assert restored.pending_rollouts == []


def test_a_pending_rollout_whose_file_is_missing_is_an_error(tmp_path):
    state = played().checkpoint(tmp_path)
    (tmp_path / pending_rollout_file(1)).unlink()
    with pytest.raises(FileNotFoundError, match=r"pending_rollout_1\.pt: the checkpoint's state names 2 pending rollout\(s\)"):
        LoopState(kl_ctrl=kl_controller()).load_checkpoint(state, tmp_path)


def test_a_launched_rollout_is_refused(tmp_path):
    loop = LoopState(kl_ctrl=kl_controller(), pending_rollouts=[Rollout(version=1, refs={"math": object()})])
    with pytest.raises(ValueError, match="collected before a checkpoint"):
        loop.checkpoint(tmp_path)

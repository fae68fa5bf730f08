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
from roll_pipeline.driver.loop_state import CODECS, PENDING_ROLLOUT_FILE, FirstValidation, LoopState, Rollout
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
    "pending_rollout": lambda: Rollout(
        version=4, batch=Batch({"scores": torch.tensor([1.0, 0.0])}, {"id": ["a", "b"]}), metrics={"rollout/x": 3.0}
    ),
}


def comparable(name: str, value):
    """A field's value in a form == compares (objects by their state)."""
    if name in ("kl_ctrl", "mixer", "reward_moments"):
        return value.state_dict()
    if name == "pending_rollout" and value is not None:
        return (value.version, value.refs, value.batch.tensors["scores"].tolist(), value.batch.meta, value.metrics)
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


def test_without_a_pending_rollout_no_file_is_written_and_none_comes_back(tmp_path):
    loop = played()
    loop.pending_rollout = None
    state = loop.checkpoint(tmp_path)
    assert not (tmp_path / PENDING_ROLLOUT_FILE).exists()
    restored = LoopState(kl_ctrl=kl_controller(), pending_rollout=PLAYED["pending_rollout"]())
    restored.load_checkpoint(state, tmp_path)
    assert restored.pending_rollout is None


def test_a_fresh_loop_starts_before_step_one_with_nothing_trained():
    """The run's loop begins at step 1 (step + 1), and actor_infer's weights (version 0) need no sync before it."""
    fresh = LoopState(kl_ctrl=kl_controller())
    assert (fresh.step, fresh.trained_version, fresh.history) == (0, 0, {})
    assert fresh.val_outcomes is None and fresh.first_val is None and fresh.pending_rollout is None


def test_a_checkpoint_from_before_the_loop_state_finds_its_pending_rollout_by_its_file(tmp_path):
    state = played().checkpoint(tmp_path)
    del state["pending_rollout"]  # older state files have no key for it: the file alone says
    restored = LoopState(kl_ctrl=kl_controller())
    restored.load_checkpoint(state, tmp_path)
    assert comparable("pending_rollout", restored.pending_rollout) == comparable("pending_rollout", played().pending_rollout)
    (tmp_path / PENDING_ROLLOUT_FILE).unlink()
    restored = LoopState(kl_ctrl=kl_controller())
    restored.load_checkpoint(state, tmp_path)
    assert restored.pending_rollout is None


def test_a_pending_rollout_whose_file_is_missing_is_an_error(tmp_path):
    state = played().checkpoint(tmp_path)
    (tmp_path / PENDING_ROLLOUT_FILE).unlink()
    with pytest.raises(FileNotFoundError, match="names a pending rollout"):
        LoopState(kl_ctrl=kl_controller()).load_checkpoint(state, tmp_path)


def test_a_launched_rollout_is_refused(tmp_path):
    loop = LoopState(kl_ctrl=kl_controller(), pending_rollout=Rollout(version=1, refs={"math": object()}))
    with pytest.raises(ValueError, match="collected before a checkpoint"):
        loop.checkpoint(tmp_path)

"""Checkpoint folders on disk: atomic saves, the latest valid one found after a crash, pruning."""

from __future__ import annotations

import json
import logging
import shutil

import pytest

from roll_pipeline.driver import checkpoint as checkpoint_module
from roll_pipeline.driver.checkpoint import (
    LATEST,
    STATE_FILE,
    CheckpointError,
    checkpoint_root,
    config_changes,
    latest_checkpoint,
    prune,
    read_state,
    write_checkpoint,
)


def save(root, step, keep=3, fail=False):
    def parts(folder):
        (folder / "actor_train").mkdir()
        (folder / "actor_train" / "weights.bin").write_bytes(b"w" * step)
        if fail:
            raise RuntimeError("disk full")

    return write_checkpoint(root, step, parts, {"step": step}, keep)


def test_a_save_writes_the_state_last_and_points_latest_at_it(tmp_path):
    path = save(tmp_path, 2)
    assert path == tmp_path / "step_2"
    assert json.loads((path / STATE_FILE).read_text()) == {"step": 2}
    assert (tmp_path / LATEST).read_text() == "step_2"
    assert latest_checkpoint(tmp_path) == path
    assert not list(tmp_path.glob("*.tmp"))


def test_a_save_that_fails_half_way_leaves_the_previous_checkpoint_as_latest(tmp_path):
    save(tmp_path, 2)
    with pytest.raises(RuntimeError, match="disk full"):
        save(tmp_path, 4, fail=True)
    assert (tmp_path / "step_4.tmp").is_dir()  # what a crash during the save leaves
    assert not (tmp_path / "step_4").exists()
    assert latest_checkpoint(tmp_path) == tmp_path / "step_2"
    save(tmp_path, 4)
    assert not (tmp_path / "step_4.tmp").exists()
    assert latest_checkpoint(tmp_path) == tmp_path / "step_4"


def test_a_pointer_to_a_missing_or_incomplete_folder_falls_back_to_the_newest_complete_one(tmp_path):
    save(tmp_path, 2)
    save(tmp_path, 4)
    (tmp_path / "step_4" / STATE_FILE).unlink()  # incomplete
    assert latest_checkpoint(tmp_path) == tmp_path / "step_2"
    (tmp_path / LATEST).write_text("step_9")
    assert latest_checkpoint(tmp_path) == tmp_path / "step_2"
    (tmp_path / LATEST).write_text("../../etc")
    assert latest_checkpoint(tmp_path) == tmp_path / "step_2"
    (tmp_path / LATEST).unlink()
    assert latest_checkpoint(tmp_path) == tmp_path / "step_2"


def test_no_checkpoint_is_none(tmp_path):
    assert latest_checkpoint(tmp_path / "nothing") is None
    (tmp_path / "step_3.tmp").mkdir()
    assert latest_checkpoint(tmp_path) is None


def test_only_the_newest_are_kept(tmp_path):
    for step in (2, 4, 6, 8, 10):
        save(tmp_path, step, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [LATEST, "step_10", "step_8"]
    prune(tmp_path, 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == [LATEST, "step_10"]


def test_saving_a_step_again_replaces_it(tmp_path):
    save(tmp_path, 2)
    (tmp_path / "step_2" / "stale").write_text("x")
    save(tmp_path, 2)
    assert not (tmp_path / "step_2" / "stale").exists()


def test_config_changes_name_the_key_paths():
    saved = {"max_steps": 10, "data": {"prompt_length": 64, "files": ["a"]}, "seed": 1}
    current = {"max_steps": 20, "data": {"prompt_length": 64, "files": ["a", "b"]}, "new": True, "seed": 1}
    assert config_changes(saved, current) == ["data.files", "max_steps", "new"]


def test_config_changes_compare_values_not_identity_and_name_a_section_that_became_a_value():
    # Equal values read from two files are different objects: only a different value is a change.
    saved = {"tags": ["math", "code"], "lr": 1e-4, "name": "".join(["run", "_a"]), "reward": {"math": {"w": 1}}}
    current = json.loads(json.dumps(saved))
    assert config_changes(saved, current) == []
    # A section replaced by a plain value (or the other way round) is one change at the section's path.
    assert config_changes(saved, {**current, "reward": None}) == ["reward"]
    assert config_changes({**saved, "reward": 3}, current) == ["reward"]


def test_the_checkpoint_root_is_the_checkpoints_folder_of_the_output_dir(tmp_path):
    assert checkpoint_root(str(tmp_path)) == tmp_path / "checkpoints"
    assert checkpoint_root(tmp_path / "run") == tmp_path / "run" / "checkpoints"


def test_the_first_save_creates_the_output_dir_and_its_checkpoints_folder(tmp_path):
    root = checkpoint_root(tmp_path / "new" / "run")
    assert save(root, 2) == root / "step_2"
    assert read_state(latest_checkpoint(root)) == {"step": 2}


def test_read_state_names_the_file_it_cannot_read(tmp_path):
    path = save(tmp_path, 2)
    assert read_state(path) == {"step": 2}
    (path / STATE_FILE).write_text("{not json")
    with pytest.raises(CheckpointError, match=rf"{path / STATE_FILE}: cannot read the checkpoint's state"):
        read_state(path)
    (path / STATE_FILE).unlink()
    with pytest.raises(CheckpointError, match=rf"{path / STATE_FILE}: cannot read the checkpoint's state"):
        read_state(path)


def test_the_next_save_removes_what_a_crashed_save_left(tmp_path):
    save(tmp_path, 2)
    with pytest.raises(RuntimeError):
        save(tmp_path, 4, fail=True)
    save(tmp_path, 6)
    assert sorted(p.name for p in tmp_path.iterdir()) == [LATEST, "step_2", "step_6"]


def test_pruning_survives_a_folder_that_something_else_deleted_first(tmp_path, monkeypatch):
    """Two processes pruning one output dir (or a user's rm) must not fail the save that prunes."""
    for step in (2, 4):
        save(tmp_path, step)
    (tmp_path / "step_5.tmp").mkdir()
    real_rmtree = shutil.rmtree

    def deleted_first(path, **kwargs):
        real_rmtree(path)
        real_rmtree(path, **kwargs)

    monkeypatch.setattr(checkpoint_module.shutil, "rmtree", deleted_first)
    prune(tmp_path, 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == [LATEST, "step_4"]


def test_the_newest_complete_checkpoint_without_a_pointer(tmp_path):
    for step in (2, 10, 4):
        save(tmp_path, step)
    (tmp_path / LATEST).unlink()
    assert latest_checkpoint(tmp_path) == tmp_path / "step_10"  # by step number, not by name or save order


def test_latest_names_the_checkpoint_to_resume_even_when_newer_ones_exist(tmp_path):
    """A user rolls a run back by pointing `latest` at an older checkpoint."""
    for step in (2, 4, 6):
        save(tmp_path, step)
    (tmp_path / LATEST).write_text("step_4\n")
    assert latest_checkpoint(tmp_path) == tmp_path / "step_4"


def test_a_pointer_outside_the_checkpoints_is_never_followed(tmp_path):
    root = tmp_path / "checkpoints"
    save(root, 2)
    save(root, 4)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / STATE_FILE).write_text("{}")
    (root / LATEST).write_text("../elsewhere")
    assert latest_checkpoint(root) == root / "step_4"


def test_a_broken_pointer_is_reported_with_the_checkpoint_used_instead(tmp_path, caplog):
    for step in (2, 4):
        save(tmp_path, step)
    (tmp_path / LATEST).write_text("step_9")
    with caplog.at_level(logging.WARNING, logger=checkpoint_module.__name__):
        assert latest_checkpoint(tmp_path) == tmp_path / "step_4"
    assert caplog.messages == [
        f"{tmp_path / LATEST} names step_9, which is not a complete checkpoint; using {tmp_path / 'step_4'}"
    ]
    caplog.clear()
    shutil.rmtree(tmp_path / "step_2")
    shutil.rmtree(tmp_path / "step_4")
    with caplog.at_level(logging.WARNING, logger=checkpoint_module.__name__):
        assert latest_checkpoint(tmp_path) is None
    assert caplog.messages == []  # nothing to fall back to: the caller says there is no checkpoint

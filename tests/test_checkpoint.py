"""Checkpoint folders on disk: atomic saves, the latest valid one found after a crash, pruning."""

from __future__ import annotations

import json

import pytest

from roll_pipeline.checkpoint import (
    LATEST,
    STATE_FILE,
    config_changes,
    latest_checkpoint,
    prune,
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

"""Run checkpoints on disk: written atomically, found again after a crash, pruned to the newest few.

A checkpoint is a folder `<output_dir>/checkpoints/step_<N>/`: the workers' parts (`actor_train/`, `critic/`:
DeepSpeed's files and RNG states), the driver's RNG states, and `pipeline_state.json`, written last. Everything is
written into `step_<N>.tmp/` first and the folder is renamed when complete, so a crash during a save leaves a
`.tmp` folder that is never taken for a checkpoint; then the `latest` file is replaced (atomically) by the
folder's name. A folder counts as a checkpoint only when its state file is there.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

STATE_FILE = "pipeline_state.json"
LATEST = "latest"
_STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointError(RuntimeError):
    """No checkpoint to resume from, or one that cannot be used."""


def checkpoint_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_checkpoint(
    root: Path, step: int, write_parts: Callable[[Path], None], state: dict[str, Any], keep: int
) -> Path:
    """Write `step_<step>`: `write_parts(folder)` writes the workers' files, then the state file marks the folder
    complete; the folder is renamed into place, `latest` is pointed at it, and all but the newest `keep`
    checkpoints are deleted. Returns the checkpoint folder."""
    root.mkdir(parents=True, exist_ok=True)
    final, tmp = root / f"step_{step}", root / f"step_{step}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    write_parts(tmp)
    _write_atomic(tmp / STATE_FILE, json.dumps(state, indent=1))
    if final.exists():  # the same step saved again (a resumed run passing a step it had saved)
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(root)
    _write_atomic(root / LATEST, final.name)
    prune(root, keep)
    return final


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every complete checkpoint under `root`, oldest first."""
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = _STEP_DIR.match(path.name)
        if match and path.is_dir() and (path / STATE_FILE).is_file():
            found.append((int(match.group(1)), path))
    return sorted(found)


def prune(root: Path, keep: int) -> None:
    """Delete all but the newest `keep` complete checkpoints, and folders of saves that never completed."""
    for _, path in complete_checkpoints(root)[:-keep]:
        shutil.rmtree(path, ignore_errors=True)
    for path in root.glob("step_*.tmp"):
        shutil.rmtree(path, ignore_errors=True)


def latest_checkpoint(root: Path) -> Path | None:
    """The folder `latest` names if it is complete; else the newest complete one (a crash between the rename and
    the pointer, or a pointer to a deleted folder); None when there is none."""
    complete = complete_checkpoints(root)
    pointer = root / LATEST
    if pointer.is_file():
        name = pointer.read_text().strip()
        named = root / name
        if _STEP_DIR.match(name) and (named / STATE_FILE).is_file():
            return named
        if complete:
            logger.warning(
                "%s names %s, which is not a complete checkpoint; using %s", pointer, named.name, complete[-1][1]
            )
    return complete[-1][1] if complete else None


def read_state(checkpoint: Path) -> dict[str, Any]:
    try:
        return json.loads((checkpoint / STATE_FILE).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{checkpoint / STATE_FILE}: cannot read the checkpoint's state: {exc}") from exc


def config_changes(saved: dict[str, Any], current: dict[str, Any], prefix: str = "") -> list[str]:
    """Key paths whose values differ between two resolved configs (nested dicts), sorted."""
    changed = []
    for key in sorted(set(saved) | set(current)):
        a, b = saved.get(key), current.get(key)
        path = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(a, dict) and isinstance(b, dict):
            changed += config_changes(a, b, path)
        elif a != b:
            changed.append(path)
    return changed

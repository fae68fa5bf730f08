"""The tracking spool: everything a run sends to MLflow, written to local disk first, in order.

A spool is one folder per run, `<output_dir>/mlflow_spool/<spool_id>/`:

- `meta.json`: the spool id, the tracking URI, the experiment and run names (written once);
- `entries.jsonl`: one JSON entry per line, numbered 0, 1, 2, ... in the order they were logged; each entry is
  one MLflow call (`create_run`, `batch` for metrics/params/tags, `artifact`, `table`, `terminate`);
- `files/<id>/`: the file an `artifact` entry uploads;
- `state.json`: the MLflow run id once the run exists, and `acked`: the highest entry id MLflow has
  acknowledged (entries are sent strictly in order, so every entry up to `acked` is stored and none after it
  is known to be);
- `rejected.jsonl`: entries the store refused as invalid (kept with the error, then skipped).

Entries carry everything their call needs, timestamps included, so sending one again sends exactly the same
data; the sender (mlflow_tracker.py) makes the one entry whose outcome is unknown idempotent.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
import uuid
from pathlib import Path
from typing import Any

SPOOL_DIRNAME = "mlflow_spool"


def _write_json_atomic(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, path)


class Spool:
    """An append-only, numbered log of tracking calls plus what has been acknowledged; safe to share between
    the thread that appends (the training loop) and the thread that sends."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.meta = json.loads((self.path / "meta.json").read_text())
        state_file = self.path / "state.json"
        state = json.loads(state_file.read_text()) if state_file.exists() else {}
        self._run_id: str | None = state.get("run_id")
        self._acked: int = state.get("acked", -1)
        self._lock = threading.Lock()
        self._offsets: dict[int, tuple[int, int]] = {}
        self._next_id = 0
        self._scan()

    @classmethod
    def create(cls, root: Path, tracking_uri: str, experiment_name: str, run_name: str | None) -> Spool:
        spool_id = f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}"
        path = Path(root) / spool_id
        path.mkdir(parents=True)
        meta = {
            "spool_id": spool_id,
            "tracking_uri": tracking_uri,
            "experiment_name": experiment_name,
            "run_name": run_name,
        }
        _write_json_atomic(path / "meta.json", meta)
        (path / "entries.jsonl").touch()
        return cls(path)

    @staticmethod
    def find(path: str | Path) -> list[Path]:
        """Spool folders at `path`: a spool, a folder of spools, or a run's output_dir; oldest first."""
        path = Path(path)
        if (path / "meta.json").exists() and (path / "entries.jsonl").exists():
            return [path]
        for root in (path / SPOOL_DIRNAME, path):
            found = sorted(
                p.parent for p in root.glob("*/meta.json") if (p.parent / "entries.jsonl").exists()
            )
            if found:
                return found
        return []

    def _scan(self) -> None:
        """Index the entries on disk; a last line cut short by a crash is dropped (never acknowledged)."""
        entries = self.path / "entries.jsonl"
        with entries.open("rb") as f:
            offset = 0
            for line in f:
                if not line.endswith(b"\n"):
                    break
                entry = json.loads(line)
                self._offsets[entry["id"]] = (offset, len(line))
                self._next_id = entry["id"] + 1
                offset += len(line)
        if offset != entries.stat().st_size:
            with entries.open("r+b") as f:
                f.truncate(offset)

    # ------------------------------------------------------------------------------------------- appending

    def append(self, kind: str, payload: dict[str, Any], files: dict[str, bytes] | None = None) -> int:
        """Write one entry (and the files it uploads) durably; returns its id."""
        with self._lock:
            entry_id = self._next_id
            if files:
                folder = self.path / "files" / str(entry_id)
                shutil.rmtree(folder, ignore_errors=True)
                folder.mkdir(parents=True)
                for name, data in files.items():
                    (folder / name).write_bytes(data)
            line = (json.dumps({"id": entry_id, "kind": kind, **payload}) + "\n").encode()
            with (self.path / "entries.jsonl").open("ab") as f:
                offset = f.tell()
                f.write(line)
                f.flush()
                os.fsync(f.fileno())
            self._offsets[entry_id] = (offset, len(line))
            self._next_id = entry_id + 1
            return entry_id

    def entries(self) -> list[dict[str, Any]]:
        """Every complete entry on disk, in order."""
        with (self.path / "entries.jsonl").open("rb") as f:
            return [json.loads(line) for line in f if line.endswith(b"\n")]

    # ------------------------------------------------------------------------------------------- sending

    def next_unacked(self) -> dict[str, Any] | None:
        with self._lock:
            entry_id = self._acked + 1
            if entry_id not in self._offsets:
                return None
            offset, length = self._offsets[entry_id]
        with (self.path / "entries.jsonl").open("rb") as f:
            f.seek(offset)
            return json.loads(f.read(length))

    def files_of(self, entry_id: int) -> Path:
        return self.path / "files" / str(entry_id)

    def ack(self, entry_id: int, run_id: str | None = None) -> None:
        with self._lock:
            if entry_id != self._acked + 1:
                raise ValueError(
                    f"entry {entry_id} acknowledged out of order (last acknowledged: {self._acked})"
                )
            self._acked = entry_id
            if run_id is not None:
                self._run_id = run_id
            _write_json_atomic(self.path / "state.json", {"run_id": self._run_id, "acked": self._acked})

    def reject(self, entry: dict[str, Any], error: str) -> None:
        """Keep an entry the store refused, with the reason, and move past it."""
        with (self.path / "rejected.jsonl").open("a") as f:
            f.write(json.dumps({"entry": entry, "error": error}) + "\n")
        self.ack(entry["id"])

    @property
    def run_id(self) -> str | None:
        with self._lock:
            return self._run_id

    @property
    def acked(self) -> int:
        with self._lock:
            return self._acked

    def pending(self) -> int:
        """Entries not yet acknowledged."""
        with self._lock:
            return self._next_id - 1 - self._acked

"""MLflow tracking for a run that never waits on the network and loses nothing when the server is away.

Every call (run creation, a step's metrics, params, tags, artifacts, tables, the final status) is first
written to the run's spool (spool.py, under `<output_dir>/mlflow_spool/`); a sender thread sends the entries
to MLflow strictly in order, one `log_batch` per step. When the store cannot be reached, training goes on and
entries wait in the spool; the sender checks the server (`GET /health` for a server URL) every
`tracking.retry_interval_s` and, once it answers, sends what waited. At the end of the run the tracker waits
for the spool to empty for as long as the sender makes progress, and gives up after `tracking.flush_timeout_s`
without any; what is left is sent by `roll mlflow sync <output_dir>`.

No gaps, no duplicates: entries carry their timestamps, so an entry sent twice is the same data; the only
entry that may have reached the store without an acknowledgement is the one whose send failed, and before it
is sent again the sender asks the store which of its metrics it already has (MLflow keeps duplicate metric
rows in a file store), looks for an existing run with the spool's id tag before creating one, and does not
append a table twice.

A server that is down when the run starts is the same case: the run starts, and its MLflow run is created
(with the start time it would have had) when the server is back; until then `run_id` is None.

A resumed run (`roll run --resume`) appends to the spool of the run it continues, so it goes on in the same
MLflow run; the steps it computes again (those between its checkpoint and the crash) are not logged again when
the spool already holds them, nor are the tables of those steps, so MLflow has every step exactly once. In a
`deterministic` run those values are the same ones; otherwise MLflow keeps the ones logged first.
"""

from __future__ import annotations

import json
import logging
import math
import os
import posixpath
import threading
import time
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from roll_core.config import TrackingConfig
from roll_core.tracking.spool import Spool

logger = logging.getLogger(__name__)

DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"
SPOOL_TAG = "roll.spool_id"
_MAX_PARAM_LEN = 6000
_PARAMS_PER_CALL = 100
_METRICS_PER_CALL = 1000
_HEALTH_TIMEOUT_S = 3.0


def tracking_uri(cfg: TrackingConfig) -> str:
    """Config first, then MLFLOW_TRACKING_URI, then a sqlite file in the working directory; a local store's
    relative path is made absolute, so `roll mlflow sync` run elsewhere writes to the same store."""
    return absolute_uri(cfg.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI)


def absolute_uri(uri: str) -> str:
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        return f"sqlite:///{Path(uri.removeprefix('sqlite:///')).resolve()}"
    if uri.startswith("file:") and not uri.startswith("file:/"):
        return Path(uri.removeprefix("file:")).resolve().as_uri()
    if ":" not in uri and "/" in uri:  # a plain path; a bare word ("databricks") is a scheme for MLflow
        return Path(uri).resolve().as_uri()
    return uri


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in tree.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, Mapping) and v:
            out |= flatten(v, key)
        else:
            out[key] = str(v)[:_MAX_PARAM_LEN]
    return out


def is_server(uri: str) -> bool:
    return uri.startswith(("http://", "https://"))


def server_reachable(uri: str, timeout_s: float = _HEALTH_TIMEOUT_S) -> bool:
    """A tracking server answers its health check; a local store (sqlite, files) counts as reachable."""
    if not is_server(uri):
        return True
    try:
        with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout_s) as response:
            return response.status == 200
    except (OSError, ValueError):  # URLError, HTTPError, timeouts and refused connections are OSErrors
        return False


def is_permanent(exc: BaseException) -> bool:
    """The store understood the call and refused it (a 4xx answer): sending it again cannot help. 404 (the run
    is not there: the wrong server?) and 429 (rate limit) are not taken as final."""
    from mlflow.exceptions import MlflowException

    if not isinstance(exc, MlflowException):
        return False
    status = exc.get_http_status_code()
    return 400 <= status < 500 and status not in (404, 429)


class Sender:
    """Sends a spool's entries in order, the one after a failed attempt idempotently (module doc)."""

    def __init__(
        self, spool: Spool, uri: str, retry_interval_s: float, client: Any = None, *, uncertain: bool = False
    ):
        from mlflow.tracking import MlflowClient

        self.spool = spool
        self.uri = uri
        self.retry_interval_s = retry_interval_s
        self.client = client if client is not None else MlflowClient(tracking_uri=uri)
        self.uncertain = uncertain
        self.down = False
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------------------------------- the loop

    def drain(self) -> bool:
        """Send entries until the spool is empty (True) or the store cannot be reached (False)."""
        while not self._stop.is_set():
            entry = self.spool.next_unacked()
            if entry is None:
                return True
            if self.down and not server_reachable(self.uri):
                return False
            try:
                run_id = self._send(entry)
            except Exception as exc:  # any failure: the entry stays in the spool and is tried again
                if is_permanent(exc) and entry["kind"] != "create_run":
                    logger.error(
                        "MLflow refused spool entry %s (%s): %s; kept in %s/rejected.jsonl",
                        entry["id"],
                        entry["kind"],
                        exc,
                        self.spool.path,
                    )
                    self.spool.reject(entry, repr(exc))
                    continue
                if not self.down:
                    logger.warning(
                        "MLflow at %s is unreachable (%s); training goes on and tracking data waits in %s",
                        self.uri,
                        str(exc).splitlines()[0][:300],
                        self.spool.path,
                    )
                self.down = True
                self.uncertain = True
                return False
            self.spool.ack(entry["id"], run_id)
            self.uncertain = False
            if self.down:
                logger.warning("MLflow at %s is reachable again; sending the spooled tracking data", self.uri)
                self.down = False
        return False

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="mlflow-sender", daemon=True)
        self._thread.start()

    def notify(self) -> None:
        self._wake.set()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            try:
                done = self.drain()
            except Exception:  # a bug here must not end the thread: the spool keeps everything
                logger.exception("MLflow sender failed; retrying in %.0f s", self.retry_interval_s)
                done = False
            self._wake.wait(None if done else self.retry_interval_s)

    def close(self, flush_timeout_s: float) -> None:
        """Wait for the spool to empty while entries keep being acknowledged, at most `flush_timeout_s`
        without progress; then stop the thread (a call it is blocked in is left to finish or fail)."""
        self.notify()
        last, since = self.spool.acked, time.monotonic()
        while self.spool.pending() and time.monotonic() - since < flush_timeout_s:
            time.sleep(0.1)
            if self.spool.acked != last:
                last, since = self.spool.acked, time.monotonic()
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)

    # ------------------------------------------------------------------------------------------- one entry

    def _send(self, entry: dict[str, Any]) -> str | None:
        kind = entry["kind"]
        if kind == "create_run":
            return self._create_run(entry)
        run_id = self.spool.run_id
        if kind == "batch":
            self._log_batch(run_id, entry)
        elif kind == "artifact":
            local = self.spool.files_of(entry["id"]) / entry["name"]
            self.client.log_artifact(run_id, str(local), entry["artifact_path"])
        elif kind == "table":
            self._log_table(run_id, entry["data"], entry["artifact_file"])
        elif kind == "terminate":
            self.client.set_terminated(run_id, status=entry["status"], end_time=entry["end_time"])
        elif kind == "reopen":  # a resumed run: RUNNING again, whatever the crash left
            self.client.update_run(run_id, status="RUNNING")
        else:
            raise ValueError(f"unknown spool entry kind {kind!r} (entry {entry['id']})")
        return None

    def _create_run(self, entry: dict[str, Any]) -> str:
        name = entry["experiment_name"]
        experiment = self.client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(name)
        if self.uncertain:
            found = self.client.search_runs(
                [experiment_id], filter_string=f"tags.`{SPOOL_TAG}` = '{entry['tags'][SPOOL_TAG]}'"
            )
            if found:
                return found[0].info.run_id
        run = self.client.create_run(
            experiment_id, start_time=entry["start_time"], tags=entry["tags"], run_name=entry["run_name"]
        )
        return run.info.run_id

    def _log_batch(self, run_id: str, entry: dict[str, Any]) -> None:
        from mlflow.entities import Metric, Param, RunTag

        metrics = [tuple(m) for m in entry.get("metrics", [])]
        if self.uncertain and metrics:
            stored = set()
            for key in {m[0] for m in metrics}:
                stored |= {
                    (m.key, m.value, m.timestamp, m.step) for m in self.client.get_metric_history(run_id, key)
                }
            metrics = [m for m in metrics if m not in stored]
        params = [Param(k, v) for k, v in entry.get("params", [])]
        tags = [RunTag(k, v) for k, v in entry.get("tags", [])]
        # MLflow takes at most 1000 metrics per call; a failure part-way is the uncertain case above.
        for i in range(0, max(len(metrics), 1), _METRICS_PER_CALL):
            chunk = metrics[i : i + _METRICS_PER_CALL]
            self.client.log_batch(
                run_id,
                metrics=[Metric(k, v, ts, step) for k, v, ts, step in chunk],
                params=params if i == 0 else [],
                tags=tags if i == 0 else [],
            )

    def _log_table(self, run_id: str, data: dict[str, list], artifact_file: str) -> None:
        """`log_table` appends to a table that exists, so a table that is already there is not sent again;
        only the run tag that lists tables for the UI (the last thing log_table writes) is made sure of."""
        from mlflow.utils.mlflow_tags import MLFLOW_LOGGED_ARTIFACTS

        folder = posixpath.dirname(artifact_file) or None
        if self.uncertain and artifact_file in {f.path for f in self.client.list_artifacts(run_id, folder)}:
            tables = json.loads(self.client.get_run(run_id).data.tags.get(MLFLOW_LOGGED_ARTIFACTS, "[]"))
            if {"path": artifact_file, "type": "table"} not in tables:
                tables.append({"path": artifact_file, "type": "table"})
                self.client.set_tag(run_id, MLFLOW_LOGGED_ARTIFACTS, json.dumps(tables))
            return
        self.client.log_table(run_id, data=data, artifact_file=artifact_file)


class MlflowTracker:
    """What the pipeline logs, spooled and sent in the background (module doc). `client` replaces the
    MlflowClient (tests use it to inject failures)."""

    def __init__(
        self, cfg: TrackingConfig, spool_root: str | Path, client: Any = None, resume_spool: str | Path | None = None
    ) -> None:
        """`resume_spool`: the spool of the run to go on with (module doc); a fresh run when None, or, with a
        warning, when that spool is gone."""
        self.flush_timeout_s = cfg.flush_timeout_s
        self.resumed_steps: set[int] = set()
        """Steps (and tables) the spool of a resumed run held already: not logged again."""
        self.resumed_tables: set[str] = set()
        reopened = resume_spool is not None and (Path(resume_spool) / "meta.json").is_file()
        if reopened:
            self.spool = Spool(Path(resume_spool))
            self.uri = self.spool.meta["tracking_uri"]
            for entry in self.spool.entries():
                self.resumed_steps |= {int(m[3]) for m in entry.get("metrics", [])}
                if entry["kind"] == "table":
                    self.resumed_tables.add(entry["artifact_file"])
            self.spool.append("reopen", {})
        else:
            if resume_spool is not None:
                logger.warning("the spool %s of the run to resume is gone: starting a new MLflow run", resume_spool)
            self.uri = tracking_uri(cfg)
            self.spool = Spool.create(Path(spool_root), self.uri, cfg.experiment_name, cfg.run_name)
            self.spool.append(
                "create_run",
                {
                    "experiment_name": cfg.experiment_name,
                    "run_name": cfg.run_name,
                    "start_time": _now_ms(),
                    "tags": {SPOOL_TAG: self.spool.meta["spool_id"]},
                },
            )
        # After a crash the last entry sent may have been stored without an acknowledgement: a reopened spool's
        # first send asks the store what it has.
        self.sender = Sender(self.spool, self.uri, cfg.retry_interval_s, client, uncertain=reopened)
        self.sender.down = not server_reachable(self.uri)
        self.sender.drain()  # in the foreground, so the run id is known at once when the store is up
        if self.run_id is None:
            logger.warning(
                "MLflow at %s is unreachable: training goes on, the MLflow run is created when it is "
                "back, and until then tracking data waits in %s",
                self.uri,
                self.spool.path,
            )
        self.sender.start()

    @property
    def run_id(self) -> str | None:
        """None until the MLflow run exists (the server was down when the run started)."""
        return self.spool.run_id

    def pending(self) -> int:
        """Spooled entries not yet stored by MLflow."""
        return self.spool.pending()

    def _append(self, kind: str, payload: dict[str, Any], files: dict[str, bytes] | None = None) -> None:
        self.spool.append(kind, payload, files)
        self.sender.notify()

    def log_params(self, params: Mapping[str, Any]) -> None:
        items = [[k, v] for k, v in flatten(params).items()]
        for i in range(0, len(items), _PARAMS_PER_CALL):
            self._append("batch", {"params": items[i : i + _PARAMS_PER_CALL]})

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        items = [[k, str(v)] for k, v in tags.items()]
        for i in range(0, len(items), _PARAMS_PER_CALL):
            self._append("batch", {"tags": items[i : i + _PARAMS_PER_CALL]})

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """All of a step's metrics in one entry (one log_batch per 1000 when sent); NaN values (nothing
        measured) are dropped; a step the spool already holds (a resumed run) is not logged again."""
        if step in self.resumed_steps:
            logger.info("step %d is already in the MLflow run (logged before the resume); not logged again", step)
            return
        now = _now_ms()
        batch = [[k, float(v), now, step] for k, v in metrics.items() if not math.isnan(float(v))]
        self._append("batch", {"metrics": batch})

    def log_dict(self, data: Mapping[str, Any], artifact_file: str) -> None:
        self.log_file(json.dumps(dict(data), indent=2).encode(), artifact_file)

    def log_file(self, content: bytes, artifact_file: str) -> None:
        """An artifact from bytes (an image, a JSON file); logging the same path again replaces it."""
        folder, name = posixpath.split(artifact_file)
        self._append("artifact", {"name": name, "artifact_path": folder or None}, files={name: content})

    def log_table(self, data: Mapping[str, list], artifact_file: str) -> None:
        """A table (columns of equal length) with MLflow's `log_table`; the MLflow UI shows it as a table. MLflow
        appends to a table that exists, so a table the spool already holds (a resumed run) is not logged again."""
        if artifact_file in self.resumed_tables:
            return
        self._append("table", {"data": {k: list(v) for k, v in data.items()}, "artifact_file": artifact_file})

    def finish(self, status: str = "FINISHED") -> None:
        self._append("terminate", {"status": status, "end_time": _now_ms()})
        self.sender.close(self.flush_timeout_s)
        left = self.pending()
        if left:
            logger.warning(
                "%d tracking entries could not be sent to MLflow at %s; they are kept in %s: send them "
                "with `roll mlflow sync %s`",
                left,
                self.uri,
                self.spool.path,
                self.spool.path,
            )


@dataclass(frozen=True)
class SyncResult:
    spool: Path
    run_id: str | None
    sent: int
    left: int


def sync(path: str | Path, uri: str | None = None) -> list[SyncResult]:
    """Send what the spools at `path` (a run's output_dir, its mlflow_spool folder, or one spool) still hold,
    to the URI each run used or to `uri`. Safe to run any number of times, also while nothing is left."""
    results = []
    for folder in Spool.find(path):
        spool = Spool(folder)
        before = spool.acked
        if spool.pending():
            target = absolute_uri(uri) if uri else spool.meta["tracking_uri"]
            sender = Sender(spool, target, retry_interval_s=0.0, uncertain=True)
            if server_reachable(target):
                sender.drain()
        results.append(SyncResult(folder, spool.run_id, spool.acked - before, spool.pending()))
    return results


def _now_ms() -> int:
    return int(time.time() * 1000)

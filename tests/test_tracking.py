"""The tracking spool, the sender's idempotent replay, run metadata, the validation artifacts and
`roll report`, against MLflow's file store (which, unlike the SQL store, keeps a metric sent twice twice) and
failing clients."""

from __future__ import annotations

import hashlib
import json
import socket
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from roll_core.config import TrackingConfig, load_config
from roll_core.rewards.scored import MASK_ERROR, ScoredSample
from roll_core.tracking.metadata import content_hash, run_tags
from roll_core.tracking.mlflow_tracker import MlflowTracker, absolute_uri, is_permanent, sync
from roll_core.tracking.spool import Spool
from roll_pipeline.driver.cli import main
from roll_pipeline.driver.report import (
    CHART_FILE,
    RunReport,
    accuracy_chart,
    accuracy_series,
    format_report,
    log_validation_artifacts,
    sample_table,
    table_file,
)
from roll_pipeline.driver.tracking_commands import ui_command
from tests.conftest import EXAMPLES, ROOT


@pytest.fixture
def file_store(tmp_path, monkeypatch):
    """A file store URI: MLflow 3 only opens one when asked explicitly."""
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return (tmp_path / "mlruns").as_uri()


def tracking(uri: str, **kw) -> TrackingConfig:
    return TrackingConfig(tracking_uri=uri, experiment_name="t", run_name="r", retry_interval_s=0.05, **kw)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens there once the socket is closed


class FailingClient:
    """An MlflowClient whose log_batch fails `failures` times, either before the call reaches the store or
    after the store has written it (a lost answer: the case that makes replays duplicate)."""

    def __init__(self, client: MlflowClient, failures: int, after_store: bool) -> None:
        self._client, self.failures, self.after_store = client, failures, after_store

    def log_batch(self, *args, **kwargs):
        if self.failures:
            self.failures -= 1
            if self.after_store:
                self._client.log_batch(*args, **kwargs)
            raise ConnectionError("connection reset by peer")
        return self._client.log_batch(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._client, name)


def history(client: MlflowClient, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def read_table(client: MlflowClient, run_id: str, artifact_file: str, tmp_path) -> dict[str, list]:
    """A table logged with log_table, as columns (MlflowClient.load_table would search the default store)."""
    split = json.loads(Path(client.download_artifacts(run_id, artifact_file, str(tmp_path))).read_text())
    return {c: [row[i] for row in split["data"]] for i, c in enumerate(split["columns"])}


# ------------------------------------------------------------------------------------------- the spool


def test_spool_keeps_order_and_acknowledgements_across_reopening(tmp_path):
    spool = Spool.create(tmp_path, "sqlite:////x.db", "e", "r")
    ids = [spool.append("batch", {"metrics": [["a", float(i), 1, i]]}) for i in range(3)]
    assert ids == [0, 1, 2] and spool.pending() == 3
    assert spool.next_unacked()["metrics"] == [["a", 0.0, 1, 0]]
    spool.ack(0, run_id="run0")
    with pytest.raises(ValueError, match="out of order"):
        spool.ack(2)
    # a crash in the middle of writing an entry leaves a cut line: it is dropped on reopening
    with (spool.path / "entries.jsonl").open("ab") as f:
        f.write(b'{"id": 3, "kind": "ba')
    again = Spool(spool.path)
    assert (again.run_id, again.acked, again.pending()) == ("run0", 0, 2)
    assert again.next_unacked()["id"] == 1
    assert again.append("terminate", {"status": "FINISHED", "end_time": 5}) == 3
    assert Spool.find(tmp_path) == [spool.path] == Spool.find(spool.path)


def test_relative_local_stores_become_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert absolute_uri("sqlite:///mlflow.db") == f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert absolute_uri("sqlite:////abs/m.db") == "sqlite:////abs/m.db"
    assert absolute_uri("./mlruns") == (tmp_path / "mlruns").as_uri()
    assert absolute_uri("http://127.0.0.1:5000") == "http://127.0.0.1:5000"
    assert absolute_uri("databricks") == "databricks"


# ------------------------------------------------------------------------------------------- the tracker


def test_tracker_logs_everything_through_the_spool(tmp_path, file_store):
    tracker = MlflowTracker(tracking(file_store), tmp_path / "spool")
    assert tracker.run_id is not None  # the store is up: the run exists as soon as the tracker does
    tracker.log_params({"a": {"b": 1}, "c": "x"})
    tracker.set_tags({"roll.version": "1"})
    for step in range(3):
        tracker.log_metrics({"loss": 1.0 / (step + 1), "nothing": float("nan")}, step)
    tracker.log_dict({"k": 1}, "resolved_config.json")
    tracker.log_table(
        {"tag": ["add", "list"], "verdict": ["correct", "wrong"]}, "validation/samples_step_000000.json"
    )
    tracker.finish()
    assert tracker.pending() == 0

    client = MlflowClient(file_store)
    run = client.get_run(tracker.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params == {"a.b": "1", "c": "x"}
    assert run.data.tags["roll.version"] == "1"
    assert history(client, tracker.run_id, "loss") == [(0, 1.0), (1, 0.5), (2, pytest.approx(1 / 3))]
    assert client.get_metric_history(tracker.run_id, "nothing") == []
    table = read_table(client, tracker.run_id, "validation/samples_step_000000.json", tmp_path)
    assert table["verdict"] == ["correct", "wrong"]
    logged = json.loads(run.data.tags["mlflow.loggedArtifacts"])
    assert {"path": "validation/samples_step_000000.json", "type": "table"} in logged


@pytest.mark.parametrize("after_store", [False, True], ids=["lost-request", "lost-answer"])
def test_a_failed_send_is_retried_without_gaps_or_duplicates(tmp_path, file_store, after_store):
    tracker = MlflowTracker(tracking(file_store), tmp_path / "spool")
    real = tracker.sender.client
    tracker.sender.client = FailingClient(real, failures=2, after_store=after_store)
    for step in range(4):
        tracker.log_metrics({"loss": float(step), "acc": step / 10}, step)
    tracker.finish()
    assert tracker.pending() == 0
    assert history(real, tracker.run_id, "loss") == [(s, float(s)) for s in range(4)]
    assert history(real, tracker.run_id, "acc") == [(s, pytest.approx(s / 10)) for s in range(4)]


def test_the_file_store_really_keeps_a_metric_sent_twice(tmp_path, file_store):
    """The control for the test above: without the sender's check, a lost answer would leave a duplicate."""
    from mlflow.entities import Metric

    client = MlflowClient(file_store)
    run = client.create_run(client.create_experiment("control"))
    for _ in range(2):
        client.log_batch(run.info.run_id, metrics=[Metric("loss", 1.0, 123, 0)])
    assert len(client.get_metric_history(run.info.run_id, "loss")) == 2


def test_a_table_is_not_appended_twice_when_its_answer_was_lost(tmp_path, file_store):
    tracker = MlflowTracker(tracking(file_store), tmp_path / "spool")
    real = tracker.sender.client

    class LostAnswerOnTable(FailingClient):
        def log_table(self, *args, **kwargs):
            if self.failures:
                self.failures -= 1
                self._client.log_table(*args, **kwargs)
                raise ConnectionError("connection reset by peer")
            return self._client.log_table(*args, **kwargs)

    tracker.sender.client = LostAnswerOnTable(real, failures=1, after_store=True)
    tracker.log_table({"tag": ["add", "list"]}, "validation/samples_step_000002.json")
    tracker.finish()
    table = read_table(real, tracker.run_id, "validation/samples_step_000002.json", tmp_path)
    assert table["tag"] == ["add", "list"]


def test_a_refused_entry_is_kept_aside_and_the_rest_still_arrives(tmp_path, file_store):
    tracker = MlflowTracker(tracking(file_store), tmp_path / "spool")
    tracker.log_metrics({"bad name!": 1.0}, 0)  # MLflow refuses the character "!"
    tracker.log_metrics({"loss": 2.0}, 1)
    tracker.finish()
    assert history(tracker.sender.client, tracker.run_id, "loss") == [(1, 2.0)]
    rejected = [json.loads(line) for line in (tracker.spool.path / "rejected.jsonl").read_text().splitlines()]
    assert [r["entry"]["metrics"][0][0] for r in rejected] == ["bad name!"]


def test_server_down_at_start_training_goes_on_and_sync_sends_it_later(tmp_path, file_store):
    """The run starts while nothing answers at its tracking URI: nothing blocks, everything is spooled with
    its original timestamps, and `roll mlflow sync` creates the run and sends it all, once, however often
    it runs."""
    down = f"http://127.0.0.1:{closed_port()}"
    tracker = MlflowTracker(tracking(down, flush_timeout_s=0.3), tmp_path / "run" / "mlflow_spool")
    tracker.log_params({"lr": 0.1})
    for step in range(3):
        tracker.log_metrics({"loss": float(step)}, step)
    tracker.finish()  # returns: nothing waited on the server
    assert tracker.run_id is None and tracker.pending() == 6  # create_run, params, 3 steps, terminate

    (result,) = sync(tmp_path / "run", uri=file_store)
    assert (result.sent, result.left) == (6, 0)
    client = MlflowClient(file_store)
    run = client.get_run(result.run_id)
    assert run.info.status == "FINISHED" and run.data.params == {"lr": "0.1"}
    assert history(client, result.run_id, "loss") == [(0, 0.0), (1, 1.0), (2, 2.0)]
    assert [r.sent for r in sync(tmp_path / "run", uri=file_store)] == [0]  # nothing twice
    assert len(client.search_runs([run.info.experiment_id])) == 1


def test_run_creation_whose_answer_was_lost_is_not_repeated(tmp_path, file_store):
    down = f"http://127.0.0.1:{closed_port()}"
    tracker = MlflowTracker(tracking(down, flush_timeout_s=0.0), tmp_path / "spool")
    tracker.log_metrics({"loss": 1.0}, 0)
    tracker.finish()
    client = MlflowClient(file_store)
    # the run was created but the answer never came back: sync must find it by the spool's id tag
    entry = tracker.spool.next_unacked()
    created = client.create_run(client.create_experiment(entry["experiment_name"]), tags=entry["tags"])
    (result,) = sync(tmp_path / "spool", uri=file_store)
    assert result.run_id == created.info.run_id
    assert len(client.search_runs([created.info.experiment_id])) == 1


def test_sync_command_reports_what_it_did(tmp_path, file_store, capsys):
    assert main(["mlflow", "sync", str(tmp_path)]) == 2
    assert "no tracking spool" in capsys.readouterr().err
    down = f"http://127.0.0.1:{closed_port()}"
    tracker = MlflowTracker(tracking(down, flush_timeout_s=0.0), tmp_path / "mlflow_spool")
    tracker.log_metrics({"loss": 1.0}, 0)
    tracker.finish()
    assert main(["mlflow", "sync", str(tmp_path)]) == 1  # the server is still down: nothing could be sent
    assert "3 entries left" in capsys.readouterr().out
    assert main(["mlflow", "sync", str(tmp_path), "--tracking-uri", file_store]) == 0
    assert "sent 3 entries" in capsys.readouterr().out


def test_refusals_that_are_final():
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE, RESOURCE_DOES_NOT_EXIST

    assert is_permanent(MlflowException("bad", error_code=INVALID_PARAMETER_VALUE))
    assert not is_permanent(MlflowException("no such run", error_code=RESOURCE_DOES_NOT_EXIST))
    assert not is_permanent(MlflowException("API request failed with exception ConnectionRefused"))
    assert not is_permanent(ConnectionError())


# ------------------------------------------------------------------------------------------- metadata


def test_content_hash_of_files_and_folders(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.txt").write_text("one")
    assert content_hash(tmp_path / "d" / "a.txt") == hashlib.sha256(b"one").hexdigest()
    before = content_hash(tmp_path / "d")
    (tmp_path / "d" / "a.txt").write_text("two")
    assert content_hash(tmp_path / "d") != before
    (tmp_path / "d" / "a.txt").write_text("one")
    assert content_hash(tmp_path / "d") == before


def test_run_tags_name_code_inputs_and_domains(tiny_model):
    resolved = load_config(
        EXAMPLES / "math_code.yaml", ["validation.num_samples=4", "validation.generating_args.do_sample=true"]
    )
    tags = run_tags(resolved)
    assert tags["roll.model.path"] == str(tiny_model.resolve())
    assert tags["roll.model.build_seed"] == str(
        json.loads((tiny_model / "build_info.json").read_text())["seed"]
    )
    assert tags["roll.model.sha256"] == content_hash(tiny_model)
    math_train = EXAMPLES / "data" / "math_train.jsonl"
    assert tags["roll.data.train.0.path"] == str(math_train.resolve())
    assert tags["roll.data.train.0.sha256"] == hashlib.sha256(math_train.read_bytes()).hexdigest()
    assert tags["domains"] == "math,code" and tags["roll.domain.code.tags"] == "string,list,arith"
    assert (tags["roll.validation.mode"], tags["roll.validation.k"]) == ("sampled", "4")
    assert tags["roll.version"] == "0.1.0"
    if (ROOT / ".git").exists():
        assert len(tags["mlflow.source.git.commit"]) == 40
    assert "roll.model.sha256" not in run_tags(resolved, hash_inputs=False)


# ------------------------------------------------------------------------------------- artifacts, report


def val_record(tag, pid, correct, text, domain="math"):
    context = dict(
        domain=domain, tag=tag, id=pid, response_text=text, response_length=3, finish_reason="stop",
        prompt=f"prompt {pid}", ground_truth="5",
    )
    if correct is None:
        return ScoredSample.masked_as(MASK_ERROR, **context)
    return ScoredSample(score=1.0, correct=correct, **context)


def test_sample_table_takes_the_first_rows_of_every_tag():
    records = [
        val_record("add", p, c, t)
        for p, c, t in [(0, True, "5"), (0, False, "6"), (1, None, "?"), (2, True, "5")]
    ]
    records.append(val_record("list", 9, False, "def f(): pass", domain="code"))
    table = sample_table(records, rows_per_tag=3)
    assert table["tag"] == ["add", "add", "add", "list"]
    assert table["sample"] == [0, 1, 0, 0]
    assert table["verdict"] == ["correct", "wrong", "masked", "wrong"]
    assert table["reward"] == [1.0, 1.0, None, 1.0]
    assert table["response"][-1] == "def f(): pass"
    assert len({len(column) for column in table.values()}) == 1


def test_accuracy_chart_draws_every_tag_over_the_steps():
    history = {
        0: {"val_correct/all/mean": 0.2, "val_correct/add/mean": 0.3, "reward/all/score": 0.1},
        1: {"reward/all/score": 0.2},
        2: {"val_correct/all/mean": 0.4, "val_correct/add/mean": 0.5, "val_correct/add/pass_at_2": 0.9},
    }
    assert accuracy_series(history) == {"all": [(0, 0.2), (2, 0.4)], "add": [(0, 0.3), (2, 0.5)]}
    png = accuracy_chart(history)
    assert png.startswith(b"\x89PNG") and len(png) > 5000


def test_validation_artifacts_reach_the_store(tmp_path, file_store):
    tracker = MlflowTracker(tracking(file_store), tmp_path / "spool")
    records = [val_record("add", 0, True, "5")]
    log_validation_artifacts(tracker, 4, records, {4: {"val_correct/add/mean": 1.0}}, rows_per_tag=2)
    tracker.finish()
    client = MlflowClient(file_store)
    files = {f.path for f in client.list_artifacts(tracker.run_id, "validation")}
    assert files == {table_file(4), CHART_FILE}


def test_format_report_shows_every_tag_at_every_step():
    report = RunReport(
        run_id="abc",
        run_name="math_code",
        status="FINISHED",
        uri="sqlite:////x.db",
        accuracy={"add": {0: 0.25, 5: 0.5}, "all": {0: 0.2, 5: 0.4}, "list": {0: 0.0, 5: 0.125}},
        latest={
            "val_correct/add/mean": 0.5,
            "val_correct/add/pass_at_2": 0.75,
            "val_correct/add/maj_at_2": 0.5,
            "val_correct/add/pass_at_1": 0.5,
            "val_prompts/add/count": 8.0,
            "val_correct/all/mean": 0.4,
        },
    )
    lines = format_report(report).splitlines()
    assert lines[0] == "run math_code (abc), FINISHED, sqlite:////x.db"
    header = next(i for i, line in enumerate(lines) if line.startswith("tag") and "step 0" in line)
    assert lines[header].split() == ["tag", "step", "0", "step", "5"]
    assert [line.split() for line in lines[header + 1 : header + 4]] == [
        ["all", "0.200", "0.400"],
        ["add", "0.250", "0.500"],
        ["list", "0.000", "0.125"],
    ]
    last = next(i for i, line in enumerate(lines) if line.startswith("tag") and "mean@k" in line)
    assert lines[last].split() == [
        "tag",
        "mean@k",
        "maj@2",
        "pass@1",
        "pass@2",
        "ci_low",
        "ci_high",
        "length",
        "truncated",
        "prompts",
    ]
    assert lines[last + 2].split() == ["add", "0.500", "0.500", "0.500", "0.750", "-", "-", "-", "-", "8"]


def test_report_command_reads_a_run_from_its_output_dir(tmp_path, file_store, capsys):
    tracker = MlflowTracker(tracking(file_store), tmp_path / "run" / "mlflow_spool")
    for step, acc in [(0, 0.25), (3, 0.75)]:
        tracker.log_metrics(
            {"val_correct/all/mean": acc, "val_correct/add/mean": acc, "reward/all/score": 0.5}, step
        )
    tracker.finish()
    assert main(["report", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "step 0" in out and "step 3" in out
    assert [line.split() for line in out.splitlines() if line.startswith("add")][0] == [
        "add",
        "0.250",
        "0.750",
    ]
    assert main(["report", "no-such-run-id", "--tracking-uri", file_store]) == 2


def test_ui_serves_a_local_store_on_localhost_only(capsys):
    command = ui_command("sqlite:////x.db", 5001)
    assert command[command.index("--host") + 1] == "127.0.0.1"
    assert command[command.index("--backend-store-uri") + 1] == "sqlite:////x.db"
    assert (
        main(["ui", "--tracking-uri", "http://127.0.0.1:5000"]) == 0
    )  # a server has its own UI: nothing to start
    assert "open http://127.0.0.1:5000" in capsys.readouterr().out

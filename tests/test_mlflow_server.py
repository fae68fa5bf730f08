"""Short trainings against a real `mlflow server` on 127.0.0.1 (sqlite backend in tmp), read back through
MLflow's client API; the same server stopped in the middle of a run and started again; and the run's page in
the real MLflow UI, opened in headless Chromium."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient
from safetensors.torch import load_file

from roll_core.tracking.mlflow_tracker import server_reachable
from roll_pipeline.driver.cli import main
from roll_pipeline.driver.pipeline import RLVRPipeline
from roll_pipeline.driver.report import CHART_FILE, prompts_file, table_file
from roll_pipeline.driver.significance import outcomes_from_table
from tests.conftest import EXAMPLES, ROOT
from tests.metric_oracles import majority, pass_at, prompt_shares, wilson_by_inversion
from tests.test_pipeline_integration import SMALL
from workers.rewards.math_rule import MathRuleScorer

ARTIFACTS = ROOT / "test-artifacts"
VAL_TAGS = ["add", "arith", "list"]  # the tags of the first 4 validation prompts of each domain (code: no string)
SAMPLED_K2 = [
    "validation.num_samples=2",
    "validation.generating_args.do_sample=true",
    "tracking.sample_rows_per_tag=3",
    "validation.max_prompts=4",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MlflowServer:
    """`mlflow server` in its own process group, on a fixed port and store, so it can be stopped and started
    again as the same server."""

    def __init__(self, root: Path, mlflow_db) -> None:
        self.root = root
        mlflow_db(root / "mlflow.db")  # its store, new and empty
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 120.0) -> None:
        env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
        env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] = (
            "false"  # no job runner processes: the UI and REST API only
        )
        command = [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--backend-store-uri",
            f"sqlite:///{self.root}/mlflow.db",
            "--artifacts-destination",
            str(self.root / "artifacts"),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--workers",
            "1",
        ]
        with (self.root / "server.log").open("ab") as log:
            self.proc = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, cwd=self.root, env=env, start_new_session=True
            )
        deadline = time.monotonic() + timeout_s
        while not server_reachable(self.url, timeout_s=1.0):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"mlflow server did not start:\n{(self.root / 'server.log').read_text()[-3000:]}")
            time.sleep(0.3)

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc = None


def metric_at(client, run_id: str, key: str, step: int) -> float:
    (value,) = [m.value for m in client.get_metric_history(run_id, key) if m.step == step]
    return value


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_model, mlflow_db):
    """A server and a 2-step `roll run` that validates at steps 0, 1 and 2 with k=2 sampled responses per prompt
    and saves a checkpoint at step 2; the server is stopped after step 1 and started again (same port, same
    store) after step 2, so everything of step 2 (metrics, audits, the validation's tables and chart) waits in
    the run's spool. Yields the server, a client, the run, its output_dir, what the command printed, and what
    the outage saw (the pipeline, and the records pending while the server was down)."""
    root = tmp_path_factory.mktemp("mlflow_server")
    server = MlflowServer(root, mlflow_db)
    server.start()
    seen: dict = {}
    run_pipeline = RLVRPipeline.run

    def run_with_outage(self, *, on_step=None, **kwargs):
        seen["pipeline"] = self

        def outage(step: int, metrics: dict[str, float]) -> None:
            if step == 1:
                server.stop()
                assert not server_reachable(server.url)
            if step == 2:
                seen["pending_while_down"] = self.tracker.pending()
                server.start()
            if on_step is not None:
                on_step(step, metrics)

        summary = run_pipeline(self, on_step=outage, **kwargs)
        seen["pending_at_end"] = self.tracker.pending()
        return summary

    try:
        output_dir = root / "run"
        printed = io.StringIO()
        with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(printed):
            # MLflow's client retries a refused request for ~4 minutes by default; the spool makes that unnecessary.
            patch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
            patch.setattr(RLVRPipeline, "run", run_with_outage)  # `roll run`'s own pipeline, observed
            code = main(
                [
                    "run",
                    str(EXAMPLES / "math_code.yaml"),
                    *SMALL,
                    *SAMPLED_K2,
                    "tracking.sample_rows_per_tag=100",  # every response, so the metrics can be recomputed
                    "reward_audit.every_steps=2",  # audits at steps 0 and 2
                    "max_steps=2",
                    "eval_steps=1",
                    "save_steps=2",
                    f"output_dir={output_dir}",
                    f"tracking.tracking_uri={server.url}",
                    "tracking.experiment_name=served",
                    "tracking.retry_interval_s=0.5",
                ]
            )
        assert code == 0, printed.getvalue()[-4000:]
        client = MlflowClient(server.url)
        (run,) = client.search_runs([client.get_experiment_by_name("served").experiment_id])
        yield server, client, run, output_dir, printed.getvalue(), seen
    finally:
        server.stop()


@pytest.mark.slow
def test_a_run_on_a_server_reads_back_through_the_client(trained, tmp_path, capsys, tiny_model):
    server, client, run, output_dir, printed, _ = trained
    run_id = run.info.run_id
    assert run.info.status == "FINISHED"
    assert "finished 2 steps" in printed
    # the end of the run: its first validation against its last, per domain and tag, and where to look further
    assert "validation accuracy, step 0 against step 2 (paired by prompt):" in printed
    assert any(line.startswith("  math ") for line in printed.splitlines()) and "`make ui`" in printed

    # the checkpoint's Hugging Face folder holds the trained policy, changed from the one the run started with
    trained_weights = load_file(output_dir / "checkpoints" / "step_2" / "actor_train" / "hf_model" / "model.safetensors")
    initial = load_file(tiny_model / "model.safetensors")
    assert any(k in trained_weights and not torch.equal(initial[k], trained_weights[k]) for k in initial)
    assert (output_dir / "checkpoints" / "latest").read_text() == "step_2"

    # every tag's validation metrics at every validation step, each once
    for scope in ["all", *VAL_TAGS]:
        for metric in ["mean", "pass_at_1", "pass_at_2"]:
            steps = sorted(m.step for m in client.get_metric_history(run_id, f"val_correct/{scope}/{metric}"))
            assert steps == [0, 1, 2], (scope, metric)
    assert sorted(m.step for m in client.get_metric_history(run_id, "val_correct/add/maj_at_2")) == [0, 1, 2]
    assert "val_correct/list/maj_at_2" not in run.data.metrics  # programs are not voted on
    for domain in ["math", "code"]:
        assert 0.0 <= run.data.metrics[f"val_domain/{domain}/correct_mean"] <= 1.0
    # reward audits at step 0 and every 2 steps: both panels pass on the live workers
    for domain in ("math", "code"):
        audit = [(m.step, m.value) for m in client.get_metric_history(run_id, f"reward_audit/{domain}/pass")]
        assert sorted(audit) == [(0, 1.0), (2, 1.0)], domain
    # training and system metrics, per step
    for key in [
        "reward/math/score",
        "reward/code/std",
        "scheduler/math/groups_kept",
        "response_length/code/mean",
        "time/rollout_s",
        "throughput/rollout_tokens_per_s",
    ]:
        assert sorted(m.step for m in client.get_metric_history(run_id, key)) == [1, 2], key
    for key in ["memory/driver_rss_mb", "memory/actor_train_rss_mb", "memory/reward_code_rss_mb"]:
        assert sorted(m.step for m in client.get_metric_history(run_id, key)) == [0, 1, 2], key
    assert run.data.metrics["memory/actor_train_rss_mb"] > 50  # a process holding torch and a model

    # params, run metadata and artifacts
    assert run.data.params["rollout_batch_size"] == "4"
    assert run.data.params["validation.num_samples"] == "2"
    tags = run.data.tags
    assert tags["roll.model.build_seed"] == "0" and len(tags["roll.model.sha256"]) == 64
    assert tags["roll.validation.mode"] == "sampled" and tags["domains"] == "math,code"
    # 4 prompts a tag cannot show a significant change (4 discordant prompts at most: p >= 0.125)
    assert tags["val_regressed"] == "none" and tags["val_ci/all"].endswith("n=8")
    assert len(tags["roll.data.val.1.sha256"]) == 64
    top = {f.path for f in client.list_artifacts(run_id)}
    assert "resolved_config.json" in top
    assert {f.path for f in client.list_artifacts(run_id, "validation")} == {
        table_file(s) for s in (0, 1, 2)
    } | {prompts_file(s) for s in (0, 1, 2)} | {CHART_FILE}
    logged = json.loads(tags["mlflow.loggedArtifacts"])
    assert {"path": table_file(2), "type": "table"} in logged

    # the sample table (every response: sample_rows_per_tag is above the count), with a verdict that matches the
    # reward, and the logged accuracies recomputed from it at every validation step
    for step in (0, 1, 2):
        split = json.loads(Path(client.download_artifacts(run_id, table_file(step), str(tmp_path))).read_text())
        rows = [dict(zip(split["columns"], row, strict=True)) for row in split["data"]]
        assert len(rows) == 2 * 4 * 2  # domains x validation.max_prompts x num_samples
        assert sorted({r["tag"] for r in rows}) == VAL_TAGS
        for r in rows:
            assert r["prompt"] and r["response"] is not None
            assert r["verdict"] in {"correct", "wrong", "masked"}
            if r["verdict"] != "masked":  # right only with full marks (code's fraction of tests included)
                assert (r["verdict"] == "correct") == (r["reward"] == 1.0), r
        for scope, members in [("all", rows), *((t, [r for r in rows if r["tag"] == t]) for t in VAL_TAGS)]:
            verdicts = [r["verdict"] for r in members if r["verdict"] != "masked"]
            want = sum(v == "correct" for v in verdicts) / len(verdicts)
            (got,) = [m.value for m in client.get_metric_history(run_id, f"val_correct/{scope}/mean") if m.step == step]
            assert got == pytest.approx(want), (step, scope)
            for k in (1, 2):
                got = metric_at(client, run_id, f"val_correct/{scope}/pass_at_{k}", step)
                assert got == pytest.approx(pass_at(members, k), nan_ok=True), (step, scope, k)
        # maj@2 for the math tag (its answers are voted on with the math rule's answer key), from the responses
        votes = [r for r in rows if r["tag"] == "add"]
        got = metric_at(client, run_id, "val_correct/add/maj_at_2", step)
        assert got == pytest.approx(majority(votes, MathRuleScorer().answer_key)), step
        # every prompt's outcome, as the per-prompt table has it, and the intervals and changes built on them
        outcomes = outcomes_from_table(
            json.loads(Path(client.download_artifacts(run_id, prompts_file(step), str(tmp_path))).read_text())
        )
        for key, outcome in outcomes.items():
            domain, pid = key.split("/", 1)
            mine = [r for r in rows if r["domain"] == domain and r["prompt_id"] == pid and r["verdict"] != "masked"]
            assert (outcome.correct, outcome.scored) == (sum(r["verdict"] == "correct" for r in mine), len(mine))
        # the 95% intervals, over prompts (each counts its share of correct responses), from the sample table
        for scope, members in [("all", rows), *((t, [r for r in rows if r["tag"] == t]) for t in VAL_TAGS)]:
            low, high = wilson_by_inversion(prompt_shares(members))
            assert metric_at(client, run_id, f"val_ci/{scope}/low", step) == pytest.approx(low, abs=1e-9), (step, scope)
            assert metric_at(client, run_id, f"val_ci/{scope}/high", step) == pytest.approx(high, abs=1e-9), (step, scope)
        paired = [m.value for m in client.get_metric_history(run_id, "val_change/all/paired") if m.step == step]
        assert paired == ([] if step == 0 else [float(len(outcomes))])  # compared with the validation before
        for domain in ("math", "code"):
            verdicts = [r["verdict"] for r in rows if r["domain"] == domain and r["verdict"] != "masked"]
            (got,) = [
                m.value for m in client.get_metric_history(run_id, f"val_domain/{domain}/correct_mean") if m.step == step
            ]
            assert got == pytest.approx(sum(v == "correct" for v in verdicts) / len(verdicts)), (step, domain)
    chart = Path(client.download_artifacts(run_id, CHART_FILE, str(tmp_path)))
    assert chart.read_bytes().startswith(b"\x89PNG")

    # the run's report in the terminal, from its output_dir
    assert main(["report", str(output_dir)]) == 0
    out = capsys.readouterr().out
    for tag in VAL_TAGS:
        line = next(line for line in out.splitlines() if line.split()[:1] == [tag])
        assert len(line.split()) == 4, line  # the tag and its accuracy at steps 0, 1 and 2


@pytest.mark.slow
def test_server_outage_mid_run_loses_and_repeats_nothing(trained):
    """The server of `trained` was down from after step 1 to after step 2. Training went on in between, and in the
    end every metric of every step is stored exactly once (the sample tables' rows, each once, are counted in
    test_a_run_on_a_server_reads_back_through_the_client)."""
    server, client, run, _, _, seen = trained
    pipeline = seen["pipeline"]
    assert seen["pending_while_down"] >= 3  # step 2's metrics, and its validation's tables and chart, waited
    assert seen["pending_at_end"] == 0
    expected: dict[str, list[int]] = {}
    for step, metrics in pipeline.loop.history.items():
        for key, value in metrics.items():
            if value == value:  # NaN is not logged
                expected.setdefault(key, []).append(step)
    assert set(run.data.metrics) == set(expected)
    for key, steps in expected.items():
        stored = sorted(m.step for m in client.get_metric_history(run.info.run_id, key))
        assert stored == sorted(steps), key  # no gap, no duplicate
    assert sorted(expected["val_correct/all/mean"]) == [0, 1, 2]
    assert sorted(expected["reward/all/score"]) == [1, 2]


@pytest.mark.slow
def test_the_run_page_in_the_mlflow_ui_shows_the_per_tag_metrics(trained):
    """Headless Chromium on the run's page of the real MLflow UI: the per-tag metric names are in its metrics
    table and its chart sections, and the sample table opens as a table. Screenshots: test-artifacts/."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    chromium, chromedriver = shutil.which("chromium"), shutil.which("chromedriver")
    if not (chromium and chromedriver):
        pytest.fail("Debian's chromium and chromium-driver are missing: `make browser` installs them")
    server, _, run, _, _, _ = trained
    ARTIFACTS.mkdir(exist_ok=True)
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    # no background connections: this machine's closed network would refuse them
    for arg in [
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--window-size=1600,1200",
        f"--user-data-dir={ARTIFACTS / 'chromium-profile'}",
    ]:
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(chromedriver), options=options)
    wait = WebDriverWait(driver, 60)

    def text() -> str:
        return driver.find_element(By.TAG_NAME, "body").text

    def scroll_to(xpath: str) -> None:
        driver.execute_script(
            "arguments[0].scrollIntoView({block: 'start'})", driver.find_element(By.XPATH, xpath)
        )

    page = f"{server.url}/#/experiments/{run.info.experiment_id}/runs/{run.info.run_id}"
    names = [f"val_correct/{scope}/mean" for scope in ["all", *VAL_TAGS]]
    try:
        driver.get(page)
        wait.until(lambda _: "val_correct/" in text())
        for close in driver.find_elements(By.CSS_SELECTOR, "button[aria-label='Close']"):
            close.click()  # the assistant side panel
        driver.find_element(By.CSS_SELECTOR, "input[placeholder='Search metrics']").send_keys("val_correct/")
        wait.until(lambda _: all(name in text() for name in names))
        assert run.info.run_name in text() and "Finished" in text()
        scroll_to("//*[starts-with(normalize-space(text()), 'Metrics (')]")
        driver.save_screenshot(str(ARTIFACTS / "mlflow_ui_run_page.png"))

        driver.find_element(By.XPATH, "//*[normalize-space(text())='Model metrics']").click()
        wait.until(
            lambda _: all(f"val_correct/{scope}" in text().splitlines() for scope in ["all", *VAL_TAGS])
        )
        scroll_to("(//*[normalize-space(text())='val_correct/add'])[1]")
        wait.until(
            lambda _: len(driver.find_elements(By.CSS_SELECTOR, "svg.main-svg")) >= 4
        )  # plotly has drawn
        time.sleep(3)  # the charts in view load their histories one by one: give the screenshot time to show them
        driver.save_screenshot(str(ARTIFACTS / "mlflow_ui_metric_charts.png"))

        driver.get(f"{page}/artifacts/{table_file(2)}")
        wait.until(
            lambda _: "View as table" in text() and all(c in text() for c in ["verdict", "reward", "prompt"])
        )
        driver.save_screenshot(str(ARTIFACTS / "mlflow_ui_sample_table.png"))
    finally:
        driver.quit()
        shutil.rmtree(ARTIFACTS / "chromium-profile", ignore_errors=True)

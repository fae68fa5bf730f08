"""The reward contract: a scorer gets every column of its sample's dataset row, in a real `roll run`."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import yaml
from mlflow.tracking import MlflowClient

from roll_core.config.loader import load_config
from roll_core.rewards.scorer import contract_problems, reward_sample
from roll_pipeline.driver.cli import main
from roll_pipeline.driver.preflight import preflight
from tests.conftest import EXAMPLES


def test_the_sample_is_the_whole_row_with_the_response():
    row = {"id": "r1", "tag": "qa", "ground_truth": "Paris", "aliases": ["Lutetia"], "level": 3, "_source": "f:1"}
    messages = [{"role": "user", "content": "Capital of France?"}]
    sample = reward_sample(row, "Paris.", messages)
    assert sample == {
        "id": "r1",
        "tag": "qa",
        "ground_truth": "Paris",
        "aliases": ["Lutetia"],
        "level": 3,
        "response": "Paris.",
        "prompt_messages": messages,
    }
    # Without an id column the sample is named by where the row was read; without a ground truth it is None.
    assert reward_sample({"tag": "qa", "_source": "f:2"}, "x") == {
        "tag": "qa", "id": "f:2", "ground_truth": None, "response": "x", "prompt_messages": None
    }


def test_a_row_column_the_contract_would_hide_is_named():
    assert list(contract_problems({"tag": "qa", "aliases": "x"})) == []
    assert [f for f, _ in contract_problems({"response": "a reference answer", "prompt_messages": []})] == [
        "response",
        "prompt_messages",
    ]


def write_qa_run(tmp_path, tiny_model, rows_extra: dict) -> str:
    """A one-domain config whose reward is the example plugin (it reads the rows' `aliases` column), over the
    example's arithmetic rows with `rows_extra` added to each."""
    data = tmp_path / "data"
    data.mkdir()
    for split, n in (("train", 64), ("val", 4)):
        lines = (EXAMPLES / "data" / f"math_{split}.jsonl").read_text().splitlines()[:n]
        rows = [{**json.loads(line), "tag": "qa", **rows_extra} for line in lines]
        (data / f"qa_{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = yaml.safe_load((EXAMPLES / "math_code.yaml").read_text())
    config |= {
        "pretrain": str(tiny_model),
        "max_steps": 1,
        "eval_steps": 0,
        "save_steps": 0,
        "rollout_batch_size": 4,
        "num_return_sequences_in_group": 4,
        "domain_interleave_probs": {"qa": 1.0},
        "data": {"train_files": [str(data / "qa_train.jsonl")], "val_files": [str(data / "qa_val.jsonl")],
                 "prompt_length": 128},
        "rewards": {"qa": {"worker": "exact_match_example", "tag_included": ["qa"]}},
    }
    config["actor_train"]["training_args"] |= {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 2}
    path = tmp_path / "qa.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


@pytest.mark.slow
def test_a_plugin_reads_an_extra_column_during_roll_run_which_reads_and_tokenizes_its_data_once(
    tmp_path, tiny_model, mlflow_db, monkeypatch
):
    """The example plugin counts the `aliases` it was given (its `aliases` metric); every training row has two.
    Before the contract passed the whole row, a run gave the scorer no `aliases` and the metric was 0. And the
    preflight checks load and encode every prompt; the run takes them from there instead of again. (Two tests
    with a `roll run` each until 2026-12-06: docs/testing.md.)"""
    from roll_core.data import loading

    encoded = []
    real = loading.encode_prompt
    monkeypatch.setattr(
        loading, "encode_prompt", lambda tok, row, *args: encoded.append(row["id"]) or real(tok, row, *args)
    )
    uri = mlflow_db(tmp_path / "mlflow.db")
    config = write_qa_run(tmp_path, tiny_model, {"aliases": "one|two"})
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = main(["run", config, f"output_dir={tmp_path / 'run'}", f"tracking.tracking_uri={uri}",
                     "tracking.experiment_name=contract"])
    assert code == 0, printed.getvalue()[-4000:]
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("contract").experiment_id])
    assert run.data.metrics["reward/qa/count"] == 16.0
    assert run.data.metrics["reward/qa/aliases"] == 2.0
    assert len(encoded) == 64 + 4 and len(set(encoded)) == 64 + 4


def test_a_row_column_named_like_the_response_fails_the_data_check(tmp_path, tiny_model):
    config = load_config(write_qa_run(tmp_path, tiny_model, {"response": "a reference response"}), [])
    (check,) = [c for c in preflight(config, dry_run=True) if c.name == "data.train_files"]
    assert not check.ok
    assert "qa_train.jsonl:1: field 'response': the reward contract passes the policy's response" in check.detail

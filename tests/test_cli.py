"""The `roll` command, driven in-process through main(argv)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from roll_pipeline.driver.cli import _print_summary, main
from roll_pipeline.driver.run_change import run_change
from roll_pipeline.driver.significance import PromptOutcome
from tests.conftest import EXAMPLES


def test_help_lists_commands(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for command in ("run", "config", "model", "data"):
        assert command in out


def test_bad_key_gives_one_clear_error_and_exit_2(capsys):
    code = main(["config", "show", str(EXAMPLES / "math_code.yaml"), "actor_train.training_args.learning_rat=1"])
    err = capsys.readouterr().err
    assert code == 2
    assert "actor_train.training_args.learning_rat: unknown key (did you mean 'learning_rate'?)" in err
    assert "Traceback" not in err


def test_missing_config_file(capsys):
    assert main(["run", "no/such.yaml", "--dry-run"]) == 2
    assert "cannot read config file no/such.yaml" in capsys.readouterr().err


def test_config_show_prints_resolved_values(capsys):
    assert main(["config", "show", str(EXAMPLES / "math_code.yaml"), "max_steps=3"]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown["config"]["max_steps"] == 3
    assert Path(shown["config"]["actor_train"]["model_args"]["model_name_or_path"]).is_absolute()
    assert sum(shown["derived"]["domain_shares"].values()) == shown["config"]["rollout_batch_size"]


@pytest.mark.parametrize("example", sorted(p.name for p in EXAMPLES.glob("*.yaml")))
def test_dry_run_passes_on_every_example(example, tiny_model, capsys):
    assert main(["run", str(EXAMPLES / example), "--dry-run"]) == 0, capsys.readouterr()
    out = capsys.readouterr().out
    assert "all checks passed" in out
    assert "[FAIL]" not in out


def test_dry_run_names_a_missing_data_file_and_model(tmp_path, capsys):
    cfg = yaml.safe_load((EXAMPLES / "math_code.yaml").read_text())
    cfg["pretrain"] = str(tmp_path / "no-model")
    cfg["data"]["train_files"] = [str(tmp_path / "missing.jsonl")]
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["run", str(path), "--dry-run"]) == 2
    out = capsys.readouterr().out
    assert f"[FAIL] data.train_files: data file {tmp_path / 'missing.jsonl'} does not exist" in out
    assert f"[FAIL] pretrain: model path {tmp_path / 'no-model'} does not exist" in out


def test_dry_run_names_an_unknown_reward_worker(tmp_path, tiny_model, capsys):
    cfg = yaml.safe_load((EXAMPLES / "math_code.yaml").read_text())
    cfg["rewards"]["math"]["worker"] = "no_such_worker"
    path = EXAMPLES / ".test_unknown_worker.yaml"
    try:
        path.write_text(yaml.safe_dump(cfg))
        assert main(["run", str(path), "--dry-run"]) == 2
    finally:
        path.unlink()
    out = capsys.readouterr().out
    assert "[FAIL] rewards.math.worker:" in out and "no_such_worker" in out


def test_data_generate_writes_files(tmp_path, capsys):
    assert main(["data", "generate", "--out", str(tmp_path)]) == 0
    assert {p.name for p in tmp_path.glob("*.jsonl")} == {
        "math_train.jsonl", "math_val.jsonl", "code_train.jsonl", "code_val.jsonl",
        "word_problems_train.jsonl", "word_problems_val.jsonl",
        "tool_math_train.jsonl", "tool_math_val.jsonl", "tool_math_warmup.jsonl",
        "arithmetic_train.jsonl", "arithmetic_val.jsonl",
    }


def test_model_build_names_the_models_it_knows_when_given_another(capsys, tmp_path):
    assert main(["model", "build", "tiny-qwen3", "--models-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no embedded model named tiny-qwen3" in err
    assert "tiny-qwen2, tiny-qwen2-multi, tiny-qwen2-judge" in err
    assert not list(tmp_path.iterdir())


def finished_summary(first: dict, last: dict, last_step: int = 240) -> dict:
    return {
        "steps": last_step, "wall_s": 200.0, "run_id": "abc", "tracking_uri": "sqlite:///mlflow.db",
        "output_dir": "runs/math_code", "start": {"step": 0}, "end": {"step": last_step},
        "change": {"first_step": 0, "last_step": last_step, "alpha": 0.05, "confidence": 0.95,
                   "rows": run_change(first, last)},
    }


def test_the_end_of_a_run_prints_each_change_with_its_interval_and_flags_the_unsure(capsys):
    first = {f"math/{i}": PromptOutcome("add", 0, 1) for i in range(20)}
    first |= {f"code/{i}": PromptOutcome("list" if i < 5 else "string", 0, 1) for i in range(10)}
    last = {f"math/{i}": PromptOutcome("add", int(i < 15), 1) for i in range(20)}  # 15 won: p = 6e-5
    last |= {f"code/{i}": PromptOutcome("list" if i < 5 else "string", int(i in (0, 5)), 1) for i in range(10)}
    _print_summary(finished_summary(first, last))
    out = capsys.readouterr().out.splitlines()
    assert out[1] == "finished 240 steps in 200 s"
    assert out[2] == "validation accuracy, step 0 against step 240 (paired by prompt):"
    rows = {line.split()[0]: line for line in out[4:10]}
    assert list(rows) == ["all", "code", "list", "string", "math", "add"]
    assert rows["add"].split()[-3:] == ["+0.750", "0.000", "better"]
    assert "0.750 [0.53, 0.89]" in rows["add"]
    assert rows["code"].endswith("not significant")  # 2 of 10 won: p = 0.5
    assert "no significant gain in: code, list, string" in out
    assert any("`make ui`" in line and "`roll report runs/math_code`" in line for line in out)


def test_a_run_that_validated_once_prints_its_accuracies_only(capsys):
    summary = finished_summary({}, {}, last_step=0)
    summary |= {"start": {"step": 0, "val_correct/all/mean": 0.5}, "end": {"step": 0, "val_correct/all/mean": 0.5}}
    _print_summary(summary)
    out = capsys.readouterr().out
    assert "paired by prompt" not in out and "no significant gain" not in out
    assert out.splitlines()[3].split() == ["all", "0.500", "0.500"]

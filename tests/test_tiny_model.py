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
from roll_core.models.folders import DATA_DIR, SHIPPED_DIR
from roll_pipeline.models import tiny
from roll_pipeline.models.build import build_embedded_model, build_problems, current_spec
from roll_pipeline.models.tiny import BUILD_INFO, INSTALLED_FROM, build_tiny_model, weights_sha256
from roll_pipeline.models.tiny_judge import JUDGE_EVAL

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
    """On a fresh machine `make test` builds every embedded model (copies tiny-qwen2's shipped build). Its weights
    are those its build measured (the file is whole), and its own figures are those of a sound build: a new torch
    or transformers that broke the warm-up, the tokenizer or the judge's verdicts fails here. The weights themselves
    depend on the processor (an Intel Xeon and an AMD EPYC build different models from one seed), so a build not
    seen before is reported, not failed: `known_builds` in roll_core/models/embedded.py lists those seen and where."""
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


# The shipped build (examples/shipped-models, roll_core/models/embedded.py's `shipped`): below, the module's 3-step
# build stands in for it, and a build that must not happen raises.
@pytest.fixture
def no_build(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("built, where the shipped build should have been copied")
    monkeypatch.setattr(tiny, "_build_in_pinned_process", refuse)


def test_a_shipped_build_of_the_spec_is_copied_not_built(built, tmp_path, no_build):
    out = build_tiny_model(tmp_path / "model", TRAIN_FILES, seed=0, shipped=built, **FAST)
    info = json.loads((out / BUILD_INFO).read_text())
    assert weights_sha256(out) == weights_sha256(built) == info["weights_sha256"]
    assert info[INSTALLED_FROM] == str(built)
    assert AutoModelForCausalLM.from_pretrained(out).config.model_type == "qwen2"
    first = (out / BUILD_INFO).stat().st_mtime_ns
    build_tiny_model(out, TRAIN_FILES, seed=0, shipped=built, **FAST)
    assert (out / BUILD_INFO).stat().st_mtime_ns == first
    assert not [path for path in out.parent.iterdir() if path.name.startswith(".")]


def test_a_build_made_here_with_other_weights_is_replaced_by_the_shipped_one(built, tmp_path, no_build):
    # What a machine of another vendor has where it built the model before it was shipped: the same spec, other weights.
    own = shutil.copytree(built, tmp_path / "model")
    info = json.loads((own / BUILD_INFO).read_text())
    (own / BUILD_INFO).write_text(json.dumps({**info, "weights_sha256": "0" * 64}))
    build_tiny_model(own, TRAIN_FILES, seed=0, shipped=built, **FAST)
    assert json.loads((own / BUILD_INFO).read_text())["weights_sha256"] == weights_sha256(built)


def test_a_shipped_build_of_another_spec_is_not_used(built, tmp_path):
    out = build_tiny_model(tmp_path / "model", TRAIN_FILES, seed=1, shipped=built, **FAST)
    info = json.loads((out / BUILD_INFO).read_text())
    assert INSTALLED_FROM not in info and info["seed"] == 1
    assert info["weights_sha256"] != weights_sha256(built)


def test_from_scratch_builds_over_a_copy_and_this_machine_builds_what_it_shipped(built, tmp_path):
    out = build_tiny_model(tmp_path / "model", TRAIN_FILES, seed=0, shipped=built, **FAST)
    build_tiny_model(out, TRAIN_FILES, seed=0, shipped=built, from_scratch=True, **FAST)
    info = json.loads((out / BUILD_INFO).read_text())
    assert INSTALLED_FROM not in info
    assert info["weights_sha256"] == weights_sha256(out) == weights_sha256(built)


def test_shipped_weights_that_are_not_the_recorded_ones_are_refused(built, tmp_path, no_build):
    damaged = shutil.copytree(built, tmp_path / "shipped")
    (damaged / "model.safetensors").write_bytes(b"version https://git-lfs.github.com/spec/v1\n")
    with pytest.raises(RuntimeError, match=r"model.safetensors has sha256 .*checkout is damaged"):
        build_tiny_model(tmp_path / "models" / "model", TRAIN_FILES, seed=0, shipped=damaged, **FAST)
    assert not (tmp_path / "models" / "model").exists()
    assert not list((tmp_path / "models").iterdir())


def test_every_embedded_model_is_shipped():
    """`make test` copies every embedded model it uses instead of building it (minutes apiece, and other weights on
    another vendor's processor): a model added without a shipped build would be built in every fresh clone."""
    assert [name for name, model in EMBEDDED_MODELS.items() if not model.shipped] == []


@pytest.mark.parametrize("name", [name for name, model in EMBEDDED_MODELS.items() if model.shipped])
def test_the_shipped_build_is_of_the_current_spec_and_a_known_build(name):
    """A change to the training data, the hyperparameters, BUILD_FORMAT (or the reward model's backbone) leaves the
    shipped build behind: `roll model build` would then build the model on each machine again, and the documented
    figures would be of no machine's."""
    model = EMBEDDED_MODELS[name]
    shipped = ROOT / SHIPPED_DIR / name
    info = json.loads((shipped / BUILD_INFO).read_text())
    spec = current_spec(name, ROOT / DATA_DIR, ROOT / SHIPPED_DIR)
    assert {key: info.get(key) for key in spec} == spec, (
        f"{shipped} is not of the current spec: build {name} with `roll model build {name} --from-scratch` and ship "
        "that folder, its sha256 first in known_builds")
    assert weights_sha256(shipped) == info["weights_sha256"] == model.known_builds[0][0]
    assert INSTALLED_FROM not in info  # a build, not a copy of one
    assert build_problems(name, shipped) == []
    if model.judge:  # its verdicts were measured on these weights, and travel with them
        assert json.loads((shipped / JUDGE_EVAL).read_text())["weights_sha256"] == info["weights_sha256"]


def test_a_shipped_model_is_copied_by_name_with_its_backbone(tmp_path, monkeypatch):
    """`roll model build tiny-qwen2-rm` on a fresh clone: the reward model and the tiny-qwen2 it is built from are
    both copied, nothing is trained; --from-scratch trains the one asked for (here: refused, to show it was asked)."""
    from roll_pipeline.models import tiny_reward

    def refuse(*args, **kwargs):
        raise AssertionError("built, where the shipped build should have been copied")

    monkeypatch.setattr(tiny, "_build_in_pinned_process", refuse)
    monkeypatch.setattr(tiny_reward, "_build_in_pinned_process", refuse)
    out = build_embedded_model("tiny-qwen2-rm", tmp_path, ROOT / DATA_DIR, shipped_dir=ROOT / SHIPPED_DIR)
    for name in ("tiny-qwen2-rm", "tiny-qwen2"):
        info = json.loads((tmp_path / name / BUILD_INFO).read_text())
        assert info[INSTALLED_FROM] == str(ROOT / SHIPPED_DIR / name)
        assert weights_sha256(tmp_path / name) == EMBEDDED_MODELS[name].known_builds[0][0]
    assert out == tmp_path / "tiny-qwen2-rm"
    with pytest.raises(AssertionError, match="should have been copied"):
        build_embedded_model("tiny-qwen2-rm", tmp_path, ROOT / DATA_DIR, shipped_dir=ROOT / SHIPPED_DIR,
                             from_scratch=True)
    assert json.loads((out / BUILD_INFO).read_text())[INSTALLED_FROM]  # a failed build leaves the copy as it was


@pytest.mark.slow
@pytest.mark.check_builds
@pytest.mark.parametrize("name", [name for name, model in EMBEDDED_MODELS.items() if model.shipped])
def test_the_shipped_build_is_what_its_processor_builds(name, tmp_path):
    """The shipped weights come from this code and data: built here from scratch, on a processor of the vendor that
    built them, they are the same bits (`make check-builds`, not `make test`: tiny-qwen2 took 196 s, the tool
    model about 7.5 min, 2026-12-04 on the AMD EPYC). Another vendor builds other weights (known_builds)."""
    where = dict(EMBEDDED_MODELS[name].known_builds)[EMBEDDED_MODELS[name].known_builds[0][0]]
    vendor = next((line.split(":")[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("vendor_id")), "")
    if (vendor == "AuthenticAMD") != where.startswith("AMD"):
        pytest.skip(f"the shipped {name} was built on an {where.split(' (')[0]}; this processor is "
                    f"{vendor or 'unknown'}")
    built_here = build_embedded_model(name, tmp_path, ROOT / DATA_DIR, from_scratch=True)
    assert weights_sha256(built_here) == weights_sha256(ROOT / SHIPPED_DIR / name)

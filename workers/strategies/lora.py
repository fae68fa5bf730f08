"""LoRA adapters with `peft`: wrapping a model so that only its adapters train, and moving the adapters alone.

The trained clusters (actor_train, critic) wrap their model with `with_lora` before DeepSpeed sees it, so the
optimizer holds the adapters' parameters only and the base weights stay frozen, bitwise. actor_infer wraps its
model the same way and takes the trained adapters after each step (`adapter_state`, `load_adapter_state`): a sync
moves the adapters, never the base weights, which never change. The reference is the base model itself:
`peft`'s `disable_adapter()` on actor_train's own model, with no second copy of the weights.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping

import torch

from roll_core.config.clusters import VLLM_MAX_LORA_RANKS, LoraArgs

#: peft's task types: which head the wrapped model has (the critic's value head is a token classifier, which peft
#: trains along with the adapters, as a module to save).
CAUSAL_LM = "CAUSAL_LM"
TOKEN_CLS = "TOKEN_CLS"


def lora_config(lora: LoraArgs, task_type: str = CAUSAL_LM):
    from peft import LoraConfig

    return LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        task_type=task_type,
    )


def with_lora(model: torch.nn.Module, lora: LoraArgs, task_type: str = CAUSAL_LM) -> torch.nn.Module:
    """`model` with LoRA adapters on `lora.target_modules`; every base parameter frozen. Raises ValueError naming
    the key when none of the target modules exists in the model."""
    from peft import get_peft_model

    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    if not names & set(lora.target_modules):
        raise ValueError(
            f"lora.target_modules: none of {list(lora.target_modules)} is a layer of this model "
            f"({type(model).__name__}); its linear layers are {sorted(linear_layer_names(model))}"
        )
    return get_peft_model(model, lora_config(lora, task_type))


def linear_layer_names(model: torch.nn.Module) -> set[str]:
    return {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' tensors (and a head trained with them), on the CPU: what a weight sync moves."""
    from peft import get_peft_model_state_dict

    return {k: v.detach().to("cpu") for k, v in get_peft_model_state_dict(model).items()}


def load_adapter_state(model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Copy `adapter_state`'s tensors into `model`'s adapters, in place. Raises ValueError when the names do not
    match the model's adapters exactly (another rank, target list or model: a sync that would half-load)."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    own = set(get_peft_model_state_dict(model))
    if set(state) != own:
        extra, lacking = sorted(set(state) - own), sorted(own - set(state))
        raise ValueError(
            f"the adapter state does not match this model's adapters: {len(extra)} unknown tensor(s) "
            f"{extra[:3]}, {len(lacking)} missing {lacking[:3]} (actor_train.lora must equal the generator's)"
        )
    with torch.no_grad():
        set_peft_model_state_dict(model, dict(state))


def vllm_max_lora_rank(rank: int) -> int:
    """The smallest `max_lora_rank` vLLM accepts that holds adapters of `rank`; ValueError above its largest."""
    for slot in VLLM_MAX_LORA_RANKS:
        if rank <= slot:
            return slot
    raise ValueError(f"lora.rank: vLLM serves adapters up to rank {VLLM_MAX_LORA_RANKS[-1]}, got {rank}")


def write_adapter_folder(state: Mapping[str, torch.Tensor], lora: LoraArgs, folder: str, base: str | None) -> None:
    """`state` (`adapter_state`'s tensors) as a peft adapter folder: adapter_config.json and
    adapter_model.safetensors, the folder vLLM's LoRARequest and `PeftModel.from_pretrained` load."""
    from safetensors.torch import save_file

    config = lora_config(lora)
    config.base_model_name_or_path = base
    os.makedirs(folder, exist_ok=True)
    config.save_pretrained(folder)
    save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(folder, "adapter_model.safetensors"))


#: Where a checkpoint keeps the adapters (peft's own folder: adapter_config.json and the adapter's weights), beside
#: hf_model/ (the merged weights, which `from_pretrained` and `roll serve` load as they load any model).
ADAPTER_FOLDER = "lora_adapter"


def merged_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The merged model's weights (base + (alpha / rank) * B @ A) on the CPU, by the base model's own names, one
    layer's delta at a time: neither the trained model nor a copy of it on its device is changed or made (a GPU
    holding the policy has no room for a second one)."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    merged: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in base.state_dict().items():
        if ".lora_" in name or tensor.data_ptr() in seen:  # a tied weight (lm_head) is saved once, as from_pretrained
            continue                                        # expects it
        seen.add(tensor.data_ptr())
        merged[name.replace(".base_layer.", ".")] = tensor.detach().to("cpu", copy=True)
    for name, module in base.named_modules():
        if isinstance(module, LoraLayer):
            with torch.no_grad():
                merged[f"{name}.weight"] += module.get_delta_weight("default").to("cpu")
    return merged


def save_lora(model: torch.nn.Module, folder: str) -> None:
    """The adapters to `folder`/lora_adapter and the merged weights to `folder`/hf_model; the trained model keeps
    its adapters unmerged."""
    model.save_pretrained(os.path.join(folder, ADAPTER_FOLDER))
    model.get_base_model().save_pretrained(os.path.join(folder, "hf_model"), state_dict=merged_state(model))


class AdapterFolderError(ValueError):
    """A folder given as a LoRA adapter holds none, or its base model cannot be found; the message says which."""


def adapter_folder(path: str | os.PathLike) -> str:
    """The adapter folder that `path` names: the folder itself (with adapter_config.json), or a checkpoint level
    above it (step_<N>/actor_train/lora_adapter, step_<N>/actor_train, step_<N>)."""
    path = os.fspath(path)
    for candidate in (path, os.path.join(path, ADAPTER_FOLDER), os.path.join(path, "actor_train", ADAPTER_FOLDER)):
        if os.path.isfile(os.path.join(candidate, "adapter_config.json")):
            return candidate
    raise AdapterFolderError(
        f"{path} holds no LoRA adapter (adapter_config.json, in it or in {ADAPTER_FOLDER}/ or "
        f"actor_train/{ADAPTER_FOLDER}/ under it): a run with actor_train.lora writes one at each checkpoint"
    )


def merge_adapter(path: str | os.PathLike, out: str | os.PathLike, base: str | None = None) -> str:
    """Write base + adapter as one Hugging Face model folder at `out` (weights, config, and the base's tokenizer
    where it has one). `base`: the base model's folder, by default the one the adapter names. Returns the base
    used."""
    import json

    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = adapter_folder(path)
    with open(os.path.join(folder, "adapter_config.json")) as f:
        named = json.load(f).get("base_model_name_or_path")
    base = base or named
    if not base or not os.path.isdir(base):
        raise AdapterFolderError(
            f"the adapter's base model {base!r} is not a folder here: name it with --base PATH"
        )
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), folder)
    model.merge_and_unload().save_pretrained(out)
    with contextlib.suppress(OSError, ValueError):  # a base without tokenizer files: the weights alone
        AutoTokenizer.from_pretrained(base).save_pretrained(out)
    return base

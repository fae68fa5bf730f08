"""Loading models and tokenizers the way a user's real checkpoint is loaded: `from_pretrained` on a path."""

from __future__ import annotations

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForTokenClassification,
    AutoTokenizer,
    PreTrainedTokenizerBase,
)

from roll_core.config import ModelArgs
from roll_core.models import row_attention

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_tokenizer(model_args: ModelArgs) -> PreTrainedTokenizerBase:
    tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_causal_lm(model_args: ModelArgs, packed: bool = False) -> torch.nn.Module:
    """The causal LM of model_args; `packed`: its forwards will run packed rows (the section's
    use_sequence_packing)."""
    return AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path, **model_kwargs(model_args, packed))


def model_kwargs(model_args: ModelArgs, packed: bool = False) -> dict:
    """from_pretrained's arguments from model_args: the dtype, and the attention kernel where one is named. For
    packed rows, sdpa (named or transformers' default) runs row by row (roll_core/models/row_attention.py)."""
    kwargs = {"dtype": DTYPES[model_args.dtype]}
    kernel = row_attention.kernel_for(model_args.attn_implementation, packed)
    if kernel is not None:
        kwargs["attn_implementation"] = kernel
    return kwargs


def load_value_model(model_args: ModelArgs, packed: bool = False) -> torch.nn.Module:
    """The policy's backbone with a fresh one-output head per token (the critic); `packed` as in load_causal_lm.

    Without dropout: transformers gives a token-classification head dropout 0.1 by default, so the values the
    critic trains on (train mode) would be noisy copies of the old values it is clipped against (computed in eval
    mode), and the clipped value loss would compare the two."""
    config = AutoConfig.from_pretrained(model_args.model_name_or_path, num_labels=1)
    config.classifier_dropout = 0.0
    if hasattr(config, "attention_dropout"):
        config.attention_dropout = 0.0
    model = AutoModelForTokenClassification.from_pretrained(
        model_args.model_name_or_path, config=config, **model_kwargs(model_args, packed)
    )
    for module in model.modules():  # any other dropout layer the architecture builds
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model


def eos_token_ids(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if ids is None:
        ids = tokenizer.eos_token_id
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    if not ids:
        raise ValueError("the model has no end-of-sequence token (generation_config.eos_token_id or tokenizer)")
    return ids

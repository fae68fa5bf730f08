"""The vLLM inference strategy for GPU clusters: selected with actor_infer.strategy_args.strategy_name: vllm."""

from __future__ import annotations

import importlib.util


class StrategyUnavailable(RuntimeError):
    """A configured strategy cannot run on this host; the message says what is missing."""


def check_vllm_available() -> None:
    """Raise StrategyUnavailable naming what is missing: the vllm package or a CUDA GPU."""
    missing = []
    if importlib.util.find_spec("vllm") is None:
        missing.append("the vllm package (pip install 'roll-pipeline[gpu]')")
    import torch

    if not torch.cuda.is_available():
        missing.append("a CUDA GPU (torch.cuda.is_available() is False)")
    if missing:
        raise StrategyUnavailable(
            "actor_infer.strategy_args.strategy_name: vllm needs " + " and ".join(missing)
            + "; use strategy_name: hf_infer on this host"
        )

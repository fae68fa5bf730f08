"""What the vLLM strategy does without an engine: the sampling-parameter mapping, the weight-name mapping, the
output conversion, and a clear error on a host without vLLM or a GPU."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch

from roll_pipeline.config import GeneratingArgs, load_config
from tests.conftest import EXAMPLES
from workers.strategies.vllm_infer import (
    StrategyUnavailable,
    check_vllm_available,
    outputs_to_tensors,
    sampled_token_log_probs,
    sampling_kwargs,
    vllm_weight_items,
)


def test_sampling_parameters_for_sampling():
    kw = sampling_kwargs(GeneratingArgs(max_new_tokens=48, temperature=0.7, top_p=0.9, top_k=0), 8, [2, 5], seed=3)
    assert kw == {
        "n": 8, "max_tokens": 48, "stop_token_ids": [2, 5], "skip_special_tokens": False,
        "include_stop_str_in_output": True, "detokenize": False,
        "temperature": 0.7, "top_p": 0.9, "top_k": -1, "seed": 3,
    }
    assert sampling_kwargs(GeneratingArgs(top_k=20), 1, [2])["top_k"] == 20


def test_greedy_is_temperature_zero_whatever_the_sampling_fields_say():
    kw = sampling_kwargs(GeneratingArgs(do_sample=False, temperature=0.3, top_p=0.5, top_k=7), 1, [2])
    assert (kw["temperature"], kw["top_p"], kw["top_k"], kw["n"]) == (0.0, 1.0, -1, 1)
    assert "seed" not in kw


def test_weight_names_lose_wrapper_prefixes_and_tied_or_computed_tensors():
    t = torch.zeros(1)
    state = {
        "module.model.embed_tokens.weight": t,
        "_orig_mod.model.layers.0.self_attn.q_proj.weight": t,
        "model.layers.0.self_attn.rotary_emb.inv_freq": t,
        "lm_head.weight": t,
    }
    assert [n for n, _ in vllm_weight_items(state, tie_word_embeddings=True)] == [
        "model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
    ]
    assert "lm_head.weight" in [n for n, _ in vllm_weight_items(state, tie_word_embeddings=False)]


def test_weight_names_of_the_tiny_model_pass_through(tiny_model):
    from safetensors.torch import load_file

    state = load_file(str(tiny_model / "model.safetensors"))
    names = [n for n, _ in vllm_weight_items(state, tie_word_embeddings=False)]
    assert names == [n for n in state if not n.endswith("rotary_emb.inv_freq")]


def test_outputs_become_right_padded_tensors_with_finish_reasons():
    out = outputs_to_tensors([([5, 6, 2], "stop"), ([7], "length"), ([], "abort")], pad_id=0)
    assert out["response_ids"].tolist() == [[5, 6, 2], [7, 0, 0], [0, 0, 0]]
    assert out["response_mask"].tolist() == [[1, 1, 1], [1, 0, 0], [0, 0, 0]]
    assert out["finish_reason"] == ["stop", "length", "length"]


@pytest.mark.skipif(
    importlib.util.find_spec("vllm") is not None and torch.cuda.is_available(), reason="vLLM can run here"
)
def test_a_host_without_vllm_or_gpu_gets_a_clear_error():
    with pytest.raises(StrategyUnavailable, match="strategy_name: vllm needs .*use strategy_name: hf_infer"):
        check_vllm_available()
    cfg = load_config(EXAMPLES / "math_code.yaml", ["actor_infer.strategy_args.strategy_name=vllm"]).config
    from workers.actor_infer import make_infer_strategy

    with pytest.raises(StrategyUnavailable, match="a CUDA GPU"):
        make_infer_strategy(cfg)


def test_log_probs_of_the_sampled_tokens_come_out_padded_like_the_tokens():
    logprob = SimpleNamespace
    steps = [{5: logprob(logprob=-0.5), 9: logprob(logprob=-2.0)}, {6: logprob(logprob=-0.25)}, {2: logprob(logprob=-1.0)}]
    assert sampled_token_log_probs([5, 6, 2], steps) == [-0.5, -0.25, -1.0]
    assert sampled_token_log_probs([5], None) is None
    out = outputs_to_tensors([([5, 6, 2], "stop", [-0.5, -0.25, -1.0]), ([7], "length", [-3.0])], pad_id=0)
    assert out["infer_log_probs"].tolist() == [[-0.5, -0.25, -1.0], [-3.0, 0.0, 0.0]]
    # A row without log-probs (the engine was not asked for them): no infer_log_probs at all.
    assert "infer_log_probs" not in outputs_to_tensors([([5], "stop", None), ([7], "stop", [-1.0])], pad_id=0)
    assert sampling_kwargs(GeneratingArgs(), 2, [2], with_log_probs=True)["logprobs"] == 0
    assert "logprobs" not in sampling_kwargs(GeneratingArgs(), 2, [2])

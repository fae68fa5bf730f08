"""When colocated GPU clusters take turns, decided from the config alone and tested on CPU: whether actor_infer
frees its GPU after rollouts and validation, the order the clusters start in, the memory the clusters that share
a GPU need together, and the GPU memory each step logs."""

from __future__ import annotations

import pytest
import torch

from roll_core.config import load_config
from roll_core.tracking import system
from roll_pipeline.distributed.placement import start_stages
from roll_pipeline.driver import memory_fit
from tests.conftest import EXAMPLES

COLOCATED = EXAMPLES / "gpu" / "qwen2.5-0.5b-1x8-colocated.yaml"
SEPARATE = EXAMPLES / "gpu" / "qwen2.5-1.5b-1x8-separate.yaml"


def config(path, *overrides):
    return load_config(path, list(overrides)).config


def test_vllm_sleeps_only_where_it_shares_its_gpus_and_generation_is_synchronous():
    assert config(COLOCATED).infer_offloads
    assert not config(SEPARATE).infer_offloads  # actor_infer on GPUs 4-7 of its own
    # the separate example turns sleep mode off; on GPUs of its own vLLM stays awake even with it on
    assert not config(SEPARATE, "actor_infer.strategy_args.strategy_config={enable_sleep_mode: true}").infer_offloads
    assert not config(COLOCATED, "async_generation_ratio=1").infer_offloads
    off = "actor_infer.strategy_args.strategy_config={gpu_memory_utilization: 0.4, enable_sleep_mode: false}"
    assert not config(COLOCATED, off).infer_offloads
    assert not config(EXAMPLES / "math_code.yaml").infer_offloads  # hf on the CPU, no offload_states
    assert config(EXAMPLES / "math_code.yaml", "actor_infer.offload_states=true").infer_offloads


def test_colocated_vllm_starts_alone_before_the_clusters_whose_memory_it_would_count_as_taken():
    assert start_stages(config(COLOCATED)) == [["actor_infer"], ["actor_train", "reference"]]
    assert start_stages(config(SEPARATE)) == [["actor_train", "actor_infer", "reference"]]
    assert start_stages(config(EXAMPLES / "ppo_gae.yaml")) == [["actor_train", "actor_infer", "critic"]]


def test_clusters_sharing_a_gpu_are_added_together(tiny_model):
    p = memory_fit.parameter_count(tiny_model)
    # bfloat16 (the example's dtype): actor_train under ZeRO-2 over 8 ranks holds 2 + 14 / 8 = 3.75 B per
    # parameter, the reference 2 B, vLLM half the GPU; a GPU of 4 B per parameter holds each alone, not all three
    gpu = 4 * p
    pretrain = f"pretrain={tiny_model}"
    half = "actor_infer.strategy_args.strategy_config={gpu_memory_utilization: 0.5, enable_sleep_mode: false}"
    cfg = config(COLOCATED, pretrain, "actor_train.offload_states=false", "reference.offload_states=false", half)
    (problem,) = memory_fit.shared_gpu_problems(cfg, gpu)
    assert problem.startswith("GPU 0 is shared by actor_train") and "actor_infer" in problem and "reference" in problem
    assert "set offload_states on the colocated sections" in problem
    assert memory_fit.gpu_problems(cfg, gpu) == [problem]  # each alone fits its share: only the sum is refused
    # the example as written takes turns (offload_states on both, vLLM asleep between rollouts): the peak is the
    # largest of them, actor_train's 3.75 B per parameter
    assert memory_fit.shared_gpu_problems(config(COLOCATED, pretrain, half.replace("false", "true")), gpu) == []
    assert memory_fit.shared_gpu_problems(config(COLOCATED, pretrain, half.replace("false", "true")), 3 * p)


def test_no_gpu_memory_is_reported_where_torch_sees_no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert system.process_gpu_bytes() == {}
    rss, gpu = system.process_memory()
    assert rss > 0 and gpu == {}
    assert system.memory_metrics(["actor_train"], [(2 * 2**20, {})]) == {"memory/actor_train_rss_mb": 2.0}


def test_gpu_memory_is_reported_per_cluster_and_per_device_where_cuda_exists(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (30 * 2**20, 80 * 2**20))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda: 12 * 2**20)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda: 20 * 2**20)
    gpu = system.process_gpu_bytes()
    assert gpu == {"reserved": 12 * 2**20, "peak_reserved": 20 * 2**20, "device_used": 50 * 2**20}
    other = {"reserved": 4 * 2**20, "peak_reserved": 4 * 2**20, "device_used": 70 * 2**20}
    metrics = system.memory_metrics(["actor_train", "actor_train", "actor_infer"], [(2**20, gpu), (2**20, gpu), (2**20, other)])
    assert metrics["memory/actor_train_gpu_reserved_mb"] == 24.0
    assert metrics["memory/actor_train_gpu_peak_reserved_mb"] == 40.0
    assert metrics["memory/actor_infer_gpu_reserved_mb"] == 4.0
    assert metrics["memory/gpu_device_used_mb"] == 70.0
    assert metrics["memory/actor_train_rss_mb"] == 2.0


class RecordingCluster:
    def __init__(self):
        self.calls = []

    def call(self, method, *args):
        self.calls.append((method, *args))
        return []


@pytest.mark.parametrize(("example", "calls"), [(COLOCATED, [("offload", False)]), (SEPARATE, [])])
def test_vllm_sharing_its_gpus_sleeps_after_validation_keeping_its_weights(example, calls, monkeypatch):
    from roll_pipeline.driver.pipeline import RLVRPipeline

    pipeline = RLVRPipeline(load_config(example))
    pipeline.runtime.actor_infer, pipeline.answer_keys = RecordingCluster(), {}
    monkeypatch.setattr(pipeline, "_settle", lambda: None)
    monkeypatch.setattr(pipeline.runtime, "on_schedulers", lambda *args: [])  # no validation prompts: only the phases
    pipeline.validate()
    assert pipeline.runtime.actor_infer.calls == calls

"""Every GPU example passes `roll run --dry-run` on a CPU machine without downloading anything, and prints the
plan: the GPU pool, which clusters share which GPUs, and what only the GPU cluster can check."""

from __future__ import annotations

import re
import socket

import pytest
import torch

from roll_core.config import load_config
from roll_pipeline.driver.cli import main
from roll_pipeline.driver.preflight import preflight
from tests.conftest import EXAMPLES

GPU_EXAMPLES = sorted(p.name for p in (EXAMPLES / "gpu").glob("*.yaml"))

PLANS = {
    "multi_domain_vllm.yaml": [
        "no device_mapping: Ray places actor_train (1 worker x 1 GPU), actor_infer (1 worker x 1 GPU), "
        "reference (1 worker x 1 GPU) wherever it finds the GPUs (3 in all)",
    ],
    "qwen2.5-0.5b-1x8-colocated.yaml": [
        "GPU pool: 1 node x 8 GPUs",
        "GPUs 0-7 (node 0): actor_train (8 workers x 1 GPU), actor_infer (8 workers x 1 GPU), "
        "reference (8 workers x 1 GPU): colocated, 3 clusters share each GPU",
    ],
    "qwen2.5-1.5b-1x8-separate.yaml": [
        "GPU pool: 1 node x 8 GPUs",
        "GPUs 0-3 (node 0): actor_train (4 workers x 1 GPU), reference (4 workers x 1 GPU): colocated",
        "GPUs 4-7 (node 0): actor_infer (4 workers x 1 GPU): not shared",
    ],
    "qwen2.5-7b-2x8-colocated.yaml": [
        "GPU pool: 2 nodes x 8 GPUs",
        "GPUs 0-15 (nodes 0-1): actor_train (16 workers x 1 GPU), actor_infer (8 workers x 2 GPUs), "
        "reference (16 workers x 1 GPU): colocated",
    ],
    "qwen2.5-7b-2x8-separate.yaml": [
        "GPU pool: 2 nodes x 8 GPUs",
        "GPUs 0-7 (node 0): actor_train (8 workers x 1 GPU), reference (8 workers x 1 GPU): colocated",
        "GPUs 8-15 (node 1): actor_infer (4 workers x 2 GPUs): not shared",
    ],
    "smollm2-1gpu-colocated.yaml": [
        "GPU pool: 1 node x 1 GPUs",
        "GPUs 0 (node 0): actor_train (1 worker x 1 GPU), actor_infer (1 worker x 1 GPU), reference (1 worker x 1 "
        "GPU): colocated, 3 clusters share each GPU",
    ],
}


@pytest.fixture
def offline(monkeypatch):
    """The hub is off, no Ray cluster is configured, and any connection beyond this machine fails the test."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    attempts = []
    connect, getaddrinfo = socket.socket.connect, socket.getaddrinfo
    local = ("127.0.0.1", "localhost", "::1", None)

    def guarded_connect(sock, address):
        host = address[0] if isinstance(address, tuple) else address
        if host not in local and not str(host).startswith("/"):
            attempts.append(address)
            raise OSError(f"test: no network ({address})")
        return connect(sock, address)

    def guarded_lookup(host, *args, **kwargs):
        if host not in local:
            attempts.append(host)
            raise OSError(f"test: no network ({host})")
        return getaddrinfo(host, *args, **kwargs)

    monkeypatch.setattr(socket.socket, "connect", guarded_connect)
    monkeypatch.setattr(socket, "getaddrinfo", guarded_lookup)
    yield attempts


def test_every_gpu_example_has_an_expected_plan():
    assert sorted(PLANS) == GPU_EXAMPLES


@pytest.mark.parametrize("example", GPU_EXAMPLES)
def test_dry_run_prints_the_plan_and_passes_on_a_cpu_machine(example, offline, capsys):
    code = main(["run", str(EXAMPLES / "gpu" / example), "--dry-run"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "[FAIL]" not in out and "all checks passed" in out
    for line in PLANS[example]:
        assert line in out, f"{line!r} not in:\n{out}"
    pretrain = load_config(EXAMPLES / "gpu" / example).config.pretrain
    if pretrain.startswith("/"):  # a local folder (the one-GPU example's SmolLM2, from `roll model fetch`)
        assert "[ok] pretrain" in out
    else:
        assert f"pretrain: hub id {pretrain}" in out  # [skip] here; [ok] where it is in the local HF cache
    if not torch.cuda.is_available():
        assert "[skip] actor_infer.strategy_args.strategy_name: vllm is" in out
        assert "this host has 0 GPU(s), so not checked here" in out
        assert "they do not fail a dry run" in out
        if example == "qwen2.5-7b-2x8-separate.yaml":  # packed rows through FlashAttention, checked on the GPU nodes
            for section in ("actor_train", "reference"):
                assert (f"[skip] {section}.model_args.attn_implementation: flash_attention_2: this host has no CUDA "
                        f"GPU; flash_attn must be importable on {section}'s GPU nodes") in out
    assert offline == [], f"the dry run tried to reach {offline}"


def test_a_worker_split_across_nodes_fails_the_dry_run(offline, capsys):
    config = EXAMPLES / "gpu" / "qwen2.5-7b-2x8-colocated.yaml"
    assert main(["run", str(config), "actor_infer.device_mapping=list(range(1,17))", "--dry-run"]) == 2
    out = capsys.readouterr().out
    assert (
        "[FAIL] plan: actor_infer.device_mapping: worker 3 gets GPUs [7, 8], which lie on nodes [0, 1]" in out
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has a GPU")
def test_a_real_run_here_stops_before_starting_ray(offline):
    # Without a Ray cluster to join, the run would start Ray on this GPU-less host and wait for GPUs forever.
    resolved = load_config(EXAMPLES / "gpu" / "qwen2.5-7b-2x8-separate.yaml")
    failed = {c.name: c.detail for c in preflight(resolved) if not c.ok}
    # vLLM's CPU build (the dev venv's) cannot serve a GPU section; without any vLLM the package is named
    assert re.search("vllm needs|installed vLLM is its CPU build", failed["actor_infer.strategy_args.strategy_name"])
    assert failed["plan"].startswith(
        "needs 2 nodes x 8 GPUs; this host has 0 GPU(s) and no Ray cluster is configured"
    )
    assert failed["actor_train.model_args.attn_implementation"].startswith(
        "flash_attention_2 needs the flash-attn package and a CUDA GPU, and "
    )


def test_hub_ids_are_looked_up_on_disk_only_even_with_the_hub_reachable(offline, monkeypatch, capsys):
    monkeypatch.delenv("HF_HUB_OFFLINE")
    assert main(["run", str(EXAMPLES / "gpu" / "qwen2.5-7b-2x8-separate.yaml"), "--dry-run"]) == 0
    assert offline == [], f"the dry run tried to reach {offline}"
    assert "pretrain: hub id Qwen/Qwen2.5-7B-Instruct" in capsys.readouterr().out


def test_a_hub_model_in_the_local_cache_is_checked(offline, monkeypatch, tmp_path, tiny_model, capsys):
    import shutil

    from huggingface_hub import constants

    repo = tmp_path / "hub" / "models--acme--tiny-qwen2"
    (repo / "snapshots" / "abc123").mkdir(parents=True)
    shutil.copy(tiny_model / "config.json", repo / "snapshots" / "abc123" / "config.json")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    config = EXAMPLES / "gpu" / "qwen2.5-0.5b-1x8-colocated.yaml"
    assert main(["run", str(config), "pretrain=acme/tiny-qwen2", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "[ok] pretrain: hub id acme/tiny-qwen2 (qwen2; config from the local Hugging Face cache)" in out
    assert offline == []

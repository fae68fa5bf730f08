"""One RL step of examples/gpu/qwen2.5-0.5b-1x8-colocated.yaml shrunk to one GPU, with vLLM and with hf inference.

Marked `gpu`: skipped (the reason printed by -ra) where torch sees no CUDA device, as on every machine of this
project's CI. The example's hub model is not reachable offline, so the step runs the same layout (every cluster
colocated on GPU 0, bfloat16, ZeRO-2 with offloaded states, the reference offloaded between its log-probs) on
SmolLM2-135M-Instruct where `make real-model` wrote it, else on the embedded tiny model."""

from __future__ import annotations

import contextlib
import io

import pytest
import torch

from roll_core.config import load_config
from roll_pipeline.driver.cli import main
from tests.conftest import EXAMPLES, ROOT, TINY_MODEL
from workers.strategies.vllm_infer import vllm_build

SMOLLM2 = EXAMPLES / "models" / "smollm2-135m-instruct"

CONFIG = EXAMPLES / "gpu" / "qwen2.5-0.5b-1x8-colocated.yaml"


def one_gpu_overrides(engine: str, out, uri: str, transport: str = "rpc") -> list[str]:
    model = SMOLLM2 if (SMOLLM2 / "config.json").is_file() else TINY_MODEL
    per_cluster = []
    for section in ("actor_train", "actor_infer", "reference"):
        per_cluster += [f"{section}.device_mapping=[0]", f"{section}.world_size=1"]
    infer_config = "{}"
    if engine == "vllm":
        infer_config = f"{{gpu_memory_utilization: 0.3, enable_sleep_mode: true, weight_transport: {transport}}}"
    return [
        f"pretrain={model}",
        "ray.num_gpus_per_node=1",
        *per_cluster,
        "actor_train.offload_states=true",
        "reference.offload_states=true",
        f"actor_infer.offload_states={str(engine == 'hf_infer').lower()}",
        "actor_train.training_args.per_device_train_batch_size=8",
        "actor_train.training_args.gradient_accumulation_steps=2",
        f"actor_infer.strategy_args.strategy_name={engine}",
        f"actor_infer.strategy_args.strategy_config={infer_config}",
        "actor_infer.generating_args.max_new_tokens=64",
        "validation.generating_args.max_new_tokens=64",
        "rollout_batch_size=4",  # 3 math prompts and 1 code prompt (shares 0.75 / 0.25)
        "max_steps=1",
        "save_steps=1",
        "eval_steps=1",
        "validation.max_prompts=4",
        f"output_dir={out}",
        f"tracking.tracking_uri={uri}",
        "tracking.experiment_name=gpu",
    ]


@pytest.mark.parametrize("engine", ["hf_infer", "vllm", "vllm+ipc"])
def test_the_one_gpu_step_config_loads_with_every_domain_given_prompts(engine, tmp_path):
    engine, _, transport = engine.partition("+")
    resolved = load_config(CONFIG, one_gpu_overrides(engine, tmp_path / "run", "sqlite:///unused.db", transport or "rpc"))
    cfg = resolved.config
    assert cfg.actor_infer.strategy_args.strategy_name == engine
    assert cfg.actor_infer.weight_transport == (transport or "rpc")
    assert all(section.device_mapping == [0] for section in (cfg.actor_train, cfg.actor_infer, cfg.reference))
    assert resolved.domain_shares == {"math": 3, "code": 1}


# PPO with GAE: a critic on GPU 0 too (ZeRO-2 bf16, offloaded between its phases), beside the three others.
CRITIC = [
    "adv_estimator=gae",
    "critic_warmup=0",
    "critic={device_mapping: [0], world_size: 1, num_gpus_per_worker: 1, model_args: {dtype: bfloat16},"
    " offload_states: true, training_args: {learning_rate: 1.0e-5, warmup_steps: 0, per_device_train_batch_size: 8,"
    " gradient_accumulation_steps: 2}, strategy_args: {strategy_name: deepspeed_train,"
    " strategy_config: {zero_optimization: {stage: 2}}}}",
]


def test_the_one_gpu_step_with_a_critic_puts_four_clusters_on_gpu_0(tmp_path):
    cfg = load_config(CONFIG, one_gpu_overrides("hf_infer", tmp_path / "run", "sqlite:///unused.db") + CRITIC).config
    assert cfg.adv_estimator == "gae" and cfg.critic.device_mapping == [0] and cfg.reference.device_mapping == [0]


@pytest.mark.parametrize("engine", ["hf_infer", "vllm", "hf_infer+critic", "vllm+ipc"])
@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="no CUDA device here: the GPU step runs only where torch sees a GPU (docs/placement.md, 'GPU tests')",
)
def test_one_rl_step_of_the_colocated_example_on_one_gpu(engine, tmp_path, mlflow_db):
    from mlflow.tracking import MlflowClient

    if engine == "vllm":  # a failure, not a skip: `make test-gpu` must not pass without the engine it tests
        assert vllm_build() == "cuda", "vLLM's CUDA build is not installed: pip install 'roll-pipeline[gpu]'"
    if engine == "vllm+ipc":
        assert vllm_build() == "cuda", "vLLM's CUDA build is not installed: pip install 'roll-pipeline[gpu]'"
    with_critic = engine.endswith("+critic")
    ipc = engine.endswith("+ipc")  # two steps: the sync after step 1 goes by CUDA IPC (vLLM's weight transfer)
    engine = engine.removesuffix("+critic").removesuffix("+ipc")
    uri = mlflow_db(tmp_path / "mlflow.db")
    overrides = one_gpu_overrides(engine, tmp_path / "run", uri, "ipc" if ipc else "rpc")
    overrides += (CRITIC if with_critic else []) + (["max_steps=2", "save_steps=2", "infer_is_cap=2.0"] if ipc else [])
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = main(["run", str(CONFIG), *overrides])
    assert code == 0, printed.getvalue()[-4000:]
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("gpu").experiment_id])
    assert run.data.metrics["throughput/generated_tokens"] > 0
    assert "actor/pg_loss" in run.data.metrics
    # Every cluster shares GPU 0: each reserved GPU memory during the step, and the device shows it in use.
    for cluster in ("actor_train", "actor_infer", "reference") + (("critic",) if with_critic else ()):
        assert run.data.metrics[f"memory/{cluster}_gpu_peak_reserved_mb"] > 0, cluster
    if with_critic:
        assert "critic/value_loss" in run.data.metrics
    assert run.data.metrics["memory/gpu_device_used_mb"] > 0
    last = 2 if ipc else 1
    assert (tmp_path / "run" / "checkpoints" / f"step_{last}" / "actor_train" / "hf_model" / "model.safetensors").is_file()
    if ipc:  # step 2 was generated with the weights step 1's IPC sync brought: printed, no bound measured yet
        kl = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "offpolicy/kl_infer_old")}
        print(f"offpolicy/kl_infer_old by step (bf16 vLLM vs bf16 actor_train): {kl}")
        assert sorted(kl) == [1, 2] and all(v == v for v in kl.values()), kl


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has a CUDA device")
def test_make_test_gpu_fails_naming_what_is_missing_on_a_host_without_cuda():
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "tests.require_gpu"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 1
    assert "make test-gpu: torch sees no CUDA device" in done.stderr
    if vllm_build() != "cuda":
        assert "make test-gpu: " + ("vLLM is not installed" if vllm_build() is None else "the installed vLLM is its CPU build") in done.stderr

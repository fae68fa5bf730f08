"""The device paths of workers/ on a real GPU, without Ray: hf inference and the trainer's log-probs on CUDA, the
sampling distribution there, and DeepSpeed's offload/reload of a ZeRO-2 engine.

Marked `gpu`: skipped (the reason printed by -ra) where torch sees no CUDA device, as on this project's CI. The
CPU twins of these checks are tests/test_devices.py (a meta device stands for the GPU), tests/test_sampling.py
and tests/test_offload.py; tests/test_gpu_step.py runs a whole RL step through Ray."""

from __future__ import annotations

import pytest
import torch

from roll_core.batch import Batch
from roll_core.config import load_config
from roll_core.models.forward import batched_log_probs
from roll_core.models.sampling import SamplingDistribution
from tests.conftest import EXAMPLES
from tests.test_sampling import assert_sampling_matches_the_log_probs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="no CUDA device here: these checks run only where torch sees a GPU (docs/placement.md, 'GPU tests')",
    ),
]
GPU = torch.device("cuda", 0)


def infer_section(tiny_model, *extra: str):
    overrides = [f"actor_infer.model_args.model_name_or_path={tiny_model}", *extra]
    return load_config(EXAMPLES / "math_code.yaml", overrides).config


@pytest.fixture(scope="module")
def gpu_strategy(tiny_model):
    from workers.strategies.hf_infer import HFInferStrategy

    return HFInferStrategy(infer_section(tiny_model).actor_infer, device=GPU)


@pytest.mark.parametrize(
    "temperature, top_p, top_k", [(1.0, 1.0, 0), (0.7, 0.9, 0), (1.3, 1.0, 8)], ids=["full", "top_p", "top_k"]
)
def test_tokens_sampled_on_the_gpu_follow_the_log_probs_the_losses_use(gpu_strategy, temperature, top_p, top_k):
    assert next(gpu_strategy.model.parameters()).device == GPU
    assert_sampling_matches_the_log_probs(gpu_strategy, temperature, top_p, top_k)


def test_gpu_generation_returns_cpu_tensors_whose_log_probs_the_trainer_reproduces_on_gpu_and_cpu(tiny_model):
    """Sampled on the GPU with its log-probs; the trainer's forward on the GPU model gives the same log-probs
    (results back on the CPU), and so does the same model on the CPU."""
    from roll_core.data.loading import collate_prompts, encode_prompts, load_rows
    from workers.strategies.hf_infer import HFInferStrategy

    cfg = infer_section(
        tiny_model,
        "actor_infer.generating_args.temperature=0.7",
        "actor_infer.generating_args.top_p=0.8",
        "actor_infer.generating_args.top_k=20",
        "actor_infer.generating_args.max_new_tokens=12",
    )
    args = cfg.actor_infer.generating_args
    gpu = HFInferStrategy(cfg.actor_infer, device=GPU)
    rows = load_rows(str(EXAMPLES / "data" / "math_train.jsonl"))[:6]
    prompt_ids, prompt_mask = collate_prompts(encode_prompts(gpu.tokenizer, rows, cfg.data), gpu.pad_id)
    n = 2
    out = gpu.generate(prompt_ids, prompt_mask, args, n, seed=0, with_log_probs=True)
    assert all(t.device.type == "cpu" for t in out.values() if isinstance(t, torch.Tensor))
    batch = Batch(
        {
            "prompt_ids": prompt_ids.repeat_interleave(n, 0),
            "prompt_mask": prompt_mask.repeat_interleave(n, 0),
            "response_ids": out["response_ids"],
            "response_mask": out["response_mask"],
        }
    )
    sampling = SamplingDistribution.of(args)
    on_gpu = batched_log_probs(gpu.model, batch, micro_batch_size=5, sampling=sampling)
    assert on_gpu.device.type == "cpu"
    cpu = HFInferStrategy(cfg.actor_infer, device="cpu")
    on_cpu = batched_log_probs(cpu.model, batch, micro_batch_size=5, sampling=sampling)
    mask = batch["response_mask"] > 0
    assert mask.sum() > 6 * n
    gap_sampled = float((on_gpu - out["infer_log_probs"])[mask].abs().max())
    gap_cpu = float((on_gpu - on_cpu)[mask].abs().max())
    # float32 on both sides; the CPU bound of the same check (tests/test_forward.py) is 1e-4. A log-prob computed
    # without the truncation, or on another model's weights, is off by > 0.1.
    assert gap_sampled < 1e-3 and gap_cpu < 1e-3, (gap_sampled, gap_cpu)


def test_deepspeed_zero2_offloads_its_states_off_the_gpu_and_trains_after_reloading(tiny_model, monkeypatch):
    from transformers import AutoModelForCausalLM

    from workers.strategies.deepspeed_train import DeepSpeedTrainStrategy

    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "29531"}.items():
        monkeypatch.setenv(key, value)
    cfg = load_config(
        EXAMPLES / "math_code.yaml",
        [
            f"pretrain={tiny_model}",
            "ray.num_gpus_per_node=1",
            "actor_train.device_mapping=[0]",
            "actor_train.num_gpus_per_worker=1",
            "actor_train.world_size=1",
            "actor_train.model_args.dtype=bfloat16",
            "actor_train.offload_states=true",
            "actor_train.strategy_args.strategy_config.zero_optimization.stage=2",
            "actor_train.training_args.per_device_train_batch_size=2",
            "actor_train.training_args.gradient_accumulation_steps=1",
            "actor_train.training_args.warmup_steps=0",
        ],
    ).config
    model = AutoModelForCausalLM.from_pretrained(tiny_model).to(GPU)
    strategy = DeepSpeedTrainStrategy(cfg.actor_train, model, total_optimizer_steps=4)
    assert strategy.device == GPU and strategy.zero_stage == 2
    ids = torch.randint(0, model.config.vocab_size, (2, 16), device=GPU)

    def train_step() -> None:
        strategy.backward(strategy.engine(input_ids=ids, labels=ids).loss)
        strategy.step()

    def loss() -> float:
        with torch.no_grad():
            return float(strategy.engine(input_ids=ids, labels=ids).loss)

    train_step()
    trained = loss()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    strategy.offload()
    torch.cuda.synchronize()
    after = torch.cuda.memory_allocated()
    params = sum(p.numel() for p in model.parameters())
    # What ZeRO-2 holds per parameter: bf16 weights (2 B), fp32 master weights and two Adam moments (12 B). Measured
    # on an H100 (2026-11-26, deterministic sizes): 14.6 MB freed, 14 B per parameter, of 87 MB allocated in the
    # process (the rest: this module's other models). Seen to fail with offload() doing nothing: 0 B freed.
    assert before - after >= 13 * params, (before, after, params)
    assert all(p.numel() == 0 or p.device.type == "cpu" for p in strategy.module.parameters())
    strategy.reload()
    assert torch.cuda.memory_allocated() >= before - params  # back on the GPU (gradients may be freed)
    assert loss() == trained  # the same weights came back
    train_step()
    assert loss() < trained  # and training goes on: one more AdamW step on the same batch lowers its loss

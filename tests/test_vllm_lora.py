"""LoRA on vLLM (its CPU build): the engine serves the base model plus the adapters a sync brings, and then
computes the trainer's log-probs, token by token; the base weights never travel.

The trainer's side is the tiny model wrapped by peft with the same adapters, as actor_train holds it; the sync
sends what actor_train's get_weights sends with LoRA (`adapter_state`)."""

from __future__ import annotations

import os

import pytest
import torch

from roll_core.config import load_config
from roll_core.config.clusters import GeneratingArgs
from tests.conftest import EXAMPLES
from tests.test_vllm_engine import EAGER, prompts, require_vllm_cpu_build, trainer_log_probs
from workers.strategies.vllm_infer import vllm_build

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(vllm_build() == "cuda", reason="vLLM's CUDA build is installed: tests/test_gpu_step.py runs it"),
]

LORA = "actor_train.lora={rank: 4, alpha: 8.0}"
SAMPLED = GeneratingArgs(max_new_tokens=16, temperature=1.0)


@pytest.fixture(scope="module")
def config(tiny_model):
    require_vllm_cpu_build()
    return load_config(
        EXAMPLES / "math_code.yaml",
        ["actor_infer.strategy_args.strategy_name=vllm", f"pretrain={tiny_model}", EAGER, LORA],
    ).config


@pytest.fixture(scope="module")
def engine(config):
    from workers.strategies.vllm_infer import VLLMInferStrategy

    strategy = VLLMInferStrategy(config.actor_infer, lora=config.actor_train.lora)
    yield strategy
    strategy.close()


def trained_policy(tiny_model, lora, seed: int):
    """The tiny model with adapters as training leaves them: peft's fresh adapters (B = 0, the base model's
    outputs) with every B drawn, so that the adapters change what the model computes."""
    from transformers import AutoModelForCausalLM

    from workers.strategies.lora import with_lora

    model = with_lora(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32), lora).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(0.3 * torch.randn(parameter.shape, generator=generator))
    return model


def largest_gap(engine, model) -> float:
    ids, mask = prompts(engine)
    out = engine.generate(ids, mask, SAMPLED, 4, seed=1, with_log_probs=True)
    kept = out["response_mask"] > 0
    return float((out["infer_log_probs"] - trainer_log_probs(model, ids, mask, out, SAMPLED)).abs()[kept].max())


def test_vllm_serves_the_synced_adapters_with_the_trainers_log_probs(engine, config, tiny_model):
    from transformers import AutoModelForCausalLM

    from workers.strategies.lora import adapter_state

    lora = config.actor_train.lora
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    first, second = trained_policy(tiny_model, lora, 0), trained_policy(tiny_model, lora, 1)
    assert largest_gap(engine, base) < 1e-4  # before any sync: the base model, as the fresh adapters compute

    state = adapter_state(first)
    assert all("lora_" in name for name in state)  # the adapters alone travel
    engine.load_state_dict(state)
    after_first = largest_gap(engine, first)
    folder = engine.adapter.lora_path
    engine.load_state_dict(adapter_state(second))
    after_second, stale = largest_gap(engine, second), largest_gap(engine, first)
    print(f"vLLM vs trainer: {after_first:.3g} after the first sync, {after_second:.3g} after the second; "
          f"{stale:.3g} against the first adapters after the second sync")
    # The engine takes each version, computes what the trainer computes with it, and holds one version only.
    assert after_first < 1e-4 and after_second < 1e-4
    assert stale > 1e-2
    assert engine.adapter.lora_int_id == 2 and set(engine.llm.llm_engine.list_loras()) == {2}
    assert not os.path.exists(folder)


def test_a_lora_sync_never_lets_sleep_drop_the_base_weights(engine):
    """Sleep level 2 drops the weights when a sync will replace them; a LoRA sync brings the adapters alone,
    so the base must survive the sleep."""
    engine.sleep_mode, engine.sleeping = True, set()
    calls = []
    real_sleep = engine.llm.sleep
    engine.llm.sleep = lambda level: calls.append(level)
    try:
        engine.sleep(discard_weights=True)
    finally:
        engine.llm.sleep, engine.sleep_mode, engine.sleeping = real_sleep, False, set()
    assert calls == [1] and not engine.weights_discarded


def test_a_lora_run_on_vllm_generates_each_step_with_the_adapters_of_the_last_update(tmp_path, tiny_model, mlflow_db):
    """`roll run` with actor_train.lora and vLLM: step 2's rollouts are sampled by the adapters step 1 trained,
    which the pipeline's own check sees as one policy on both sides (tests/test_vllm_pipeline.py says how)."""
    from tests.test_vllm_pipeline import SMALL, roll_run, step_metrics

    uri = mlflow_db(tmp_path / "mlflow.db")
    roll_run(*SMALL, LORA, "actor_train.training_args.learning_rate=1e-2", f"pretrain={tiny_model}",
             f"output_dir={tmp_path / 'run'}", f"tracking.tracking_uri={uri}", "tracking.experiment_name=vllm",
             "max_steps=2", "eval_steps=0", "save_steps=0")
    kl = step_metrics(uri, "offpolicy/kl_infer_old")
    weight_max = step_metrics(uri, "offpolicy/is_weight_max")
    print(f"step 2: KL(infer || trainer) {kl[2]:.3g}, largest IS weight {weight_max[2]:.6f}")
    assert sorted(kl) == [1, 2]
    assert kl[2] < 1e-5 and abs(weight_max[2] - 1.0) < 1e-3, (kl, weight_max)

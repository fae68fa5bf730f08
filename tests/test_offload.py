"""Offloading states between phases (section `offload_states`): what the config accepts, and which calls move the
states. There is no GPU here, so the strategies are stand-ins that record the moves (on the CPU the real ones
move nothing)."""

from __future__ import annotations

import pytest
import torch

from roll_core.batch import Batch
from roll_core.config import ConfigError, load_config
from tests.conftest import EXAMPLES
from workers.training import TrainedWorker


def test_offloading_a_trained_cluster_needs_a_zero_optimizer_and_actor_infer_synchronous_generation():
    with pytest.raises(ConfigError, match=r"actor_train\.offload_states.*zero_optimization\.stage 1, 2 or 3.*got stage 0"):
        load_config(EXAMPLES / "math_code.yaml", ["actor_train.offload_states=true"])
    ok = ["actor_train.offload_states=true", "actor_train.strategy_args.strategy_config.zero_optimization.stage=2"]
    assert load_config(EXAMPLES / "math_code.yaml", ok).config.actor_train.offload_states
    with pytest.raises(ConfigError, match=r"actor_infer\.offload_states.*async_generation_ratio"):
        load_config(EXAMPLES / "math_code.yaml", ["actor_infer.offload_states=true", "async_generation_ratio=1"])


class Recording:
    device = torch.device("cpu")

    def __init__(self) -> None:
        self.moves: list[str] = []
        self.module = torch.nn.Linear(1, 1)

    def offload(self) -> None:
        self.moves.append("offload")

    def reload(self) -> None:
        self.moves.append("reload")

    def backward(self, loss) -> None:
        pass

    def set_boundary(self, last: bool) -> None:
        pass

    def step(self) -> None:
        pass

    def grad_norm(self) -> float:
        return 0.0


class Worker(TrainedWorker):
    section_name = "actor_train"
    metric_prefix = "test"

    def objective(self, micro, norm, token_norm):
        return torch.zeros(()), {}


@pytest.mark.parametrize("offload", [True, False])
def test_a_trained_worker_offloads_only_when_its_section_says_so_and_reloads_before_training(offload):
    overrides = [f"actor_train.offload_states={str(offload).lower()}",
                 "actor_train.strategy_args.strategy_config.zero_optimization.stage=1"]
    cfg = load_config(EXAMPLES / "math_code.yaml", overrides).config
    worker = Worker(pipeline_config=cfg, total_optimizer_steps=1, name="t", rank=0, world_size=1)
    worker.strategy = Recording()
    worker.offload_states()
    worker.train_loop(
        Batch({"prompt_ids": torch.ones(4, 1, dtype=torch.long), "prompt_mask": torch.ones(4, 1),
               "response_ids": torch.ones(4, 2, dtype=torch.long), "response_mask": torch.ones(4, 2),
               "in_loss": torch.ones(4)})
    )
    assert worker.strategy.moves == (["offload", "reload"] if offload else ["reload"])


def test_hf_inference_sleeps_in_cpu_memory_and_wakes_on_its_device_for_the_next_call(tiny_model, monkeypatch):
    from workers.strategies.hf_infer import HFInferStrategy

    cfg = load_config(EXAMPLES / "math_code.yaml", [f"reference.model_args.model_name_or_path={tiny_model}"])
    strategy = HFInferStrategy(cfg.config.reference)
    strategy.sleep()
    assert not strategy.asleep  # on the CPU there is nothing to move
    moves: list[str] = []
    monkeypatch.setattr(strategy, "device", torch.device("meta"))  # stands for a GPU
    monkeypatch.setattr(strategy.model, "to", lambda device: moves.append(str(device)) or strategy.model)
    strategy.sleep()
    strategy.sleep()
    assert moves == ["cpu"] and strategy.asleep
    batch = Batch({"prompt_ids": torch.ones(1, 2, dtype=torch.long), "prompt_mask": torch.ones(1, 2),
                   "response_ids": torch.ones(1, 2, dtype=torch.long), "response_mask": torch.ones(1, 2)})
    monkeypatch.setattr("workers.strategies.hf_infer.log_probs_in_micro_batches", lambda *a: moves.append("forward"))
    strategy.log_probs(batch, None)
    assert moves == ["cpu", "meta", "forward"] and not strategy.asleep


def test_the_driver_offloads_the_trained_clusters_that_ask_for_it_before_each_rollout():
    from roll_pipeline.driver.pipeline import RLVRPipeline

    class Cluster:
        def __init__(self) -> None:
            self.calls: list[str] = []

        def call(self, method: str, *args) -> None:
            self.calls.append(method)

    overrides = ["actor_train.offload_states=true", "actor_train.strategy_args.strategy_config.zero_optimization.stage=2"]
    for resolved, expected in ((load_config(EXAMPLES / "ppo_gae.yaml", overrides), ["offload_states"]),
                               (load_config(EXAMPLES / "ppo_gae.yaml"), [])):
        pipeline = RLVRPipeline(resolved)  # no cluster starts before setup(): the handles are stand-ins
        pipeline.runtime.actor_train, pipeline.runtime.critic = Cluster(), Cluster()
        pipeline.offload_trained_states()
        assert pipeline.runtime.actor_train.calls == expected and pipeline.runtime.critic.calls == []

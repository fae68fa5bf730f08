"""Every tensor that enters a forward or a collective is on the worker's device (workers/devices.py).

There is no GPU here, so the device under test is the meta device: a tensor left on the CPU shows as a CPU tensor
where a meta one is expected. Stand-in models record the device of every input and answer on the CPU."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from roll_core.batch import Batch
from roll_core.config import load_config
from roll_core.models.forward import FULL_SOFTMAX, batched_log_probs, batched_values
from tests.conftest import EXAMPLES
from workers.devices import NoGPUError, worker_device
from workers.training import global_normalizers

META = torch.device("meta")


class Recorder(torch.nn.Module):
    """A causal LM (or value model) stand-in whose weights are on the meta device: it records its inputs'
    devices and answers with zeros on the CPU, `width` outputs per position."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, device=META))
        self.width = width
        self.seen: list[torch.device] = []

    def forward(self, input_ids, attention_mask, position_ids):
        self.seen += [input_ids.device, attention_mask.device, position_ids.device]

        class Out:
            logits = torch.zeros(*input_ids.shape, self.width)

        return Out()


def pairs(n: int = 5) -> Batch:
    return Batch(
        {
            "prompt_ids": torch.ones(n, 4, dtype=torch.long),
            "prompt_mask": torch.ones(n, 4),
            "response_ids": torch.ones(n, 3, dtype=torch.long),
            "response_mask": torch.ones(n, 3),
        }
    )


def section(*overrides: str):
    return load_config(EXAMPLES / "math_code.yaml", list(overrides)).config.reference


def test_a_worker_without_gpus_computes_on_the_cpu_and_one_with_gpus_on_its_first_visible_gpu(monkeypatch):
    assert worker_device(section()) == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on this project's machines, also on a GPU host
    with pytest.raises(NoGPUError, match=r"reference: .*num_gpus_per_worker=1.*no CUDA device"):
        worker_device(section("reference.num_gpus_per_worker=1"), "reference")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert worker_device(section("reference.num_gpus_per_worker=0.5")) == torch.device("cuda", 0)


def test_log_probs_and_values_run_on_the_models_device_and_come_back_to_the_batchs():
    model = Recorder(width=7)
    log_probs = batched_log_probs(model, pairs(), micro_batch_size=2, sampling=FULL_SOFTMAX)
    assert set(model.seen) == {META} and len(model.seen) == 3 * 3  # three micro-batches
    assert log_probs.device.type == "cpu" and log_probs.shape == (5, 3)
    values_model = Recorder(width=1)
    values = batched_values(values_model, pairs(), micro_batch_size=4)
    assert set(values_model.seen) == {META} and values.device.type == "cpu"


def test_the_normalizers_collective_gets_a_float64_tensor_on_the_training_device(monkeypatch):
    reduced: list[torch.Tensor] = []

    class Reduced(Exception):
        pass

    def all_reduce(tensor):
        reduced.append(tensor)
        raise Reduced  # a meta tensor has no values to read back

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    with pytest.raises(Reduced):
        global_normalizers(torch.ones(4, 3), ("token-mean", "seq-mean-token-mean"), world_size=2, device=META)
    assert reduced[0].device == META and reduced[0].dtype == torch.float64
    # one rank: no collective, nothing moved
    assert global_normalizers(torch.ones(4, 3), ("token-mean",), world_size=1, device=META) == [12.0]


def test_hf_inference_generates_on_its_device_and_returns_cpu_tensors(tiny_model, monkeypatch):
    from roll_core.config.clusters import GeneratingArgs
    from workers.strategies.hf_infer import HFInferStrategy

    cfg = load_config(EXAMPLES / "math_code.yaml", [f"actor_infer.model_args.model_name_or_path={tiny_model}"])
    strategy = HFInferStrategy(cfg.config.actor_infer)
    assert strategy.device == torch.device("cpu") and next(strategy.model.parameters()).device.type == "cpu"
    seen: list[torch.device] = []

    def generate(model, input_ids, attention_mask, generation_config, **kwargs):
        assert model is strategy.model
        seen.extend([input_ids.device, attention_mask.device])
        rows = input_ids.shape[0] * generation_config.num_return_sequences

        class Out:
            sequences = torch.full((rows, input_ids.shape[1] + 2), 5)

        return Out()

    # what the strategy calls to generate (generate_sharing_prefill: a prefill forward, then model.generate)
    monkeypatch.setattr("workers.strategies.hf_infer.generate_sharing_prefill", generate)
    monkeypatch.setattr(strategy, "device", META)
    out = strategy.generate(torch.ones(3, 4, dtype=torch.long), torch.ones(3, 4), GeneratingArgs(), 2)
    assert seen and set(seen) == {META}
    assert out["response_ids"].shape == (6, 2) and out["response_ids"].device.type == "cpu"

"""actor_infer: generates responses with the current policy weights."""

from __future__ import annotations

import torch

from roll_pipeline.batch import Batch
from roll_pipeline.config import GeneratingArgs, PipelineConfig
from workers.base import Worker


def make_infer_strategy(pipeline_config: PipelineConfig):
    section = pipeline_config.actor_infer
    name = section.strategy_args.strategy_name
    if name == "vllm":
        from workers.strategies.vllm_infer import check_vllm_available

        check_vllm_available()
        raise NotImplementedError("the vllm strategy arrives with multi-GPU support; use hf_infer for now")
    from workers.strategies.hf_infer import HFInferStrategy

    return HFInferStrategy(section)


class ActorInferWorker(Worker):
    def __init__(self, *, pipeline_config: PipelineConfig, **kwargs) -> None:
        section = pipeline_config.actor_infer
        super().__init__(seed=pipeline_config.seed + 1000, torch_threads=section.torch_threads, **kwargs)
        self.strategy = make_infer_strategy(pipeline_config)

    def generate(self, batch: Batch, args: GeneratingArgs, num_return_sequences: int) -> Batch:
        """Responses for every prompt in `batch`, `num_return_sequences` each, rows grouped by prompt."""
        batch.require("prompt_ids", "prompt_mask", where="actor_infer.generate")
        out = self.strategy.generate(batch["prompt_ids"], batch["prompt_mask"], args, num_return_sequences)
        repeat = torch.arange(len(batch)).repeat_interleave(num_return_sequences)
        expanded = batch.select(repeat)
        return expanded.update(
            {"response_ids": out["response_ids"], "response_mask": out["response_mask"]},
            finish_reason=out["finish_reason"],
        )

    def update_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        self.strategy.load_state_dict(state_dict)

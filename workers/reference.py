"""reference: the frozen starting policy, for KL against it."""

from __future__ import annotations

import torch

from roll_pipeline.batch import Batch
from roll_pipeline.config import PipelineConfig
from roll_pipeline.models.sampling import SamplingDistribution
from workers.base import Worker
from workers.strategies.hf_infer import HFInferStrategy


class ReferenceWorker(Worker):
    def __init__(self, *, pipeline_config: PipelineConfig, **kwargs) -> None:
        section = pipeline_config.reference
        super().__init__(seed=pipeline_config.seed, torch_threads=section.torch_threads, **kwargs)
        self.sampling = SamplingDistribution.of(pipeline_config.actor_infer.generating_args)
        self.strategy = HFInferStrategy(section, name="reference")

    def compute_log_probs(self, batch: Batch) -> torch.Tensor:
        batch.require("prompt_ids", "prompt_mask", "response_ids", "response_mask", where="reference.compute_log_probs")
        return self.strategy.log_probs(batch, self.sampling)

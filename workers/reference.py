"""reference: the frozen starting policy, for KL against it."""

from __future__ import annotations

import torch

from roll_core.batch import Batch
from roll_core.config import PipelineConfig
from roll_core.models.sampling import SamplingDistribution
from workers.base import Worker
from workers.strategies.hf_infer import HFInferStrategy


class ReferenceWorker(Worker):
    def __init__(self, *, pipeline_config: PipelineConfig, **kwargs) -> None:
        section = pipeline_config.reference
        super().__init__(seed=pipeline_config.seed, torch_threads=section.torch_threads, **kwargs)
        self.sampling = SamplingDistribution.of(pipeline_config.actor_infer.generating_args)
        self.strategy = HFInferStrategy(section, name="reference")
        self.offload_states = section.offload_states
        if self.offload_states:
            self.strategy.sleep()

    def compute_log_probs(self, batch: Batch) -> torch.Tensor:
        batch.require("prompt_ids", "prompt_mask", "response_ids", "response_mask", where="reference.compute_log_probs")
        log_probs = self.strategy.log_probs(batch, self.sampling)
        if self.offload_states:
            self.strategy.sleep()  # until the next step's log-probs
        return log_probs

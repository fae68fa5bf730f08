"""DynamicSamplingScheduler: one per domain; draws that domain's prompts, has them generated and scored."""

from __future__ import annotations

import logging
import zlib
from typing import Any

import numpy as np
import torch

from roll_pipeline.batch import Batch
from roll_pipeline.config import GeneratingArgs
from roll_pipeline.data.loading import collate_prompts
from roll_pipeline.distributed.cluster import Cluster
from workers.rewards.worker import domain_metrics

logger = logging.getLogger(__name__)


class PromptSampler:
    """Walks a domain's rows in a seeded shuffled order, epoch after epoch; its position is checkpointable."""

    def __init__(self, size: int, seed: int) -> None:
        if size == 0:
            raise ValueError("a domain with no rows cannot be sampled")
        self.size, self.seed = size, seed
        self.epoch, self.position = 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.size)

    def take(self, k: int) -> list[int]:
        out: list[int] = []
        while len(out) < k:
            if self.position == self.size:
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            n = min(k - len(out), self.size - self.position)
            out.extend(int(i) for i in self._order[self.position : self.position + n])
            self.position += n
        return out

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "size": self.size}


class DynamicSamplingScheduler:
    """Turns a domain's share of a step into a scored batch: prompts -> actor_infer -> reward cluster."""

    def __init__(
        self,
        *,
        domain: str,
        rows: list[dict[str, Any]],
        prompt_ids: list[list[int]],
        val_rows: list[dict[str, Any]],
        val_prompt_ids: list[list[int]],
        tokenizer: Any,
        infer: Cluster,
        reward: Cluster,
        seed: int,
    ) -> None:
        self.domain = domain
        self.rows = rows
        self.prompt_ids = prompt_ids
        self.val_rows = val_rows
        self.val_prompt_ids = val_prompt_ids
        self.tokenizer = tokenizer
        self.infer = infer
        self.reward = reward
        self.sampler = PromptSampler(len(rows), seed=seed + zlib.crc32(domain.encode()))

    def get_batch(
        self, num_prompts: int, group_size: int, args: GeneratingArgs, first_group_id: int
    ) -> tuple[Batch, dict[str, float]]:
        """`num_prompts` fresh prompts with `group_size` scored responses each, group ids from `first_group_id`;
        and the reward worker's metrics of the batch."""
        indices = self.sampler.take(num_prompts)
        batch, results = self.generate_and_score(
            [self.rows[i] for i in indices], [self.prompt_ids[i] for i in indices], group_size, args
        )
        group_ids = first_group_id + torch.arange(num_prompts).repeat_interleave(group_size)
        return batch.update({"group_ids": group_ids}), domain_metrics(self.domain, results)

    def validate(self, args: GeneratingArgs, max_prompts: int = 0) -> Batch:
        """One response per validation prompt (the first `max_prompts` when it is > 0), scored."""
        n = len(self.val_rows) if max_prompts <= 0 else min(max_prompts, len(self.val_rows))
        return self.generate_and_score(self.val_rows[:n], self.val_prompt_ids[:n], 1, args)[0]

    def generate_and_score(
        self, rows: list[dict[str, Any]], token_lists: list[list[int]], n: int, args: GeneratingArgs
    ) -> tuple[Batch, list[dict[str, Any]]]:
        prompt_ids, prompt_mask = collate_prompts(token_lists, self.tokenizer.pad_token_id)
        prompts = Batch(
            {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask},
            {
                "id": [r.get("id", r["_source"]) for r in rows],
                "domain": [self.domain] * len(rows),
                "tag": [r["tag"] for r in rows],
                "ground_truth": [r.get("ground_truth") for r in rows],
                "test_cases": [r.get("test_cases") for r in rows],
            },
        )
        generated = Batch.concat(self.infer.dispatch("generate", prompts, args, n))
        texts = self.decode(generated)
        samples = [
            {
                "response": text,
                "ground_truth": generated.meta["ground_truth"][i],
                "test_cases": generated.meta["test_cases"][i],
                "tag": generated.meta["tag"][i],
                "id": generated.meta["id"][i],
            }
            for i, text in enumerate(texts)
        ]
        results = self.reward.dispatch_items("score_batch", samples)
        scores = torch.tensor([r["score"] if not r["masked"] else 0.0 for r in results], dtype=torch.float32)
        sample_mask = torch.tensor([0.0 if r["masked"] else 1.0 for r in results], dtype=torch.float32)
        scored = generated.update(
            {"scores": scores, "sample_mask": sample_mask},
            response_text=texts,
            correct=[None if r["masked"] else bool(r["correct"]) for r in results],
        )
        return scored, results

    def decode(self, batch: Batch) -> list[str]:
        ids, mask = batch["response_ids"], batch["response_mask"]
        return [
            self.tokenizer.decode(row[m > 0].tolist(), skip_special_tokens=True)
            for row, m in zip(ids, mask, strict=True)
        ]

    def state_dict(self) -> dict[str, Any]:
        return {"domain": self.domain, "sampler": self.sampler.state_dict()}

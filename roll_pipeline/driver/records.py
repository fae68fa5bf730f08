"""A batch's samples as scored (ScoredSample), rebuilt from its tensors and meta: what the rollout metrics, the
validation report and the training sample table read."""

from __future__ import annotations

from roll_core.batch import Batch
from roll_core.rewards.scored import ScoredSample
from roll_pipeline.driver.validation import TOOL_STATS


def batch_records(batch: Batch) -> list[ScoredSample]:
    """The batch's samples as scored. A sample is masked here only when its reward could not be computed;
    samples that only left the loss (filler groups at the redraw bound, filtered responses) keep theirs."""
    lengths = batch["response_mask"].sum(-1).long().tolist()
    scores = batch["scores"].tolist()
    meta = batch.meta
    trajectories = meta.get("trajectory") or [None] * len(batch)
    tool = {key: batch[key].tolist() for key in TOOL_STATS if key in batch.tensors}
    return [
        ScoredSample(
            score=None if meta["mask_reason"][i] else scores[i],
            correct=meta["correct"][i],
            mask_reason=meta["mask_reason"][i],
            response_length=lengths[i],
            finish_reason=meta["finish_reason"][i],
            domain=meta["domain"][i],
            tag=meta["tag"][i],
            id=meta["id"][i],
            response_text=meta["response_text"][i],
            trajectory=trajectories[i],
            tool_use=None if trajectories[i] is None else {key: v[i] for key, v in tool.items()},
        )
        for i in range(len(batch))
    ]

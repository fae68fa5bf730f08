"""The one batch type that flows between the pipeline's stages, and the names of its keys.

Every key a stage may read or write is declared here with its shape (B = samples, P = prompt tokens,
R = response tokens), so a typo is an error at the boundary instead of a silent miss.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

TENSOR_KEYS: dict[str, str] = {
    "prompt_ids": "(B, P) long, left-padded prompt token ids",
    "prompt_mask": "(B, P) long, 1 on prompt tokens",
    "response_ids": "(B, R) long, right-padded response token ids",
    "response_mask": "(B, R) float, 1 on the response tokens the model sampled, up to and including the end-of-sequence"
    " token",
    "tool_mask": "(B, R) float, 1 on the response tokens a tool wrote (a multi-turn trajectory's tool outputs): in"
    " the sequence the model reads, never in the loss, the KL or the importance weights (response_mask is 0 there);"
    " absent: none",
    "group_ids": "(B,) long, the index of the prompt a response belongs to (its GRPO group)",
    "scores": "(B,) float, the reward worker's score for each response",
    "in_loss": "(B,) float, 1 in the loss; 0 where the reward is masked, or a filter or shaping left it out",
    "token_level_rewards": "(B, R) float, the score placed at the last response token (minus any KL penalty)",
    "old_log_probs": "(B, R) float, log-probs of the response under the policy that generated it",
    "own_old_log_probs": "(B,) float, 1 where actor_train takes the update's own forward as the old log-probs",
    "ref_log_probs": "(B, R) float, log-probs of the response under the frozen reference policy",
    "infer_log_probs": "(B, R) float, log-probs of the response under the distribution actor_infer sampled it from",
    "token_versions": "(B, R) long, the weights version (actor updates included) that sampled each response token; a"
    " response generated across a weight sync has two (partial rollouts); absent: batches not from actor_infer",
    "infer_is_weights": "(B, R) float, truncated importance weights old / infer on the policy-gradient terms (per token,"
    " or a response's on each of its tokens)",
    "offpolicy_keep": "(B, R) float, 0 on the tokens the off-policy rejection takes out of the loss (loss_mask applies"
    " it); absent: none rejected",
    "turns": "(B,) float, a multi-turn response's model turns; absent: one",
    "tool_calls": "(B,) float, a multi-turn response's tool calls; absent: none",
    "tool_errors": "(B,) float, its tool calls that failed (an error, a timeout, a crash: the policy's doing)",
    "tool_s": "(B,) float, the seconds its tool calls took",
    "values": "(B, R) float, the critic's value estimates",
    "advantages": "(B, R) float",
    "returns": "(B, R) float, targets of the value loss",
}

META_KEYS: dict[str, str] = {
    "id": "the data row's id",
    "domain": "the domain that drew the prompt",
    "tag": "the data row's tag",
    "response_text": "the decoded response",
    "ground_truth": "the data row's ground truth",
    "correct": "whether the reward worker judged the response correct (None when masked)",
    "mask_reason": "why the reward could not be computed (roll_core.rewards.scored.MASK_REASONS); None when scored",
    "finish_reason": "'stop' when the response ended with end-of-sequence, 'length' when truncated",
    "trajectory": "a multi-turn response's chat messages (the model's turns, the tools' answers); None: single-turn",
}


#: Keys a batch leaves out where every sample would hold the same (a single-turn response has no tool tokens, one
#: turn and no tool calls), with the tensor key whose shape they take and that value: Batch.concat fills them in
#: where the batches it joins disagree (a single-turn domain's batch beside a multi-turn one's).
FILLED_WHEN_ABSENT = {
    "tool_mask": ("response_mask", 0.0),
    "turns": ("scores", 1.0),
    "tool_calls": ("scores", 0.0),
    "tool_errors": ("scores", 0.0),
    "tool_s": ("scores", 0.0),
}
#: Meta keys filled with None the same way.
META_FILLED_WHEN_ABSENT = ("trajectory",)


def _check_keys(keys: Iterable[str], declared: dict[str, str], kind: str) -> None:
    unknown = [k for k in keys if k not in declared]
    if unknown:
        raise KeyError(f"undeclared batch {kind} key(s) {unknown}; declare them in roll_core/batch.py")


@dataclass
class Batch:
    """Tensors that share a first dimension, plus per-sample Python values (`meta`)."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    meta: dict[str, list[Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_keys(self.tensors, TENSOR_KEYS, "tensor")
        _check_keys(self.meta, META_KEYS, "meta")
        sizes = {k: v.shape[0] for k, v in self.tensors.items()} | {k: len(v) for k, v in self.meta.items()}
        if len(set(sizes.values())) > 1:
            raise ValueError(f"batch entries disagree on the number of samples: {sizes}")

    def __len__(self) -> int:
        for v in self.tensors.values():
            return v.shape[0]
        for m in self.meta.values():
            return len(m)
        return 0

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.tensors[key]

    def __contains__(self, key: str) -> bool:
        return key in self.tensors or key in self.meta

    def require(self, *keys: str, where: str = "") -> None:
        """Raise a KeyError naming the missing keys: a worker calls this at its boundary."""
        missing = [k for k in keys if k not in self]
        if missing:
            raise KeyError(f"{where or 'batch'} needs key(s) {missing}; the batch has {sorted(self.keys())}")

    def keys(self) -> list[str]:
        return [*self.tensors, *self.meta]

    def update(self, tensors: dict[str, torch.Tensor] | None = None, **meta: list[Any]) -> Batch:
        """A new batch with these entries added or replaced (the originals are not copied)."""
        return Batch({**self.tensors, **(tensors or {})}, {**self.meta, **meta})

    def select(self, index: Sequence[int] | torch.Tensor) -> Batch:
        idx = torch.as_tensor(index, dtype=torch.long)
        rows = idx.tolist()
        return Batch(
            {k: v[idx] for k, v in self.tensors.items()},
            {k: [v[i] for i in rows] for k, v in self.meta.items()},
        )

    def split(self, size: int) -> list[Batch]:
        """Consecutive pieces of at most `size` samples."""
        n = len(self)
        return [self.select(range(i, min(i + size, n))) for i in range(0, n, size)]

    def chunk(self, pieces: int) -> list[Batch]:
        """`pieces` consecutive pieces of near-equal size (for data-parallel ranks)."""
        n = len(self)
        bounds = [round(i * n / pieces) for i in range(pieces + 1)]
        return [self.select(range(bounds[i], bounds[i + 1])) for i in range(pieces)]

    @staticmethod
    def concat(batches: Sequence[Batch]) -> Batch:
        batches = [b for b in batches if len(b)]
        if not batches:
            return Batch()
        for key, (like, value) in FILLED_WHEN_ABSENT.items():
            if any(key in b.tensors for b in batches):
                batches = [
                    b if key in b.tensors else b.update({key: torch.full_like(b[like], value, dtype=torch.float32)})
                    for b in batches
                ]
        for key in META_FILLED_WHEN_ABSENT:
            if any(key in b.meta for b in batches):
                batches = [b if key in b.meta else b.update(**{key: [None] * len(b)}) for b in batches]
        tensor_keys, meta_keys = set(batches[0].tensors), set(batches[0].meta)
        for b in batches[1:]:
            if set(b.tensors) != tensor_keys or set(b.meta) != meta_keys:
                raise KeyError("cannot concatenate batches with different keys")
        tensors = {k: _cat_padded([b.tensors[k] for b in batches], k) for k in batches[0].tensors}
        meta = {k: [x for b in batches for x in b.meta[k]] for k in batches[0].meta}
        return Batch(tensors, meta)

    def to(self, device: torch.device | str) -> Batch:
        return Batch({k: v.to(device) for k, v in self.tensors.items()}, dict(self.meta))


def sequence_mask(batch: Batch) -> torch.Tensor:
    """(B, R): the response tokens in the sequence the model reads: those it sampled and those a tool wrote."""
    mask = batch["response_mask"]
    return mask + batch["tool_mask"] if "tool_mask" in batch.tensors else mask


def loss_mask(batch: Batch) -> torch.Tensor:
    """(B, R): the response tokens of the samples in the loss (response_mask where in_loss is 1), less the tokens
    the off-policy rejection took out (`offpolicy_keep`, where the run rejects; roll_core/algorithms/offpolicy.py)."""
    mask = batch["response_mask"] * batch["in_loss"].unsqueeze(-1)
    if "offpolicy_keep" in batch:
        mask = mask * batch["offpolicy_keep"]
    return mask


def _cat_padded(parts: list[torch.Tensor], key: str) -> torch.Tensor:
    """Concatenate along dim 0; 2-D token tensors of different widths are padded (prompts on the left)."""
    if parts[0].dim() < 2 or len({p.shape[1] for p in parts}) == 1:
        return torch.cat(parts)
    width = max(p.shape[1] for p in parts)
    left = key.startswith("prompt")
    padded = []
    for p in parts:
        pad = width - p.shape[1]
        padded.append(torch.nn.functional.pad(p, (pad, 0) if left else (0, pad), value=0))
    return torch.cat(padded)

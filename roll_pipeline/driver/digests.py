"""Where two runs of one deterministic config part: each step's batch tensors as short digests.

A `deterministic: true` run appends one line per step to `<output_dir>/digests.jsonl`, after the log-prob passes:
the step and a digest of each batch tensor (the tokens, masks and every worker's log-probs). Two runs that should
be bitwise equal, or a run and its resume, are compared with `first_difference`, which names the first step and
tensor that differ: equal tokens with different reference log-probs point at the reference's forward pass, different
tokens at the rollout. A resumed run appends the steps it computes again; the last line of a step is the one kept."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

DIGESTS_FILE = "digests.jsonl"
#: The batch tensors a step's line holds, where the batch has them: what generation made and what each worker's
#: log-prob pass gave.
DIGESTED = (
    "prompt_ids",
    "prompt_mask",
    "response_ids",
    "response_mask",
    "token_versions",
    "scores",
    "infer_log_probs",
    "old_log_probs",
    "ref_log_probs",
)


def tensor_digest(t: torch.Tensor) -> str:
    """Shape, dtype and a hash of the bytes: equal only for bitwise-equal tensors."""
    data = t.detach().cpu().contiguous()
    raw = data.reshape(-1).view(torch.uint8).numpy().tobytes() if data.numel() else b""
    shape = "x".join(map(str, data.shape))
    return (
        f"{shape}:{str(data.dtype).removeprefix('torch.')}:{hashlib.blake2b(raw, digest_size=8).hexdigest()}"
    )


def append_step_digests(path: Path, step: int, tensors: dict[str, torch.Tensor]) -> None:
    line = {"step": step, "tensors": {k: tensor_digest(tensors[k]) for k in DIGESTED if k in tensors}}
    with path.open("a") as f:
        f.write(json.dumps(line) + "\n")


def read_step_digests(path: Path) -> dict[int, dict[str, str]]:
    """Each step's digests, the last line of a step winning (a resume computes the steps after its checkpoint
    again)."""
    steps: dict[int, dict[str, str]] = {}
    for line in path.read_text().splitlines():
        entry = json.loads(line)
        steps[entry["step"]] = entry["tensors"]
    return steps


def first_difference(a: Path, b: Path) -> str:
    """The first step and the tensors at which two runs' digests differ, or that they do not."""
    da, db = read_step_digests(a), read_step_digests(b)
    for step in sorted(da.keys() | db.keys()):
        x, y = da.get(step), db.get(step)
        if x is None or y is None:
            return f"step {step} only in {a if y is None else b}"
        differ = sorted(k for k in x.keys() | y.keys() if x.get(k) != y.get(k))
        if differ:
            return f"step {step}: {', '.join(differ)} differ (of {', '.join(sorted(x))})"
    return f"the batch tensors of every step are equal ({len(da)} steps)"

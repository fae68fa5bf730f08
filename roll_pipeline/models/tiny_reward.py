"""The tiny reward model: the embedded policy's backbone with a scalar head, trained to prefer right sums.

A discriminative reward model of the kind `reward_model` runs (workers/rewards/reward_model.py): a Hugging Face
`Qwen2ForSequenceClassification` (one label; the score of the last token of prompt + response). It starts from
tiny-qwen2's weights (built first) and learns, by the Bradley-Terry loss of RLHF reward models, to score the right
answer to a math row (its ground truth) above a wrong one (the ground truth moved by 1 to 10), the conversation
rendered as the worker renders it (workers/rewards/reward_model.py: render_conversation; measured 2026-11-26, seed 0,
lr 1e-4: held-out 0.93 ending at the end-of-turn token, 0.86 reading the template's trailing newline). It is a learned, imperfect judge on purpose:
beside `math_rule` in examples/reward_model.yaml it shows how a weighted second reward enters a domain's reward.

Builds run in the pinned child process of the other embedded models (roll_pipeline/models/tiny.py: repeatable on
one vendor's processors, whatever their vector units), are cached by spec (base weights, data, hyperparameters,
seed) in `build_info.json`, written atomically, with the held-out pairwise accuracy (right scored above wrong, on
math_val.jsonl) and the weights' sha256.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from roll_pipeline.models.tiny import (
    WEIGHTS_FILE,
    reuse_or_install,
    run_pinned,
    weights_sha256,
    write_build,
)

logger = logging.getLogger(__name__)

#: 2: built in the pinned child process (roll_pipeline/models/tiny.py's PINNED_KERNELS) like the other embedded
#: models; format 1 was built in the calling process, whose kernels follow the processor's vector units (an AMD
#: EPYC with AVX-512 built 66a5fdbc where one without it had built b05c5aae, 2026-12-06).
BUILD_FORMAT = 2


@dataclass(frozen=True)
class TinyRewardHyperparameters:
    steps: int = 300
    batch_size: int = 32
    learning_rate: float = 1e-4
    """Measured 2026-11-26, seed 0, 300 steps: 1e-3 stays at chance (loss 0.69, held-out 0.51); 3e-4 0.85; 1e-4 0.93."""
    max_shift: int = 10
    """A wrong answer is the ground truth moved by 1 to this much, up or down."""


def wrong_answer(truth: str, rng: random.Random, max_shift: int) -> str:
    shift = rng.randint(1, max_shift) * rng.choice((-1, 1))
    return str(int(truth) + shift)


def pairs(rows: list[dict], rng: random.Random, max_shift: int) -> list[tuple[list[dict], str, str]]:
    """(messages, right answer, wrong answer) for every row whose ground truth is an integer."""
    out = []
    for row in rows:
        truth = str(row["ground_truth"]).strip()
        if truth.lstrip("-").isdigit():
            out.append((row["messages"], truth, wrong_answer(truth, rng, max_shift)))
    return out


def reward_model_spec(base_dir: Path, train_file: Path, val_file: Path, seed: int = 0,
                      hparams: TinyRewardHyperparameters | None = None) -> dict:
    """What a build of the tiny reward model depends on: recorded in its build_info.json, compared before reuse."""
    return {
        "build_format": BUILD_FORMAT,
        "seed": seed,
        "hyperparameters": asdict(hparams or TinyRewardHyperparameters()),
        "base_weights": weights_sha256(base_dir),
        "data": {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in (Path(train_file), Path(val_file))},
    }


def build_tiny_reward_model(out_dir: Path, base_dir: Path, train_file: Path, val_file: Path, seed: int = 0,
                            shipped: Path | None = None, from_scratch: bool = False, **hyperparameters) -> Path:
    """Build (or reuse, when its spec is unchanged, or copy from `shipped`: see `build_tiny_model`) the tiny reward
    model in `out_dir` from the policy in `base_dir`."""
    out_dir = Path(out_dir)
    hparams = TinyRewardHyperparameters(**hyperparameters)
    spec = reward_model_spec(base_dir, train_file, val_file, seed, hparams)
    if reuse_or_install(out_dir, spec, shipped, from_scratch, "tiny reward model"):
        return out_dir

    def build(staging: Path) -> dict:
        return _build_in_pinned_process(staging, Path(base_dir), Path(train_file), Path(val_file), seed, hparams)

    return write_build(out_dir, spec, build, "tiny reward model")


def _build_in_pinned_process(out_dir: Path, base_dir: Path, train_file: Path, val_file: Path, seed: int,
                             hparams: TinyRewardHyperparameters) -> dict:
    return run_pinned(out_dir, f"{__name__}:_pinned_build",
                      {"base_dir": str(base_dir), "train_file": str(train_file), "val_file": str(val_file),
                       "seed": seed, "hyperparameters": asdict(hparams)})


def _pinned_build(out_dir: Path, base_dir: str, train_file: str, val_file: str, seed: int,
                  hyperparameters: dict) -> dict:
    return _build(out_dir, Path(base_dir), Path(train_file), Path(val_file), seed,
                  TinyRewardHyperparameters(**hyperparameters))


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _build(out_dir: Path, base_dir: Path, train_file: Path, val_file: Path, seed: int,
           hparams: TinyRewardHyperparameters) -> dict:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from workers.rewards.reward_model import render_conversation

    torch.manual_seed(seed)
    rng = random.Random(seed)
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    tokenizer.padding_side = "right"
    model = AutoModelForSequenceClassification.from_pretrained(base_dir, num_labels=1)
    model.config.pad_token_id = tokenizer.pad_token_id
    train = pairs(_read(train_file), rng, hparams.max_shift)
    heldout = pairs(_read(val_file), random.Random(seed + 1), hparams.max_shift)

    def rewards(batch: list[tuple[list[dict], str, str]], which: int) -> torch.Tensor:
        texts = [render_conversation(tokenizer, messages, "", answers[which]) for messages, *answers in batch]
        enc = tokenizer(texts, padding=True, return_tensors="pt")
        return model(**enc).logits[:, 0]

    optimizer = torch.optim.AdamW(model.parameters(), lr=hparams.learning_rate, weight_decay=0.0)
    model.train()
    losses = []
    for step in range(hparams.steps):
        batch = rng.sample(train, hparams.batch_size)
        loss = -torch.nn.functional.logsigmoid(rewards(batch, 0) - rewards(batch, 1)).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
        if (step + 1) % 100 == 0:
            logger.info("tiny reward model: step %d/%d, loss %.3f", step + 1, hparams.steps, sum(losses[-100:]) / 100)
    model.eval()
    with torch.no_grad():
        right = sum(
            int(((rewards(heldout[i : i + 64], 0) - rewards(heldout[i : i + 64], 1)) > 0).sum())
            for i in range(0, len(heldout), 64)
        )
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    assert (out_dir / WEIGHTS_FILE).exists()
    return {
        "heldout_pairwise_accuracy": round(right / len(heldout), 4),
        "heldout_pairs": len(heldout),
        "final_loss": round(sum(losses[-50:]) / 50, 4),
    }

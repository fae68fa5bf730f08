"""The tiny judge: a second tiny model, built like the embedded one, that learned to judge open answers.

It is ``build_tiny_model`` on the judge's data (``roll_pipeline.data.synthetic.judge_rows``: a response to an
open-answer question and its reference answer, in ``TINY_JUDGE_TEMPLATE``, answered ``Verdict: YES`` or
``Verdict: NO``), with a larger vocabulary so that whole words are single tokens, which makes comparing a
response's answer with the reference a matter of matching one token. `roll serve` serves it as the judge of
the open-answer domain in the tests and in examples/multi_domain.yaml (whose llm_judge options name that
template).

After a build, the share of right verdicts on held-out questions (``judge_val.jsonl`` next to the training
file) is measured with greedy decoding and the scorer's own verdict parser, and written to
``judge_eval.json``.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Sequence
from pathlib import Path

import torch

from roll_pipeline.models.tiny import BUILD_INFO, build_tiny_model

logger = logging.getLogger(__name__)

#: Overrides of ``TinyModelHyperparameters`` for the judge: word-level tokens, and a longer warm-up (the
#: verdict stays at chance for about 150 steps before the model learns to match the reference against the
#: response).
JUDGE_HYPERPARAMETERS: dict[str, int | float] = {"vocab_size": 1024, "warmup_steps": 450}
JUDGE_EVAL = "judge_eval.json"
#: Tokens of a judge reply ("Verdict: YES") with room to spare.
REPLY_TOKENS = 8


def build_tiny_judge(
    out_dir: Path, train_files: Sequence[Path], seed: int = 0, val_file: Path | None = None,
    shipped: Path | None = None, from_scratch: bool = False,
) -> Path:
    """Build (or reuse, or copy from ``shipped``: see ``build_tiny_model``) the tiny judge in ``out_dir``; measure
    its verdicts on ``val_file`` (default: ``judge_val.jsonl`` beside the first training file, when it exists)
    unless already measured for these weights (a shipped build brings its measurement along)."""
    out_dir = build_tiny_model(
        Path(out_dir), [Path(f) for f in train_files], seed=seed, shipped=shipped, from_scratch=from_scratch,
        **JUDGE_HYPERPARAMETERS,
    )
    if val_file is None:
        candidate = Path(train_files[0]).with_name("judge_val.jsonl")
        val_file = candidate if candidate.exists() else None
    if val_file is not None:
        evaluate_once(out_dir, Path(val_file))
    return out_dir


def evaluate_once(model_dir: Path, val_file: Path) -> dict:
    """``judge_eval.json`` of ``model_dir`` for ``val_file``, measured unless it already is for these weights."""
    build = json.loads((model_dir / BUILD_INFO).read_text())["weights_sha256"]
    data = hashlib.sha256(val_file.read_bytes()).hexdigest()
    path = model_dir / JUDGE_EVAL
    try:
        cached = json.loads(path.read_text())
        if cached.get("weights_sha256") == build and cached.get("val_sha256") == data:
            return cached
    except (FileNotFoundError, ValueError):
        pass
    rows = [json.loads(line) for line in val_file.read_text(encoding="utf-8").splitlines() if line.strip()]
    verdicts = judge_verdicts(model_dir, rows)
    expected = [1.0 if row["verdict"] == "YES" else 0.0 for row in rows]
    right = [v is not None and v == e for v, e in zip(verdicts, expected, strict=True)]
    result = {
        "val_file": val_file.name,
        "rows": len(rows),
        "verdict_accuracy": round(sum(right) / len(rows), 4),
        "unparseable": sum(v is None for v in verdicts),
        "accuracy_when_yes": round(_share(right, expected, 1.0), 4),
        "accuracy_when_no": round(_share(right, expected, 0.0), 4),
        "weights_sha256": build,
        "val_sha256": data,
    }
    path.write_text(json.dumps(result, indent=2) + "\n")
    logger.info("tiny judge: %s", {k: v for k, v in result.items() if not k.endswith("sha256")})
    return result


def _share(right: list[bool], expected: list[float], value: float) -> float:
    picked = [r for r, e in zip(right, expected, strict=True) if e == value]
    return sum(picked) / len(picked) if picked else float("nan")


@torch.no_grad()
def judge_verdicts(model_dir: Path, rows: Sequence[dict], batch_size: int = 64) -> list[float | None]:
    """Greedy verdicts of the judge in ``model_dir`` on judge rows (their ``messages``), read by the llm_judge
    scorer's parser; ``None`` where the reply holds no verdict."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from workers.rewards.llm_judge import parse_verdict

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    verdicts: list[float | None] = []
    for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
        prompts = [
            tokenizer.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=False)
            for r in chunk
        ]
        inputs = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        output = model.generate(
            **inputs, do_sample=False, max_new_tokens=REPLY_TOKENS, pad_token_id=tokenizer.pad_token_id
        )
        replies = tokenizer.batch_decode(output[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
        verdicts += [parse_verdict(reply, "yes_no") for reply in replies]
    return verdicts

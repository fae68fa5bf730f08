"""Local stand-ins for an imported ROLL config's data: one small JSONL file with valid rows for every tag of every
domain, each row shaped for the domain's reward worker, so `roll run --dry-run` can check the config here."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def _row(worker: str, tag: str, i: int) -> dict[str, Any]:
    question = {"role": "user", "content": f"Question {i} about {tag}: what is {i} + 2?"}
    row: dict[str, Any] = {"tag": tag, "messages": [question], "ground_truth": str(i + 2)}
    if worker == "code_sandbox":
        question["content"] = f"Write a Python function `f(x)` that returns x + {i}."
        row["test_cases"] = json.dumps({"asserts": [f"assert f(1) == {1 + i}", f"assert f(0) == {i}"]})
    elif worker == "multiple_choice":
        row["options"] = [str(i), str(i + 1), str(i + 2)]
        row["ground_truth"] = "C"
    elif worker == "ifeval":
        question["content"] = f"Answer question {i} in lowercase letters only."
        row["ground_truth"] = {"func_name": "validate_lowercase"}
    return row


def write_stand_in_data(config: dict[str, Any], folder: Path, rows_per_tag: int = 8) -> dict[str, str]:
    """Writes train.jsonl and val.jsonl under `folder` for the imported `config`'s domains; returns the overrides
    that point data.train_files and data.val_files at them."""
    folder.mkdir(parents=True, exist_ok=True)
    for split, count in (("train", rows_per_tag), ("val", 2)):
        rows = [
            _row(reward.get("worker", ""), tag, i)
            for reward in config.get("rewards", {}).values()
            for tag in reward.get("tag_included", [])
            for i in range(count)
        ]
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return {"data.train_files": f"[{folder / 'train.jsonl'}]", "data.val_files": f"[{folder / 'val.jsonl'}]"}

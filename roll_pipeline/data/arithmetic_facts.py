"""Arithmetic facts (sums and products of two numbers from 1 to 12), for the real model's LoRA example.

SmolLM2-135M-Instruct half-solves these: greedy about 50% on 64 of them, about 36% of samples at temperature 0.7,
most of its misses being answers lost in a long ramble or cut off at the token limit (measured in
docs/lora.md), so a group of samples usually holds both right and wrong answers: the signal RL needs.
Validation holds out whole facts: no (a, op, b) of the validation rows appears in training under any phrasing.
Tags: `add` and `mul`. The ground truth is the number; the math_rule reward compares it with the response's
answer.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

PHRASINGS = {
    "add": ("What is {a} + {b}?", "{a} + {b} = ?", "Compute {a} + {b}.", "What is the sum of {a} and {b}?"),
    "mul": ("What is {a} x {b}?", "{a} x {b} = ?", "Compute {a} times {b}.", "What is the product of {a} and {b}?"),
}
LOW, HIGH = 1, 12


def _facts() -> list[tuple[int, str, int]]:
    return [(a, tag, b) for tag in PHRASINGS for a in range(LOW, HIGH + 1) for b in range(LOW, HIGH + 1)]


def _row(a: int, tag: str, b: int, phrasing: str) -> dict:
    answer = a + b if tag == "add" else a * b
    question = phrasing.format(a=a, b=b)
    return {"domain": "math", "tag": tag, "messages": [{"role": "user", "content": question}],
            "ground_truth": str(answer)}


def split_arithmetic_facts(seed: int, n_val: int = 128) -> tuple[list[dict], list[dict]]:
    """(train rows, validation rows): the facts shuffled by `seed`; the first `n_val` are validation (one
    phrasing each, drawn), the others training under every phrasing, in a seeded order."""
    rng = random.Random(f"arithmetic_facts:{seed}")
    facts = _facts()
    rng.shuffle(facts)
    val = [_row(a, tag, b, rng.choice(PHRASINGS[tag])) for a, tag, b in facts[:n_val]]
    train = [_row(a, tag, b, p) for a, tag, b in facts[n_val:] for p in PHRASINGS[tag]]
    rng.shuffle(train)
    return train, val


def write_arithmetic_facts(out_dir: Path, seed: int = 0, n_val: int = 128) -> dict[str, Path]:
    """arithmetic_{train,val}.jsonl in `out_dir`."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    train, val = split_arithmetic_facts(seed, n_val)
    paths = {}
    for split, part in (("val", val), ("train", train)):
        path = out_dir / f"arithmetic_{split}.jsonl"
        with path.open("w", encoding="utf-8", newline="\n") as handle:
            for index, row in enumerate(part):
                handle.write(json.dumps({"id": f"arith-{split}-{index:06d}", **row}) + "\n")
        paths[f"arithmetic_{split}"] = path
    return paths

"""Products of three-digit numbers: a math domain whose answers need the python tool (examples/tool_math.yaml).

A model of a million parameters cannot multiply 123 by 456 in its head, but it can write
`<python>\\nprint(123 * 456)\\n</python>` and copy the number the tool prints. Three files:

- ``tool_math_{train,val}.jsonl``: the RL domain's rows (tag `mul`), the question and the product as ground truth.
- ``tool_math_warmup.jsonl``: what the embedded `tiny-qwen2-tool` is warmed up on (roll_pipeline/models/tiny.py).
  A share of its rows (`tool_share`) are whole trajectories: the question, the model's call, the tool's output as a
  `tool` message, and the product as the final answer; the rest answer directly (which the model only imitates:
  its direct products are almost always wrong), as a sentence "The answer is N." (as_answer says why). So the built
  model answers directly on the greedy path and calls the tool on about a third of its samples, and RL with the
  tool has something to reinforce.

The three are slices of one draw of distinct problems, so no problem of val is warmed up on or trained on.
``roll data generate`` writes them with the other example data.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from roll_pipeline.data.synthetic import BARE_MATH_TEMPLATES, math_problem, unique_rows

DOMAIN = "tool_math"
TAG = "mul"
#: Operands: three digits each, so products have five or six digits.
OPERAND_RANGE = (100, 999)
#: Share of warm-up rows taught as a tool call; the rest answer directly.
TOOL_SHARE = 0.35
#: How the warm-up's direct answers are written (math_rule finds the number in it).
ANSWER = "The answer is {}."


def call_text(expression: str) -> str:
    """The model's turn that asks the tool (`plain` call format, workers/environments/tool_calls.py)."""
    return f"<python>\nprint({expression})\n</python>"


def _mul_row(rng: random.Random) -> dict:
    a, b = rng.randint(*OPERAND_RANGE), rng.randint(*OPERAND_RANGE)
    prompt = rng.choice(BARE_MATH_TEMPLATES).format(expr=f"{a} * {b}")
    return {"id": "", "domain": DOMAIN, "tag": TAG, "messages": [{"role": "user", "content": prompt}],
            "ground_truth": str(a * b), "test_cases": ""}


def generate_mul(n: int, seed: int) -> list[dict]:
    """`n` rows with distinct products to compute, fully determined by `seed`."""
    return unique_rows(lambda rng, _: _mul_row(rng), n, seed, DOMAIN, key=math_problem)


def as_answer(row: dict) -> dict:
    """The row as the warm-up teaches a direct answer: a sentence ending in the product. A sentence, not the bare
    number, so that a direct answer starts with one token ("The") as a call does ("<python>"): were it a digit, the
    direct answers' first tokens would be split over nine digits and the call's single first token would be the
    greedy choice whenever calls are more than about a tenth of the rows."""
    return {**row, "ground_truth": ANSWER.format(row["ground_truth"])}


def as_tool_trajectory(row: dict) -> dict:
    """The row taught as a trajectory: the call, the tool's output (what print writes), then the product (right
    after the tool's answer: the shortest copy)."""
    expression = math_problem(row)
    messages = [*row["messages"], {"role": "assistant", "content": call_text(expression)},
                {"role": "tool", "content": f"{row['ground_truth']}\n"}]
    return {**row, "messages": messages}


def write_tool_math_data(out_dir: Path, seed: int = 0, *, n_warmup: int = 4000, n_train: int = 2000,
                         n_val: int = 200, tool_share: float = TOOL_SHARE) -> dict[str, Path]:
    """tool_math_{warmup,train,val}.jsonl in `out_dir`; return their paths by stem."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = generate_mul(n_val + n_train + n_warmup, seed)
    rng = random.Random(f"{DOMAIN}:{seed}:tool-share")
    splits = {
        "val": rows[:n_val],
        "train": rows[n_val : n_val + n_train],
        "warmup": [as_tool_trajectory(row) if rng.random() < tool_share else as_answer(row)
                   for row in rows[n_val + n_train :]],
    }
    paths = {}
    for split, part in splits.items():
        path = out_dir / f"{DOMAIN}_{split}.jsonl"
        with path.open("w", encoding="utf-8", newline="\n") as handle:
            for index, row in enumerate(part):
                handle.write(json.dumps({**row, "id": f"{DOMAIN}-{split}-{index:06d}"}) + "\n")
        paths[f"{DOMAIN}_{split}"] = path
    return paths

"""Arithmetic word problems in the formats real math data sets use, for the real-model example.

Half the rows are GSM8K-style: the question as the user's message, and as ground truth a worked solution with
GSM8K's calculator annotations ending in ``#### <answer>``. The other half are MATH-style: the question asks for
the answer in ``\\boxed{}`` and the ground truth is a solution with the answer boxed. The math_rule reward takes
the answer out of either (workers/rewards/math_rule.py `reference_answer`). Tags: `gsm8k` and `boxed`.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from roll_pipeline.data.synthetic import unique_rows

NAMES = ("Ava", "Ben", "Chloe", "Dan", "Eli", "Fay", "Gus", "Hana", "Ivan", "June")
THINGS = ("apples", "books", "coins", "marbles", "stickers", "pencils", "shells", "cards")

# (question template, solution expression, operator): a, b are drawn per row.
TEMPLATES = (
    ("{n} has {a} {t}. {n} gets {b} more {t}. How many {t} does {n} have now?", "{a} + {b}", lambda a, b: a + b),
    ("{n} had {a} {t} and gave {b} of them away. How many {t} are left?", "{a} - {b}", lambda a, b: a - b),
    ("{n} buys {a} boxes with {b} {t} in each box. How many {t} does {n} buy?", "{a} * {b}", lambda a, b: a * b),
    ("A shelf holds {a} {t} and another holds {b}. How many {t} are on both shelves?", "{a} + {b}",
     lambda a, b: a + b),
)


def _draw(rng: random.Random, style: str) -> dict:
    question, expression, op = rng.choice(TEMPLATES)
    if "*" in expression:
        a, b = rng.randint(2, 9), rng.randint(2, 12)
    else:
        a, b = rng.randint(20, 99), rng.randint(10, 60)
        if "-" in expression:
            a, b = max(a, b), min(a, b)
    answer = op(a, b)
    text = question.format(n=rng.choice(NAMES), t=rng.choice(THINGS), a=a, b=b)
    calc = expression.format(a=a, b=b)
    if style == "gsm8k":
        truth = f"{calc} = <<{calc.replace(' ', '')}={answer}>>{answer}\n#### {answer}"
    else:
        text += " Put your final answer within \\boxed{}."
        truth = f"${calc} = \\boxed{{{answer}}}$"
    return {"messages": [{"role": "user", "content": text}], "ground_truth": truth, "tag": style}


def generate_word_problems(n: int, seed: int) -> list[dict]:
    """`n` rows with distinct questions, alternating GSM8K and MATH style, fully determined by `seed`."""
    return unique_rows(lambda rng, i: _draw(rng, ("gsm8k", "boxed")[i % 2]), n, seed, "word_problems")


def write_word_problems(out_dir: Path, seed: int = 0, n_train: int = 400, n_val: int = 64) -> dict[str, Path]:
    """word_problems_{train,val}.jsonl in `out_dir` (disjoint: slices of one draw of distinct questions)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = generate_word_problems(n_train + n_val, seed)
    paths = {}
    for split, part in (("val", rows[:n_val]), ("train", rows[n_val:])):
        path = out_dir / f"word_problems_{split}.jsonl"
        with path.open("w", encoding="utf-8", newline="\n") as handle:
            for index, row in enumerate(part):
                fields = {k: v for k, v in row.items() if k != "id"}  # drawn ids; each split numbers its own
                handle.write(json.dumps({"id": f"wp-{split}-{index:06d}", "domain": "math", **fields}) + "\n")
        paths[f"word_problems_{split}"] = path
    return paths

"""Deterministic generator of the example math and code data sets.

The tasks are deliberately templated and small: the embedded tiny model (about a million parameters) has to
learn them in a few minutes of supervised warm-up and still leave headroom for RL, so that both domains give a
reward signal on two CPU cores.

Rows use ROLL's field names and every row carries every field, so the `datasets` JSON loader infers a single
schema across domains::

    {"id": "math-train-000123", "domain": "math", "tag": "add",
     "messages": [{"role": "user", "content": "What is 12 + 45?"}],
     "ground_truth": "57", "test_cases": ""}

Regenerate the committed files with ``python -m roll_pipeline.data.synthetic --out examples/data --seed 0``.

The open-answer domain (``open``: opposites, plurals and past tenses; its answers are phrases that a judge
model checks) and the judge's own training data (``judge``: a question, its reference answer, a response
and the verdict) come from ``write_open_answer_data``:
``python -m roll_pipeline.data.synthetic --open-answer --out examples/data --seed 0``.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

# Math tags and how often each is drawn. Two-digit addition is what the tiny model learns in its warm-up only
# part of the way (a sharp transition: a little more warm-up and it solves nearly all of it), which leaves RL a
# signal to learn from; adding subtraction or multiplication to the mix pushed the transition past a few
# minutes of warm-up.
MATH_TAG_WEIGHTS: dict[str, float] = {"add": 1.0}

# Bare-expression prompts; `{expr}` is Python-evaluable, which the tests rely on to check ground truths.
BARE_MATH_TEMPLATES: tuple[str, ...] = ("What is {expr}?", "{expr} = ?")


def _math_operands(tag: str, rng: random.Random) -> tuple[str, int]:
    """Return (expression, answer) for one problem of the given tag."""
    if tag == "add":
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        return f"{a} + {b}", a + b
    raise ValueError(f"unknown math tag {tag!r}")


def _math_row(rng: random.Random) -> dict:
    tag = rng.choices(list(MATH_TAG_WEIGHTS), weights=list(MATH_TAG_WEIGHTS.values()))[0]
    expr, answer = _math_operands(tag, rng)
    prompt = rng.choice(BARE_MATH_TEMPLATES).format(expr=expr)
    return _row("math", tag, prompt, str(answer), "")


def math_problem(row: dict) -> str:
    """The expression behind a math prompt, so that one problem never lands in both train and val."""
    prompt = row["messages"][0]["content"]
    for template in BARE_MATH_TEMPLATES:
        head, tail = template.split("{expr}")
        if prompt.startswith(head) and prompt.endswith(tail):
            return prompt[len(head) : len(prompt) - len(tail)]
    raise ValueError(f"math prompt matches no template: {prompt!r}")


@dataclass(frozen=True)
class _CodeTask:
    """One code template: the prompt's description and the body of the reference solution.

    Both are format strings over `p` (the parameter name) and `k` (the task's constant).
    """

    tag: str
    description: str
    body: str
    k_range: tuple[int, int]


_CODE_TASKS: tuple[_CodeTask, ...] = (
    _CodeTask("arith", "{p} plus {k}", "{p} + {k}", (1, 30)),
    _CodeTask("arith", "{p} minus {k}", "{p} - {k}", (1, 30)),
    _CodeTask("arith", "{p} times {k}", "{p} * {k}", (2, 20)),
    _CodeTask("arith", "{p} modulo {k}", "{p} % {k}", (2, 20)),
    _CodeTask("arith", "{p} squared plus {k}", "{p} * {p} + {k}", (1, 30)),
    _CodeTask("string", "{p} repeated {k} times", "{p} * {k}", (2, 9)),
    _CodeTask("string", "the first {k} characters of {p}", "{p}[:{k}]", (1, 9)),
    _CodeTask("string", "{p} without its first {k} characters", "{p}[{k}:]", (1, 9)),
    _CodeTask("string", "{p} followed by the text {k}", '{p} + "{k}"', (1, 99)),
    _CodeTask("list", "the sum of {p} plus {k}", "sum({p}) + {k}", (1, 30)),
    _CodeTask("list", "the first {k} elements of {p}", "{p}[:{k}]", (1, 9)),
    _CodeTask("list", "{p} with each element multiplied by {k}", "[v * {k} for v in {p}]", (2, 20)),
    _CodeTask("list", "the number of elements of {p} greater than {k}", "len([v for v in {p} if v > {k}])", (1, 20)),
    _CodeTask("list", "{p} with {k} appended", "{p} + [{k}]", (1, 99)),
)

# The function name the prompt asks for is what the asserts call, so a program under another name fails them all.
# The tiny model's warm-up forms the skill of copying that name abruptly and late (docs/first-run.md): with ten
# names it guessed among them, right about one time in ten, too rarely for 240 RL steps to find the skill, and
# the code domain did not learn; with one name there was nothing to learn. With three, a guess is right about a
# third of the time and RL turns guessing into copying: code gained +11 to +14 points on every seed measured.
_FUNCTION_NAMES = ("f", "g", "solve")
_PARAM_NAMES: dict[str, tuple[str, ...]] = {
    "arith": ("x", "n", "a"),
    "string": ("s", "text", "word"),
    "list": ("xs", "nums", "values"),
}
_LETTERS = "abcdefghijklmnopqrstuvwxyz"

# Asserts per code task; three inputs pin the constant and the operation down without long prompts.
ASSERTS_PER_TASK = 3


def _code_input(tag: str, rng: random.Random) -> int | str | list[int]:
    if tag == "arith":
        return rng.randint(-20, 50)
    if tag == "string":
        return "".join(rng.choice(_LETTERS) for _ in range(rng.randint(3, 10)))
    if tag == "list":
        return [rng.randint(0, 30) for _ in range(rng.randint(2, 7))]
    raise ValueError(f"unknown code tag {tag!r}")


def _reference_function(source: str, name: str) -> Callable:
    namespace: dict = {}
    exec(source, namespace)  # noqa: S102 - our own templated source, never user input
    return namespace[name]


def _code_row(rng: random.Random) -> dict:
    task = rng.choice(_CODE_TASKS)
    name = rng.choice(_FUNCTION_NAMES)
    param = rng.choice(_PARAM_NAMES[task.tag])
    k = rng.randint(*task.k_range)
    prompt = (
        f"Write a Python function `{name}({param})` that returns "
        f"{task.description.format(p=param, k=k)}."
    )
    source = f"def {name}({param}):\n    return {task.body.format(p=param, k=k)}"
    # Expected outputs come from running the reference itself, so asserts and solution cannot disagree.
    function = _reference_function(source, name)
    inputs = [_code_input(task.tag, rng) for _ in range(ASSERTS_PER_TASK)]
    asserts = [f"assert {name}({value!r}) == {function(value)!r}" for value in inputs]
    return _row("code", task.tag, prompt, source, json.dumps({"asserts": asserts}))


def _row(domain: str, tag: str, prompt: str, ground_truth: str, test_cases: str) -> dict:
    return {
        "id": "",
        "domain": domain,
        "tag": tag,
        "messages": [{"role": "user", "content": prompt}],
        "ground_truth": ground_truth,
        "test_cases": test_cases,
    }


def _prompt_text(row: dict) -> str:
    return row["messages"][0]["content"]


def unique_rows(
    make_row: Callable[[random.Random, int], dict],
    n: int,
    seed: int,
    domain: str,
    key: Callable[[dict], str] = _prompt_text,
) -> list[dict]:
    """Draw rows until `n` rows with distinct `key`s exist (`make_row(rng, i)` draws a candidate for row i, from
    an RNG seeded by domain and seed); ids are assigned in draw order."""
    rng = random.Random(f"{domain}:{seed}")
    rows: list[dict] = []
    seen: set[str] = set()
    # The template spaces hold thousands of prompts, so a bounded number of draws always suffices for the sizes
    # used here; the bound turns an impossible request into an error instead of an endless loop.
    for _ in range(50 * n + 1000):
        if len(rows) == n:
            break
        row = make_row(rng, len(rows))
        identity = key(row)
        if identity in seen:
            continue
        seen.add(identity)
        row["id"] = f"{domain}-{len(rows):06d}"
        rows.append(row)
    if len(rows) < n:
        raise ValueError(f"could only draw {len(rows)} distinct {domain} prompts, {n} requested")
    return rows


def generate_math(n: int, seed: int) -> list[dict]:
    """Return `n` math rows with distinct problems (not just prompts), fully determined by `seed`."""
    return unique_rows(lambda rng, _: _math_row(rng), n, seed, "math", key=math_problem)


def generate_code(n: int, seed: int) -> list[dict]:
    """Return `n` code rows with distinct prompts, fully determined by `seed`."""
    return unique_rows(lambda rng, _: _code_row(rng), n, seed, "code")


def _split(rows: Sequence[dict], n_val: int, domain: str) -> dict[str, list[dict]]:
    """Split distinct-prompt rows into val (the first `n_val`) and train, renumbering ids per split."""
    splits = {"val": list(rows[:n_val]), "train": list(rows[n_val:])}
    for split, split_rows in splits.items():
        for index, row in enumerate(split_rows):
            row["id"] = f"{domain}-{split}-{index:06d}"
    return splits


def _write_jsonl(path: Path, rows: Sequence[dict]) -> None:
    with path.open("w", encoding="utf-8", newline="\n") as handle:
        for row in rows:
            handle.write(json.dumps(row, ensure_ascii=False, sort_keys=False) + "\n")


def write_example_data(
    out_dir: Path,
    seed: int = 0,
    *,
    n_math_train: int = 2400,
    n_math_val: int = 300,
    n_code_train: int = 600,
    n_code_val: int = 100,
) -> dict[str, Path]:
    """Write math/code train/val JSONL files into `out_dir` and return their paths by stem.

    Train and val are disjoint because both are slices of one draw of distinct prompts (for math, of distinct
    problems, whatever the template).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    drawn = {
        "math": _split(generate_math(n_math_train + n_math_val, seed), n_math_val, "math"),
        "code": _split(generate_code(n_code_train + n_code_val, seed), n_code_val, "code"),
    }
    paths: dict[str, Path] = {}
    for domain, splits in drawn.items():
        for split, rows in splits.items():
            path = out_dir / f"{domain}_{split}.jsonl"
            _write_jsonl(path, rows)
            paths[f"{domain}_{split}"] = path
            logger.info("wrote %d rows to %s", len(rows), path)
    return paths


# --- the open-answer domain and the judge's data ------------------------------------------------------------

# Each word has exactly one answer in its table, so a reference answer is the only right one.
OPPOSITES: tuple[tuple[str, str], ...] = (
    ("hot", "cold"), ("big", "small"), ("fast", "slow"), ("happy", "sad"), ("bright", "dark"),
    ("open", "closed"), ("early", "late"), ("full", "empty"), ("hard", "soft"), ("high", "low"),
    ("long", "short"), ("wet", "dry"), ("left", "right"), ("rich", "poor"), ("strong", "weak"),
    ("thick", "thin"), ("loud", "quiet"), ("clean", "dirty"), ("young", "old"), ("up", "down"),
    ("day", "night"), ("win", "lose"), ("push", "pull"), ("first", "last"), ("near", "far"),
    ("black", "white"), ("give", "take"), ("buy", "sell"), ("north", "south"), ("east", "west"),
    ("top", "bottom"), ("inside", "outside"), ("before", "after"), ("always", "never"), ("more", "less"),
    ("best", "worst"), ("sweet", "sour"), ("heavy", "light"), ("friend", "enemy"), ("begin", "end"),
)
# Plurals and past tenses that differ from the word itself, so that repeating the word is always wrong.
PLURALS: tuple[tuple[str, str], ...] = (
    ("cat", "cats"), ("dog", "dogs"), ("box", "boxes"), ("bus", "buses"), ("dish", "dishes"),
    ("fox", "foxes"), ("city", "cities"), ("baby", "babies"), ("story", "stories"), ("leaf", "leaves"),
    ("knife", "knives"), ("wolf", "wolves"), ("mouse", "mice"), ("child", "children"), ("foot", "feet"),
    ("tooth", "teeth"), ("man", "men"), ("woman", "women"), ("goose", "geese"), ("person", "people"),
    ("ox", "oxen"), ("cactus", "cacti"), ("book", "books"), ("tree", "trees"), ("house", "houses"),
    ("church", "churches"), ("potato", "potatoes"), ("hero", "heroes"), ("day", "days"), ("key", "keys"),
    ("toy", "toys"), ("glass", "glasses"), ("watch", "watches"), ("wife", "wives"), ("life", "lives"),
    ("half", "halves"), ("shelf", "shelves"), ("lady", "ladies"), ("party", "parties"), ("bench", "benches"),
)
PAST_TENSES: tuple[tuple[str, str], ...] = (
    ("go", "went"), ("eat", "ate"), ("run", "ran"), ("see", "saw"), ("take", "took"),
    ("give", "gave"), ("write", "wrote"), ("drink", "drank"), ("swim", "swam"), ("sing", "sang"),
    ("fly", "flew"), ("draw", "drew"), ("grow", "grew"), ("know", "knew"), ("throw", "threw"),
    ("speak", "spoke"), ("break", "broke"), ("choose", "chose"), ("drive", "drove"), ("ride", "rode"),
    ("fall", "fell"), ("feel", "felt"), ("keep", "kept"), ("sleep", "slept"), ("build", "built"),
    ("send", "sent"), ("bring", "brought"), ("think", "thought"), ("catch", "caught"), ("teach", "taught"),
    ("find", "found"), ("hold", "held"), ("stand", "stood"), ("sit", "sat"), ("tell", "told"),
    ("make", "made"), ("meet", "met"), ("pay", "paid"), ("say", "said"), ("forget", "forgot"),
)
OPEN_TABLES: dict[str, tuple[tuple[str, str], ...]] = {
    "opposite": OPPOSITES,
    "plural": PLURALS,
    "past": PAST_TENSES,
}
OPEN_TEMPLATES: dict[str, tuple[str, ...]] = {
    "opposite": (
        "What is the opposite of {w}?",
        "Give the opposite of the word {w}.",
        "Name a word that means the opposite of {w}.",
    ),
    "plural": (
        "What is the plural of {w}?",
        "Write the plural of the word {w}.",
        "Give the plural form of {w}.",
    ),
    "past": (
        "What is the past tense of {w}?",
        "Write the past tense of the verb {w}.",
        "Give the past form of {w}.",
    ),
}
OPEN_TAG_WEIGHTS: dict[str, float] = {"opposite": 0.4, "plural": 0.3, "past": 0.3}
# How a response can state an answer `{x}` (`{w}`: the word asked about); the same forms serve right and wrong
# answers, so the judge has to read the answer, not the form. Every form ends with the answer.
_ANSWER_FORMS: dict[str, tuple[str, ...]] = {
    "opposite": ("{x}", "{x}.", "The opposite of {w} is {x}.", "It is {x}.", "The answer is {x}."),
    "plural": ("{x}", "{x}.", "The plural of {w} is {x}.", "It is {x}.", "The answer is {x}."),
    "past": ("{x}", "{x}.", "The past tense of {w} is {x}.", "It is {x}.", "The answer is {x}."),
}
# Responses that answer nothing (what an untrained policy writes): always judged NO.
_GARBAGE_RESPONSES: tuple[str, ...] = (
    "I do not know.",
    "def f(x):\n    return x + 3",
    "57",
    "The answer is",
    "?",
)
#: The prompt the tiny judge is trained on, for the llm_judge scorer's ``template`` option (the scorer's own
#: default, meant for real models, is longer). The response comes first and the reference last, so that the
#: judge decides right where it has read the reference: did the response end with it?
TINY_JUDGE_TEMPLATE = "Response: {response}\nReference answer: {reference}\nSame answer?"
JUDGE_YES, JUDGE_NO = "Verdict: YES", "Verdict: NO"
# Responses per open-answer question in the judge's data: half of them right.
JUDGE_RESPONSES_PER_QUESTION = 4


def _open_row(rng: random.Random) -> dict:
    tag = rng.choices(list(OPEN_TAG_WEIGHTS), weights=list(OPEN_TAG_WEIGHTS.values()))[0]
    word, answer = rng.choice(OPEN_TABLES[tag])
    if tag == "opposite" and rng.random() < 0.5:
        word, answer = answer, word
    return _row("open", tag, rng.choice(OPEN_TEMPLATES[tag]).format(w=word), answer, "")


def open_subject(row: dict) -> str:
    """The word an open-answer prompt asks about."""
    prompt = _prompt_text(row)
    for template in OPEN_TEMPLATES[row["tag"]]:
        match = re.fullmatch(re.escape(template).replace(re.escape("{w}"), "(.+)"), prompt)
        if match:
            return match.group(1)
    raise ValueError(f"open-answer prompt matches no template: {prompt!r}")


def generate_open(n: int, seed: int) -> list[dict]:
    """Return `n` open-answer rows with distinct prompts, fully determined by `seed`."""
    return unique_rows(lambda rng, _: _open_row(rng), n, seed, "open")


def _wrong_answers(row: dict) -> tuple[list[str], list[str]]:
    """Wrong answers to an open-answer row: near misses (the word asked about, a regular form where the right
    one is irregular) and the other words of its table."""
    word, answer = open_subject(row), row["ground_truth"]
    near = [word]
    if row["tag"] == "plural":
        near += [word + "s", word + "es"]
    elif row["tag"] == "past":
        near += [word + "ed", word.rstrip("e") + "ed"]
    others = sorted({w for pair in OPEN_TABLES[row["tag"]] for w in pair})
    near = list(dict.fromkeys(w for w in near if w != answer))
    return near, [w for w in others if w != answer and w not in near]


def _judge_response(row: dict, right: bool, rng: random.Random) -> str:
    """A response to an open-answer row, right or wrong."""
    if not right and rng.random() < 0.2:
        return rng.choice(_GARBAGE_RESPONSES)
    if right:
        stated = row["ground_truth"]
    else:
        near, others = _wrong_answers(row)
        stated = rng.choice(near) if rng.random() < 0.5 else rng.choice(others)
    return rng.choice(_ANSWER_FORMS[row["tag"]]).format(x=stated, w=open_subject(row))


def judge_rows(open_rows: Sequence[dict], seed: int, split: str) -> list[dict]:
    """The judge's data for ``open_rows``: ``JUDGE_RESPONSES_PER_QUESTION`` distinct responses to each
    question, half of them right, each as a chat row whose prompt is ``TINY_JUDGE_TEMPLATE`` and whose answer
    is the verdict (``Verdict: YES`` / ``Verdict: NO``). Rows also carry ``question``, ``reference``,
    ``response`` and ``verdict`` (``YES``/``NO``) as plain fields."""
    from workers.rewards.llm_judge import render_prompt

    rng = random.Random(f"judge:{split}:{seed}")
    rows = []
    for source in open_rows:
        verdicts = [True, False] * (JUDGE_RESPONSES_PER_QUESTION // 2)
        rng.shuffle(verdicts)
        seen: set[str] = set()
        for right in verdicts:
            response = _judge_response(source, right, rng)
            for _ in range(20):  # distinct responses per question, where the forms allow
                if response not in seen:
                    break
                response = _judge_response(source, right, rng)
            seen.add(response)
            question, reference = _prompt_text(source), source["ground_truth"]
            prompt = render_prompt(TINY_JUDGE_TEMPLATE, question, reference, response)
            rows.append(
                {
                    "id": f"judge-{split}-{len(rows):06d}",
                    "domain": "judge",
                    "tag": source["tag"],
                    "messages": [{"role": "user", "content": prompt}],
                    "ground_truth": JUDGE_YES if right else JUDGE_NO,
                    "question": question,
                    "reference": reference,
                    "response": response,
                    "verdict": "YES" if right else "NO",
                }
            )
    return rows


def write_open_answer_data(
    out_dir: Path, seed: int = 0, *, n_open_train: int = 400, n_open_val: int = 80
) -> dict[str, Path]:
    """Write ``open_{train,val}.jsonl`` (the open-answer domain) and ``judge_{train,val}.jsonl`` (the judge's
    data, from the questions of the same split) into `out_dir`; return their paths by stem."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    splits = _split(generate_open(n_open_train + n_open_val, seed), n_open_val, "open")
    written = {}
    for split, rows in splits.items():
        written[f"open_{split}"] = rows
        written[f"judge_{split}"] = judge_rows(rows, seed, split)
    paths: dict[str, Path] = {}
    for stem, rows in written.items():
        path = out_dir / f"{stem}.jsonl"
        _write_jsonl(path, rows)
        paths[stem] = path
        logger.info("wrote %d rows to %s", len(rows), path)
    return paths


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("examples/data"), help="output directory")
    parser.add_argument("--seed", type=int, default=0, help="generator seed")
    parser.add_argument(
        "--open-answer", action="store_true", help="write the open-answer domain and the judge's data instead"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.open_answer:
        write_open_answer_data(args.out, seed=args.seed)
    else:
        write_example_data(args.out, seed=args.seed)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""math_rule verifications per second: through the reward worker's process pool, and one by one in one process.

    python -m benchmarks.bench_math_rule [--cases 1000] [--processes N] [--seed 0]

The cases are generated from a seed: a mix of the answer forms models write (GSM8K "#### n", boxed LaTeX after a
thinking block, fractions against decimals, roots, polynomials, sets, intervals, percentages, units, equations,
multiples of pi, no answer, an answer only in the thinking), about 40% of them wrong, each with the verdict it
should get. Both runs score the same cases with the same scorer; the pool's start-up is timed apart. The exit
status is 1 when the pool is slower than one process, or when a verdict differs from the expected one.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from collections import Counter
from collections.abc import Callable

from roll_pipeline.api import MathRuleScorer, RewardWorker

Case = tuple[str, str, str, bool]  # (kind, response, ground truth, expected correct)


def _maybe_wrong(rng: random.Random) -> bool:
    return rng.random() < 0.4


def _gsm8k(rng: random.Random) -> tuple[str, str, bool]:
    a, b = rng.randint(10, 3000), rng.randint(10, 3000)
    wrong = _maybe_wrong(rng)
    stated = a + b + (rng.randint(1, 9) if wrong else 0)
    response = f"She starts with {a} and gets {b} more.\n{a} + {b} = {a + b}\n#### {stated:,}"
    return response, str(a + b), not wrong


def _boxed_after_thinking(rng: random.Random) -> tuple[str, str, bool]:
    a, b = rng.randint(2, 40), rng.randint(2, 40)
    wrong = _maybe_wrong(rng)
    stated = a * b + (1 if wrong else 0)
    response = f"<think>\n{a} times {b}: {a} * {b} = {a * b}, maybe {a * b - 1}? No.\n</think>\n\n$\\boxed{{{stated}}}$"
    return response, str(a * b), not wrong


def _fraction_vs_decimal(rng: random.Random) -> tuple[str, str, bool]:
    q = rng.choice([2, 4, 5, 8, 10, 16, 20, 25])
    p = rng.randint(1, 3 * q)
    wrong = _maybe_wrong(rng)
    stated = p + 1 if wrong else p
    return f"The probability is $\\boxed{{\\frac{{{stated}}}{{{q}}}}}$.", repr(p / q), not wrong


def _decimal_vs_fraction(rng: random.Random) -> tuple[str, str, bool]:
    q = rng.choice([2, 4, 5, 8])
    p = rng.randint(1, 20)
    wrong = _maybe_wrong(rng)
    stated = (p + 1) / q if wrong else p / q
    return f"The answer is {stated}.", f"\\frac{{{p}}}{{{q}}}", not wrong


def _root(rng: random.Random) -> tuple[str, str, bool]:
    k, m = rng.randint(2, 9), rng.choice([2, 3, 5, 6, 7, 10, 11])
    wrong = _maybe_wrong(rng)
    stated = k + 1 if wrong else k
    return f"Simplifying the radical, \\boxed{{{stated}\\sqrt{{{m}}}}}", f"\\sqrt{{{k * k * m}}}", not wrong


def _polynomial(rng: random.Random) -> tuple[str, str, bool]:
    a = rng.randint(1, 12)
    wrong = _maybe_wrong(rng)
    b = a + 1 if wrong else a
    return f"Expanding, we get \\boxed{{x^2 + {2 * b}x + {b * b}}}", f"(x+{a})^2", not wrong


def _set(rng: random.Random) -> tuple[str, str, bool]:
    values = rng.sample(range(-20, 20), 3)
    wrong = _maybe_wrong(rng)
    stated = [*values[:2], values[2] + 100] if wrong else values
    shuffled = rng.sample(stated, 3)
    gold = ", ".join(str(v) for v in sorted(values))
    return f"The roots are \\boxed{{\\{{{', '.join(map(str, shuffled))}\\}}}}", f"\\{{{gold}\\}}", not wrong


def _interval(rng: random.Random) -> tuple[str, str, bool]:
    a = rng.randint(-10, 5)
    b = a + rng.randint(1, 10)
    wrong = _maybe_wrong(rng)
    stated = f"[{a}, {b})" if wrong else f"({a}, {b}]"
    return f"So $x \\in \\boxed{{{stated}}}$.", f"({a},{b}]", not wrong


def _percentage(rng: random.Random) -> tuple[str, str, bool]:
    p = rng.randint(1, 99)
    wrong = _maybe_wrong(rng)
    stated = p + 5 if wrong else p
    gold = rng.choice([str(p), repr(p / 100), f"{p}\\%"])
    return f"The discount is \\boxed{{{stated}\\%}}.", gold, not wrong


def _units(rng: random.Random) -> tuple[str, str, bool]:
    n = rng.randint(2, 5000)
    wrong = _maybe_wrong(rng)
    stated = n * 2 if wrong else n
    response = rng.choice(
        [
            f"The rope is \\boxed{{{stated:,} \\text{{ cm}}}} long.",
            f"So the total is ${stated:,}. The answer is {stated:,} dollars.",
        ]
    )
    return response, str(n), not wrong


def _equation(rng: random.Random) -> tuple[str, str, bool]:
    a, x = rng.randint(2, 9), rng.randint(-20, 20)
    wrong = _maybe_wrong(rng)
    stated = x + 1 if wrong else x
    return f"Solving ${a}x = {a * x}$ gives \\boxed{{x = {stated}}}.", str(x), not wrong


def _pi(rng: random.Random) -> tuple[str, str, bool]:
    a, b = rng.randint(1, 9), rng.choice([2, 3, 4, 6])
    wrong = _maybe_wrong(rng)
    stated = a + 1 if wrong else a
    return f"The arc is \\boxed{{\\frac{{{stated}\\pi}}{{{b}}}}}", f"\\frac{{{a}}}{{{b}}}\\pi", not wrong


def _no_answer(rng: random.Random) -> tuple[str, str, bool]:
    return "I am not sure how to approach this problem.", str(rng.randint(1, 100)), False


def _answer_only_in_thinking(rng: random.Random) -> tuple[str, str, bool]:
    n = rng.randint(1, 100)
    return f"<think>It is {n}, so the answer is \\boxed{{{n}}}.</think>I need more time.", str(n), False


KINDS: dict[str, Callable[[random.Random], tuple[str, str, bool]]] = {
    "gsm8k": _gsm8k,
    "boxed_after_thinking": _boxed_after_thinking,
    "fraction_vs_decimal": _fraction_vs_decimal,
    "decimal_vs_fraction": _decimal_vs_fraction,
    "root": _root,
    "polynomial": _polynomial,
    "set": _set,
    "interval": _interval,
    "percentage": _percentage,
    "units": _units,
    "equation": _equation,
    "pi": _pi,
    "no_answer": _no_answer,
    "answer_only_in_thinking": _answer_only_in_thinking,
}


def make_cases(n: int, seed: int = 0) -> list[Case]:
    """``n`` cases, the kinds in turn, values drawn from ``random.Random(seed)``."""
    rng = random.Random(seed)
    kinds = list(KINDS)
    return [(kind, *KINDS[kind](rng)) for kind in (kinds[i % len(kinds)] for i in range(n))]


def run_single(cases: list[Case]) -> tuple[float, list[bool]]:
    scorer = MathRuleScorer()
    scorer.warm_up()
    start = time.perf_counter()
    verdicts = [scorer.score(response, truth).correct for _, response, truth, _ in cases]
    return time.perf_counter() - start, verdicts


def run_pool(cases: list[Case], processes: int) -> tuple[float, float, list[bool | None]]:
    start = time.perf_counter()
    with RewardWorker("bench", "math_rule", {}, timeout_s=30.0, processes=processes) as worker:
        worker.score_batch(
            [{"response": "\\boxed{1}", "ground_truth": "1"}] * processes
        )  # every process is up
        startup = time.perf_counter() - start
        start = time.perf_counter()
        records = worker.score_batch([{"response": r, "ground_truth": t} for _, r, t, _ in cases])
        elapsed = time.perf_counter() - start
    return startup, elapsed, [record.correct for record in records]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=1000)
    parser.add_argument("--processes", type=int, default=min(4, os.cpu_count() or 1))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    cases = make_cases(args.cases, args.seed)
    expected = [case[3] for case in cases]
    print(
        f"math_rule on {len(cases)} mixed cases ({len(KINDS)} kinds, {sum(expected)} right answers), "
        f"{args.processes} scoring processes, {os.cpu_count()} CPUs"
    )
    single_s, single = run_single(cases)
    startup_s, pool_s, pooled = run_pool(cases, args.processes)
    single_rate, pool_rate = len(cases) / single_s, len(cases) / pool_s
    print(f"  one process, one by one : {single_s:7.2f} s  {single_rate:8.1f} verifications/s")
    print(
        f"  worker pool             : {pool_s:7.2f} s  {pool_rate:8.1f} verifications/s  "
        f"(x{pool_rate / single_rate:.2f}; start-up {startup_s:.2f} s, not counted)"
    )
    misjudged = Counter(case[0] for case, got in zip(cases, single, strict=True) if got != case[3])
    differ = sum(a != b for a, b in zip(single, pooled, strict=True))
    print(
        f"  verdicts as expected    : {len(cases) - sum(misjudged.values())}/{len(cases)} {dict(misjudged) or ''}"
    )
    print(f"  pool agrees with single : {len(cases) - differ}/{len(cases)}")
    slower = pool_rate < single_rate
    if slower:
        print("  the pool is slower than one process", file=sys.stderr)
    return 1 if slower or misjudged or differ else 0


if __name__ == "__main__":
    sys.exit(main())

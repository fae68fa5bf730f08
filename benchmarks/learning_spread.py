"""How much the learning tests' runs gain, over several seeds: the measurement behind tests/test_learning.py.

Each case is the test's own config (tests.test_learning.small_math_config: an example config cut to the math domain
and 32 prompts that are both training and validation data), run once per seed with `seed=<seed>` (the schedulers'
draw order, sampling and worker seeds all follow it). Prints one line per run and a summary per case: the gain in
prompts answered right (greedy, of 32) at the end of `--steps` steps, its min / median / max.

    python -m benchmarks.learning_spread --seeds 1 2 3 4 5 [--cases grpo dapo] [--steps 20] [--model DIR]

`--example` measures tests/test_learning.py's cut-down first-run example instead (math_code.yaml, both domains:
its own math and code prompts as training and validation data): per domain, the gain in prompts answered right.

`--model` runs the cases from another build of the policy (default: examples/models/tiny-qwen2), e.g. one of
`roll model build tiny-qwen2 --seed N --models-dir DIR`, to see how the gains depend on the build.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
from pathlib import Path

from tests.conftest import TINY_MODEL
from tests.test_learning import CASES, EXAMPLE_PROMPTS, PROMPTS, run_case, run_example


def gain_of_one_run(case: str, seed: int, steps: int, model: Path = TINY_MODEL) -> tuple[float, float, float]:
    """(start accuracy, end accuracy, seconds) of one run of a case."""
    example, extra = CASES[case]
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        _, summary = run_case(example, extra, Path(tmp), model, seed=seed, max_steps=steps)
        return (summary["start"]["val_correct/all/mean"], summary["end"]["val_correct/all/mean"],
                time.perf_counter() - started)


def example_spread(seeds: list[int], steps: int, model: Path) -> None:
    """Each seed's per-domain gain of the cut-down first-run example, then min / median / max per domain."""
    gains: dict[str, list[int]] = {domain: [] for domain in EXAMPLE_PROMPTS}
    for seed in seeds:
        with tempfile.TemporaryDirectory() as tmp:
            started = time.perf_counter()
            right = run_example(Path(tmp), model, seed=seed, max_steps=steps)
        parts = []
        for domain, (start, end) in right.items():
            gains[domain].append(end - start)
            parts.append(f"{domain} {start} -> {end} of {EXAMPLE_PROMPTS[domain]} ({end - start:+d})")
        print(f"math_code seed {seed}: {', '.join(parts)} in {time.perf_counter() - started:.0f} s", flush=True)
    for domain, values in gains.items():
        print(f"math_code {domain}: gain over {len(values)} seeds after {steps} steps: min {min(values):+d}, "
              f"median {statistics.median(values):+g}, max {max(values):+d}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--steps", type=int, default=None, help="default: the test's STEPS")
    parser.add_argument("--model", type=Path, default=TINY_MODEL, help="the policy's build (default: %(default)s)")
    parser.add_argument("--example", action="store_true", help="the cut-down first-run example instead of --cases")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    from tests.test_learning import EXAMPLE_STEPS, STEPS

    if args.example:
        example_spread(args.seeds, args.steps or EXAMPLE_STEPS, args.model)
        return 0

    steps = args.steps or STEPS
    for case in args.cases:
        gains = []
        for seed in args.seeds:
            start, end, seconds = gain_of_one_run(case, seed, steps, args.model)
            gains.append(round((end - start) * PROMPTS))
            print(f"{case} seed {seed}: {start:.3f} -> {end:.3f} ({gains[-1]:+d} of {PROMPTS} prompts) "
                  f"in {seconds:.0f} s", flush=True)
        print(f"{case}: gain over {len(gains)} seeds after {steps} steps: min {min(gains):+d}, "
              f"median {statistics.median(gains):+g}, max {max(gains):+d}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

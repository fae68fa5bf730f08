"""Item 5 of `make bench`: step time as rollout_batch_size doubles, and as the number of domains grows from 1 to 3.

    python -m benchmarks.bench_scaling [--repeats 3] [--steps 10] [--quick]

Batch size: bench_trl's config (GRPO on the math domain, no KL) at rollout_batch_size 4, 8, 16 and 32 prompts of 8
responses, per_device_train_batch_size fixed at the smallest batch's sample count (so 1, 2, 4 and 8 optimizer
steps a step; the mini-batch a user keeps when the batch grows). Domains: examples/multi_domain_local_judge.yaml
(its policy, 16 prompts of 8 a step) with math alone, math and code (0.5 / 0.5), and math, code and open answers
judged by the tiny judge in a Ray actor (0.5 / 0.25 / 0.25, the example's mix), group filters off so every step
trains on the same number of prompts. Both without validation. Each point runs `--steps` steps in a pipeline of
its own; its step time is the median wall-clock time between the ends of consecutive steps after the first.
Within a repetition the points run one after the other, in reverse order in odd repetitions; the ratio is each
point's step time over the first point's, per repetition.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from benchmarks.summary import Comparison, Section, markdown_table, print_section, turn_order

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
BATCH_SIZES = (4, 8, 16, 32)
QUICK_BATCH_SIZES = (1, 2, 4, 8)
DOMAIN_MIXES: dict[str, dict[str, float]] = {
    "math": {"math": 1.0},
    "math+code": {"math": 0.5, "code": 0.5},
    "math+code+open": {"math": 0.5, "code": 0.25, "open": 0.25},
}


def batch_configs(tmp: Path, quick: bool) -> dict[str, tuple[Path, list[str]]]:
    """Per point: bench_trl's config and the overrides that set its batch size."""
    from benchmarks.bench_trl import QUICK, write_config

    config = write_config(tmp, quick)
    sizes = QUICK_BATCH_SIZES if quick else BATCH_SIZES
    group = QUICK["num_return_sequences_in_group"] if quick else 8
    return {
        f"rollout_batch_size {b}": (
            config,
            [
                f"rollout_batch_size={b}",
                f"num_return_sequences_in_group={group}",
                # half the smallest batch: every point takes at least two optimizer steps, so every point has
                # actor_train compute the later mini-batches' old log-probs itself (docs/how-a-run-works.md, "log_probs")
                f"actor_train.training_args.per_device_train_batch_size={sizes[0] * group // 2}",
                "data.val_files=[]",
            ],
        )
        for b in sizes
    }


def domain_configs(tmp: Path, quick: bool) -> dict[str, tuple[Path, list[str]]]:
    """Per mix: examples/multi_domain_local_judge.yaml cut to those domains, with absolute paths."""
    base = yaml.safe_load((EXAMPLES / "multi_domain_local_judge.yaml").read_text())
    out = {}
    for name, probs in DOMAIN_MIXES.items():
        cfg = dict(base)
        cfg["pretrain"] = str((EXAMPLES / base["pretrain"]).resolve())
        cfg["domain_interleave_probs"] = probs
        cfg["rewards"] = {d: {**base["rewards"][d], "group_filters": {}} for d in probs}
        if "open" in probs:
            options = cfg["rewards"]["open"]["options"]
            cfg["rewards"]["open"]["options"] = {**options, "model_path": str(ROOT / options["model_path"])}
        cfg["data"] = {
            **base["data"],
            "train_files": [str(EXAMPLES / "data" / f"{d}_train.jsonl") for d in probs],
        }
        cfg["data"]["val_files"] = []
        overrides = ["eval_steps=0", "save_steps=0"]
        if quick:
            overrides += [
                "rollout_batch_size=4",
                "num_return_sequences_in_group=2",
                "actor_train.training_args.per_device_train_batch_size=8",
                "actor_train.training_args.gradient_accumulation_steps=1",
            ]
        path = tmp / f"domains_{name.replace('+', '_')}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        out[f"{name} ({len(probs)} domain{'s' * (len(probs) > 1)})"] = (path, overrides)
    return out


def run_points(
    points: dict[str, tuple[Path, list[str]]], repeats: int, steps: int, tmp: Path, tag: str, log
) -> dict[str, list[dict[str, Any]]]:
    from benchmarks.bench_trl import run_pipeline

    results: dict[str, list[dict[str, Any]]] = {name: [] for name in points}
    for r in range(repeats):
        for name in turn_order(r, list(points)):
            config, overrides = points[name]
            out = tmp / f"{tag}{r}_{list(points).index(name)}"
            run = run_pipeline(config, steps, out, overrides)
            results[name].append(run | {"step_s": statistics.median(run["step_s"])})
            log(f"  [scaling] repetition {r + 1}: {name}: {results[name][-1]['step_s']:.2f} s/step")
    return results


def comparisons(results: dict[str, list[dict[str, Any]]], per_token: bool = False) -> list[Comparison]:
    """Each point's step time over the first point's, per repetition; with `per_token` also its step time per
    generated token (the points' responses differ in length: math answers are shorter than code)."""
    names = list(results)
    base = tuple(x["step_s"] for x in results[names[0]])
    out = [
        Comparison(
            f"step time, {name} / {names[0]}",
            "s/step",
            name,
            tuple(x["step_s"] for x in results[name]),
            names[0],
            base,
            higher_is_better=None,
        )
        for name in names[1:]
    ]
    if per_token:
        base_token = tuple(1000 * x["step_s"] / x["tokens"] for x in results[names[0]])
        out += [
            Comparison(
                f"step time per generated token, {name} / {names[0]}",
                "ms/token",
                name,
                tuple(1000 * x["step_s"] / x["tokens"] for x in results[name]),
                names[0],
                base_token,
                higher_is_better=None,
            )
            for name in names[1:]
        ]
    return out


def points_table(results: dict[str, list[dict[str, Any]]], prompts: dict[str, int]) -> str:
    """Markdown: per point its step time, its ratio to the first point, time per prompt, tokens, and stages."""
    names = list(results)
    base = [x["step_s"] for x in results[names[0]]]
    stage_names = sorted({k for runs in results.values() for x in runs for k in x["stages"]})
    main_stages = [k for k in ("rollout", "log_probs", "train", "sync_weights") if k in stage_names]
    rows = []
    for name, runs in results.items():
        step = statistics.median(x["step_s"] for x in runs)
        ratios = [x["step_s"] / b for x, b in zip(runs, base, strict=True)]
        rows.append(
            [
                name,
                f"{step:.2f}",
                f"{statistics.median(ratios):.2f} [{min(ratios):.2f}, {max(ratios):.2f}]",
                f"{step / prompts[name]:.3f}",
                f"{statistics.median(x['tokens'] for x in runs):.0f}",
                *(f"{statistics.median(x['stages'].get(k, 0.0) for x in runs):.2f}" for k in main_stages),
            ]
        )
    header = [
        "point",
        "s/step",
        "ratio to first [min, max]",
        "s per prompt",
        "tokens/step",
        *(f"{k} s" for k in main_stages),
    ]
    return markdown_table(rows, header)


def measure(repeats: int = 3, steps: int = 10, quick: bool = False, log=print) -> Section:
    from benchmarks.bench_trl import load

    start_wall = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="roll-bench-scaling-") as tmp_dir:
        tmp = Path(tmp_dir)
        batch_points = batch_configs(tmp, quick)
        domain_points = domain_configs(tmp, quick)
        prompts = {
            name: load(path, 1, tmp / "probe", overrides).config.rollout_batch_size
            for name, (path, overrides) in {**batch_points, **domain_points}.items()
        }
        batches = run_points(batch_points, repeats, steps, tmp, "batch", log)
        domains = run_points(domain_points, repeats, steps, tmp, "domains", log)
    section = Section(
        title="5. Scaling",
        setup=(
            f"Step time of our pipeline, {steps} steps per point, median over the steps after the first; see "
            "benchmarks/bench_scaling.py for the configs. Batch size: bench_trl's config (math, GRPO, no KL) as "
            "rollout_batch_size doubles, per_device_train_batch_size fixed at half the smallest batch's samples (so "
            "every point takes two or more optimizer steps, the later ones' old log-probs computed by actor_train). "
            "Domains: examples/multi_domain_local_judge.yaml with 1, 2 and 3 domains (the open domain's judge "
            "in a Ray actor), group filters off. The ratio is each point's step time over the first point's in "
            "the same repetition; with perfect linear scaling in the batch it would equal the batch ratio. For the "
            "domains also per generated token (step time over the tokens the step trained on), since code and "
            "open answers are longer than math ones."
        ),
        comparisons=comparisons(batches) + comparisons(domains, per_token=True),
    )
    section.details += [
        "As rollout_batch_size doubles (stage columns: median seconds of the pipeline's time/<stage>_s):\n\n"
        + points_table(batches, prompts),
        "As domains are added:\n\n" + points_table(domains, prompts),
    ]
    section.wall_s = time.perf_counter() - start_wall
    return section


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="tiny batches, for a smoke run")
    args = parser.parse_args(argv)
    section = measure(args.repeats, args.steps, args.quick)
    print_section(section)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""LoRA against full weights, the same work: seconds per step, resident memory per worker group, and the bytes one
weight sync moves (issue 45).

Each run is examples/grpo.yaml (the KL loss, so a reference is needed) cut to the math domain's first 64 training
prompts, `--steps` steps, no validation or checkpoints; the `lora` side adds `actor_train.lora` (rank 8, the
default targets), which also drops the reference cluster (actor_train's base model is the reference). The sides
alternate run by run (full first on even runs), each after waiting for a quiet machine. Per run it prints: the
median `time/step_s` over the steps after the first (the first builds DeepSpeed's optimizer and warms caches), the
peak `memory/<group>_rss_mb` of each group of workers over the steps (the pipeline samples it every step), and the
bytes of `actor_train.get_weights()` after the run, which is exactly what each sync hands to actor_infer. Then per
side the median and range over the runs.

    python -m benchmarks.bench_lora [--runs 4] [--steps 6] [--model examples/models/tiny-qwen2] [--set K=V ...]
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
from dataclasses import dataclass
from pathlib import Path

import yaml

from benchmarks.harness import add_run_options, machine, wait_for_quiet, work_folder
from benchmarks.summary import spread

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "grpo.yaml"
PROMPTS = 64
SIDES = {"full": {}, "lora": {"rank": 8, "alpha": 16.0}}


@dataclass(frozen=True)
class Run:
    side: str
    s_per_step: float
    rss_mb: dict[str, float]
    sync_bytes: int
    load: str


def config(side: str, model: Path, steps: int, work: Path) -> Path:
    cfg = yaml.safe_load(EXAMPLE.read_text())
    rows = (ROOT / "examples" / "data" / "math_train.jsonl").read_text().splitlines()[:PROMPTS]
    data = work / "math.jsonl"
    data.write_text("\n".join(rows) + "\n")
    cfg |= {
        "pretrain": str(model.resolve()),
        "max_steps": steps,
        "eval_steps": 0,
        "save_steps": 0,
        "domain_interleave_probs": {"math": 1.0},
        "rewards": {"math": cfg["rewards"]["math"]},
        "output_dir": str(work / f"run-{side}"),
        "tracking": {"tracking_uri": f"sqlite:///{work / 'mlflow.db'}", "experiment_name": "bench_lora"},
    }
    cfg["data"] |= {"train_files": [str(data)], "val_files": [str(data)]}
    cfg["validation"] = {**cfg.get("validation", {}), "eval_at_start": False, "max_prompts": 8}
    if SIDES[side]:
        cfg["actor_train"] = {**cfg["actor_train"], "lora": SIDES[side]}
    path = work / f"{side}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def run_once(side: str, model: Path, steps: int, overrides: list[str], work: Path) -> Run:
    from roll_pipeline.api import RLVRPipeline, load_run_config

    load = os.getloadavg()[0]
    pipeline = RLVRPipeline(load_run_config(config(side, model, steps, work), overrides))
    try:
        pipeline.setup()
        pipeline.run()
        weights = pipeline.runtime.actor_train.call_rank0("get_weights")
    finally:
        pipeline.shutdown()
    history = pipeline.loop.history
    seconds = [history[s]["time/step_s"] for s in sorted(history) if s > 1 and "time/step_s" in history[s]]
    groups = {k for metrics in history.values() for k in metrics if k.startswith("memory/") and k.endswith("_rss_mb")}
    rss = {k[len("memory/"):-len("_rss_mb")]: max(m.get(k, 0.0) for m in history.values()) for k in sorted(groups)}
    sync = sum(t.numel() * t.element_size() for t in weights.values())
    return Run(side, statistics.median(seconds), rss, sync, f"{load:.2f} -> {os.getloadavg()[0]:.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=4, help="runs in all, the sides alternating (default 4)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--model", type=Path, default=ROOT / "examples" / "models" / "tiny-qwen2")
    parser.add_argument("--set", dest="overrides", nargs="*", default=[], metavar="KEY=VALUE")
    add_run_options(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    print(machine(), flush=True)
    print(f"{EXAMPLE.name}, {PROMPTS} math prompts, {args.steps} steps, model {args.model}; "
          f"lora {SIDES['lora']} {' '.join(args.overrides)}", flush=True)
    runs: list[Run] = []
    with work_folder(args.keep, "bench-lora-") as work:
        for i in range(args.runs):
            side = ("full", "lora")[i % 2]
            quiet = wait_for_quiet(args.quiet_wait)
            run = run_once(side, args.model, args.steps, args.overrides, work)
            runs.append(run)
            memory = ", ".join(f"{k} {v:.0f}" for k, v in run.rss_mb.items())
            print(f"{side:<5} {run.s_per_step:6.2f} s/step  sync {run.sync_bytes / 2**20:8.3f} MiB  peak RSS MiB: "
                  f"{memory}  load {run.load} ({quiet})", flush=True)
    for side in SIDES:
        mine = [r for r in runs if r.side == side]
        if not mine:
            continue
        step = spread([r.s_per_step for r in mine])
        groups = sorted({g for r in mine for g in r.rss_mb})
        memory = "; ".join(
            f"{g} {spread([r.rss_mb.get(g, 0.0) for r in mine]).median:.0f} "
            f"({spread([r.rss_mb.get(g, 0.0) for r in mine]).low:.0f}-{spread([r.rss_mb.get(g, 0.0) for r in mine]).high:.0f})"
            for g in groups
        )
        print(f"{side}: {step.n} runs, s/step median {step.median:.2f} (range {step.low:.2f}-{step.high:.2f}); sync "
              f"{mine[0].sync_bytes / 2**20:.3f} MiB; peak RSS MiB median (range): {memory}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

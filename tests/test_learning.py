"""The example algorithm configs learn: GRPO, DAPO and PPO with GAE each train the embedded tiny model on a small
set of arithmetic prompts, and greedy validation accuracy on those prompts must rise.

The configs are examples/grpo.yaml, dapo.yaml and ppo_gae.yaml as they are (algorithm, learning rate, batch
sizes), cut down only in what a test must: the math domain alone, 32 prompts that are both the training data and
the validation set (so a short run can show its effect; RL that works raises the reward on what it trains on),
fewer steps, no checkpoints, a temporary MLflow store."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from roll_core.config import load_config
from roll_pipeline.driver.pipeline import RLVRPipeline
from tests.conftest import EXAMPLES, shared_ray

PROMPTS = 32
STEPS = 20


def cut_down(cfg: dict, tmp_path, tiny_model, files: list[str], steps: int, tracking_uri: str | None) -> dict:
    """An example config cut to what a test runs: the tiny model, `steps` steps, `files` as both the training
    data and the validation set (validated at the start and the end only), no checkpoints, a temporary MLflow
    store."""
    cfg = cfg | {
        "pretrain": str(tiny_model),
        "max_steps": steps,
        "eval_steps": 0,
        "save_steps": 0,
        "output_dir": str(tmp_path / "run"),
        "tracking": {
            "tracking_uri": tracking_uri or f"sqlite:///{tmp_path / 'mlflow.db'}",
            "experiment_name": "learning",
        },
    }
    cfg["data"] = cfg["data"] | {"train_files": files, "val_files": files}
    return cfg


def first_rows(domain: str, count: int, tmp_path) -> str:
    """The first `count` rows of the example's `domain` training data, as a file of their own."""
    rows = (EXAMPLES / "data" / f"{domain}_train.jsonl").read_text().splitlines()[:count]
    path = tmp_path / f"{domain}.jsonl"
    path.write_text("\n".join(rows) + "\n")
    return str(path)


def run_config(cfg: dict, path) -> tuple[RLVRPipeline, dict]:
    """Write `cfg` to `path` and run it to its end: the pipeline (for its history) and the run's summary."""
    path.write_text(yaml.safe_dump(cfg))
    shared_ray()
    pipeline = RLVRPipeline(load_config(path, []))
    try:
        pipeline.setup()
        return pipeline, pipeline.run()
    finally:
        pipeline.shutdown()


def small_math_config(example: str, tmp_path, tiny_model, tracking_uri: str | None = None) -> dict:
    cfg = yaml.safe_load((EXAMPLES / example).read_text())
    data = first_rows("math", PROMPTS, tmp_path)
    assert {json.loads(r)["tag"] for r in Path(data).read_text().splitlines()} == {"add"}
    cfg = cut_down(cfg, tmp_path, tiny_model, [data], STEPS, tracking_uri)
    cfg |= {"domain_interleave_probs": {"math": 1.0}, "rewards": {"math": cfg["rewards"]["math"]}}
    cfg["validation"] = {**cfg.get("validation", {}), "max_prompts": PROMPTS}
    return cfg


#: The first run's example (examples/math_code.yaml, both domains) cut down the same way: this many prompts of each
#: domain's training data, which are also its validation set, drawn half and half (the example draws 3 math
#: prompts to 1 code prompt, and in 20 steps its code prompts were drawn too rarely to move: +0, +0, +1 of 16).
EXAMPLE_PROMPTS = {"math": 32, "code": 32}
EXAMPLE_STEPS = 30


def small_example_config(tmp_path, tiny_model, tracking_uri: str | None = None) -> dict:
    cfg = yaml.safe_load((EXAMPLES / "math_code.yaml").read_text())
    files = [first_rows(domain, count, tmp_path) for domain, count in EXAMPLE_PROMPTS.items()]
    cfg = cut_down(cfg, tmp_path, tiny_model, files, EXAMPLE_STEPS, tracking_uri)
    # deterministic: the run does not follow the machine's timing (a loaded make test once left code at +0 where
    # six quiet runs gained +4 to +6), so the measured spread holds under any load
    return cfg | {"domain_interleave_probs": {"math": 0.5, "code": 0.5}, "deterministic": True}


def run_example(tmp_path, tiny_model, tracking_uri: str | None = None, **overrides) -> dict[str, tuple[int, int]]:
    """Run the cut-down first-run example to its end: per domain, (prompts right at the start, at the end)."""
    cfg = small_example_config(tmp_path, tiny_model, tracking_uri) | overrides
    pipeline, summary = run_config(cfg, tmp_path / "math_code.yaml")
    history = pipeline.loop.history
    return {domain: tuple(round(history[summary[end]["step"]][f"val_domain/{domain}/correct_mean"] * count)
                          for end in ("start", "end"))
            for domain, count in EXAMPLE_PROMPTS.items()}


# GRPO once more with async rollouts: each batch is generated one update behind, corrected by truncated IS; and
# two steps ahead, where weight syncs land while rollouts generate (partial rollouts: tokens 1 or 2 updates old).
ASYNC = {"async_generation_ratio": 1.0, "infer_is_cap": 2.0}
ASYNC_2 = {"async_generation_ratio": 2.0, "infer_is_cap": 2.0}
#: The cases, by name: (example config, overrides). benchmarks/learning_spread.py measures the same ones.
CASES = {
    "grpo": ("grpo.yaml", {}),
    "dapo": ("dapo.yaml", {}),
    "ppo_gae": ("ppo_gae.yaml", {}),
    "grpo_async": ("grpo.yaml", ASYNC),
    "grpo_async_2": ("grpo.yaml", ASYNC_2),
}


def run_case(example: str, extra: dict, tmp_path, tiny_model, tracking_uri: str | None = None,
             **overrides) -> tuple[RLVRPipeline, dict]:
    """Run one case to its end: the pipeline (for its history) and the run's summary."""
    cfg = small_math_config(example, tmp_path, tiny_model, tracking_uri) | extra | overrides
    return run_config(cfg, tmp_path / example)


@pytest.mark.slow
@pytest.mark.parametrize(("example", "extra"), list(CASES.values()), ids=list(CASES))
def test_example_config_raises_validation_accuracy(example, extra, tmp_path, tiny_model, mlflow_db):
    pipeline, summary = run_case(example, extra, tmp_path, tiny_model, mlflow_db(tmp_path / "mlflow.db"))
    start, end = summary["start"]["val_correct/all/mean"], summary["end"]["val_correct/all/mean"]
    print(f"{example} {extra}: val_correct/all/mean {start:.3f} at step 0 -> {end:.3f} at step {summary['steps']}")
    assert summary["steps"] == STEPS
    history = [pipeline.loop.history[s] for s in range(1, STEPS + 1)]
    staleness = [m["offpolicy/staleness"] for m in history]
    k = int(extra.get("async_generation_ratio", 0))
    if k == 1:  # every batch after the first was generated one update behind, and weighted for it
        assert staleness == [0.0] + [1.0] * (STEPS - 1)
    elif k == 2:  # steps 1 and 2 train what the first weights sampled; later tokens are 1 or 2 updates old
        assert staleness[:2] == [0.0, 1.0]
        assert all(1.0 <= m["offpolicy/staleness_min"] <= m["offpolicy/staleness_max"] <= 2.0 for m in history[2:])
        assert [m["offpolicy/buffered_rollouts"] for m in history] == [2.0] * (STEPS - 2) + [1.0, 0.0]
    else:
        assert staleness == [0.0] * STEPS
    if k:
        assert all(m["offpolicy/is_weight_mean"] > 0 for m in history)
    # At least 2 more of the 32 prompts answered right. Measured with `python -m benchmarks.learning_spread --seeds
    # 1 2 3 4 5` and `--seeds 6 7 8 9 10` (2026-11-25, the reference build of tiny-qwen2, which starts at 0.781 = 25
    # of 32 prompts): gains after 20 steps, min / median / max over the 10 seeds: GRPO +3/+4/+5, DAPO +3/+4/+5,
    # PPO+GAE +3/+4/+5, async GRPO +3/+4/+5 (every case gained +3 at least twice). Each of those runs also had its
    # own thread scheduling (this mode is not bitwise repeatable: requests finish in any order, so batches differ),
    # so the spread holds both sources. Without training the greedy validation is the same at both ends (gain 0),
    # so 2 sits one prompt below every measured run and two above no learning. The model the runs start from is the
    # same on machines with the same kind of processor, not on all (roll_core/models/embedded.py): the AMD
    # EPYC's build b26823ba passed here too, and so did the weakest of four seeds' builds (seed 2, which starts at
    # 0.156: `--seeds 1 2 --model DIR/tiny-qwen2` on 2026-11-25 gave GRPO +3/+3, DAPO +2/+6, PPO+GAE +3/+4, async
    # GRPO +5/+5; DAPO's +2 is on the bound). Two steps ahead (grpo_async_2, measured 2026-12-03 on the Intel build
    # 0df32600, seeds 1-5, the runs `python -m benchmarks.learning_spread --cases grpo_async_2` makes): +3/+5/+3/+3/+3,
    # and +4 in the test's own run; every batch from step 3 on was 2 updates old (no sync landed mid-rollout here:
    # each rollout was done before the sync that followed it). Before the build was pinned, a machine with other vector units built
    # a model that started at 0.594 and gained 1-2 prompts here. (The build of 2026-11-24, which started at 0.719,
    # gained +4 at least on 5 seeds; the bound was 3 then.)
    gained = round((end - start) * PROMPTS)
    assert gained >= 2, f"{example}: accuracy {start:.3f} -> {end:.3f} after {STEPS} steps"


@pytest.mark.slow
def test_first_run_example_learns_in_every_domain(tmp_path, tiny_model, mlflow_db):
    """`make run`'s example learns math and code: a change that breaks either domain's learning fails here, where
    the example's own run (docs/first-run.md: +11 to +18 points in each domain over 4 seeds) is too long to test."""
    right = run_example(tmp_path, tiny_model, mlflow_db(tmp_path / "mlflow.db"))
    print(f"math_code, {EXAMPLE_STEPS} steps: prompts right (start, end) {right}")
    # At least 2 more prompts right in each domain. The run is deterministic (small_example_config), so on one build
    # it gives the same figures under any load; the seeds stand in for other builds. Measured with `python -m
    # benchmarks.learning_spread --example --seeds 42 1 2 3 4 5` (2026-12-04, AMD EPYC, tiny-qwen2 c0a8be9e, which
    # starts at 23 of 32 math and 21 of 32 code prompts): gains after 30 steps, math +7/+6/+2/+3/+5/+3, code
    # +4/+5/+7/+6/+5/+6 (136-186 s per run); seed 42 is this test's run. Without training the greedy validation is
    # the same at both ends (gain 0), so 2 sits two above no learning, and on the least measured gain (math's +2,
    # seed 2). Before it was deterministic (2026-12-03, seeds 1-6: math +3 to +6, code +4 to +6, 80-98 s a run,
    # measured alone), a make test under load left code at 21 -> 21 (2026-12-04). With GRPO's advantages negated,
    # math went 23 -> 0 and code 21 -> 2 (seed 42, not deterministic). On other builds (seeds 1, 2, 3 of tiny-qwen2,
    # built 2026-12-04 on the EPYC, `learning_spread --example --seeds 42 --model DIR/tiny-qwen2`; stand-ins for
    # another processor's build): math 9 -> 20, 2 -> 9, 5 -> 18; code 23 -> 24, 21 -> 23, 17 -> 20. So on build 1 this
    # test fails in code (+1), as the example itself does not learn code there (docs/first-run.md, "On other
    # builds"). Every machine runs c0a8be9e, since it is shipped (examples/shipped-models), not built where it runs.
    for domain, (start, end) in right.items():
        assert end - start >= 2, f"{domain}: {start} -> {end} of {EXAMPLE_PROMPTS[domain]} prompts right"

"""Item 1 of `make bench`: RL step time and learning against TRL's GRPOTrainer, set up the same way.

    python -m benchmarks.bench_trl [--repeats 3] [--steps 30] [--quick]

Ours is tests/test_learning.py's GRPO config (examples/grpo.yaml cut to the math domain, the first 32 `add`
prompts of examples/data/math_train.jsonl as both training and validation set) with the KL loss off, so no
reference cluster starts. TRL's GRPOTrainer gets the same model folder, prompts (same chat template), prompts per
step and group size, max new tokens, sampling temperature, learning rate (constant, no warm-up), AdamW betas,
gradient clipping, PPO clip, mini-batch size and so optimizer steps per RL step, one pass over each batch, beta 0
(no reference model), float32 on CPU, no gradient checkpointing, and as reward our math_rule scorer called in
its process. Both train for `--steps` RL steps; each repetition runs ours and TRL one after the other (the order
swaps every repetition), both with the seed of that repetition (the config's seed + the repetition's index).

Step time is the wall-clock time between the ends of consecutive RL steps (TRL: between every
`steps_per_generation` optimizer steps), median over the steps after the first; ours leaves out its last step,
which validates. Accuracy is measured for both by the same code (`greedy_accuracy`): greedy decoding of the 32
prompts, `max_new_tokens` as in training, scored with math_rule, on the weights each side ends with. Our
pipeline's own `val_correct/all/mean` at the end is reported beside it as a cross-check.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import yaml

from benchmarks.summary import (
    Comparison,
    Measure,
    Section,
    in_turn,
    markdown_table,
    print_section,
)
from tests.conftest import TINY_MODEL
from tests.test_learning import PROMPTS, small_math_config

# Tiny settings for a smoke run: 2 prompts of 4 responses a step, mini-batches of 4 (2 optimizer steps a step).
QUICK = {"rollout_batch_size": 2, "num_return_sequences_in_group": 4, "per_device_train_batch_size": 4}


def write_config(tmp: Path, quick: bool = False) -> Path:
    """tests/test_learning.py's GRPO config with the KL loss off and validation only at the end; returns its path."""
    cfg = small_math_config("grpo.yaml", tmp, TINY_MODEL)
    cfg |= {"use_kl_loss": False, "kl_loss_coef": 0.0}
    cfg["validation"]["eval_at_start"] = False
    if quick:
        cfg |= {k: QUICK[k] for k in ("rollout_batch_size", "num_return_sequences_in_group")}
        cfg["actor_train"]["training_args"]["per_device_train_batch_size"] = QUICK[
            "per_device_train_batch_size"
        ]
        cfg["dynamic_sampling"]["max_running_requests"] = QUICK["rollout_batch_size"]
    path = tmp / "grpo_math.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def load(path: Path, steps: int, out: Path, extra: list[str] | None = None):
    from roll_pipeline.api import load_run_config as load_config

    return load_config(
        path,
        [
            f"max_steps={steps}",
            f"output_dir={out}",
            f"tracking.tracking_uri=sqlite:///{out}/mlflow.db",
            *(extra or []),
        ],
    )


def math_rows(resolved) -> list[dict[str, Any]]:
    from roll_pipeline.api import load_rows

    return [row for f in resolved.config.data.train_files for row in load_rows(f)]


@torch.no_grad()
def greedy_accuracy(model, tokenizer, rows, data_cfg, max_new_tokens: int, batch_size: int = 32) -> float:
    """Share of `rows` whose greedy response math_rule judges correct: prompts encoded as the pipeline encodes them
    (chat template), left-padded, `batch_size` at a time, each response cut after its end-of-sequence token."""
    from transformers import GenerationConfig

    from roll_pipeline.api import (
        MathRuleScorer,
        collate_prompts,
        encode_prompt,
        eos_token_ids,
        truncate_at_eos,
    )

    scorer = MathRuleScorer()
    eos = eos_token_ids(model, tokenizer)
    gen = GenerationConfig(
        do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=tokenizer.pad_token_id
    )
    was_training = model.training
    model.eval()
    correct = 0
    for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
        ids, mask = collate_prompts(
            [encode_prompt(tokenizer, r, data_cfg) for r in chunk], tokenizer.pad_token_id
        )
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=gen)
        responses, kept, _ = truncate_at_eos(out[:, ids.shape[1] :], eos, tokenizer.pad_token_id)
        for row, resp, m in zip(chunk, responses, kept, strict=True):
            text = tokenizer.decode(resp[m > 0].tolist(), skip_special_tokens=True)
            correct += scorer.score(text, row["ground_truth"]).correct
    model.train(was_training)
    return correct / len(rows)


def _step_times(start: float, marks: list[float], drop_last: bool) -> list[float]:
    gaps = [b - a for a, b in zip([start, *marks], marks, strict=False)]
    gaps = gaps[1:]  # the first step warms up
    return gaps[:-1] if drop_last else gaps


def run_pipeline(config: Path, steps: int, out: Path, extra: list[str] | None = None, before_shutdown=None):
    """One `RLVRPipeline` run of `steps` steps (the pattern of benchmarks/bench_async.py's `run_once`).

    Returns its step times (wall clock between the ends of consecutive steps, the first step left out as warm-up
    and the last when it validates), the median seconds of each stage over those steps (the pipeline's
    time/<stage>_s metrics), generated tokens per step, the summary, the metric history, and what
    `before_shutdown(pipeline)` returned."""
    from roll_pipeline.api import RLVRPipeline

    pipeline = RLVRPipeline(load(config, steps, out, extra))
    marks: list[float] = []
    try:
        pipeline.setup()
        start = time.perf_counter()
        summary = pipeline.run(on_step=lambda step, metrics: marks.append(time.perf_counter()))
        kept = before_shutdown(pipeline) if before_shutdown else None
        history = dict(pipeline.loop.history)
    finally:
        pipeline.shutdown()
    validates_last = summary["end"] is not None and summary["end"]["step"] == steps
    step_s = _step_times(start, marks, drop_last=validates_last)
    timed = range(2, 2 + len(step_s))  # the steps whose times are in step_s
    stages = sorted({k for s in timed for k in history[s] if k.startswith("time/") and k != "time/step_s"})
    rollout_parts = {}
    for domain in summary_domains(history, timed):
        p = f"scheduler/{domain}"
        groups = [history[s][f"{p}/groups_kept"] + history[s][f"{p}/groups_dropped"] for s in timed]
        rollout_parts[domain] = {
            "wall_s": statistics.median(history[s][f"{p}/wall_s"] for s in timed),
            "generate_s": statistics.median(
                history[s][f"{p}/generate_s"] / g for s, g in zip(timed, groups, strict=True)
            ),
            "reward_s": statistics.median(
                history[s][f"{p}/reward_s"] / g for s, g in zip(timed, groups, strict=True)
            ),
        }
    return {
        "step_s": step_s,
        "stages": {k[5:-2]: statistics.median(history[s].get(k, 0.0) for s in timed) for k in stages},
        "rollout_parts": rollout_parts,
        "staged_s": statistics.median(history[s]["time/step_s"] for s in timed),
        "tokens": statistics.median(history[s]["throughput/generated_tokens"] for s in timed),
        "summary": summary,
        "history": history,
        "kept": kept,
    }


def summary_domains(history: dict[int, dict[str, float]], steps) -> list[str]:
    """The domains whose scheduler metrics are in every one of `steps`."""
    names = {
        k.split("/")[1] for k in history[steps[0]] if k.startswith("scheduler/") and k.endswith("/wall_s")
    }
    return sorted(d for d in names if all(f"scheduler/{d}/wall_s" in history[s] for s in steps))


def run_ours(config: Path, steps: int, out: Path, seed: int) -> dict[str, Any]:
    """One run of our pipeline; its step times, stage times, and the accuracy of its final weights."""
    from transformers import AutoModelForCausalLM

    from roll_pipeline.api import load_tokenizer

    resolved = load(config, steps, out, [f"seed={seed}"])
    cfg = resolved.config
    run = run_pipeline(
        config,
        steps,
        out,
        [f"seed={seed}"],
        before_shutdown=lambda p: (
            p.runtime.actor_train.call_rank0("get_weights"),
            p.runtime.actor_infer.call("batch_stats")[0],
        ),
    )
    weights, stats = run["kept"]
    batch_sizes = [b["sequences"] for b in stats]
    tokenizer = load_tokenizer(cfg.actor_infer.model_args)
    model = AutoModelForCausalLM.from_pretrained(cfg.pretrain, dtype=torch.float32)
    model.load_state_dict(weights)
    # actor_infer's batches in the order it ran them: the training rollouts, then the final validation's.
    trained = steps * cfg.samples_per_step
    cumulative = list(itertools.accumulate(batch_sizes))
    training_batches = next((i + 1 for i, c in enumerate(cumulative) if c >= trained), len(batch_sizes))
    accuracy = greedy_accuracy(
        model, tokenizer, math_rows(resolved), cfg.data, cfg.validation.generating_args.max_new_tokens
    )
    training = stats[:training_batches]
    end, history = run["summary"]["end"], run["history"]
    return {
        "step_s": statistics.median(run["step_s"]),
        "stages": run["stages"],
        "staged_s": run["staged_s"],
        "rollout_parts": run["rollout_parts"]["math"]
        | {
            "batches_per_step": training_batches / steps,
            "sequences_per_batch": cumulative[training_batches - 1] / training_batches,
            "sequences_per_step": trained / steps,
        },
        "accuracy": accuracy,
        # the work of generation, as TRL's is counted: every token generated (dropped groups' too) and the
        # decode loop's forward passes, per RL step
        "generated_tokens": sum(b["tokens"] for b in training) / steps,
        "decode_steps": sum(b["decode_steps"] for b in training) / steps,
        "pipeline_val": end["val_correct/all/mean"] if end else float("nan"),
        "reward_first": history[1].get("reward/math/score", float("nan")),
        "reward_last": history[steps].get("reward/math/score", float("nan")),
    }


def trl_args(cfg, steps: int, out: Path):
    """GRPOConfig matching our config `cfg` (a PipelineConfig); see the module docstring for what is matched."""
    from trl import GRPOConfig

    ta = cfg.actor_train.training_args
    gen = cfg.actor_infer.generating_args
    samples = cfg.samples_per_step
    steps_per_generation = samples // ta.per_device_train_batch_size
    # transformers 5.20 renamed TrainingArguments' gradient_checkpointing to activation_checkpointing
    fields = GRPOConfig.__dataclass_fields__
    no_checkpointing = {
        "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing": False
    }
    return GRPOConfig(
        **no_checkpointing,
        output_dir=str(out),
        use_cpu=True,
        bf16=False,
        fp16=False,
        seed=cfg.seed,
        max_steps=steps * steps_per_generation // ta.gradient_accumulation_steps,
        per_device_train_batch_size=ta.per_device_train_batch_size,
        gradient_accumulation_steps=ta.gradient_accumulation_steps,
        steps_per_generation=steps_per_generation,
        num_generations=cfg.num_return_sequences_in_group,
        max_completion_length=gen.max_new_tokens,
        temperature=gen.temperature,
        top_p=gen.top_p,
        top_k=gen.top_k,
        learning_rate=ta.learning_rate,
        lr_scheduler_type="constant",
        warmup_steps=ta.warmup_steps,
        weight_decay=ta.weight_decay,
        adam_beta1=ta.adam_beta1,
        adam_beta2=ta.adam_beta2,
        max_grad_norm=ta.max_grad_norm,
        optim="adamw_torch",
        beta=0.0,
        num_iterations=cfg.ppo_epochs,
        epsilon=cfg.pg_clip,
        loss_type="grpo",  # each response weighs the same: our seq-mean-token-mean
        scale_rewards="group",  # (r - group mean) / group std: our grpo estimator
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        dataloader_pin_memory=False,
        model_init_kwargs={"dtype": torch.float32},
    )


def run_trl(config: Path, steps: int, out: Path, seed: int) -> dict[str, Any]:
    """One GRPOTrainer run on the same prompts; its step times, generation time and final accuracy."""
    from datasets import Dataset
    from transformers import PrinterCallback, ProgressCallback, TrainerCallback
    from trl import GRPOTrainer

    from roll_pipeline.api import MathRuleScorer, load_tokenizer

    resolved = load(config, steps, out, [f"seed={seed}"])
    cfg = resolved.config
    torch.set_num_threads(cfg.actor_train.torch_threads)  # what each of our workers gets
    rows = math_rows(resolved)
    dataset = Dataset.from_list([{"prompt": r["messages"], "ground_truth": r["ground_truth"]} for r in rows])
    scorer = MathRuleScorer(**cfg.rewards["math"].options)

    def math_rule(completions, ground_truth, **_: Any) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [scorer.score(t, g).score for t, g in zip(texts, ground_truth, strict=True)]

    args = trl_args(cfg, steps, out / "trl")
    per_rl_step = args.steps_per_generation // args.gradient_accumulation_steps
    marks: list[float] = []
    start = [0.0]

    class Marks(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            start[0] = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step % per_rl_step == 0:
                marks.append(time.perf_counter())

    tokenizer = load_tokenizer(cfg.actor_infer.model_args)
    trainer = GRPOTrainer(
        model=cfg.pretrain,
        reward_funcs=math_rule,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[Marks()],
    )
    for quiet in (PrinterCallback, ProgressCallback):
        trainer.remove_callback(quiet)
    generate_s: list[float] = []
    tokens: list[int] = []
    decode_steps: list[int] = []
    inner = trainer._generate_and_score_completions

    def timed(*a: Any, **kw: Any):
        t = time.perf_counter()
        try:
            out = inner(*a, **kw)
        finally:
            generate_s.append(time.perf_counter() - t)
        # one call per RL step: one `generate` over the whole generation batch, padded to its longest completion
        # (the eos token counted, as ours counts it)
        tokens.append(int(out["completion_mask"].sum()))
        decode_steps.append(int(out["completion_ids"].shape[1]))
        return out

    trainer._generate_and_score_completions = timed
    trainer.train()
    rewards = [e["reward"] for e in trainer.state.log_history if "reward" in e]
    accuracy = greedy_accuracy(
        trainer.model, tokenizer, rows, cfg.data, cfg.validation.generating_args.max_new_tokens
    )
    step_s = _step_times(start[0], marks, drop_last=False)
    del trainer
    gc.collect()
    return {
        "step_s": statistics.median(step_s),
        "generate_s": statistics.median(generate_s[1:] or generate_s),
        "generated_tokens": statistics.fmean(tokens),
        "decode_steps": statistics.fmean(decode_steps),
        "accuracy": accuracy,
        "reward_first": rewards[0] if rewards else float("nan"),
        "reward_last": rewards[-1] if rewards else float("nan"),
    }


def start_accuracy(config: Path, out: Path) -> float:
    from transformers import AutoModelForCausalLM

    from roll_pipeline.api import load_tokenizer

    resolved = load(config, 1, out)
    cfg = resolved.config
    model = AutoModelForCausalLM.from_pretrained(cfg.pretrain, dtype=torch.float32)
    tokenizer = load_tokenizer(cfg.actor_infer.model_args)
    return greedy_accuracy(
        model, tokenizer, math_rows(resolved), cfg.data, cfg.validation.generating_args.max_new_tokens
    )


def measure(repeats: int = 3, steps: int = 30, quick: bool = False, log=print) -> Section:
    import trl

    start_wall = time.perf_counter()
    ours: list[dict[str, Any]] = []
    peer: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="roll-bench-trl-") as tmp_dir:
        tmp = Path(tmp_dir)
        config = write_config(tmp, quick)
        cfg = load(config, steps, tmp / "probe").config
        initial = start_accuracy(config, tmp / "probe")
        for r in range(repeats):
            a, b = in_turn(
                r,
                lambda r=r: run_ours(config, steps, tmp / f"ours{r}", cfg.seed + r),
                lambda r=r: run_trl(config, steps, tmp / f"trl{r}", cfg.seed + r),
            )
            ours.append(a)
            peer.append(b)
            log(
                f"  [trl] repetition {r + 1}: ours {a['step_s']:.2f} s/step, accuracy {a['accuracy']:.3f}; "
                f"TRL {b['step_s']:.2f} s/step, accuracy {b['accuracy']:.3f}"
            )
    ta = cfg.actor_train.training_args
    samples = cfg.samples_per_step
    section = Section(
        title="1. End to end against TRL",
        setup=(
            f"TRL {trl.__version__} `GRPOTrainer` against our `RLVRPipeline`, {steps} RL steps each on the "
            f"{PROMPTS} `add` prompts of tests/test_learning.py (training and validation set), same model "
            f"({TINY_MODEL.name}), {cfg.rollout_batch_size} prompts x {cfg.num_return_sequences_in_group} "
            f"responses per step, {cfg.actor_infer.generating_args.max_new_tokens} max new tokens, temperature "
            f"{cfg.actor_infer.generating_args.temperature}, learning rate {ta.learning_rate} constant, "
            f"mini-batches of {ta.minibatch_size} "
            f"({samples // ta.minibatch_size} optimizer steps per RL "
            f"step), {cfg.ppo_epochs} pass per batch, no KL (our use_kl_loss false, TRL beta 0), float32 on CPU, "
            f"{cfg.actor_train.torch_threads} torch threads (each of our workers; TRL's one process). "
            "Step time: median wall-clock seconds between the ends of consecutive RL steps after the first (ours "
            "leaves out its last, which validates). Accuracy: the same greedy evaluator for both on the final "
            f"weights; before training it is {initial:.3f}. See benchmarks/bench_trl.py for every setting."
        ),
        comparisons=[
            Comparison(
                "RL step time",
                "s/step",
                "roll-pipeline",
                tuple(x["step_s"] for x in ours),
                f"TRL {trl.__version__}",
                tuple(x["step_s"] for x in peer),
                higher_is_better=False,
            )
        ],
        measures=[
            Measure(
                f"greedy accuracy after {steps} steps (start {initial:.3f})",
                "share of 32",
                {
                    "roll-pipeline": tuple(x["accuracy"] for x in ours),
                    f"TRL {trl.__version__}": tuple(x["accuracy"] for x in peer),
                    "roll-pipeline val_correct/all/mean (cross-check)": tuple(
                        x["pipeline_val"] for x in ours
                    ),
                },
            ),
            Measure(
                "generated tokens per RL step (the work each side did)",
                "tokens",
                {
                    "roll-pipeline": tuple(x["generated_tokens"] for x in ours),
                    f"TRL {trl.__version__}": tuple(x["generated_tokens"] for x in peer),
                },
            ),
            Measure(
                "decode steps per RL step (forward passes of generation)",
                "steps",
                {
                    "roll-pipeline": tuple(x["decode_steps"] for x in ours),
                    f"TRL {trl.__version__}": tuple(x["decode_steps"] for x in peer),
                },
            ),
        ],
    )
    section.details.append(where_time_goes(ours, peer))
    section.wall_s = time.perf_counter() - start_wall
    return section


def where_time_goes(ours: list[dict[str, Any]], peer: list[dict[str, Any]]) -> str:
    """Markdown: our step's stages (the pipeline's time/<stage>_s metrics) beside TRL's generation and the rest."""
    step = statistics.median(x["step_s"] for x in ours)
    stages = {k: statistics.median(x["stages"][k] for x in ours) for k in ours[0]["stages"]}
    staged = statistics.median(x["staged_s"] for x in ours)
    rows = [
        [k, f"{v:.3f}", f"{v / step:.0%}"] for k, v in sorted(stages.items(), key=lambda kv: -kv[1]) if v > 0
    ]
    rows.append(
        [
            "outside the stages (logging, metrics, driver)",
            f"{step - staged:.3f}",
            f"{(step - staged) / step:.0%}",
        ]
    )
    keys = (
        "wall_s",
        "generate_s",
        "reward_s",
        "batches_per_step",
        "sequences_per_batch",
        "sequences_per_step",
    )
    parts = {k: statistics.median(x["rollout_parts"][k] for x in ours) for k in keys}
    rollout_note = (
        f"Inside rollout: the math scheduler's `get_batch` took {parts['wall_s']:.3f} s; one prompt's group waited "
        f"{parts['generate_s']:.3f} s on average from its request to actor_infer to its responses (requests of all "
        f"prompts are batched together, so these overlap) and {parts['reward_s']:.3f} s for its scores "
        "(scheduler/math/generate_s and reward_s per group). actor_infer joined each step's "
        f"{parts['sequences_per_step']:.0f} sequences into {parts['batches_per_step']:.2f} generation batches on "
        f"average ({parts['sequences_per_batch']:.1f} sequences per batch; its `batch_sizes`): more than one batch "
        "per step means the step's requests did not all arrive within the request batcher's gather window, and "
        "generation ran that many times one after the other."
    )
    trl_step = statistics.median(x["step_s"] for x in peer)
    trl_gen = statistics.median(x["generate_s"] for x in peer)
    rows_trl = [
        [
            "generate and score (`_generate_and_score_completions`, which adds an old log-prob pass only where a "
            "generation feeds more than one optimizer step; ours: rollout + log_probs)",
            f"{trl_gen:.3f}",
            f"{trl_gen / trl_step:.0%}",
        ],
        [
            "the rest (forward, backward, optimizer, Trainer loop)",
            f"{trl_step - trl_gen:.3f}",
            f"{(trl_step - trl_gen) / trl_step:.0%}",
        ],
    ]
    rewards = [
        [
            "roll-pipeline",
            *(f"{statistics.median(x[k] for x in ours):.3f}" for k in ("reward_first", "reward_last")),
        ],
        ["TRL", *(f"{statistics.median(x[k] for x in peer):.3f}" for k in ("reward_first", "reward_last"))],
    ]
    return "\n\n".join(
        [
            f"Where the time of our step goes (median seconds over the timed steps and repetitions; step {step:.3f} s):",
            markdown_table(rows, ["stage (time/<stage>_s)", "seconds", "share of step"]),
            rollout_note,
            f"TRL's step ({trl_step:.3f} s), timed around its generation:",
            markdown_table(rows_trl, ["part", "seconds", "share of step"]),
            "Mean training reward at the first and the last step (median over repetitions):",
            markdown_table(rewards, ["", "first step", "last step"]),
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--quick", action="store_true", help="tiny batches, for a smoke run")
    args = parser.parse_args(argv)
    section = measure(args.repeats, args.steps, args.quick)
    print_section(section)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

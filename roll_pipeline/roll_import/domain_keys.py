"""ROLL's data, validation and reward domains as this project's `data`, `validation` and `rewards.<domain>`: each
reward worker class becomes the registered worker that scores the same thing, VLM domains are refused by name."""

from __future__ import annotations

import math
from typing import Any

from roll_pipeline.roll_import.report import Importer, show

#: ROLL's reward workers (module.Class, the last two parts of worker_cls) -> this project's worker.
WORKERS = {
    "math_rule_reward_worker.MathRuleRewardWorker": "math_rule",
    "code_sandbox_reward_worker.CodeSandboxRewardWorker": "code_sandbox",
    "llm_judge_reward_worker.LLMJudgeRewardWorker": "llm_judge",
    "crossthinkqa_rule_reward_worker.CrossThinkQARuleRewardWorker": "multiple_choice",
    "multiple_choice_boxed_rule_reward_worker.MultipleChoiceBoxedRuleRewardWorker": "multiple_choice",
    "ifeval_rule_reward_worker.GeneralRuleRewardWorker": "ifeval",
}

#: ROLL's VLM reward workers: their domains are refused by name.
VLM_WORKERS = {
    "detection_reward_worker.DetectionRewardWorker": "object detection on images",
    "video_r1_reward_worker.VideoR1RewardWorker": "question answering on video",
}

VLM_DATA_KEYS = ("image_max_pixels", "image_min_pixels", "video_folder", "video_fps", "video_max_frames",
                 "video_max_pixels", "video_min_pixels", "video_total_pixels", "custom_data_kwargs_func")

#: ROLL's crossthinkqa scores by reward_type (crossthinkqa_rule_reward_worker.py), for the report.
CROSSTHINKQA_SCORES = {
    "soft": "1 (right letter in \\boxed), 0.5 (right, unboxed), -0.5 (wrong, boxed), -1 (wrong, unboxed)",
    "loose": "1 for the right letter, boxed or not, else -1",
    "strict": "1 for the right letter in \\boxed, else -1",
}

REPETITION = (
    "ROLL adds a repetition penalty to this domain's score (3-gram, down to -0.5); here the score is the "
    "checker's alone"
)


def import_data(imp: Importer) -> None:
    src = imp.src
    d = "actor_train.data_args"
    _files(imp, d, "data.train_files")
    probs = src.get(f"{d}.domain_interleave_probs")
    if probs is not None:  # reported by import_rewards, which turns them into ROLL's per-step counts
        imp.put("domain_interleave_probs", {str(k): float(v) for k, v in probs.items()})
    messages = src.get(f"{d}.messages")
    if messages is not None:
        imp.mapped(f"{d}.messages", "data.messages_key", messages)
    imp.dropped(f"{d}.interleave_probs", "the rows of every file are pooled and routed to domains by tag; each "
                "domain's share comes from domain_interleave_probs")
    if src.has("prompt_length"):
        imp.put("data.prompt_length", src.get("prompt_length"))
        imp.changed("prompt_length", "data.on_long_prompt", "drop",
                    f"data.prompt_length: {src.get('prompt_length')}; ROLL leaves out prompts longer than that (and "
                    "those of 5 tokens or fewer) without a word; here longer ones are left out and counted per "
                    "domain, short ones are kept")
    _template(imp, [f"{s}.data_args.template" for s in ("actor_train", "validation")] + ["global_template"])
    imp.dropped("tag_to_template", "every domain is encoded with the model's chat template")


def _files(imp: Importer, data_args: str, ours: str) -> None:
    src = imp.src
    files = src.get(f"{data_args}.file_name")
    if files is not None:
        imp.mapped(f"{data_args}.file_name", ours, [files] if isinstance(files, str) else list(files))
    imp.dropped(f"{data_args}.dataset_dir", "file_name paths are written as given, relative to the imported "
                "config's folder")
    imp.dropped(f"{data_args}.preprocessing_num_workers", "processes that tokenise the data")
    for key in VLM_DATA_KEYS:
        if src.has(f"{data_args}.{key}"):
            imp.refuse(f"{data_args}.{key}", "multimodal data (images, video): VLMs are not supported")


def _template(imp: Importer, paths: list[str]) -> None:
    for path in paths:
        if imp.src.has(path):
            imp.changed(path, None, None, f"{imp.src.get(path)!r} (ROLL's template by name) -> the model "
                        "tokenizer's own chat template")


def import_validation(imp: Importer) -> None:
    src = imp.src
    v = "validation"
    if not src.has(v):
        return
    _files(imp, f"{v}.data_args", "data.val_files")
    g = f"{v}.generating_args"
    for key in ("temperature", "top_p", "top_k"):
        imp.move(f"{g}.{key}", f"validation.generating_args.{key}")
    greedy = bool(src.take("val_greedy", False))
    if greedy:
        imp.report.mapped.append(("val_greedy", "validation.generating_args.do_sample: false"))
    imp.put("validation.generating_args.do_sample", not greedy)
    if not greedy:
        imp.default("validation.generating_args.do_sample", True, "ROLL samples validation responses")
    imp.put("validation.generating_args.max_new_tokens", imp.ours("actor_infer.generating_args.max_new_tokens"))
    imp.dropped(f"{g}.max_new_tokens", "ROLL sets it from the validation lengths (response_length by default)")
    if src.get(f"{g}.num_beams", 1) == 1:
        imp.dropped(f"{g}.num_beams", "1: sampling")
    else:
        imp.refuse(f"{g}.num_beams", "beam search is not mapped")
    samples = src.take("val_n_sample", None) or src.get(f"{g}.num_return_sequences", 1)
    src.take(f"{g}.num_return_sequences")
    imp.put("validation.num_samples", int(samples))
    imp.report.mapped.append((f"{g}.num_return_sequences", f"validation.num_samples: {int(samples)}"))
    imp.dropped(f"{v}.eval_steps", "ROLL validates every top-level eval_steps")
    imp.dropped(f"{v}.data_args.messages", "read as data.messages_key")
    for key in ("model_args", "strategy_args", "device_mapping", "infer_batch_size", "world_size"):
        imp.dropped(f"{v}.{key}", "validation generates with actor_infer")


def import_rewards(imp: Importer) -> None:
    src = imp.src
    refused: list[str] = []
    for domain in src.keys("rewards"):
        p = f"rewards.{domain}"
        cls = str(src.get(f"{p}.worker_cls") or "")
        name = ".".join(cls.split(".")[-2:])
        if name in VLM_WORKERS:
            imp.refuse(p, f"a VLM domain ({VLM_WORKERS[name]}, {cls.rsplit('.', 1)[-1]}): images and video are "
                       "not supported")
            refused.append(domain)
            continue
        if name not in WORKERS:
            imp.refuse(p, f"worker_cls {cls!r} is none of the reward workers the importer maps "
                       f"({', '.join(sorted(set(WORKERS.values())))})")
            refused.append(domain)
            continue
        worker = WORKERS[name]
        imp.mapped(f"{p}.worker_cls", f"{p}.worker", worker)
        imp.move(f"{p}.tag_included", f"{p}.tag_included")
        imp.move(f"{p}.world_size", f"{p}.world_size")
        _filters(imp, p)
        if imp.flags.get("max_len_mask"):
            imp.put(f"{p}.response_filters", {"truncated": {}})
        coef = src.get(f"{p}.response_length_penalty_coef", 0.0)
        if coef:
            imp.refuse(f"{p}.response_length_penalty_coef", "a reward term proportional to the response's length")
        else:
            imp.dropped(f"{p}.response_length_penalty_coef", "0")
        if worker == "llm_judge":
            _judge(imp, p)
        else:
            for key in ("model_args", "data_args", "infer_batch_size", "strategy_args", "generating_args",
                        "device_mapping", "num_gpus_per_worker"):
                imp.dropped(f"{p}.{key}", "a rule reward loads no model")
        if worker == "code_sandbox":
            _code(imp, p)
        elif worker == "multiple_choice":
            kind = str(src.get(f"{p}.reward_type", "soft"))
            imp.changed(f"{p}.reward_type", None, None,
                        f"ROLL's {kind!r} scores {CROSSTHINKQA_SCORES.get(kind, 'by its own rule')}; "
                        "multiple_choice scores 1 for one marked letter that is right, else 0. " + REPETITION)
        elif worker == "ifeval":
            imp.changed(f"{p}.reward_type", None, None, "1 when the constraint holds, else 0. " + REPETITION)
        else:
            imp.dropped(f"{p}.reward_type", "unused by this worker in ROLL")
        imp.dropped(f"{p}.format_pattern", "ROLL computes a format reward it does not add to the score")
    _roll_shares(imp)
    _drop_refused(imp, refused)


def _roll_shares(imp: Importer) -> None:
    """ROLL gives each domain but the last int(p * rollout_batch_size) prompts and the last what is left
    (rlvr_pipeline.py); those counts, over rollout_batch_size, are shares this project's rounding keeps exactly.
    A reward domain with no prompts (absent from the probabilities, or rounded to 0) leaves the config."""
    probs = imp.ours("domain_interleave_probs")
    batch = int(imp.ours("rollout_batch_size", 128))
    if not isinstance(probs, dict) or not probs:
        return
    counts: dict[str, int] = {}
    for i, (domain, p) in enumerate(probs.items()):
        counts[domain] = batch - sum(counts.values()) if i == len(probs) - 1 else int(p * batch)
    shares = {d: c / batch for d, c in counts.items() if c > 0}
    rewards = imp.ours("rewards") or {}
    for domain in [d for d in rewards if d not in shares]:
        del rewards[domain]
        imp.report.changed.append((f"rewards.{domain}", "no prompts in ROLL (not in domain_interleave_probs, or "
                                   "int(p * rollout_batch_size) = 0): left out, with the tags it routed"))
    key = "actor_train.data_args.domain_interleave_probs"
    if any(abs(shares.get(d, 0.0) - p) > 1e-12 for d, p in probs.items()):
        imp.changed(key, "domain_interleave_probs", shares, f"ROLL's prompt counts per step {show(counts)} "
                    f"(int(p * {batch}) each, the last domain the rest) over rollout_batch_size")
    else:
        imp.mapped(key, "domain_interleave_probs", probs)


def _filters(imp: Importer, p: str) -> None:
    """ROLL's query_filter_config (one filter) as group_filters, with ROLL's comparisons."""
    src = imp.src
    q = f"{p}.query_filter_config"
    kind = src.get(f"{q}.type", "no_filter")
    args = src.get(f"{q}.filter_args") or {}
    if kind == "no_filter":
        imp.dropped(q, "no_filter")
    elif kind == "mean_filter":
        low, high = float(args.get("threshold_down", -1)), float(args.get("threshold_up", math.inf))
        imp.changed(q, f"{p}.group_filters", {"mean_filter": {"low": low, "high": high, "inclusive": False}},
                    "ROLL keeps a group whose mean lies strictly between the thresholds (inclusive: false)")
    elif kind == "std_filter":
        threshold = float(args.get("std_threshold", -1))
        if threshold < 0:
            imp.changed(q, None, None, "std_filter with std_threshold < 0 (ROLL's default -1) never drops a group: "
                        "no group filter here")
        else:
            n = int(imp.ours("num_return_sequences_in_group", 1))
            min_std = threshold * math.sqrt((n - 1) / n) if n > 1 else 0.0
            imp.changed(q, f"{p}.group_filters", {"std_filter": {"min_std": min_std}},
                        f"ROLL drops a group whose sample std (n - 1) is <= {threshold}; this filter's std is the "
                        f"population std, so min_std = {threshold} * sqrt({n - 1}/{n})")
    else:
        imp.refuse(q, f"filter type {kind!r}: no_filter, mean_filter and std_filter are mapped")
    r = f"{p}.response_filter_config"
    if src.get(f"{r}.type", "no_filter") == "no_filter":
        imp.dropped(r, "no_filter")
    else:
        imp.dropped(r, "ROLL's response_filter keeps every response whatever its type")


def _code(imp: Importer, p: str) -> None:
    src = imp.src
    if src.get(f"{p}.use_local", True):
        imp.dropped(f"{p}.use_local", "the code_sandbox worker runs tests in its local sandbox")
        imp.dropped(f"{p}.code_url", "read only without use_local")
    else:
        imp.refuse(f"{p}.use_local", "a remote sandbox service (code_url): the code_sandbox worker runs locally")
        imp.src.take(f"{p}.code_url")
    imp.default(f"{p}.options.reward_mode", "all_or_nothing", "ROLL scores 1 when every test passes, else 0")


def _judge(imp: Importer, p: str) -> None:
    """ROLL's LLM judge: a local model (judge_model_type inference) or an API (api)."""
    src = imp.src
    kind = src.get(f"{p}.judge_model_type", "api")
    options: dict[str, Any] = {"verdict_format": "yes_no"}
    gen = src.get(f"{p}.generating_args") or {}
    if "max_new_tokens" in gen:
        options["max_tokens"] = int(gen["max_new_tokens"])
    if "temperature" in gen:
        options["temperature"] = float(gen["temperature"])
    if kind in ("inference", "cluster"):
        options["backend"] = "ray_actor"
        options["model_path"] = src.get(f"{p}.model_args.model_name_or_path")
        gpus = 1 if src.get(f"{p}.device_mapping") is not None else 0
        options["actor"] = {"num_gpus": gpus}
        imp.changed(f"{p}.judge_model_type", None, None,
                    f"{kind!r}: ROLL's judge cluster ({show(src.get(f'{p}.device_mapping'))}, "
                    f"{src.get(f'{p}.strategy_args.strategy_name', 'hf_infer')}) -> one judge actor with "
                    f"transformers on {gpus} GPU, shared by the domain's reward workers")
        for key in ("model_args", "strategy_args", "device_mapping", "infer_batch_size", "data_args",
                    "num_gpus_per_worker"):
            imp.src.take(f"{p}.{key}")
    elif kind == "api":
        options["backend"] = "http"
        options["base_url"] = src.take(f"{p}.judge_api_url")
        options["model"] = src.take(f"{p}.judge_model_name")
        imp.src.take(f"{p}.judge_model_type")
        if src.get(f"{p}.judge_api_key"):
            imp.changed(f"{p}.judge_api_key", f"{p}.options.api_key_env", "JUDGE_API_KEY",
                        "the key is read from an environment variable, never from the config: export JUDGE_API_KEY")
            options["api_key_env"] = "JUDGE_API_KEY"
        for key in ("model_args", "data_args", "infer_batch_size"):
            imp.dropped(f"{p}.{key}", "the judge is behind the API")
    else:
        imp.refuse(f"{p}.judge_model_type", f"{kind!r}: inference and api are mapped")
    extra = {k: v for k, v in gen.items() if k not in ("max_new_tokens", "temperature", "num_return_sequences",
                                                       "num_beams")}
    if extra:
        imp.changed(f"{p}.generating_args", None, None, f"the judge samples with temperature and max_tokens only "
                    f"here; {show(extra)} are not applied")
    else:
        imp.src.take(f"{p}.generating_args")
    prompt = src.get(f"{p}.judge_prompt")
    imp.changed(f"{p}.judge_prompt", None, None,
                f"ROLL's prompt {prompt!r} is not reproduced; the judge gets this worker's template (question, "
                "reference answer, response) and answers 'Verdict: YES' or 'NO'. ROLL scores 1 when 'yes' appears "
                "anywhere in the reply; here the verdict must be stated")
    imp.put(f"{p}.options", options)
    imp.report.mapped.append((p, f"{p}.options: {show(options)}"))


def _drop_refused(imp: Importer, refused: list[str]) -> None:
    """With --lenient, a refused domain leaves the mix; the others' shares are scaled to sum to 1."""
    probs = imp.ours("domain_interleave_probs")
    if not refused or not isinstance(probs, dict):
        return
    kept = {k: v for k, v in probs.items() if k not in refused}
    total = sum(kept.values())
    if not kept or total <= 0:
        return
    scaled = {k: round(v / total, 12) for k, v in kept.items()}
    imp.put("domain_interleave_probs", scaled)
    imp.report.changed.append(("domain_interleave_probs",
                               f"{show(scaled)}: without the refused domain(s) {', '.join(refused)}, scaled to sum to 1"))

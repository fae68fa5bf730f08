"""The embedded tiny model: a Qwen2-architecture causal LM of about a million parameters, built offline.

`build_tiny_model` trains a byte-level BPE tokenizer on the example data, initialises a small
`Qwen2ForCausalLM` and gives it a short supervised warm-up on the same data through the chat template, then
saves a Hugging Face folder that loads with plain `AutoModelForCausalLM.from_pretrained` /
`AutoTokenizer.from_pretrained`. The warm-up is deliberately short: RL needs a model that sometimes gets the
answer right (reward signal) but often does not (headroom).

Builds are cached by spec (seed, hyperparameters, hashes of the train files) in `build_info.json` and written
atomically, so a pipeline can call `build_tiny_model` on every start.

A build is repeatable: the same spec gives the same weights, bit for bit, on machines with the same kind of
processor and the pinned packages, whatever their core count, load or vector units. Floating-point kernels differ
by CPU (ATen picks AVX-512 or AVX2 code, MKL its own paths per processor) and by thread count (how reductions are
split), and a 300-step warm-up amplifies a last-bit difference into another model, as far apart as two seeds are
(seeds 0 and 1 of tiny-qwen2: 0.45 and 0.19 held-out accuracy). So the warm-up runs in a child process whose
kernels are pinned (`PINNED_KERNELS`) with a fixed number of threads, and the weights' sha256 is recorded in
`build_info.json` and printed. The pins do not make every vendor alike: an Intel Xeon and an AMD EPYC build
different weights from one seed although MKL runs its COMPATIBLE branch on both (MKL_VERBOSE shows CNR:COMPATIBLE
on every SGEMM of the EPYC's warm-up, its only MKL calls); what else differs is not found. So the embedded models
list every build seen (`known_builds`), and the tests check a build's quality, not its bits. Where the example's
figures depend on the exact weights (tiny-qwen2), a finished build is shipped with the project and copied in
(`shipped`, `install_shipped`) rather than built on each machine.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

logger = logging.getLogger(__name__)

BUILD_INFO = "build_info.json"
# Bumped when the build procedure changes in a way the hyperparameters do not capture, to invalidate caches.
BUILD_FORMAT = 3
#: Environment of the build's child process. ATen's vector code is held to its AVX2 path, which every x86-64
#: processor of the last decade has (ATEN_CPU_CAPABILITY), so an AVX-512 machine computes what an AVX2-only one
#: does; MKL's BLAS to its one code path that Intel and AMD processors run alike (MKL_CBWR=COMPATIBLE: SSE2
#: without the approximate rcpps/rsqrtps, whose results differ between vendors); a fixed number of intra-op
#: threads, so the split of reductions never depends on the core count. MKL_CBWR=AVX2 is not enough: MKL honours
#: it on Intel processors only and falls back to its automatic, vendor-specific branch elsewhere. Measured
#: 2026-11-24 on a 2-core AVX-512 AMD EPYC: unpinned, the weights changed when MKL and ATen were told the CPU had
#: only AVX2. Measured 2026-11-25 on a 2-core AVX-512 Intel Xeon: with MKL_CBWR=AVX2 tiny-qwen2 was not the
#: EPYC's build (5d14fccf... against 52688a35...), which is what moved the pin to COMPATIBLE (build 74 s -> 138 s).
BUILD_THREADS = 2
PINNED_KERNELS = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "COMPATIBLE", "OMP_NUM_THREADS": str(BUILD_THREADS),
                  "MKL_NUM_THREADS": str(BUILD_THREADS), "MKL_DYNAMIC": "FALSE"}
WEIGHTS_FILE = "model.safetensors"
RESULTS_FILE = ".build_results.json"
#: The key of build_info.json that names the shipped build a model folder was copied from (absent where built).
INSTALLED_FROM = "installed_from"
# Warm-up steps between progress log lines; not part of the spec because it does not change the model.
LOG_EVERY = 50

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (PAD_TOKEN, IM_START, IM_END)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass(frozen=True)
class TinyModelHyperparameters:
    """Everything that shapes a build besides the seed and the train files; all of it enters the cache key."""

    vocab_size: int = 512
    hidden_size: int = 128
    intermediate_size: int = 512
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 256
    warmup_steps: int = 300
    batch_size: int = 64
    learning_rate: float = 2e-3
    lr_warmup_steps: int = 50
    weight_decay: float = 0.0
    # Rows held out of the warm-up (per train file) to measure its greedy accuracy.
    eval_rows_per_file: int = 50


def build_tiny_model(out_dir: Path, train_files: list[Path], seed: int = 0, shipped: Path | None = None,
                     from_scratch: bool = False, **hyperparameters) -> Path:
    """Build (or reuse) the tiny model in `out_dir` and return `out_dir`.

    `hyperparameters` override fields of `TinyModelHyperparameters`; an unknown name is an error. The build is
    skipped when `out_dir/build_info.json` records the same spec. `shipped` is a finished build kept with the
    project: where its build_info.json records this spec, it is copied in (its weights checked against their
    recorded sha256) instead of built, unless `from_scratch`; a copy already in `out_dir` is up to date only when
    it has the shipped weights, and `from_scratch` replaces it with a build made here.
    """
    out_dir = Path(out_dir)
    known = {field.name for field in fields(TinyModelHyperparameters)}
    unknown = sorted(set(hyperparameters) - known)
    if unknown:
        raise TypeError(f"unknown tiny-model hyperparameters: {unknown}; known: {sorted(known)}")
    hparams = TinyModelHyperparameters(**hyperparameters)
    train_files = [Path(path) for path in train_files]
    spec = build_spec(hparams, train_files, seed)
    if reuse_or_install(out_dir, spec, shipped, from_scratch, "tiny model"):
        return out_dir
    return write_build(out_dir, spec, lambda staging: _build_in_pinned_process(staging, hparams, train_files, seed),
                       "tiny model")


def reuse_or_install(out_dir: Path, spec: dict, shipped: Path | None, from_scratch: bool, what: str) -> bool:
    """Whether `out_dir` now holds a build of `spec` without building one: it already did (a copy of `shipped` is up
    to date only when it has the shipped weights), or `shipped`, a finished build kept with the project whose
    build_info.json records `spec`, was copied in. `from_scratch` ignores `shipped` and refuses a copy of it, so
    that the caller builds the model here. False: the caller builds it."""
    reference = _read_info(shipped) if shipped is not None and not from_scratch else None
    if reference is not None and _spec_of(reference, spec) != spec:
        reference = None
    cached = _read_info(out_dir)
    if cached is not None and _spec_of(cached, spec) == spec:
        if reference is not None:
            up_to_date = cached.get("weights_sha256") == reference["weights_sha256"]
        else:
            up_to_date = not (from_scratch and INSTALLED_FROM in cached)
        if up_to_date:
            logger.info("%s in %s is up to date, not rebuilding", what, out_dir)
            return True
    if reference is not None:
        install_shipped(Path(shipped), out_dir, reference)
        return True
    return False


def install_shipped(shipped: Path, out_dir: Path, info: dict) -> Path:
    """Copy the shipped build `shipped` (its build_info.json read as `info`) to `out_dir`, atomically, after checking
    that its weights are the ones it records; build_info.json then says where they came from (`INSTALLED_FROM`)."""
    def copy(staging: Path) -> None:
        shutil.copytree(shipped, staging, dirs_exist_ok=True)
        digest = weights_sha256(staging)
        if digest != info["weights_sha256"]:
            raise RuntimeError(f"{shipped / WEIGHTS_FILE} has sha256 {digest}, not the {info['weights_sha256']} its "
                               f"{BUILD_INFO} records: the checkout is damaged (restore it with `git checkout -- "
                               f"{shipped}`), or build the model here with `--from-scratch`")
        (staging / BUILD_INFO).write_text(json.dumps({**info, INSTALLED_FROM: str(shipped)}, indent=2) + "\n")

    _fill_in_place(out_dir, copy, "installing")
    logger.info("installed the shipped build %s in %s (weights sha256 %s)", shipped, out_dir, info["weights_sha256"])
    return out_dir


def write_build(out_dir: Path, spec: dict, build: Callable[[Path], dict], what: str) -> Path:
    """Build into a staging folder beside `out_dir` (`build(staging)` writes the model there and returns its
    figures), record spec, figures and build_seconds in build_info.json, then move it into place; a failed build
    leaves `out_dir` as it was."""
    results: dict = {}

    def build_and_record(staging: Path) -> None:
        started = time.perf_counter()
        results.update(build(staging))
        info = {**spec, **results, "build_seconds": round(time.perf_counter() - started, 1)}
        (staging / BUILD_INFO).write_text(json.dumps(info, indent=2) + "\n")

    _fill_in_place(out_dir, build_and_record, "building")
    logger.info("built %s in %s (%s)", what, out_dir, results)
    return out_dir


def _fill_in_place(out_dir: Path, fill: Callable[[Path], None], doing: str) -> None:
    """`fill(staging)` writes a model folder into a staging folder beside `out_dir`, which then takes its place;
    when anything fails, `out_dir` is left as it was and the staging folder removed."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.{doing}-", dir=out_dir.parent))
    try:
        fill(staging)
        _replace_dir(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def weights_sha256(model_dir: Path) -> str:
    """sha256 of a built model's weights file: equal on every machine for the same build spec."""
    from roll_core.tracking.metadata import content_hash

    return content_hash(Path(model_dir) / WEIGHTS_FILE)


def _build_in_pinned_process(out_dir: Path, hparams: TinyModelHyperparameters, train_files: Sequence[Path],
                             seed: int) -> dict:
    return run_pinned(out_dir, f"{__name__}:_pinned_build",
                      {"hyperparameters": asdict(hparams), "train_files": [str(path) for path in train_files],
                       "seed": seed})


def run_pinned(out_dir: Path, target: str, args: dict) -> dict:
    """Run `target` ("module:function", called as function(out_dir, **args) and returning the build's figures) in
    a fresh interpreter with `PINNED_KERNELS`: torch and MKL read them once, when they load, so they cannot be set
    in a process that has already imported torch (a test, a pipeline). The figures come back with the weights'
    sha256 and the kernels used."""
    job = {"out_dir": str(out_dir), "target": target, "args": args,
           "log_level": logging.getLogger().getEffectiveLevel()}
    env = {**os.environ, **PINNED_KERNELS}
    done = subprocess.run([sys.executable, "-m", __name__], input=json.dumps(job), text=True, env=env, check=False)
    results = Path(out_dir) / RESULTS_FILE
    if done.returncode != 0 or not results.exists():
        raise RuntimeError(f"building the model in {out_dir} failed (exit code {done.returncode}; "
                           "its error is printed above)")
    try:
        return json.loads(results.read_text())
    finally:
        results.unlink()


def _main() -> None:
    """The build's child process: a job as JSON on stdin; the build's results go to `RESULTS_FILE` beside it."""
    import importlib

    job = json.loads(sys.stdin.read())
    logging.basicConfig(level=job["log_level"], stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # save_pretrained's bar for a one-file model says nothing
    capability = torch.backends.cpu.get_cpu_capability()
    if capability.lower() != "avx2":
        logger.warning("this CPU runs torch's %s kernels, not AVX2: the weights will differ from other machines'",
                       capability)
    torch.set_num_threads(BUILD_THREADS)
    torch.use_deterministic_algorithms(True)
    module, function = job["target"].split(":")
    out_dir = Path(job["out_dir"])
    results = getattr(importlib.import_module(module), function)(out_dir, **job["args"])
    results["weights_sha256"] = weights_sha256(out_dir)
    results["kernels"] = f"{capability}, {BUILD_THREADS} thread(s), torch {torch.__version__}"
    (out_dir / RESULTS_FILE).write_text(json.dumps(results))


def _pinned_build(out_dir: Path, hyperparameters: dict, train_files: list[str], seed: int) -> dict:
    return _build(out_dir, TinyModelHyperparameters(**hyperparameters), [Path(path) for path in train_files], seed)


def build_spec(hparams: TinyModelHyperparameters, train_files: Sequence[Path], seed: int) -> dict:
    return {
        "build_format": BUILD_FORMAT,
        "seed": seed,
        "hyperparameters": asdict(hparams),
        "train_files": {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in train_files},
    }


def _read_info(model_dir: Path) -> dict | None:
    try:
        return json.loads((Path(model_dir) / BUILD_INFO).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _spec_of(info: dict, spec: dict) -> dict:
    """The part of a build_info.json that a spec of `spec`'s keys compares with."""
    return {key: info.get(key) for key in spec}


def _replace_dir(staging: Path, out_dir: Path) -> None:
    """Move the finished build into place; an old build is moved aside first so `out_dir` is never partial."""
    if out_dir.exists():
        trash = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
        out_dir.rename(trash / out_dir.name)
        staging.rename(out_dir)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        staging.rename(out_dir)


def _build(out_dir: Path, hparams: TinyModelHyperparameters, train_files: Sequence[Path], seed: int) -> dict:
    rows_per_file = [_read_jsonl(path) for path in train_files]
    corpus = [text for rows in rows_per_file for row in rows for text in _texts(row)]
    tokenizer = build_tokenizer(corpus, hparams.vocab_size)

    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(_model_config(hparams, tokenizer))
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id)
    logger.info("tiny model: %d parameters", sum(p.numel() for p in model.parameters()))

    rng = random.Random(seed)
    train_rows, eval_rows = [], []
    for rows in rows_per_file:
        shuffled = rows[:]
        rng.shuffle(shuffled)
        eval_rows += shuffled[: hparams.eval_rows_per_file]
        train_rows += shuffled[hparams.eval_rows_per_file :]
    examples = _encode(tokenizer, train_rows)
    final_loss = _warm_up(model, examples, hparams, tokenizer.pad_token_id, rng)
    accuracy = _greedy_exact_match(model, tokenizer, eval_rows)

    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return {"parameters": sum(p.numel() for p in model.parameters()), "final_loss": round(final_loss, 4),
            "heldout_greedy_accuracy": round(accuracy, 4), "heldout_rows": len(eval_rows)}


def _read_jsonl(path: Path) -> list[dict]:
    with path.open(encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def _texts(row: dict) -> list[str]:
    """The row's texts for the tokenizer's corpus: its messages and its ground truth."""
    return [message["content"] for message in row["messages"]] + [row["ground_truth"]]


def _question(row: dict) -> list[dict]:
    """The messages before the model's first turn: the prompt."""
    messages = row["messages"]
    first_turn = next((i for i, m in enumerate(messages) if m["role"] != "user" and m["role"] != "system"),
                      len(messages))
    return messages[:first_turn]


def build_tokenizer(corpus: Sequence[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on `corpus` with one token per digit, wrapped for transformers.

    Single-digit tokens keep numbers compositional, which is what lets a tiny model learn column arithmetic.
    """
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        chat_template=CHAT_TEMPLATE,
        model_max_length=1024,
    )


def _model_config(hparams: TinyModelHyperparameters, tokenizer: PreTrainedTokenizerFast) -> Qwen2Config:
    return Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hparams.hidden_size,
        intermediate_size=hparams.intermediate_size,
        num_hidden_layers=hparams.num_hidden_layers,
        num_attention_heads=hparams.num_attention_heads,
        num_key_value_heads=hparams.num_key_value_heads,
        max_position_embeddings=hparams.max_position_embeddings,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )


def _encode(tokenizer: PreTrainedTokenizerFast, rows: Sequence[dict]) -> list[tuple[list[int], list[int], list[int]]]:
    """Return (prompt ids, response ids + eos, taught) per row, tokenized exactly as RL will see them; `taught` is 1
    on the response tokens the warm-up learns.

    A row whose messages go on after the question (the model's turns and tools' answers, roll_pipeline/data/
    tool_math.py) is taught as that trajectory, built the way the multi-turn rollout builds one
    (schedulers/trajectory.py): each model turn encoded on its own, each tool answer as the chat template renders
    it (out of the loss: the model reads it, never learns to write it), then the ground truth as the last turn."""
    from schedulers.trajectory import tool_answer_text

    prompts = tokenizer.apply_chat_template([_question(row) for row in rows], add_generation_prompt=True,
                                            tokenize=False)
    prompt_ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    encoded = []
    for row, prompt in zip(rows, prompt_ids, strict=True):
        response: list[int] = []
        taught: list[int] = []
        for message in row["messages"][len(_question(row)) :]:
            if message["role"] == "tool":
                ids = tokenizer.encode(tool_answer_text(tokenizer, message["content"], "template"),
                                       add_special_tokens=False)
            else:
                ids = tokenizer.encode(message["content"], add_special_tokens=False)
            response += ids
            taught += [int(message["role"] != "tool")] * len(ids)
        answer = tokenizer.encode(row["ground_truth"], add_special_tokens=False) + [tokenizer.eos_token_id]
        encoded.append((prompt, response + answer, taught + [1] * len(answer)))
    return encoded


def _collate(batch: Sequence[tuple[list[int], list[int], list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    length = max(len(prompt) + len(response) for prompt, response, _ in batch)
    input_ids = torch.full((len(batch), length), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), length), -100, dtype=torch.long)
    attention_mask = torch.zeros((len(batch), length), dtype=torch.long)
    for i, (prompt, response, taught) in enumerate(batch):
        ids = prompt + response
        input_ids[i, : len(ids)] = torch.tensor(ids)
        attention_mask[i, : len(ids)] = 1
        # Loss on the response only (the model should learn to answer, not to reproduce prompts), and there on
        # the tokens it writes (not a tool's).
        labels[i, len(prompt) : len(ids)] = torch.where(torch.tensor(taught, dtype=torch.bool),
                                                        torch.tensor(response), -100)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def _warm_up(model: Qwen2ForCausalLM, examples: Sequence, hparams: TinyModelHyperparameters, pad_id: int,
             rng: random.Random) -> float:
    """Supervised fine-tune with linear LR warm-up and cosine decay; returns the mean loss of the last steps."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=hparams.learning_rate, weight_decay=hparams.weight_decay)

    def lr_factor(step: int) -> float:
        if step < hparams.lr_warmup_steps:
            return (step + 1) / hparams.lr_warmup_steps
        progress = (step - hparams.lr_warmup_steps) / max(1, hparams.warmup_steps - hparams.lr_warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    model.train()
    order: list[int] = []
    recent: list[float] = []
    for step in range(hparams.warmup_steps):
        if len(order) < hparams.batch_size:
            epoch = list(range(len(examples)))
            rng.shuffle(epoch)
            order += epoch
        batch = [examples[index] for index in order[: hparams.batch_size]]
        del order[: hparams.batch_size]
        loss = model(**_collate(batch, pad_id)).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        recent = (recent + [loss.item()])[-20:]
        if (step + 1) % LOG_EVERY == 0 or step + 1 == hparams.warmup_steps:
            logger.info("warm-up step %d/%d loss %.4f", step + 1, hparams.warmup_steps, sum(recent) / len(recent))
    model.eval()
    return sum(recent) / len(recent) if recent else float("nan")


@torch.no_grad()
def _greedy_exact_match(model: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerFast, rows: Sequence[dict],
                        batch_size: int = 64, max_new_tokens: int = 48) -> float:
    """Share of rows whose greedy response equals the ground truth exactly (whitespace-trimmed).

    A row taught as a trajectory counts when the response starts with the trajectory's first model turn (the
    tool is not run here). Exact match is stricter than the RL rewards (which check numbers or run asserts); it is only a build-time
    sanity figure and keeps the builder free of code execution.
    """
    if not rows:
        return float("nan")
    tokenizer.padding_side = "left"
    correct = 0
    for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
        prompts = [tokenizer.apply_chat_template(_question(row), add_generation_prompt=True, tokenize=False)
                   for row in chunk]
        inputs = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        output = model.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens,
                                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        responses = tokenizer.batch_decode(output[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
        correct += sum(_taught_start(response, row) for response, row in zip(responses, chunk, strict=True))
    tokenizer.padding_side = "right"
    return correct / len(rows)


def _taught_start(response: str, row: dict) -> bool:
    turns = row["messages"][len(_question(row)) :]
    if turns:
        return response.startswith(turns[0]["content"])
    return response.strip() == row["ground_truth"].strip()


if __name__ == "__main__":
    _main()

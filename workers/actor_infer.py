"""actor_infer: generates responses with the current policy weights.

It serves many concurrent requests (every domain's scheduler sends its prompts one group at a time), so the
pipeline runs it as a threaded Ray actor (`ActorInferWorker.MAX_CONCURRENCY` calls at once); a
`RequestBatcher` joins the waiting requests into batches for the generation strategy.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any

import torch

from roll_core.batch import Batch
from roll_core.config import GeneratingArgs, PipelineConfig
from roll_core.data.loading import collate_prompts
from workers.base import Worker, load_rng_states, release_free_memory, rng_states
from workers.inference.held_update import HeldUpdate
from workers.inference.request_batcher import Request, RequestBatcher
from workers.inference.version_store import VersionStore
from workers.inference.weight_swap import WeightSwap
from workers.inference.weight_wire import PackedWeights, unpack


class StaleWeightsError(RuntimeError):
    """A request names a newer policy than this worker holds: it was restarted and came back with the starting
    weights. The caller sends the current weights and the request again."""


def make_infer_strategy(pipeline_config: PipelineConfig):
    section = pipeline_config.actor_infer
    name = section.strategy_args.strategy_name
    if name == "vllm":
        from workers.strategies.vllm_infer import VLLMInferStrategy

        return VLLMInferStrategy(section, lora=pipeline_config.actor_train.lora)
    from workers.strategies.hf_infer import HFInferStrategy

    return HFInferStrategy(section, name="actor_infer", lora=pipeline_config.actor_train.lora)


class ActorInferWorker(Worker):
    MAX_CONCURRENCY = 256
    """Ray calls served at once: every in-flight request blocks one of these threads until its batch is done."""

    def __init__(self, *, pipeline_config: PipelineConfig, **kwargs) -> None:
        section = pipeline_config.actor_infer
        super().__init__(seed=pipeline_config.seed + 1000, torch_threads=section.torch_threads, **kwargs)
        self.batcher = RequestBatcher(
            self._run_batch,
            max_sequences=section.infer_batch_size,
            name="actor_infer",
            sources=pipeline_config.domain_interleave_probs,  # each domain's scheduler sends its waves
        )
        # The batcher's thread is the only one that touches the model, from its load on (request_batcher.py: one
        # thread for every torch operation keeps OpenMP's threads spinning between operations).
        self.strategy = self.batcher.call(lambda: make_infer_strategy(pipeline_config))
        self.pad_id = self.strategy.pad_id
        self._ids = itertools.count()
        self.with_log_probs = pipeline_config.needs_infer_log_probs
        self.swap = WeightSwap(self._load, self.batcher.defer)
        """Weight syncs, loaded between two tokens of a generating batch (partial rollouts) or between batches."""
        self.store = VersionStore(self.strategy.load_state_dict) if pipeline_config.partial_rule else None
        """Deterministic partial rollouts (partial_rollout_token): syncs are kept here, and each token loads the
        version its request's rule names instead."""
        self.transfer: tuple[HeldUpdate, threading.Thread, list[BaseException]] | None = None
        """The weight update actor_train drives now through vLLM's weight-transfer API (`transfer_*`), if any."""
        self.stats: list[dict[str, int]] = []
        """Per batch run, in order: sequences, tokens generated (up to each row's end) and decode steps (the
        strategy's forward passes, where it counts them)."""

    def generate_request(
        self,
        request_id: str,
        prompts: list[list[int]],
        args: GeneratingArgs,
        num_return_sequences: int,
        seed: int | None = None,
        weights_version: int | None = None,
        switch_at: int | None = None,
        wave: tuple[str, str, int] | None = None,
    ) -> dict[str, Any] | None:
        """Responses for a few prompts (token lists), `num_return_sequences` each, rows grouped by prompt:
        ``{"response_ids", "response_mask", "finish_reason"}``; None if the request was aborted.

        A request with a `seed` runs as a batch of its own, sampled from that seed: its responses then depend on
        nothing but its prompts, the weights and the seed (deterministic runs). A request that names a
        `weights_version` newer than this worker holds raises StaleWeightsError; one that names an older version
        is served with the weights held (a sync landed after it was sent), and `token_versions` (B, R) says which
        version sampled each token. With partial_rollout_token (self.store) the request is sampled by the version
        it names, and from token `switch_at` of each generate call on by the next one (waiting for its sync).
        `wave`: (domain, wave, requests in it), when the request is one of a wave its scheduler sent at once (a
        batch starts without waiting out the gather window once every domain has a whole wave in)."""
        if weights_version is not None and weights_version > self.weights_version:
            raise StaleWeightsError(
                f"{self.name}[{self.rank}] holds weights version {self.weights_version}, the request needs "
                f"{weights_version}"
            )
        rule = None
        if self.store is not None:
            rule = (self.weights_version if weights_version is None else weights_version, switch_at)
        key = (args, num_return_sequences, rule) if seed is None else (args, num_return_sequences, request_id)
        request = Request(request_id, prompts, num_return_sequences, key=key, payload=(args, seed, rule), wave=wave)
        return self.batcher.submit(request).result()

    def abort(self, request_ids: list[str]) -> int:
        """Abort requests still pending or running here; their callers get None. Returns how many were live."""
        return self.batcher.abort(request_ids)

    def generate(self, batch: Batch, args: GeneratingArgs, num_return_sequences: int) -> Batch:
        """Responses for every prompt in `batch`, `num_return_sequences` each, rows grouped by prompt."""
        batch.require("prompt_ids", "prompt_mask", where="actor_infer.generate")
        prompts = [row[m > 0].tolist() for row, m in zip(batch["prompt_ids"], batch["prompt_mask"], strict=True)]
        out = self.generate_request(f"batch-{next(self._ids)}", prompts, args, num_return_sequences)
        repeat = torch.arange(len(batch)).repeat_interleave(num_return_sequences)
        return batch.select(repeat).update(
            {"response_ids": out["response_ids"], "response_mask": out["response_mask"]},
            finish_reason=out["finish_reason"],
        )

    def batch_sizes(self) -> list[int]:
        """Sequences in each batch run so far (to see how requests were joined)."""
        return list(self.batcher.sizes)

    def batch_stats(self) -> list[dict[str, int]]:
        """Per batch run so far: ``{"sequences", "tokens", "decode_steps"}`` (decode steps -1 where the strategy
        does not count them)."""
        return list(self.stats)

    def offload(self, discard_weights: bool = False) -> None:
        """Free accelerator memory between rollouts (vLLM's sleep mode, or the hf weights to CPU memory); the next
        request wakes the engine. `discard_weights`: a weight sync comes before the next generation, so vLLM may
        drop its weights instead of copying them to host memory."""
        self.batcher.call(lambda: self.strategy.sleep(discard_weights))

    @property
    def weights_version(self) -> int:
        """The weights this worker holds: 0 those it started with, else the version the last sync brought."""
        return self.swap.version if self.store is None else self.store.newest

    def update_weights(
        self,
        state_dict: dict[str, torch.Tensor] | PackedWeights,
        version: int | None = None,
        keep_from: int | None = None,
    ) -> None:
        """Load actor_train's weights (a state dict, or packed: workers/inference/weight_wire.py): between two
        tokens of the batch generating now (its rows go on with them: a partial rollout), or at once when none is;
        returns when they are loaded (workers/inference/weight_swap.py). With partial_rollout_token they are kept as
        `version` for the tokens that name it, and versions below `keep_from` (no rollout in flight names them) are
        dropped (workers/inference/version_store.py)."""
        state_dict = unpack(state_dict)
        if self.store is not None:
            self.store.add(state_dict, self.store.newest + 1 if version is None else version, keep_from)
            return
        self.swap.offer(state_dict, version)

    # ---- weights actor_train sends itself (strategy_config.weight_transport: vLLM's weight-transfer API) ----
    # actor_train's transfer engine calls these four in turn (workers/strategies/vllm_transfer.py); the weights
    # travel beside Ray (a process group, or CUDA IPC handles), never through it.

    def transfer_init(self, init_info: dict[str, Any]) -> None:
        """Join actor_train's transfer group (once, before the first sync; a rendezvous both sides enter)."""
        self.batcher.call(lambda: self.strategy.transfer_call("init_weight_transfer_engine", init_info))

    def transfer_start(self, version: int) -> None:
        """Begin the sync that brings `version`: offered like any sync (between two engine steps of a generating
        batch, or at once), its holder begins vLLM's update and then runs the next calls until `transfer_finish`."""
        if self.transfer is not None:
            raise RuntimeError(f"{self.name}[{self.rank}]: a weight transfer is already under way")
        update, errors = HeldUpdate(), []

        def offer() -> None:
            try:
                self.swap.offer(update, version)
            except BaseException as err:
                errors.append(err)
            # returned without holding it: a newer sync replaced it (WeightSwap keeps the newest offer)
            update.refuse(RuntimeError(f"{self.name}[{self.rank}]: the sync of version {version} was replaced"))

        thread = threading.Thread(target=offer, name=f"transfer-v{version}", daemon=True)
        thread.start()
        self.transfer = (update, thread, errors)
        try:
            update.wait_begun()
        except BaseException:
            self.transfer = None
            thread.join()
            raise

    def transfer_update(self, update_info: dict[str, Any]) -> None:
        """Receive one part of the weights (vLLM's `update_weights`), on the thread that holds the update."""
        if self.transfer is None:
            raise RuntimeError(f"{self.name}[{self.rank}]: transfer_update without transfer_start")
        update = self.transfer[0]
        update.run(lambda: self.strategy.transfer_call("update_weights", update_info))

    def transfer_finish(self) -> None:
        """End the update (vLLM's layerwise reload finishes); generation goes on."""
        if self.transfer is None:
            raise RuntimeError(f"{self.name}[{self.rank}]: transfer_finish without transfer_start")
        (update, thread, errors), self.transfer = self.transfer, None
        update.close()
        thread.join()
        if errors:
            raise errors[0]

    def _load(self, state: Any) -> None:
        """A sync's weights: a state dict, or an update actor_train drives (HeldUpdate)."""
        if isinstance(state, HeldUpdate):
            self.strategy.hold_transfer(state)
        else:
            self.strategy.load_state_dict(state)

    def rng_state(self) -> dict[str, Any]:
        """The global RNG states (what unseeded sampling draws from), for checkpoints."""
        return rng_states()

    def load_rng_state(self, state: dict[str, Any]) -> None:
        load_rng_states(state)

    def _run_batch(self, requests: list[Request], is_aborted) -> list[dict[str, Any]]:
        results = self._generate_batch(requests, is_aborted)
        release_free_memory()  # the batch's padded inputs, KV cache and logits are freed by now
        return results

    def _generate_batch(self, requests: list[Request], is_aborted) -> list[dict[str, Any]]:
        args, seed, rule = requests[0].payload  # a seeded request is alone in its batch (its key holds its id)
        n = requests[0].num_return_sequences
        owner = [i for i, r in enumerate(requests) for _ in r.prompts]
        prompt_ids, prompt_mask = collate_prompts([p for r in requests for p in r.prompts], self.pad_id)
        out = self.strategy.generate(
            prompt_ids,
            prompt_mask,
            args,
            n,
            is_aborted=lambda p: is_aborted(owner[p]),
            seed=seed,
            with_log_probs=self.with_log_probs,
            version_now=self.swap.apply if rule is None else self.store.rule(*rule),
        )
        self.stats.append(
            {
                "sequences": int(out["response_ids"].shape[0]),
                "tokens": int(out["response_mask"].sum()),
                "decode_steps": int(out.get("decode_steps", -1)),
            }
        )
        results, row = [], 0
        for request in requests:
            rows = slice(row, row + request.sequences)
            row += request.sequences
            results.append(
                {
                    # clone: a slice would carry the whole batch's storage through Ray's serialiser
                    "response_ids": out["response_ids"][rows].clone(),
                    "response_mask": out["response_mask"][rows].clone(),
                    "finish_reason": out["finish_reason"][rows],
                    **{key: out[key][rows].clone() for key in ("infer_log_probs", "token_versions") if key in out},
                }
            )
        return results

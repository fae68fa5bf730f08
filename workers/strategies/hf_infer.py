"""Inference with transformers: batched sampling for actor_infer, frozen log-probs for the reference."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList

from roll_core.config import ClusterConfig, GeneratingArgs
from roll_core.config.clusters import LoraArgs
from roll_core.models.microbatches import log_probs_in_micro_batches
from roll_core.models.sampling import SamplingDistribution
from workers.devices import worker_device
from workers.strategies.loading import eos_token_ids, load_causal_lm, load_tokenizer
from workers.strategies.lora import load_adapter_state, with_lora


def truncate_at_eos(responses: torch.Tensor, eos_ids: list[int], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """Cut each row after its first end-of-sequence token.

    Returns the responses with everything after that token set to `pad_id`, the (B, R) float mask of kept tokens
    (the eos token included), and each row's finish reason: 'stop' or 'length' (no eos within the budget).
    """
    is_eos = torch.isin(responses, torch.tensor(eos_ids, device=responses.device))
    seen_before = (is_eos.long().cumsum(-1) - is_eos.long()) > 0
    mask = (~seen_before).float()
    cleaned = torch.where(seen_before, torch.full_like(responses, pad_id), responses)
    finish = ["stop" if bool(row.any()) else "length" for row in is_eos]
    return cleaned, mask, finish


@torch.no_grad()
def generate_sharing_prefill(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    generation_config: GenerationConfig,
    **kwargs,
):
    """`model.generate` with `generation_config.num_return_sequences` = n samples per (left-padded) prompt, each
    prompt prefilled once instead of n times: one forward over the prompts but their last token fills the KV
    cache, the cache is repeated n times per prompt, and generation goes on from the prompts' last token for the
    n copies, as generate itself would after its own prefill. Same rows in the same order, from the same
    distribution; with the same seed the same tokens (generate draws no random numbers in its prefill; checked in
    tests/test_sampling.py). Falls back to plain generate for n = 1, one-token prompts, or a cache that cannot be
    repeated."""
    n = generation_config.num_return_sequences or 1
    if n == 1 or input_ids.shape[1] < 2:
        return model.generate(
            input_ids=input_ids, attention_mask=attention_mask, generation_config=generation_config, **kwargs
        )
    head = attention_mask[:, :-1]
    # the positions generate gives left-padded prompts: counted over real tokens, pads at 1
    positions = head.long().cumsum(-1) - 1
    positions.masked_fill_(head == 0, 1)
    cache = model(
        input_ids=input_ids[:, :-1], attention_mask=head, position_ids=positions, use_cache=True
    ).past_key_values
    if not hasattr(cache, "batch_repeat_interleave"):
        return model.generate(
            input_ids=input_ids, attention_mask=attention_mask, generation_config=generation_config, **kwargs
        )
    cache.batch_repeat_interleave(n)
    single = copy.deepcopy(generation_config)
    single.num_return_sequences = 1
    return model.generate(
        input_ids=input_ids.repeat_interleave(n, dim=0),
        attention_mask=attention_mask.repeat_interleave(n, dim=0),
        past_key_values=cache,
        generation_config=single,
        **kwargs,
    )


def sampled_log_probs(scores: tuple[torch.Tensor, ...], tokens: torch.Tensor) -> torch.Tensor:
    """(B, T) log-probabilities of the generated `tokens` (B, T) under the distribution they were drawn from:
    `scores` are generate's processed logits per step (temperature, top-p and top-k applied), one (B, V) each."""
    steps = [
        torch.log_softmax(step.float(), dim=-1).gather(-1, tokens[:, t : t + 1]).squeeze(-1)
        for t, step in enumerate(scores)
    ]
    out = torch.stack(steps, dim=1) if steps else tokens.new_zeros(tokens.shape, dtype=torch.float32)
    return torch.nan_to_num(out, neginf=0.0)  # rows that stopped early are padded with tokens of no mass


class _AbortedRows(StoppingCriteria):
    """Stops the rows whose prompt was aborted: row r of a chunk belongs to prompt `first + r // n`."""

    def __init__(self, is_aborted: Callable[[int], bool], first: int, n: int) -> None:
        self.is_aborted, self.first, self.n = is_aborted, first, n

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        rows = input_ids.shape[0]
        return torch.tensor(
            [self.is_aborted(self.first + r // self.n) for r in range(rows)], dtype=torch.bool, device=input_ids.device
        )


class _StopStrings(StoppingCriteria):
    """Ends a row at the first step its generated text ends with one of `stops` (GeneratingArgs.stop) and records
    its response length then (`ends`). Only the last tokens are decoded: enough of them for the longest stop,
    every token being at least one character."""

    def __init__(self, tokenizer, stops: tuple[str, ...], prompt_length: int) -> None:
        self.tokenizer, self.stops, self.prompt_length = tokenizer, stops, prompt_length
        self.window = max(len(stop) for stop in stops) + 2
        self.ends: dict[int, int] = {}

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        length = input_ids.shape[1] - self.prompt_length
        for row in range(input_ids.shape[0]):
            if row not in self.ends:
                tail = self.tokenizer.decode(input_ids[row, -min(self.window, length) :].tolist())
                if any(tail.endswith(stop) for stop in self.stops):
                    self.ends[row] = length
        return torch.tensor(
            [row in self.ends for row in range(input_ids.shape[0])], dtype=torch.bool, device=input_ids.device
        )


def cut_at_stops(
    responses: torch.Tensor, mask: torch.Tensor, finish: list[str], ends: list[int | None], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """Rows that met a stop string end there (`ends`: a row's response length at its stop, None where it met
    none): the tokens after it are padding, out of the mask, and the row's finish reason is `stop`."""
    positions = torch.arange(responses.shape[1]).unsqueeze(0)
    limit = torch.tensor([responses.shape[1] if end is None else end for end in ends]).unsqueeze(1)
    after = positions >= limit
    responses = torch.where(after, torch.full_like(responses, pad_id), responses)
    finish = [reason if end is None else "stop" for reason, end in zip(finish, ends, strict=True)]
    return responses, mask * (~after).float(), finish


class _VersionTrace(StoppingCriteria):
    """Which weights sampled each token of a generate call: `version_now(t)` is asked before token t (the first
    before the call's first token, then after every token), and may load other weights then (partial rollouts:
    the worker swaps weights between two tokens); `versions[t]` is the version that sampled token t. Never stops
    a row."""

    def __init__(self, version_now: Callable[[int], int]) -> None:
        self.version_now = version_now
        self.versions = [version_now(0)]

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        self.versions.append(self.version_now(len(self.versions)))
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def version_rows(versions: list[int], rows: int, width: int) -> torch.Tensor:
    """(rows, width) long: token t of every row sampled by `versions[t]`; columns past the last token repeat the
    last version (padding, under no mask)."""
    steps = versions[:width] + [versions[min(width, len(versions)) - 1]] * max(0, width - len(versions))
    return torch.tensor(steps, dtype=torch.long).expand(rows, width).clone()


class HFInferStrategy:
    """A transformers model on this worker's device (workers/devices.py): prompts go there, results come back
    on the CPU."""

    def __init__(
        self,
        config: ClusterConfig,
        device: torch.device | str | None = None,
        name: str = "hf_infer",
        lora: LoraArgs | None = None,
    ) -> None:
        """`lora`: the trained policy's adapters (actor_train.lora): the model gets the same adapters, and a weight
        sync brings the adapters alone."""
        self.config = config
        self.device = torch.device(device) if device is not None else worker_device(config, name)
        self.tokenizer = load_tokenizer(config.model_args)
        model = load_causal_lm(config.model_args, config.use_sequence_packing)
        self.lora = lora
        if lora is not None:
            model = with_lora(model, lora)
        self.model = model.eval().to(self.device)
        self.eos_ids = eos_token_ids(self.model, self.tokenizer)
        self.pad_id = self.tokenizer.pad_token_id
        self.asleep = False

    def sleep(self, discard_weights: bool = False) -> None:
        """The weights to CPU memory until the next call that needs them (a no-op on the CPU); they are kept
        whatever `discard_weights` says (the next sync loads them in place)."""
        if self.device.type != "cpu" and not self.asleep:
            self.model.to("cpu")
            torch.cuda.empty_cache()
            self.asleep = True

    def wake_up(self) -> None:
        if self.asleep:
            self.model.to(self.device)
            self.asleep = False

    def generation_config(self, args: GeneratingArgs, num_return_sequences: int) -> GenerationConfig:
        # top_k 0 is passed as 0, never None: generate fills a None from its defaults (top_k 50), which would
        # silently sample from a truncated distribution that the trainer's log-probs do not match.
        sampling = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k}
        return GenerationConfig(
            max_new_tokens=args.max_new_tokens,
            do_sample=args.do_sample,
            num_return_sequences=num_return_sequences,
            eos_token_id=self.eos_ids,
            pad_token_id=self.pad_id,
            **(sampling if args.do_sample else {}),
        )

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        args: GeneratingArgs,
        num_return_sequences: int,
        is_aborted: Callable[[int], bool] | None = None,
        seed: int | None = None,
        with_log_probs: bool = False,
        version_now: Callable[[int], int] | None = None,
    ) -> dict[str, object]:
        """Sample `num_return_sequences` responses per prompt; rows come out grouped by prompt (i * n + j).

        `is_aborted(prompt_index)`, checked after every token, stops that prompt's rows early (their output is
        then unfinished and the caller discards it). `seed`, when given, seeds the sampling first, so the same
        prompts give the same responses (the caller runs one seeded request at a time). `with_log_probs` adds
        `infer_log_probs` (B, R): each token's log-probability under the sampling distribution. `version_now(t)`,
        asked before each call's first token and after every token with the index t of the token to come, names
        the weights version that samples it and may load other weights in between (the worker's partial rollouts); the result then has
        `token_versions` (B, R): the version that sampled each token."""
        self.wake_up()
        gen_cfg = self.generation_config(args, num_return_sequences)
        if seed is not None:
            torch.manual_seed(seed)
        prompts_per_call = max(1, self.config.infer_batch_size // num_return_sequences)
        outs, log_probs, ends, versions = [], [], [], []
        for start in range(0, prompt_ids.shape[0], prompts_per_call):
            ids = prompt_ids[start : start + prompts_per_call].to(self.device)
            mask = prompt_mask[start : start + prompts_per_call].to(self.device)
            stopping = StoppingCriteriaList()
            if is_aborted is not None:
                stopping.append(_AbortedRows(is_aborted, start, num_return_sequences))
            stops = _StopStrings(self.tokenizer, args.stop, ids.shape[1]) if args.stop else None
            if stops is not None:
                stopping.append(stops)
            trace = _VersionTrace(version_now) if version_now is not None else None
            if trace is not None:
                stopping.append(trace)
            out = generate_sharing_prefill(
                self.model,
                ids,
                mask,
                gen_cfg,
                stopping_criteria=stopping or None,
                return_dict_in_generate=True,
                output_scores=with_log_probs,
            )
            responses = out.sequences[:, ids.shape[1] :]
            outs.append(responses.cpu())
            if trace is not None:
                versions.append(trace.versions)
            ends += [None if stops is None else stops.ends.get(row) for row in range(responses.shape[0])]
            if with_log_probs:
                log_probs.append(sampled_log_probs(out.scores, responses).cpu())
        width = max(o.shape[1] for o in outs)
        responses = torch.cat(
            [torch.nn.functional.pad(o, (0, width - o.shape[1]), value=self.pad_id) for o in outs]
        )
        responses, response_mask, finish = truncate_at_eos(responses, self.eos_ids, self.pad_id)
        if args.stop:
            responses, response_mask, finish = cut_at_stops(responses, response_mask, finish, ends, self.pad_id)
        result = {"response_ids": responses, "response_mask": response_mask, "finish_reason": finish}
        # Forward passes of the decode loop, over the calls (each runs to its longest row): the work done, as
        # benchmarks compare it with another trainer's.
        result["decode_steps"] = sum(o.shape[1] for o in outs)
        if version_now is not None:
            result["token_versions"] = torch.cat(
                [version_rows(v, o.shape[0], width) for v, o in zip(versions, outs, strict=True)]
            )
        if with_log_probs:
            padded = [torch.nn.functional.pad(lp, (0, width - lp.shape[1])) for lp in log_probs]
            result["infer_log_probs"] = torch.cat(padded) * response_mask
        return result

    def log_probs(self, batch, sampling: SamplingDistribution) -> torch.Tensor:
        self.wake_up()
        c = self.config
        return log_probs_in_micro_batches(
            self.model, batch, c.infer_batch_size, sampling, c.infer_max_tokens_per_microbatch, c.use_sequence_packing,
            c.infer_sequence_length_round,
        )

    def load_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        if self.lora is not None:  # the adapters alone: the base weights never change
            load_adapter_state(self.model, state_dict)
            return
        self.model.load_state_dict(state_dict)  # copies into the parameters wherever they are

"""Item 2 of `make bench`: actor_infer's generation against a bare `model.generate` loop on the same model and batch.

    python -m benchmarks.bench_generate [--repeats 3] [--calls 3] [--quick]

The batch is one RL step's rollout of bench_trl's config: its first `rollout_batch_size` prompts (chat template
applied as the pipeline does), `num_return_sequences_in_group` responses each, its `max_new_tokens` and sampling
arguments. Three ways generate it, each `--calls` times per repetition after one untimed warm-up call:

* bare: `AutoModelForCausalLM.from_pretrained` and `model.generate` on the left-padded batch, in this process;
* worker: `ActorInferWorker` built in this process, called with `generate_request` (its request batcher, its
  strategy, the truncation at end-of-sequence, the per-request split of the results);
* ray: the same worker as a Ray actor started the way `RLVRPipeline` starts it (its threads and env), called from
  here (adds Ray's call and the transfer of the results).

Every call samples from the same seed (the worker's `seed` argument; `torch.manual_seed` for the bare loop), so all
three generate the same tokens and the figures differ only by overhead; the token counts are checked equal.
Throughput is generated tokens (up to and including end-of-sequence) per second. All use the worker's
`torch_threads`. Afterwards one worker call runs under cProfile, to show where its time goes.

Two more ways send the batch as the pipeline sends it, unseeded (a seeded request runs as a batch of its own):

* per-prompt: one Ray call per prompt for its group, all sent at once, as a scheduler's step does; the worker's
  request batcher joins whatever arrived within its gather window (`batches per call` says how many batches
  it ran: more than one means generation ran that many times one after the other);
* one request: the whole batch in one Ray call.

Unseeded calls generate different tokens, so these compare tokens per second, with each way's tokens and decode
steps (the decode loop's forward passes) per call beside them.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.summary import Comparison, Section, in_turn, markdown_table, print_section, turn_order

SEED = 1234


def setup_batch(tmp: Path, quick: bool):
    """bench_trl's resolved config and its first rollout_batch_size prompts, as token lists."""
    from benchmarks.bench_trl import load, math_rows, write_config
    from roll_pipeline.api import encode_prompt, load_tokenizer

    resolved = load(write_config(tmp, quick), 1, tmp / "run")
    cfg = resolved.config
    tokenizer = load_tokenizer(cfg.actor_infer.model_args)
    rows = math_rows(resolved)[: cfg.rollout_batch_size]
    return cfg, tokenizer, [encode_prompt(tokenizer, row, cfg.data) for row in rows]


class Bare:
    """The plain loop: one `model.generate` on the whole batch, tokens counted up to the first end-of-sequence."""

    def __init__(self, cfg, tokenizer, prompts: list[list[int]]) -> None:
        from transformers import AutoModelForCausalLM, GenerationConfig

        from roll_pipeline.api import collate_prompts

        self.model = AutoModelForCausalLM.from_pretrained(cfg.pretrain, dtype=torch.float32).eval()
        args = cfg.actor_infer.generating_args
        self.eos = [tokenizer.eos_token_id]
        self.gen = GenerationConfig(
            do_sample=True,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,  # 0: off, as the worker passes it (None would let generate fill in 50)
            max_new_tokens=args.max_new_tokens,
            num_return_sequences=cfg.num_return_sequences_in_group,
            eos_token_id=self.eos,
            pad_token_id=tokenizer.pad_token_id,
        )
        self.ids, self.mask = collate_prompts(prompts, tokenizer.pad_token_id)

    @torch.inference_mode()
    def __call__(self) -> int:
        torch.manual_seed(SEED)
        out = self.model.generate(input_ids=self.ids, attention_mask=self.mask, generation_config=self.gen)
        responses = out[:, self.ids.shape[1] :]
        is_eos = torch.isin(responses, torch.tensor(self.eos))
        after_eos = (is_eos.long().cumsum(-1) - is_eos.long()) > 0
        return int((~after_eos).sum())


def throughput(call, calls: int) -> tuple[float, int]:
    """(tokens per second, tokens per call) over `calls` calls of `call() -> tokens`."""
    start = time.perf_counter()
    tokens = [call() for _ in range(calls)]
    elapsed = time.perf_counter() - start
    if len(set(tokens)) != 1:
        raise RuntimeError(f"the same seed gave different token counts: {tokens}")
    return sum(tokens) / elapsed, tokens[0]


def sampled_rate(call, calls: int) -> tuple[float, int]:
    """(tokens per second, median tokens per call) over `calls` calls of `call() -> tokens`, tokens free to vary."""
    start = time.perf_counter()
    tokens = [call() for _ in range(calls)]
    elapsed = time.perf_counter() - start
    return sum(tokens) / elapsed, int(statistics.median(tokens))


def profile_table(profiler: cProfile.Profile, limit: int = 14) -> str:
    """Markdown: the functions with the most cumulative time in what `profiler` recorded."""
    stats = pstats.Stats(profiler, stream=io.StringIO())
    total = max(v[3] for v in stats.stats.values())  # cumulative time of the outermost frame
    rows = []
    for (path, line, name), (_, calls, tottime, cumtime, _) in stats.stats.items():
        short = "/".join(Path(path).parts[-2:]) if path != "~" else ""
        cells = [
            f"`{short}:{line} {name}`",
            str(calls),
            f"{tottime:.3f}",
            f"{cumtime:.3f}",
            f"{cumtime / total:.0%}",
        ]
        rows.append((cumtime, cells))
    rows.sort(key=lambda r: -r[0])
    return markdown_table(
        [r[1] for r in rows[:limit]], ["function", "calls", "own s", "cumulative s", "share"]
    )


def profile_top(call, limit: int = 14) -> str:
    """Markdown: the functions with the most cumulative time in one `call()` (this thread only)."""
    profiler = cProfile.Profile()
    profiler.enable()
    call()
    profiler.disable()
    return profile_table(profiler, limit)


def profile_worker_call(worker, call) -> str:
    """Markdown: one `call()` of the in-process worker, split into the time its batch function ran (profiled in
    the request batcher's thread, where generation happens) and the time around it (queueing, the gather window,
    the results' hand-over)."""
    profiler = cProfile.Profile()
    inner = worker.batcher.run_batch
    batch_s: list[float] = []

    def profiled(requests, is_aborted):
        start = time.perf_counter()
        profiler.enable()
        try:
            return inner(requests, is_aborted)
        finally:
            profiler.disable()
            batch_s.append(time.perf_counter() - start)

    worker.batcher.run_batch = profiled
    try:
        start = time.perf_counter()
        call()
        total = time.perf_counter() - start
    finally:
        worker.batcher.run_batch = inner
    return (
        f"One in-process `generate_request` call under cProfile took {total:.3f} s: {batch_s[0]:.3f} s in the "
        f"batch function (`_run_batch`: collation, `strategy.generate`, the per-request split), "
        f"{total - batch_s[0]:.3f} s around it in the request batcher (queueing and its gather window, "
        f"gather_s={worker.batcher.gather_s} s up to max_gather_s={worker.batcher.max_gather_s} s). The batch "
        "function's top functions by cumulative time (`share` is of the batch function; cProfile slows "
        "Python-heavy code):\n\n" + profile_table(profiler)
    )


def measure(repeats: int = 5, calls: int = 10, quick: bool = False, log=print) -> Section:
    import ray

    from roll_pipeline.api import ActorInferWorker, Cluster, worker_env

    start_wall = time.perf_counter()
    results: dict[str, list[float]] = {"bare": [], "worker": [], "ray": []}
    tokens: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="roll-bench-generate-") as tmp:
        cfg, tokenizer, prompts = setup_batch(Path(tmp), quick)
        section_cfg = cfg.actor_infer
        args, n = section_cfg.generating_args, cfg.num_return_sequences_in_group
        worker = ActorInferWorker(name="actor_infer", rank=0, world_size=1, pipeline_config=cfg)
        # The worker set the thread count for this whole process: the bare loop runs with the same.
        torch.set_num_threads(section_cfg.torch_threads)
        bare = Bare(cfg, tokenizer, prompts)
        ray.init(
            address="local",
            num_cpus=max(2, int(section_cfg.num_cpus_per_worker)),
            include_dashboard=False,
            log_to_driver=False,
        )
        cluster = None
        try:
            cluster = Cluster(
                "actor_infer",
                ActorInferWorker,
                world_size=1,
                num_cpus=section_cfg.num_cpus_per_worker,
                num_gpus=0,
                worker_kwargs={"pipeline_config": cfg},
                env_vars=worker_env(section_cfg.torch_threads),
                max_concurrency=ActorInferWorker.MAX_CONCURRENCY,
            )
            remote = cluster.workers[0]
            ids = iter(range(10**9))

            def in_process() -> int:
                out = worker.generate_request(f"bench-{next(ids)}", prompts, args, n, seed=SEED)
                return int(out["response_mask"].sum())

            def via_ray() -> int:
                out = ray.get(
                    remote.generate_request.remote(f"bench-{next(ids)}", prompts, args, n, seed=SEED)
                )
                return int(out["response_mask"].sum())

            def per_prompt() -> int:
                refs = [
                    remote.generate_request.remote(f"bench-{next(ids)}", [p], args, n) for p in prompts
                ]
                return sum(int(out["response_mask"].sum()) for out in ray.get(refs))

            def one_request() -> int:
                out = ray.get(remote.generate_request.remote(f"bench-{next(ids)}", prompts, args, n))
                return int(out["response_mask"].sum())

            ways = {"bare": bare, "worker": in_process, "ray": via_ray}
            for name, call in ways.items():
                tokens[name] = call()  # warm-up, untimed
            for r in range(repeats):
                (bare_rate, bare_tokens), ours = in_turn(
                    r,
                    lambda: throughput(bare, calls),
                    lambda: (throughput(in_process, calls), throughput(via_ray, calls)),
                )
                results["bare"].append(bare_rate)
                results["worker"].append(ours[0][0])
                results["ray"].append(ours[1][0])
                tokens |= {"bare": bare_tokens, "worker": ours[0][1], "ray": ours[1][1]}
                log(
                    f"  [generate] repetition {r + 1}: bare {bare_rate:.0f} tok/s, worker {ours[0][0]:.0f} tok/s, "
                    f"ray {ours[1][0]:.0f} tok/s"
                )
            pattern = {"per_prompt": [], "one_request": [], "bare": []}
            per_call: dict[str, list[dict[str, float]]] = {"per_prompt": [], "one_request": []}
            for r in range(repeats):
                for name in turn_order(r, ["per_prompt", "one_request", "bare"]):
                    if name == "bare":
                        pattern["bare"].append(throughput(bare, calls)[0])
                        continue
                    before = len(ray.get(remote.batch_stats.remote()))
                    rate, _ = sampled_rate(per_prompt if name == "per_prompt" else one_request, calls)
                    ran = ray.get(remote.batch_stats.remote())[before:]
                    pattern[name].append(rate)
                    per_call[name].append(
                        {k: sum(b[k] for b in ran) / calls for k in ("tokens", "decode_steps")}
                        | {"batches": len(ran) / calls}
                    )
                log(
                    f"  [generate] pattern repetition {r + 1}: per-prompt {pattern['per_prompt'][-1]:.0f} tok/s, "
                    f"one request {pattern['one_request'][-1]:.0f} tok/s, bare {pattern['bare'][-1]:.0f} tok/s"
                )
            profile = profile_worker_call(worker, in_process)
        finally:
            if cluster is not None:
                cluster.shutdown()
            ray.shutdown()
    same = len(set(tokens.values())) == 1
    bare_s = tuple(results["bare"])
    section = Section(
        title="2. Generation overhead",
        setup=(
            f"One rollout batch: {cfg.rollout_batch_size} prompts x {n} responses, max {args.max_new_tokens} new "
            f"tokens, temperature {args.temperature}, {section_cfg.torch_threads} torch threads, model "
            f"{Path(cfg.pretrain).name}; {calls} timed calls per figure after an untimed warm-up. Every call samples "
            f"from the same seed, so each way generates the same {tokens.get('bare')} tokens"
            f"{'' if same else ' (NOT the case in this run: ' + str(tokens) + ')'}; the ratio is pure overhead. "
            "`bare`: `model.generate` in this process. `ActorInferWorker`: the worker class in this process "
            "(`generate_request`). `via Ray`: the same worker as a Ray actor started as the pipeline starts it, "
            "called from this process. See benchmarks/bench_generate.py."
        ),
        comparisons=[
            Comparison(
                "actor_infer throughput",
                "tokens/s",
                "ActorInferWorker",
                tuple(results["worker"]),
                "bare generate",
                bare_s,
                higher_is_better=True,
            ),
            Comparison(
                "actor_infer throughput via Ray",
                "tokens/s",
                "ActorInferWorker via Ray",
                tuple(results["ray"]),
                "bare generate",
                bare_s,
                higher_is_better=True,
            ),
        ],
    )
    section.comparisons += [
        Comparison(
            "actor_infer throughput, per-prompt requests via Ray (the scheduler's pattern)",
            "tokens/s",
            "per-prompt requests",
            tuple(pattern["per_prompt"]),
            "bare generate",
            tuple(pattern["bare"]),
            higher_is_better=True,
        ),
        Comparison(
            "actor_infer throughput, one request per batch via Ray",
            "tokens/s",
            "one request",
            tuple(pattern["one_request"]),
            "bare generate",
            tuple(pattern["bare"]),
            higher_is_better=True,
        ),
    ]
    rows = [
        [
            label,
            *(
                f"{statistics.median(c[k] for c in per_call[name]):.2f}"
                for k in ("batches", "tokens", "decode_steps")
            ),
        ]
        for name, label in (("per_prompt", "per-prompt requests"), ("one_request", "one request"))
    ]
    section.details.append(
        f"Unseeded calls in the pipeline's pattern ({calls} calls per figure and repetition; bare: the seeded bare "
        f"loop, {tokens.get('bare')} tokens a call). Per call, median over repetitions:\n\n"
        + markdown_table(rows, ["way", "generation batches", "tokens", "decode steps"])
    )
    section.details.append(profile)
    section.wall_s = time.perf_counter() - start_wall
    return section


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="bench_trl's tiny batch, for a smoke run")
    args = parser.parse_args(argv)
    section = measure(args.repeats, args.calls, args.quick)
    print_section(section)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

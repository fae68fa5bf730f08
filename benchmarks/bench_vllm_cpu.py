"""vLLM's CPU build against transformers' generation for one rollout of examples/math_code.yaml, on this machine.

    python -m benchmarks.bench_vllm_cpu [--repeats 5] [--quiet-wait 60]

The rollout is the example's: its domain shares of rollout_batch_size prompts (the first rows of each domain's
training file, chat template applied as the pipeline does), num_return_sequences_in_group responses each, its
actor_infer generating_args (the same sampling on both sides: temperature, top-p, top-k, max_new_tokens). Each side
is actor_infer's strategy as a run builds it (`make_infer_strategy`: `hf_infer`, and `vllm` with its defaults),
both in this process (vLLM's engine runs in processes of its own), with the example's torch_threads. Each repetition
generates the rollout once per side, in alternating order, after one untimed warm-up call each; the figures are
seconds per rollout and generated tokens per second (up to and including end-of-sequence), median and range over
the repetitions, with the machine's load average while each side ran. Not part of `make bench` (not in
BENCHMARKS.md): vLLM's start-up alone takes 40-60 s here.
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import replace
from pathlib import Path

import torch

from benchmarks.harness import machine, wait_for_quiet
from benchmarks.summary import in_turn, spread

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "math_code.yaml"


def rollout_prompts(resolved) -> tuple[list[list[int]], object]:
    """The example's rollout prompts, each domain's share from the first rows of its training file."""
    import roll_pipeline.api as api

    cfg = resolved.config
    tokenizer = api.load_tokenizer(cfg.actor_infer.model_args)
    rows_by_domain: dict[str, list[dict]] = {}
    for path in cfg.data.train_files:
        for row in api.load_rows(path):
            rows_by_domain.setdefault(row["domain"], []).append(row)
    prompts = []
    for domain, share in resolved.domain_shares.items():
        prompts += [api.encode_prompt(tokenizer, row, cfg.data) for row in rows_by_domain[domain][:share]]
    return prompts, tokenizer


def strategy(resolved, engine: str):
    import roll_pipeline.api as api

    cfg = resolved.config
    args = replace(cfg.actor_infer.strategy_args, strategy_name=engine, strategy_config={})
    return api.make_infer_strategy(replace(cfg, actor_infer=replace(cfg.actor_infer, strategy_args=args)))


def timed(engine, ids, mask, args, n) -> tuple[float, int, float]:
    """(seconds, generated tokens, load average after) of one rollout."""
    start = time.perf_counter()
    out = engine.generate(ids, mask, args, n)
    seconds = time.perf_counter() - start
    return seconds, int(out["response_mask"].sum()), os.getloadavg()[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quiet-wait", type=float, default=60.0)
    options = parser.parse_args(argv)

    import roll_pipeline.api as api

    resolved = api.load_run_config(EXAMPLE)
    cfg = resolved.config
    torch.set_num_threads(cfg.actor_infer.torch_threads)
    prompts, tokenizer = rollout_prompts(resolved)
    ids, mask = api.collate_prompts(prompts, tokenizer.pad_token_id)
    args, n = cfg.actor_infer.generating_args, cfg.num_return_sequences_in_group
    print(f"machine: {machine()}")
    print(f"rollout: {len(prompts)} prompts x {n} responses ({dict(resolved.domain_shares)}), max_new_tokens "
          f"{args.max_new_tokens}, temperature {args.temperature}, top_p {args.top_p}, top_k {args.top_k}")
    started = time.perf_counter()
    vllm = strategy(resolved, "vllm")
    print(f"vLLM ({vllm.build} build) started in {time.perf_counter() - started:.0f} s")
    hf = strategy(resolved, "hf_infer")
    for engine in (vllm, hf):  # warm-up: first-call costs (vLLM's graphs, allocator growth) stay out
        engine.generate(ids, mask, args, n)
    print(wait_for_quiet(options.quiet_wait))
    rows = []
    for repetition in range(options.repeats):
        ours, peer = in_turn(repetition, lambda: timed(vllm, ids, mask, args, n), lambda: timed(hf, ids, mask, args, n))
        rows.append((ours, peer))
        print(f"  repetition {repetition + 1} ({'vllm first' if repetition % 2 == 0 else 'hf first'}): "
              f"vllm {ours[0]:.2f} s, {ours[1]} tokens, load {ours[2]:.2f}; "
              f"hf {peer[0]:.2f} s, {peer[1]} tokens, load {peer[2]:.2f}")
    vllm.close()
    for name, side in (("vllm", 0), ("hf", 1)):
        seconds = [r[side][0] for r in rows]
        rate = [r[side][1] / r[side][0] for r in rows]
        print(f"{name}: s/rollout {spread(seconds)}, tokens/s {spread(rate)} (median [min, max], n={len(rows)})")
    speedup = [(r[0][1] / r[0][0]) / (r[1][1] / r[1][0]) for r in rows]
    print(f"vllm tokens/s over hf tokens/s, per repetition: {spread(speedup)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The hf generator under LoRA, two ways to take a sync (issue 45): the adapters on a peft model (what hf_infer does)
against merged weights (the adapters folded into the base after each sync), the same work.

Both sides start from the same model and the same trained adapters (peft's fresh adapters with every B drawn, so
that they change the model). Per round, in alternating order (peft first on even rounds), each side takes one
sync and generates one batch:

- peft: the sync copies the adapters into the wrapped model (`load_adapter_state`); generation runs the base
  layers plus each adapter's two small matmuls.
- merged: the sync unmerges the previous adapters from the base weights, copies the new ones and merges them
  back (peft's `unmerge_adapter` / `merge_adapter`, base += (alpha / rank) * B @ A per layer); generation runs
  plain linear layers. Bytes moved are the same (the adapters); a generator that received merged weights instead
  would move the whole model (`python -m benchmarks.bench_lora` prints both sizes).

It prints the seconds of each sync and of each generation (`--prompts` chat prompts of the arithmetic example,
each repeated `--samples` times in the batch, `--max-new-tokens` each, greedy, so both sides have the same work and
generate the same tokens up to rounding), the machine's load,
then per side the median and range.

    python -m benchmarks.bench_lora_generation [--rounds 6] [--model examples/models/smollm2-135m-instruct]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from benchmarks.harness import machine, wait_for_quiet
from benchmarks.summary import spread

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "examples" / "data" / "arithmetic_val.jsonl"


def drawn_adapters(model, seed: int) -> dict[str, torch.Tensor]:
    from roll_pipeline.api import adapter_state

    state = adapter_state(model)
    generator = torch.Generator().manual_seed(seed)
    return {k: (0.05 * torch.randn(v.shape, generator=generator) if "lora_B" in k else v) for k, v in state.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6, help="rounds, each a sync and a batch per side")
    parser.add_argument("--model", type=Path, default=ROOT / "examples" / "models" / "smollm2-135m-instruct")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--quiet-wait", type=float, default=60.0)
    args = parser.parse_args(argv)
    from peft.tuners.lora import LoraLayer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from roll_pipeline.api import LoraArgs, load_adapter_state, with_lora

    print(machine(), flush=True)
    print(f"{args.model.name}, LoRA rank {args.rank}, {args.prompts} prompts x {args.samples} samples, "
          f"{args.max_new_tokens} new tokens, greedy; torch threads {torch.get_num_threads()}", flush=True)
    lora = LoraArgs(rank=args.rank, alpha=2.0 * args.rank)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    tokenizer.padding_side = "left"
    rows = [json.loads(line) for line in DATA.read_text().splitlines()[: args.prompts]]
    texts = [tokenizer.apply_chat_template(r["messages"], tokenize=False, add_generation_prompt=True) for r in rows]
    batch = tokenizer([t for t in texts for _ in range(args.samples)], return_tensors="pt", padding=True)
    sides = {name: with_lora(AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32), lora).eval()
             for name in ("peft", "merged")}

    def sync(side: str, state: dict[str, torch.Tensor]) -> None:
        model = sides[side]
        if side == "merged":
            if any(m.merged for m in model.modules() if isinstance(m, LoraLayer)):
                model.unmerge_adapter()
            load_adapter_state(model, state)
            model.merge_adapter()
        else:
            load_adapter_state(model, state)

    def generate(side: str) -> torch.Tensor:
        with torch.no_grad():
            return sides[side].generate(
                **batch, do_sample=False, max_new_tokens=args.max_new_tokens, min_new_tokens=args.max_new_tokens,
                pad_token_id=tokenizer.pad_token_id,
            )

    figures: dict[str, dict[str, list[float]]] = {s: {"sync": [], "generate": []} for s in sides}
    for round_ in range(args.rounds):
        state = drawn_adapters(sides["peft"], round_)
        order = ("peft", "merged") if round_ % 2 == 0 else ("merged", "peft")
        outputs = {}
        for side in order:
            quiet = wait_for_quiet(args.quiet_wait)
            load = os.getloadavg()[0]
            start = time.perf_counter()
            sync(side, state)
            synced = time.perf_counter()
            outputs[side] = generate(side)
            done = time.perf_counter()
            figures[side]["sync"].append(synced - start)
            figures[side]["generate"].append(done - synced)
            print(f"round {round_} {side:<6} sync {synced - start:7.3f} s  generate {done - synced:6.2f} s  "
                  f"load {load:.2f} -> {os.getloadavg()[0]:.2f} ({quiet})", flush=True)
        same = torch.equal(outputs["peft"], outputs["merged"])
        print(f"round {round_}: both sides generated the same tokens: {same}", flush=True)
    for side, measured in figures.items():
        sync_s, gen_s = spread(measured["sync"]), spread(measured["generate"])
        print(f"{side}: sync median {sync_s.median:.3f} s (range {sync_s.low:.3f}-{sync_s.high:.3f}); generation "
              f"median {gen_s.median:.2f} s (range {gen_s.low:.2f}-{gen_s.high:.2f}) over {gen_s.n} rounds")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

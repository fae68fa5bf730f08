"""`make bench`: every comparison of issue 11 in one run; prints a table and writes BENCHMARKS.md.

    python -m benchmarks.run_all [--repeats 5] [--only 1 2 3 4 5] [--quick] [--out BENCHMARKS.md]

1. end to end against TRL's GRPOTrainer (benchmarks/bench_trl.py); 2. actor_infer against bare `generate`
(bench_generate.py); 3. actor_train against a bare torch loop (bench_train.py); 4. math_rule and code_sandbox
throughput (bench_rewards.py, with bench_math_rule.py's and bench_code_sandbox.py's functions); 5. step time as
the batch and the number of domains grow (bench_scaling.py). Each repetition measures ours and the reference one
right after the other; ratios are per repetition, reported as median and [min, max]. A comparison that fails
is written as not measured, with its error, and the exit status is 1.

`--quick` shrinks everything (tiny batches, few steps, short windows) to check that the whole thing runs; its
figures say nothing about speed, and the file it writes says so at the top.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import multiprocessing
import sys
import time
import traceback
from pathlib import Path

from benchmarks.harness import machine, wait_for_quiet
from benchmarks.summary import Section, render_markdown, render_table, summary_rows

ROOT = Path(__file__).resolve().parent.parent
ITEMS = {
    1: "1. End to end against TRL",
    2: "2. Generation overhead",
    3: "3. Training overhead",
    4: "4. Rewards",
    5: "5. Scaling",
}


def log(message: str) -> None:
    print(message, flush=True)


def run_item_alone(item: int, args: argparse.Namespace) -> Section:
    """`run_item` in a new interpreter of its own. An item run after others in one process inherits their
    memory: the sandbox's `fork` (it drops to another uid, so no `vfork`) copies the page tables of everything
    the earlier items left, and code_sandbox ran at 10.7 executions/s after items 1-3 against 39.3 alone."""
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
        return pool.submit(run_item, item, args, log).result()


def run_item(item: int, args: argparse.Namespace, log) -> Section:
    if item == 1:
        from benchmarks.bench_trl import measure

        return measure(args.repeats, args.steps, args.quick, log)
    if item == 2:
        from benchmarks.bench_generate import measure

        return measure(args.repeats, args.calls, args.quick, log)
    if item == 3:
        from benchmarks.bench_train import measure

        return measure(args.repeats, args.calls, args.quick, log)
    if item == 4:
        from benchmarks.bench_rewards import measure

        return measure(args.repeats, args.quick, log)
    from benchmarks.bench_scaling import measure

    return measure(args.repeats, args.scaling_steps, args.quick, log)


def slower_lines(sections: list[Section]) -> list[str]:
    """Where ours came out slower than its reference, by the median ratio, pointing at the section that shows
    where the time goes."""
    lines = []
    for section in sections:
        for c in section.comparisons:
            verdict = c.verdict()
            if verdict.endswith("slower"):
                lines.append(
                    f"- {section.title.split(' ', 1)[0]} {c.name}: {c.ours_label} is {verdict} than "
                    f"{c.peer_label} ({c.unit}: median {c.ratio()} ratio); see section {section.title!r}."
                )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="repetitions of every comparison")
    parser.add_argument("--only", type=int, nargs="+", choices=sorted(ITEMS), default=sorted(ITEMS))
    parser.add_argument("--steps", type=int, default=30, help="RL steps of each run against TRL (item 1)")
    parser.add_argument("--scaling-steps", type=int, default=10, help="steps of each scaling point (item 5)")
    parser.add_argument("--calls", type=int, default=10, help="timed calls per figure (items 2 and 3)")
    parser.add_argument(
        "--quick", action="store_true", help="tiny settings: checks that it runs, measures nothing"
    )
    parser.add_argument("--out", default=str(ROOT / "BENCHMARKS.md"))
    parser.add_argument(
        "--quiet-wait", type=float, default=60.0, help="seconds to wait for a quiet machine before each item"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.scaling_steps, args.calls = (
            min(args.steps, 4),
            min(args.scaling_steps, 4),
            min(args.calls, 2),
        )
    command = "python -m benchmarks.run_all " + " ".join(argv if argv is not None else sys.argv[1:])

    started = time.perf_counter()
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    sections: list[Section] = []
    loads: list[str] = []
    for item in args.only:
        quiet = wait_for_quiet(args.quiet_wait)
        loads.append(f"- {ITEMS[item]}: {quiet}")
        log(f"[bench] {ITEMS[item]} ({quiet}) ...")
        t = time.perf_counter()
        try:
            section = run_item_alone(item, args)
        except Exception:  # one failed comparison is reported, the others still run
            section = Section(
                title=ITEMS[item], error=traceback.format_exc(limit=8), wall_s=time.perf_counter() - t
            )
            log(f"[bench] {ITEMS[item]} failed:\n{section.error}")
        sections.append(section)
        log(f"[bench] {ITEMS[item]}: {section.wall_s:.0f} s")
    wall = time.perf_counter() - started
    preamble = [
        f"Total wall time: {wall / 60:.1f} min, {args.repeats} repetition(s). The machine before each item:",
        "",
        *loads,
    ]
    if args.quick:
        preamble[:0] = [
            "**Smoke run (`--quick`): tiny batches and few steps, to check that every benchmark "
            "runs. These figures say nothing about speed; run `make bench` for real ones.**",
            "",
        ]
    slower = slower_lines(sections)
    if slower:
        preamble += [
            "",
            "Where ours is slower than its reference (the sections below show where the time goes):",
            "",
            *slower,
        ]
    text = render_markdown(
        sections, command=command.strip(), date=date, machine=machine(), preamble="\n".join(preamble)
    )
    Path(args.out).write_text(text)
    print()
    print(render_table(summary_rows(sections)))
    print(f"\nwrote {args.out} ({wall:.0f} s)")
    return 1 if any(s.error for s in sections) else 0


if __name__ == "__main__":
    raise SystemExit(main())

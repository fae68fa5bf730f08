"""Item 4 of `make bench`: reward throughput, with benchmarks/bench_math_rule.py's and bench_code_sandbox.py's own
functions, repeated and paired.

    python -m benchmarks.bench_rewards [--repeats 3] [--quick]

math_rule: verifications per second of the reward worker's process pool (`run_pool`, start-up not counted)
against one process scoring one by one (`run_single`), on bench_math_rule's generated cases.
code_sandbox: samples scored per second by the sandboxed scorer (pre-started sandboxes, as configured) against
the same programs run as bare `python -I -S` subprocesses without isolation, harness or judging
(`scorer_runner` / `bare_runner` / `rate`), for each of bench_code_sandbox's workloads at concurrency 1, 2 and 4.
"""

from __future__ import annotations

import argparse
import os
import time

from benchmarks.summary import (
    Comparison,
    Measure,
    Section,
    in_turn,
    markdown_table,
    render_table,
    summary_rows,
)


def measure_math(repeats: int, cases: int, processes: int, log=print) -> tuple[Comparison, str]:
    from benchmarks.bench_math_rule import make_cases, run_pool, run_single

    data = make_cases(cases)
    expected = [case[3] for case in data]
    pool_rates, single_rates, wrong = [], [], 0
    for r in range(repeats):
        (_, pool_s, pooled), (single_s, single) = in_turn(
            r, lambda: run_pool(data, processes), lambda: run_single(data)
        )
        pool_rates.append(len(data) / pool_s)
        single_rates.append(len(data) / single_s)
        wrong += sum(a != e for a, e in zip(single, expected, strict=True))
        wrong += sum(a != e for a, e in zip(pooled, expected, strict=True))
        log(
            f"  [rewards] repetition {r + 1}: math_rule pool {pool_rates[-1]:.0f}/s, one process {single_rates[-1]:.0f}/s"
        )
    comparison = Comparison(
        f"math_rule, {processes}-process pool vs one process",
        "verifications/s",
        f"RewardWorker pool ({processes} processes)",
        tuple(pool_rates),
        "one process, one by one",
        tuple(single_rates),
        higher_is_better=True,
    )
    note = (
        f"math_rule: {len(data)} generated cases of bench_math_rule (14 answer forms, {sum(expected)} right); "
        f"verdicts that differed from the expected one over all runs: {wrong}."
    )
    return comparison, note


def measure_code(
    repeats: int, seconds: float, concurrency: list[int], workloads: list[str], log=print
) -> tuple[list[Comparison], list[Measure]]:
    """Samples per second of the sandboxed scorer (as configured by default: reused zygote sandboxes) against bare
    subprocesses, and the CPU milliseconds each side spent per sample (this process and its ended children: the
    sandboxes, bubblewrap, the programs; the scorer's sandboxes are started and closed inside each window, so
    their starts and every run they reaped count)."""
    from benchmarks.bench_code_sandbox import bare_runner, rate_and_cpu, scorer_rate_and_cpu
    from roll_pipeline.api import CodeSandboxScorer

    out, cpu = [], []
    for conc in concurrency:
        scorer = CodeSandboxScorer(concurrency=conc)
        try:
            figures: dict[str, tuple[list, list]] = {w: ([], []) for w in workloads}
            for r in range(repeats):
                for name in workloads:
                    pooled, bare = in_turn(
                        r,
                        lambda name=name, s=scorer, c=conc: scorer_rate_and_cpu(s, name, c, seconds),
                        lambda name=name, s=scorer, c=conc: rate_and_cpu(
                            bare_runner(s.spec.python, name), c, seconds
                        ),
                    )
                    figures[name][0].append(pooled)
                    figures[name][1].append(bare)
                    log(
                        f"  [rewards] repetition {r + 1}: code {name} at concurrency {conc}: sandbox "
                        f"{pooled[0]:.1f}/s ({pooled[1]:.1f} CPU ms each), bare {bare[0]:.1f}/s "
                        f"({bare[1]:.1f} CPU ms each)"
                    )
        finally:
            scorer.close()
        out += [
            Comparison(
                f"code_sandbox {name}, concurrency {conc}",
                "samples/s",
                "sandboxed scorer",
                tuple(x[0] for x in p),
                "bare subprocess",
                tuple(x[0] for x in b),
                higher_is_better=True,
            )
            for name, (p, b) in figures.items()
        ]
        cpu += [
            Measure(
                f"code_sandbox {name}, concurrency {conc}: CPU per sample",
                "CPU ms",
                {"sandboxed scorer": tuple(x[1] for x in p), "bare subprocess": tuple(x[1] for x in b)},
            )
            for name, (p, b) in figures.items()
        ]
    return out, cpu


def sandbox_cost_table(workloads: list[str], samples: int, log=print) -> str:
    """Markdown: where one sequential sample's milliseconds go, per workload: the bare subprocesses; the scorer's
    harness and judging without isolation; the same isolated (bubblewrap, seccomp, cgroups), each sandbox started
    at request time so that its start-up is on the clock and can be told apart from the run; and the scorer as
    configured by default, its reused sandboxes (``isolation: zygote``) started and closed within the row."""
    from benchmarks.bench_code_sandbox import bare_cost, cost_split, zygote_cost
    from roll_pipeline.api import CodeSandboxScorer

    scorer = CodeSandboxScorer(concurrency=1)
    python = scorer.spec.python
    scorer.close()
    rows = []
    for name in workloads:
        bare = bare_cost(python, name, samples)
        plain = cost_split(name, samples, isolated=False)
        isolated = cost_split(name, samples, isolated=True)
        zygote = zygote_cost(name, samples)
        log(
            f"  [rewards] cost split {name}: bare {bare}, harness {plain}, isolated {isolated}, zygote {zygote}"
        )
        rows.append([name, "bare subprocess", "", "", "", f"{bare['total']:.1f}", f"{bare['cpu']:.1f}"])
        rows.append(
            [
                name,
                "reused sandboxes (zygote, the default)",
                "",
                "",
                "",
                f"{zygote['total']:.1f}",
                f"{zygote['cpu']:.1f}",
            ]
        )
        for label, x in (("harness, no isolation", plain), ("harness, isolated", isolated)):
            rows.append([name, label, *(f"{x[k]:.1f}" for k in ("start", "run", "judge", "total", "cpu"))])
    return (
        f"Where a sandboxed sample's time goes ({samples} samples one after the other per row, milliseconds per "
        "sample; each sandbox started when its run is asked for, so start-up is on the clock; `judge` is the rest "
        "of the scorer's call: parsing the tests, building the jobs, comparing outputs; `CPU` is this process and "
        "its ended children, the programs included). The isolated rows minus the unisolated ones are the price of "
        "isolation per sandbox; the unisolated ones minus bare, the harness's. `isolation: strict` pays the isolated "
        "row's start for every run (ahead of it, in the pool); the default reuses each sandbox, whose zygote forks a "
        "child per run, and its row counts its pool's starts and close:\n\n"
        + markdown_table(rows, ["workload", "way", "start", "run", "judge", "total", "CPU"])
    )


def launch_costs(runs: int) -> dict[str, float]:
    """Median milliseconds to start and finish a program that does nothing, one at a time: as a bare interpreter,
    and inside the sandbox's bubblewrap command line (namespaces, mounts, the uid the sandbox runs as)."""
    import statistics
    import subprocess

    from roll_pipeline.api import CodeSandboxScorer

    scorer = CodeSandboxScorer(concurrency=1)
    spec = scorer.spec
    scorer.close()
    ids = {"user": spec.uid, "group": spec.gid, "extra_groups": []} if spec.uid is not None else {}
    ways = {"bare": ([spec.python, "-I", "-S", "-c", "pass"], {})}
    if spec.bwrap is not None:
        ways["bubblewrap"] = (spec.argv("pass", 0, None), ids)  # the harness's arguments, unused by "pass"
    costs = {}
    for name, (argv, kwargs) in ways.items():
        times = []
        for _ in range(runs):
            start = time.perf_counter()
            subprocess.run(argv, env={}, check=True, capture_output=True, **kwargs)
            times.append((time.perf_counter() - start) * 1000)
        costs[name] = statistics.median(times)
    return costs


def measure(repeats: int = 3, quick: bool = False, log=print) -> Section:
    from benchmarks.bench_code_sandbox import WORKLOADS

    start_wall = time.perf_counter()
    processes = min(4, os.cpu_count() or 1)
    cases = 200 if quick else 1000
    seconds = 0.5 if quick else 3.0
    workloads = ["trivial"] if quick else list(WORKLOADS)
    concurrency = [1, 2, 4]
    math_comparison, math_note = measure_math(repeats, cases, processes, log)
    code, cpu = measure_code(repeats, seconds, concurrency, workloads, log)
    section = Section(
        title="4. Rewards",
        setup=(
            f"{math_note} code_sandbox: bench_code_sandbox's workloads ({', '.join(workloads)}: one program run, "
            "one run with 5 calls, 5 stdin/stdout runs; a sample is one program against all its tests), each "
            f"measured for {seconds:g} s from as many client threads as the concurrency, the scorer's "
            "`concurrency` set to the same, its sandboxes started ahead; the bare side runs the same programs as "
            "plain `python -I -S` subprocesses. See benchmarks/bench_rewards.py."
        ),
        comparisons=[math_comparison, *code],
        measures=cpu,
    )
    section.details.append(sandbox_cost_table(workloads, 10 if quick else 40, log))
    costs = launch_costs(10 if quick else 40)
    log(f"  [rewards] launch costs (ms): {costs}")
    trivial = next(c for c in code if c.name == "code_sandbox trivial, concurrency 1")
    per_sample = 1000 / sorted(trivial.ours)[len(trivial.ours) // 2]
    if "bubblewrap" in costs:
        section.details.append(
            "Where a sandboxed sample's time goes (sequential, medians): an interpreter that does nothing starts "
            f"and ends in {costs['bare']:.1f} ms bare and in {costs['bubblewrap']:.1f} ms inside the sandbox's "
            "bubblewrap command line (user, PID, network, IPC and UTS namespaces, the read-only mounts, the "
            f"sandbox's uid): isolation adds {costs['bubblewrap'] - costs['bare']:.1f} ms of start-up to every run. "
            "The scorer starts each sandbox ahead of the sample that uses it, so that start-up overlaps the "
            f"previous sample's run and judging: a trivial sample at concurrency 1 takes {per_sample:.1f} ms "
            "through the scorer. At higher concurrency the start-ups take CPU from the runs themselves, which is "
            "where the bare side pulls further ahead."
        )
    else:
        section.details.append("bubblewrap is not installed here: the sandboxed side ran without it.")
    section.wall_s = time.perf_counter() - start_wall
    return section


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="fewer cases, shorter windows, for a smoke run")
    args = parser.parse_args(argv)
    print(render_table(summary_rows([measure(args.repeats, args.quick)])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

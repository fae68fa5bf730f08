"""The code sandbox benchmark runs end to end and prints a positive rate for every workload and column."""

from __future__ import annotations

import pytest

from benchmarks.bench_code_sandbox import WORKLOADS, main
from workers.rewards.code_sandbox import CodeSandboxScorer
from workers.rewards.sandbox.layers import IsolationUnavailable


@pytest.mark.slow
def test_benchmark_prints_every_workload(capsys):
    try:
        CodeSandboxScorer().close()
    except IsolationUnavailable as err:
        pytest.skip(f"this host cannot isolate the sandbox: {err}")
    assert main(["--seconds", "0.3", "--concurrency", "1", "--quiet-wait", "0"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "quiet machine: load" in out[0] or "NOT QUIET: load" in out[0]
    rows = [line.split() for line in out[2:]]
    assert [row[0] for row in rows] == list(WORKLOADS)
    for row in rows:
        # conc, then zygote/s, strict/s, bare/s, the two ratios, the two CPU figures, the load
        assert row[1] == "1" and all(float(x) > 0 for x in row[2:9]) and float(row[9]) >= 0

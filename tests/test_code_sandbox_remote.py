"""Remote mode: the scorer against the project's own SandboxFusion-compatible stub on 127.0.0.1."""

from __future__ import annotations

import json
import socket
import threading
from dataclasses import replace

import pytest

from tests.sandbox_fusion_stub import SandboxFusionStub
from workers.rewards.code_sandbox import CodeSandboxScorer
from workers.rewards.sandbox.layers import IsolationUnavailable
from workers.rewards.sandbox.process import SandboxUnavailable
from workers.rewards.sandbox.remote import SandboxFusionClient
from workers.rewards.worker import RewardWorker

SQUARE = "def square(x):\n    return x * x\n"
ASSERTS = json.dumps({"asserts": ["assert square(2) == 4", "assert square(3) == 9"]})
CALLS = json.dumps({"fn_name": "square", "inputs": [[2], [3]], "outputs": [4, 9]})
STDIO = json.dumps({"inputs": ["2\n", "3\n"], "outputs": ["4\n", "9\n"]})


@pytest.fixture(scope="module")
def local():
    try:
        scorer = CodeSandboxScorer(timeout_s=2.0, concurrency=1)
    except IsolationUnavailable as err:
        pytest.skip(f"this host cannot isolate the sandbox: {err}")
    yield scorer
    scorer.close()


@pytest.fixture
def stub(local):
    with SandboxFusionStub(local.spec, concurrency=2) as stub:
        yield stub


def remote_scorer(url, **options):
    return CodeSandboxScorer(
        backend="remote", remote_url=url, timeout_s=2.0, remote_backoff_s=0.05, **options
    )


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    ("tests", "good", "bad"),
    [
        (CALLS, SQUARE, "def square(x):\n    return 4\n"),
        (STDIO, "n = int(input())\nprint(n * n)\n", "print(4)\n"),
    ],
    ids=["calls", "stdio"],
)
def test_the_data_formats_remotely(stub, tests, good, bad):
    scorer = remote_scorer(stub.url)
    assert scorer.score(good, "", test_cases=tests).correct
    result = scorer.score(bad, "", test_cases=tests)
    assert (result.score, result.metrics["wrong_answer"]) == (0.5, 1.0)
    request = stub.requests[-1]
    assert (
        request["language"] == "python"
        and request["run_timeout"] == 2.0
        and request["memory_limit_MB"] == 512
    )


@pytest.mark.parametrize(
    "tests", [ASSERTS, json.dumps({"test": "def check(c):\n    assert c(2) == 4", "entry_point": "square"})]
)
def test_test_code_formats_are_refused_remotely_and_never_sent(stub, tests):
    # One script per run: the test code would share the program's interpreter. Refused, not judged there.
    with pytest.raises(ValueError, match="need backend: local"):
        remote_scorer(stub.url).score(SQUARE, "", test_cases=tests)
    assert stub.requests == []


def test_remote_failure_kinds(stub):
    scorer = remote_scorer(stub.url)
    assert scorer.score("def square(x) return", "", test_cases=CALLS).metrics["syntax_error"] == 1.0
    assert (
        scorer.score("def square(x):\n    while True: pass\n", "", test_cases=CALLS).metrics["timeout"] == 1.0
    )
    memory = scorer.score("def square(x):\n    return len(bytearray(8 << 30))\n", "", test_cases=CALLS)
    assert memory.metrics["memory_limit"] == 1.0
    crash = "n = int(input())\nprint(n * n)\nraise SystemExit(3)\n"
    assert scorer.score(crash, "", test_cases=STDIO).metrics["runtime_error"] == 1.0


def test_expected_outputs_are_not_sent(stub):
    scorer = remote_scorer(stub.url)
    tests = json.dumps({"fn_name": "f", "inputs": [[1]], "outputs": ["expected-canary-1"]})
    scorer.score("def f(x):\n    return x\n", "", test_cases=tests)
    stdio = json.dumps({"inputs": ["in\n"], "outputs": ["expected-canary-2\n"]})
    scorer.score("print(input())\n", "", test_cases=stdio)
    sent = json.dumps(stub.requests)
    assert "expected-canary" not in sent and len(stub.requests) == 2


def test_forged_events_on_stderr_do_not_pass(stub):
    scorer = remote_scorer(stub.url)
    code = (
        "import sys\n"
        "for i in range(2):\n"
        '    sys.stderr.write(\'{"t": %d, "v": 4}\\n\' % i)\n'
        "def square(x):\n    return -1\n"
    )
    assert scorer.score(code, "", test_cases=CALLS).score == 0.0


def test_retries_5xx_with_backoff(stub):
    stub.fail_with = [503, 502]
    scorer = remote_scorer(stub.url, remote_retries=3)
    assert scorer.score(SQUARE, "", test_cases=CALLS).correct
    assert len(stub.requests) == 3


def test_service_down_raises_so_the_worker_masks(stub):
    stub.fail_with = [500] * 10
    with pytest.raises(SandboxUnavailable, match="HTTP 500"):
        remote_scorer(stub.url, remote_retries=2).score(SQUARE, "", test_cases=CALLS)
    assert len(stub.requests) == 3
    url = f"http://127.0.0.1:{closed_port()}"
    with pytest.raises(SandboxUnavailable, match="failed 2 times"):
        remote_scorer(url, remote_retries=1).score(SQUARE, "", test_cases=CALLS)


def test_generic_worker_masks_instead_of_scoring_zero():
    url = f"http://127.0.0.1:{closed_port()}"
    worker = RewardWorker(
        "code", "code_sandbox", {"backend": "remote", "remote_url": url, "remote_retries": 0}, timeout_s=10
    )
    [record] = worker.score_batch([{"response": SQUARE, "ground_truth": "", "test_cases": CALLS}])
    assert record.masked is True and record.score is None


def test_request_timeouts_are_retried_then_give_up(stub, local):
    stub.delay_s = 1.0
    client = SandboxFusionClient(
        stub.url, replace(local.spec.limits), retries=1, backoff_s=0.01, request_timeout_s=0.2
    )
    with pytest.raises(SandboxUnavailable, match="TimeoutError|timed out"):
        client.run({"mode": "stdio", "code": "print(1)", "limits": local.spec.limits.for_job()})
    assert len(stub.requests) == 2


def test_concurrency_limit(stub, local):
    stub.delay_s = 0.2
    client = SandboxFusionClient(stub.url, local.spec.limits, concurrency=2)
    job = {"mode": "stdio", "code": "print(1)", "limits": local.spec.limits.for_job()}
    outputs = []
    threads = [threading.Thread(target=lambda: outputs.append(client.run(job))) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [o.stdout for o in outputs] == [b"1\n"] * 6
    assert stub.max_in_flight == 2

"""`roll serve` throughput: requests per second at each concurrency, against a real server process on
127.0.0.1.

    python -m benchmarks.bench_serve [--model examples/models/tiny-qwen2] [--concurrency 1 16] [--requests 64]
                                     [--max-tokens 32] [--torch-threads 2] [--url http://127.0.0.1:PORT/v1]

The workload is the example data's own prompts (math and code validation prompts, alternating) sent as chat
completions with sampling at temperature 1 and ``max_tokens``; each level sends ``--requests`` requests
(at least four per client) from ``concurrency`` client threads after a short warm-up. Reported per level:
requests per second, completion tokens per second, latency percentiles, and the mean number of sequences per
batch the server ran (from its /health counters). Without ``--url`` the server is started here (`roll serve`
in a child process) and stopped at the end; the clients run in this process, on the same machine, so they
share its cores with the server.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parents[1]


def _prompts(n: int) -> list[list[dict]]:
    rows = []
    for name in ("math_val.jsonl", "code_val.jsonl"):
        lines = (ROOT / "examples" / "data" / name).read_text().splitlines()
        rows.append([json.loads(line)["messages"] for line in lines])
    return [rows[i % 2][(i // 2) % len(rows[i % 2])] for i in range(n)]


def _start(model: str, torch_threads: int, max_batch: int) -> tuple[subprocess.Popen, str]:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [
        sys.executable,
        "-m",
        "roll_pipeline.driver.cli",
        "serve",
        model,
        "--port",
        str(port),
        "--served-model-name",
        "bench",
        "--torch-threads",
        str(torch_threads),
        "--max-batch-size",
        str(max_batch),
    ]
    process = subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"roll serve exited: {process.stderr.read()}")
        try:
            if requests.get(f"http://127.0.0.1:{port}/health", timeout=1).ok:
                return process, f"http://127.0.0.1:{port}/v1"
        except requests.RequestException:
            time.sleep(0.2)
    process.kill()
    raise RuntimeError("roll serve did not start within 120 s")


def _health(url: str) -> dict:
    return requests.get(url.removesuffix("/v1") + "/health", timeout=10).json()


def _model_name(url: str) -> str:
    return requests.get(f"{url}/models", timeout=10).json()["data"][0]["id"]


def run_level(url: str, model: str, concurrency: int, n_requests: int, max_tokens: int) -> dict:
    prompts = _prompts(n_requests)
    sessions = [requests.Session() for _ in range(concurrency)]

    def one(i: int) -> tuple[float, int]:
        body = {"model": model, "messages": prompts[i], "max_tokens": max_tokens, "temperature": 1.0}
        started = time.perf_counter()
        response = sessions[i % concurrency].post(f"{url}/chat/completions", json=body, timeout=300)
        response.raise_for_status()
        return time.perf_counter() - started, response.json()["usage"]["completion_tokens"]

    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, range(min(n_requests, 2 * concurrency))))  # warm-up, not counted
        before = _health(url)
        started = time.perf_counter()
        results = list(pool.map(one, range(n_requests)))
        wall = time.perf_counter() - started
    after = _health(url)
    latencies = sorted(r[0] for r in results)
    batches = after["batches"] - before["batches"]
    return {
        "concurrency": concurrency,
        "requests": n_requests,
        "wall_s": round(wall, 2),
        "requests_per_s": round(n_requests / wall, 2),
        "completion_tokens_per_s": round(sum(r[1] for r in results) / wall, 1),
        "mean_completion_tokens": round(statistics.mean(r[1] for r in results), 1),
        "latency_p50_s": round(latencies[len(latencies) // 2], 3),
        "latency_p95_s": round(latencies[min(len(latencies) - 1, int(0.95 * len(latencies)))], 3),
        "batches": batches,
        "mean_sequences_per_batch": round((after["sequences"] - before["sequences"]) / batches, 2)
        if batches
        else 0,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="examples/models/tiny-qwen2")
    parser.add_argument("--url", default=None, help="benchmark a server already running at this /v1 URL")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--requests", type=int, default=64, help="requests per level (at least 4 per client)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--torch-threads", type=int, default=2)
    parser.add_argument("--max-batch-size", type=int, default=32)
    args = parser.parse_args(argv)
    process = None
    url = args.url
    if url is None:
        process, url = _start(args.model, args.torch_threads, args.max_batch_size)
    try:
        model = _model_name(url)
        print(f"roll serve at {url}, model {model!r}, max_tokens {args.max_tokens}, temperature 1.0")
        for concurrency in args.concurrency:
            level = run_level(url, model, concurrency, max(args.requests, 4 * concurrency), args.max_tokens)
            print(json.dumps(level))
    finally:
        if process is not None:
            process.terminate()
            process.wait(30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Servers for the judge and `roll serve` tests: a real `roll serve` process, and a scriptable stub judge.

The stub speaks just enough of ``POST /v1/chat/completions`` to play a judge that fails in chosen ways: it
answers each request by calling ``behaviour(request_number, body)``, which returns ``(status, reply text)`` or
sleeps first. It records every request and the most requests it had in flight at once.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parent.parent
JUDGE_MODEL = ROOT / "examples" / "models" / "tiny-qwen2-judge"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServeProcess:
    """`roll serve MODEL` in a child process on 127.0.0.1; ``url`` is its /v1 base URL."""

    def __init__(self, model: Path, name: str, port: int | None = None, extra: tuple[str, ...] = ()) -> None:
        self.model, self.name, self.extra = model, name, extra
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.process: subprocess.Popen | None = None

    def start(self, timeout_s: float = 90.0) -> ServeProcess:
        command = [
            sys.executable,
            "-m",
            "roll_pipeline.driver.cli",
            "serve",
            str(self.model),
            "--port",
            str(self.port),
            "--served-model-name",
            self.name,
            "--torch-threads",
            "1",
            *self.extra,
        ]
        self.process = subprocess.Popen(
            command,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"roll serve exited with {self.process.returncode}:\n{self.process.stdout.read()}"
                )
            with contextlib.suppress(requests.RequestException):
                if requests.get(f"http://127.0.0.1:{self.port}/health", timeout=1).ok:
                    return self
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"roll serve did not answer /health within {timeout_s:.0f}s")

    def health(self) -> dict:
        return requests.get(f"http://127.0.0.1:{self.port}/health", timeout=5).json()

    def kill(self) -> None:
        """SIGKILL: the server dies at once, in the middle of whatever it is doing."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
        if self.process is not None and self.process.stdout is not None:
            self.process.stdout.close()


Behaviour = Callable[[int, dict], tuple[int, str]]


def chat_completion(text: str, model: str = "stub") -> dict:
    return {
        "id": "chatcmpl-stub",
        "object": "chat.completion",
        "created": 0,
        "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13},
    }


class HeldReply:
    """A behaviour that answers only once `release` is set (or after `limit_s`): a client that gives up before then
    did not wait for the judge, whatever the machine's speed. `answered` counts the replies sent."""

    def __init__(self, text: str = "Verdict: YES", limit_s: float = 120.0) -> None:
        self.text, self.limit_s = text, limit_s
        self.release = threading.Event()
        self.answered = 0

    def __call__(self, number: int, body: dict) -> tuple[int, str]:
        self.release.wait(self.limit_s)
        self.answered += 1
        return 200, self.text


class StubJudge:
    """A judge on 127.0.0.1 whose answers come from ``behaviour``; ``url`` is its /v1 base URL."""

    def __init__(self, behaviour: Behaviour) -> None:
        self.behaviour = behaviour
        self.bodies: list[dict] = []
        self.headers: list[dict] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.times: list[float] = []
        self._lock = threading.Lock()
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *_: object) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                with stub._lock:
                    number = len(stub.bodies)
                    stub.bodies.append(body)
                    stub.headers.append(dict(self.headers))
                    stub.times.append(time.monotonic())
                    stub.in_flight += 1
                    stub.max_in_flight = max(stub.max_in_flight, stub.in_flight)
                try:
                    status, text = stub.behaviour(number, body)
                finally:
                    # Out of flight before the answer is written: once the client has it, it may send the next
                    # request, which must not find this one still counted.
                    with stub._lock:
                        stub.in_flight -= 1
                payload = json.dumps(chat_completion(text) if status == 200 else {"error": {"message": text}})
                data = payload.encode()
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/v1"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def requests(self) -> int:
        return len(self.bodies)

    def __enter__(self) -> StubJudge:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._server.shutdown()
        self._server.server_close()


# Served verdicts equal to the in-process ones, of 48: 48 on each of the judge's builds of seeds 0-3 (AMD EPYC,
# 2026-11-25), served by `roll serve` and by the Ray judge actor; one may flip where a served batch pads otherwise
# and a reply is a near tie.
SERVED_AS_OWN_OF_48 = 47


def assert_judges_own_verdicts(records: list[dict], rows: list[dict], model_dir: Path = JUDGE_MODEL) -> None:
    """The rewards of `records` (scored from `rows` of judge_val.jsonl) are the judge's own verdicts and a judge's.

    Own: equal to those of its greedy replies computed in this process from the same weights (the served path adds
    the template, the round trip, batching and the verdict parser). A judge's: right more often than a sound
    build's least (roll_core/models/embedded.py), and not one verdict for everything. How often right depends
    on the build, so on the processor that built it: 43, 34, 42 and 40 of the first 48 rows on the builds of seeds
    0-3 (AMD EPYC, 2026-11-25), so a bound near 0.85 would fail on some machines' builds.
    """
    from roll_core.models.embedded import EMBEDDED_MODELS
    from roll_pipeline.models.tiny_judge import judge_verdicts

    assert len(rows) == 48
    own = judge_verdicts(model_dir, rows)
    served = [1.0 if r.correct else 0.0 for r in records]
    same = sum(a == b for a, b in zip(served, own, strict=True))
    assert same >= SERVED_AS_OWN_OF_48, f"{same}/{len(rows)} served verdicts are the judge's own"
    agree = [r.correct == (row["verdict"] == "YES") for r, row in zip(records, rows, strict=True)]
    least = EMBEDDED_MODELS[model_dir.name].min_verdict_accuracy
    assert sum(agree) / len(agree) >= least, f"{sum(agree)}/{len(agree)} verdicts as expected"
    assert {r.correct for r in records} == {True, False}

"""A small SandboxFusion-compatible service for the tests: ``POST /run_code`` on 127.0.0.1, running each Python
program through the project's own local sandbox (as ``stdio``: the submitted code is the whole program).

It answers in SandboxFusion's shape (``status``, ``message``, ``run_result`` with ``status``, ``return_code``,
``stdout``, ``stderr``, ``execution_time``). ``fail_with`` lists HTTP status codes to answer the next requests with
instead of running them; ``delay_s`` holds every answer back (to test client timeouts).
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from workers.rewards.sandbox.isolation import SandboxSpec
from workers.rewards.sandbox.prestarted import SandboxPool
from workers.rewards.sandbox.process import EXITED, TIMEOUT, SandboxUnavailable


class SandboxFusionStub:
    def __init__(self, spec: SandboxSpec, concurrency: int = 2) -> None:
        self.spec = spec
        self.concurrency = concurrency
        self.fail_with: list[int] = []
        self.delay_s = 0.0
        self.requests: list[dict] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self._pools: dict[tuple, SandboxPool] = {}
        self._lock = threading.Lock()
        self._closed = False
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (the http.server API)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with stub._lock:
                    stub.requests.append(body)
                    failure = stub.fail_with.pop(0) if stub.fail_with else None
                    stub.in_flight += 1
                    stub.max_in_flight = max(stub.max_in_flight, stub.in_flight)
                # A request stops counting as in flight before its answer is written: the client frees its slot
                # as soon as it reads the answer, and its next request may reach this server before this thread
                # would otherwise get to decrement (CI once saw 3 in flight with 2 slots that way).
                try:
                    if stub.delay_s:
                        time.sleep(stub.delay_s)
                    if self.path != "/run_code":
                        code, payload = 404, {"detail": "Not Found"}
                    elif failure is not None:
                        code, payload = failure, {"detail": "injected failure"}
                    else:
                        code, payload = 200, stub.run_code(body)
                finally:
                    with stub._lock:
                        stub.in_flight -= 1
                self._answer(code, payload)

            def _answer(self, code: int, payload: dict) -> None:
                data = json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def _pool(self, timeout_s: float, memory_mb: int) -> SandboxPool:
        key = (timeout_s, memory_mb)
        with self._lock:
            if self._closed:
                raise SandboxUnavailable("the stub is shutting down")
            if key not in self._pools:
                limits = replace(
                    self.spec.limits, timeout_s=timeout_s, memory_mb=memory_mb, output_bytes=8 << 20
                )
                self._pools[key] = SandboxPool(replace(self.spec, limits=limits), self.concurrency)
            return self._pools[key]

    def run_code(self, request: dict) -> dict:
        if request.get("language") != "python":
            return {"status": "SandboxError", "message": f"unsupported language {request.get('language')!r}"}
        memory_mb = request.get("memory_limit_MB", -1)
        start = time.monotonic()
        try:
            pool = self._pool(float(request.get("run_timeout", 10)), memory_mb if memory_mb > 0 else 1024)
            job = {"mode": "stdio", "code": request["code"], "limits": pool.spec.limits.for_job()}
            output = pool.run(job, (request.get("stdin") or "").encode())
        except SandboxUnavailable as err:
            return {"status": "SandboxError", "message": str(err)}
        exits = [e for e in output.events if e.get("ev") == "exit"]
        if exits:
            return_code = 0 if exits[0].get("ok") else 1
        else:
            return_code = output.exit_code if output.exit_code is not None else 1
        run_status = "TimeLimitExceeded" if output.status == TIMEOUT else "Finished"
        return {
            "status": "Success" if output.status == EXITED and return_code == 0 else "Failed",
            "message": "",
            "compile_result": None,
            "run_result": {
                "status": run_status,
                "execution_time": time.monotonic() - start,
                "return_code": return_code if output.status == EXITED else None,
                "stdout": output.stdout.decode(errors="replace"),
                "stderr": output.stderr.decode(errors="replace"),
            },
            "files": {},
        }

    def __enter__(self) -> SandboxFusionStub:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        with self._lock:
            self._closed = True
            pools = list(self._pools.values())
        for pool in pools:
            pool.close()

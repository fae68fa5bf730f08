"""Remote mode: run programs on a SandboxFusion-compatible HTTP service (``POST /run_code``).

The harness and the job travel as one Python script; the harness reports on stderr, each event line prefixed with
a random marker, and the worker judges from the returned stdout/stderr exactly as in local mode. The client uses
only the standard library. Requests are limited to ``concurrency`` at once; a ``SandboxError``, a connection
failure, a timeout or a status ``workers.rewards.retry`` retries (5xx, 408, 429) is retried ``retries`` times with
its exponential backoff, and then raises ``SandboxUnavailable`` so the reward worker masks the sample: a service
that is down never yields a 0 reward.
"""

from __future__ import annotations

import json
import logging
import random
import secrets
import threading
import time
import urllib.error
import urllib.request

from workers.rewards.retry import RetryPolicy, is_retried_status
from workers.rewards.sandbox.isolation import SandboxLimits
from workers.rewards.sandbox.process import (
    EXITED,
    HARNESS_SOURCE,
    OUTPUT_LIMIT,
    TIMEOUT,
    RunOutput,
    SandboxUnavailable,
    parse_events,
)

logger = logging.getLogger(__name__)


def remote_script(job: dict, marker: str) -> str:
    """The harness with the job embedded, reporting on stderr behind ``marker``."""
    return f"{HARNESS_SOURCE}\nrun_job(_loads({json.dumps(job)!r}), {marker!r})\n"


class SandboxFusionClient:
    """Runs jobs on ``url`` (``http://host:port``) through ``POST /run_code``."""

    def __init__(
        self,
        url: str,
        limits: SandboxLimits,
        concurrency: int = 8,
        retries: int = 3,
        backoff_s: float = 0.5,
        request_timeout_s: float | None = None,
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"remote sandbox url must start with http:// or https://, got {url!r}")
        self.url = url.rstrip("/") + "/run_code"
        self.limits = limits
        self.retries = retries
        self.retry = RetryPolicy(max_retries=retries, backoff_s=backoff_s)
        self._rng = random.Random()
        # The service may queue the run: allow it the run's own time plus a margin for the round trip.
        self.request_timeout_s = request_timeout_s or limits.timeout_s + 30.0
        self._slots = threading.BoundedSemaphore(concurrency)

    def run(self, job: dict, stdin: bytes = b"") -> RunOutput:
        marker = f"@@roll-{secrets.token_hex(8)}@@"
        body = {
            "code": remote_script(job, marker),
            "language": "python",
            "stdin": stdin.decode("utf-8", errors="replace"),
            "compile_timeout": 10,
            "run_timeout": self.limits.timeout_s,
            "memory_limit_MB": self.limits.memory_mb,
            "files": {},
            "fetch_files": [],
        }
        with self._slots:
            answer = self._post(body)
        return self._to_output(answer, marker)

    def _post(self, body: dict) -> dict:
        data = json.dumps(body).encode()
        problem = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.retry.delay(attempt, self._rng))
            request = urllib.request.Request(
                self.url, data=data, headers={"Content-Type": "application/json"}, method="POST"
            )
            try:
                with urllib.request.urlopen(request, timeout=self.request_timeout_s) as response:
                    answer = json.loads(response.read())
            except urllib.error.HTTPError as err:
                if not is_retried_status(err.code):
                    raise SandboxUnavailable(f"sandbox service refused the request: HTTP {err.code}") from err
                problem = f"HTTP {err.code}"
            except (urllib.error.URLError, TimeoutError, ConnectionError, ValueError) as err:
                problem = f"{type(err).__name__}: {getattr(err, 'reason', err)}"
            else:
                if isinstance(answer, dict) and answer.get("status") != "SandboxError":
                    return answer
                problem = f"sandbox error: {answer.get('message', '')[:200] if isinstance(answer, dict) else answer}"
            logger.warning("code sandbox service %s: attempt %d failed (%s)", self.url, attempt + 1, problem)
        raise SandboxUnavailable(
            f"sandbox service {self.url} failed {self.retries + 1} times; last: {problem}"
        )

    def _to_output(self, answer: dict, marker: str) -> RunOutput:
        run = answer.get("run_result")
        if not isinstance(run, dict):
            raise SandboxUnavailable(f"sandbox service answered without a run_result: {str(answer)[:200]}")
        stdout = (run.get("stdout") or "").encode()
        stderr = (run.get("stderr") or "").encode()
        prefix = marker.encode()
        events = parse_events(
            b"\n".join(line[len(prefix) :] for line in stderr.split(b"\n") if line.startswith(prefix))
        )
        cap = self.limits.output_bytes
        if run.get("status") == "TimeLimitExceeded":
            status = TIMEOUT
        elif len(stdout) > cap or len(stderr) > 2 * cap:
            status = OUTPUT_LIMIT
        else:
            status = EXITED
        code = run.get("return_code")
        return RunOutput(
            status=status,
            stdout=stdout[:cap],
            stderr=stderr[:cap],
            events=events,
            exit_code=code if status == EXITED and isinstance(code, int) else None,
        )

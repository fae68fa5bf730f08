"""Code reward: run the response's Python code against assert-style test cases in a throwaway subprocess.

Isolation here is deliberately modest (a deeper sandbox comes later): a fresh ``python -I`` process in a private
temporary directory, an almost empty environment, closed stdin, its own session (the whole process group is
killed when the run ends or times out), bounded output, and resource limits (CPU seconds, address space,
process count, file size, no core files). Python-level process creation (fork, exec, subprocess, os.system,
posix_spawn) is refused by an audit hook, because ``RLIMIT_NPROC`` does not bind a process running as root.

The limits are set by the harness itself, before it touches the untrusted code, rather than in a
``preexec_fn``: ``preexec_fn`` is unsafe when the parent has threads, and the reward worker scores on a thread
pool.

Known gap until the deeper sandbox: the solution runs in the harness's own interpreter, so code that digs
through the interpreter's memory (frames, ``gc``, ``/proc/self/mem``) can find the result marker's nonce.
The nonce only defeats a solution that prints a plausible-looking summary.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import secrets
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from workers.rewards.base import RewardResult, RewardScorer
from workers.rewards.registry import register_reward_worker

logger = logging.getLogger(__name__)

#: Bytes of the sandbox's stdout+stderr kept from the start of the output (for debug logs).
_OUTPUT_HEAD_BYTES = 16 * 1024
#: Bytes kept from the end of the output, where the harness writes its summary line.
_OUTPUT_TAIL_BYTES = 64 * 1024
#: Largest file the solution may write.
_MAX_FILE_BYTES = 16 * 1024 * 1024
_REWARD_MODES = ("fraction", "all_or_nothing")
_FENCED = re.compile(r"```[ \t]*(?P<lang>[A-Za-z0-9_+-]*)[^\n]*\n(?P<code>.*?)```", re.DOTALL)

# Runs as `python -I -c _HARNESS <cpu_s> <memory_bytes> <file_bytes>` in the sandbox's temporary directory.
# It applies the limits, reads and deletes payload.json, runs the solution and then each assert in one
# namespace, and writes one line `<marker>{json}` to a duplicate of stdout that the solution never sees.
_HARNESS = r"""
import json, os, resource, sys

def _limit(kind, soft, hard=None):
    hard = soft if hard is None else hard
    _, current_hard = resource.getrlimit(kind)
    if current_hard != resource.RLIM_INFINITY:
        soft, hard = min(soft, current_hard), min(hard, current_hard)
    resource.setrlimit(kind, (soft, hard))

_cpu_s, _memory_bytes, _file_bytes = (int(a) for a in sys.argv[1:4])
# The soft CPU limit sends SIGXCPU, which the parent reads as a timeout; the hard one a second later kills.
_limit(resource.RLIMIT_CPU, _cpu_s, _cpu_s + 1)
_limit(resource.RLIMIT_AS, _memory_bytes)
_limit(resource.RLIMIT_FSIZE, _file_bytes)
_limit(resource.RLIMIT_CORE, 0)
# RLIMIT_NPROC counts every process of the user: 0 means this process can start no other.
_limit(resource.RLIMIT_NPROC, 0)

_DENIED = ("os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn", "os.system", "subprocess.Popen")

def _deny_process_creation(event, args):
    if event in _DENIED:
        raise PermissionError(f"{event} is not allowed in the sandbox")

def _main():
    with open("payload.json", encoding="utf-8") as f:
        payload = json.load(f)
    os.remove("payload.json")
    report = os.fdopen(os.dup(1), "w", encoding="utf-8")
    sys.argv = ["solution.py"]
    summary = {"syntax_error": False, "runtime_error": False, "passed": [False] * len(payload["asserts"])}
    try:
        code = compile(payload["solution"], "solution.py", "exec")
    except (SyntaxError, ValueError):
        summary["syntax_error"] = True
        code = None
    if code is not None:
        sys.addaudithook(_deny_process_creation)
        namespace = {"__name__": "__solution__", "__builtins__": __builtins__}
        try:
            exec(code, namespace)
        except BaseException:
            summary["runtime_error"] = True
        else:
            for i, test in enumerate(payload["asserts"]):
                try:
                    exec(compile(test, f"test_{i}.py", "exec"), namespace)
                except AssertionError:
                    pass
                except BaseException:
                    summary["runtime_error"] = True
                else:
                    summary["passed"][i] = True
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:
        pass
    report.write("\n" + payload["marker"] + json.dumps(summary) + "\n")
    report.flush()
    os._exit(0)

_main()
"""


@dataclass(frozen=True)
class SandboxRun:
    """What one sandbox run produced."""

    #: One entry per assert, ``None`` when no trustworthy summary came back (timeout, crash, sabotage).
    passed: list[bool] | None
    syntax_error: bool
    runtime_error: bool
    timed_out: bool
    #: The start of stdout+stderr, for debugging.
    output_head: str


def extract_code(response: str) -> str:
    """The last fenced ``python`` block of ``response``; else the last bare fenced block; else all of it."""
    blocks = [(m.group("lang").lower(), m.group("code")) for m in _FENCED.finditer(response)]
    python = [code for lang, code in blocks if lang in ("python", "py", "python3")]
    if python:
        return python[-1]
    bare = [code for lang, code in blocks if not lang]
    if bare:
        return bare[-1]
    return response


def parse_test_cases(test_cases: object) -> list[str] | None:
    """The asserts of a ``test_cases`` field (JSON text or an already decoded dict); ``None`` if unusable."""
    if isinstance(test_cases, str | bytes):
        try:
            test_cases = json.loads(test_cases)
        except json.JSONDecodeError:
            return None
    if not isinstance(test_cases, dict):
        return None
    asserts = test_cases.get("asserts")
    if not isinstance(asserts, list) or not asserts or not all(isinstance(a, str) for a in asserts):
        return None
    return asserts


class _OutputBuffer:
    """Keeps the head and the tail of a stream of unbounded length."""

    def __init__(self) -> None:
        self.head = bytearray()
        self.tail = bytearray()

    def add(self, chunk: bytes) -> None:
        room = _OUTPUT_HEAD_BYTES - len(self.head)
        if room > 0:
            self.head += chunk[:room]
        self.tail += chunk
        if len(self.tail) > _OUTPUT_TAIL_BYTES:
            del self.tail[: len(self.tail) - _OUTPUT_TAIL_BYTES]


def _kill_group(proc: subprocess.Popen) -> None:
    # The leader is not reaped yet, so its pid still names this process group and cannot have been reused.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def run_in_sandbox(solution: str, asserts: list[str], timeout_s: float, memory_mb: int) -> SandboxRun:
    """Run ``solution`` and then each assert in a fresh, limited Python process; see the module docstring.

    Raises ``OSError`` when the sandbox itself cannot be started: that is an infrastructure failure, which the
    reward worker masks, not a wrong answer.
    """
    marker = f"@@roll-sandbox-result:{secrets.token_hex(16)}@@"
    cpu_s = max(1, math.ceil(timeout_s)) + 1
    # mkdtemp makes the directory private (0o700); the solution may leave files there with odd permissions.
    with tempfile.TemporaryDirectory(prefix="roll-sandbox-", ignore_cleanup_errors=True) as workdir:
        with open(os.path.join(workdir, "payload.json"), "w", encoding="utf-8") as f:
            json.dump({"marker": marker, "solution": solution, "asserts": asserts}, f)
        proc = subprocess.Popen(
            [
                sys.executable,
                "-I",
                "-c",
                _HARNESS,
                str(cpu_s),
                str(memory_mb * 1024 * 1024),
                str(_MAX_FILE_BYTES),
            ],
            cwd=workdir,
            env={
                "LC_ALL": "C.UTF-8",
                "OMP_NUM_THREADS": "1",
                "OPENBLAS_NUM_THREADS": "1",
                "MKL_NUM_THREADS": "1",
            },
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        output = _OutputBuffer()
        timed_out = False
        deadline = time.monotonic() + timeout_s
        try:
            with selectors.DefaultSelector() as selector:
                selector.register(proc.stdout, selectors.EVENT_READ)
                while True:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        timed_out = True
                        break
                    if not selector.select(remaining):
                        continue
                    chunk = os.read(proc.stdout.fileno(), 65536)
                    if not chunk:
                        break
                    output.add(chunk)
        finally:
            _kill_group(proc)
            proc.stdout.close()
            returncode = proc.wait()
    # The wall-clock limit is shorter than the CPU one; SIGXCPU is the backstop for a stalled parent.
    timed_out = timed_out or returncode == -signal.SIGXCPU
    summary = None if timed_out else _read_summary(bytes(output.tail), marker)
    head = output.head.decode("utf-8", errors="replace")
    if summary is None:
        return SandboxRun(
            passed=None,
            syntax_error=False,
            runtime_error=not timed_out,
            timed_out=timed_out,
            output_head=head,
        )
    return SandboxRun(
        passed=[bool(p) for p in summary["passed"]],
        syntax_error=bool(summary["syntax_error"]),
        runtime_error=bool(summary["runtime_error"]),
        timed_out=False,
        output_head=head,
    )


def _read_summary(tail: bytes, marker: str) -> dict | None:
    text = tail.decode("utf-8", errors="replace")
    for line in reversed(text.splitlines()):
        if line.startswith(marker):
            try:
                summary = json.loads(line[len(marker) :])
            except json.JSONDecodeError:
                return None
            return summary if isinstance(summary, dict) and isinstance(summary.get("passed"), list) else None
    return None


@register_reward_worker("code_sandbox")
class CodeSandboxScorer(RewardScorer):
    """Reward = share of the sample's asserts that pass (``fraction``) or 1/0 (``all_or_nothing``).

    Needs the field ``test_cases``: JSON ``{"asserts": ["assert f(2) == 4", ...]}``; a sample without usable
    test cases is not applicable (``None``). Metrics: ``pass_rate``, ``syntax_error``, ``timeout``,
    ``runtime_error`` (0/1).
    """

    def __init__(
        self,
        *,
        timeout_s: float = 5.0,
        reward_mode: str = "fraction",
        memory_mb: int = 512,
        **options: object,
    ) -> None:
        super().__init__(**options)
        if not (isinstance(timeout_s, int | float) and timeout_s > 0):
            raise ValueError(f"code_sandbox option timeout_s must be a positive number, got {timeout_s!r}")
        if reward_mode not in _REWARD_MODES:
            raise ValueError(
                f"code_sandbox option reward_mode must be one of {_REWARD_MODES}, got {reward_mode!r}"
            )
        if not (isinstance(memory_mb, int) and memory_mb >= 64):
            raise ValueError(f"code_sandbox option memory_mb must be an integer >= 64, got {memory_mb!r}")
        self.timeout_s = float(timeout_s)
        self.reward_mode = reward_mode
        self.memory_mb = memory_mb

    def score(self, response: str, ground_truth: str, **fields: object) -> RewardResult | None:
        asserts = parse_test_cases(fields.get("test_cases"))
        if asserts is None:
            logger.warning(
                'code_sandbox: sample %r has no usable test_cases field (want JSON {"asserts": [...]}); '
                "not scored",
                fields.get("id"),
            )
            return None
        run = run_in_sandbox(extract_code(response or ""), asserts, self.timeout_s, self.memory_mb)
        passed = run.passed or [False] * len(asserts)
        if len(passed) != len(asserts):
            passed = [False] * len(asserts)
        pass_rate = sum(passed) / len(asserts)
        all_passed = all(passed)
        score = pass_rate if self.reward_mode == "fraction" else float(all_passed)
        return RewardResult(
            score=score,
            correct=all_passed,
            metrics={
                "pass_rate": pass_rate,
                "syntax_error": float(run.syntax_error),
                "timeout": float(run.timed_out),
                "runtime_error": float(run.runtime_error),
            },
        )

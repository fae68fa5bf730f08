"""The built-in environment ``python``: the policy runs Python while it reasons, in the code reward's sandbox.

Every call runs in the same isolation as a code reward (bubblewrap, the system-call filter, the memory cgroup,
the zygote pool; workers/rewards/code_sandbox.py, whose options ``sandbox`` takes), one sandboxed process per
call. State carries from call to call by **replay**: a call's program first runs the trajectory's earlier cells that
ran cleanly, their output discarded, then the new cell (tool_calls.replay_program). Replay rather than a process
kept alive per trajectory, because then every call is a fresh single-use run under the sandbox's limits: nothing a
cell leaves behind (a background process, a full /tmp, a poisoned module) reaches the next call or another
trajectory, no sandbox is held while the model generates its next turn, and a trajectory resumed after a restart
needs only its text. The cost is the earlier cells' time, counted in each call's `timeout_s`.

What the code does is the tool's answer: its output, cut at ``max_output_chars``; an exception's last line; a
timeout, a memory-limit kill or an output flood said in words, and counted as a tool error. Only a sandbox that
cannot start (EnvironmentUnavailable) masks the trajectory.

Options (``rewards.<domain>.rollout.environment_options``):

- ``call_format`` (``plain``): ``plain`` (``<python>...</python>``, taught: the prompt does not describe it) or
  ``hermes`` (``<tool_call>`` JSON, the prompt describes the tool through the chat template's ``tools`` support);
  see workers/environments/tool_calls.py.
- ``timeout_s`` (5.0): wall-clock limit of one call (its replay included).
- ``max_output_chars`` (2000): the answer is cut there (the rollout also cuts its tokens at the rollout's
  ``max_tool_output_tokens``).
- ``sandbox`` ({}): code_sandbox options for the sandbox (memory_mb, processes, output_kb, isolation,
  concurrency, pool_size, allow_missing_layers, ...); its ``timeout_s`` is this one's.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from typing import Any, ClassVar

from roll_core.environment import Environment, EnvironmentUnavailable, EnvStep
from workers.environments.registry import register_environment
from workers.environments.tool_calls import CALL_FORMATS, TOOL_DESCRIPTION, cut, parse_call, replay_program
from workers.rewards.sandbox.layers import IsolationUnavailable
from workers.rewards.sandbox.process import OUTPUT_LIMIT, TIMEOUT, RunOutput, SandboxUnavailable


def answer(run: RunOutput, timeout_s: float, max_chars: int) -> tuple[str, bool]:
    """The tool's answer to one run (the output cut at `max_chars`, then what ended the run where that was not
    the code's own end), and whether the call failed."""
    out = cut(run.stdout.decode("utf-8", errors="replace"), max_chars)
    if run.status == TIMEOUT:
        return out + f"TimeoutError: the code ran past {timeout_s:g} s", True
    if run.status == OUTPUT_LIMIT:
        return out + f"\n[the run was stopped: it printed more than {len(run.stdout)} bytes]", True
    exits = [e for e in run.events if e.get("ev") == "exit"]
    if exits:
        return out, exits[-1].get("ok") is not True  # the exception's last line is already in the output
    if run.exit_code != 0:
        if run.oom_killed:
            return out + "MemoryError: the code passed the memory limit", True
        return out + f"the process died (exit status {run.exit_code})", True
    return out, False


@register_environment("python")
class PythonToolEnvironment(Environment):
    """A Python tool in the code sandbox, state replayed from call to call (module docstring)."""

    _runners: ClassVar[dict[tuple, Any]] = {}
    _lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(
        self,
        *,
        call_format: str = "plain",
        timeout_s: float = 5.0,
        max_output_chars: int = 2000,
        sandbox: Mapping[str, Any] | None = None,
        **options: object,
    ) -> None:
        super().__init__(**options)
        if call_format not in CALL_FORMATS:
            raise ValueError(f"python environment: call_format must be one of {CALL_FORMATS}, got {call_format!r}")
        if not timeout_s > 0 or not max_output_chars >= 1:
            raise ValueError(
                f"python environment: timeout_s must be > 0 and max_output_chars >= 1, got {timeout_s!r} and "
                f"{max_output_chars!r}"
            )
        if "timeout_s" in (sandbox or {}):
            raise ValueError("python environment: give timeout_s beside sandbox, not inside it")
        self.call_format, self.timeout_s, self.max_output_chars = call_format, float(timeout_s), max_output_chars
        self.sandbox = dict(sandbox or {})
        self.cells: list[str] = []

    def runner(self) -> Any:
        """The code sandbox this process's python environments with these options share (started once)."""
        from workers.rewards.code_sandbox import CodeSandboxScorer

        key = (self.timeout_s, tuple(sorted((k, repr(v)) for k, v in self.sandbox.items())))
        with self._lock:
            if key not in self._runners:
                options = {"sample_timeout_s": self.timeout_s, **self.sandbox, "timeout_s": self.timeout_s}
                try:
                    self._runners[key] = CodeSandboxScorer(**options)
                except (IsolationUnavailable, SandboxUnavailable, OSError) as err:  # the host cannot sandbox
                    raise EnvironmentUnavailable(f"python environment: the sandbox cannot start: {err}") from err
            return self._runners[key]

    @classmethod
    def close_runners(cls) -> None:
        """Stop the shared sandboxes (they also die with the process)."""
        with cls._lock:
            for runner in cls._runners.values():
                runner.close()
            cls._runners.clear()

    def tools(self) -> list[dict[str, Any]] | None:
        return [TOOL_DESCRIPTION] if self.call_format == "hermes" else None

    def reset(self, row: Mapping[str, Any]) -> None:
        self.cells = []

    def step(self, message: str) -> EnvStep:
        call = parse_call(message, self.call_format)
        if call is None:
            return EnvStep(done=True)
        if call.problem is not None:
            return EnvStep(observation=f"error: {call.problem}", tool_calls=1, tool_errors=1)
        started = time.perf_counter()
        try:
            run = self.runner()._run(
                {"mode": "stdio", "code": replay_program([*self.cells, call.code])}, b"", self.timeout_s
            )
        except SandboxUnavailable as err:
            raise EnvironmentUnavailable(f"python environment: {err}") from err
        text, failed = answer(run, self.timeout_s, self.max_output_chars)
        if not failed:
            self.cells.append(call.code)
        return EnvStep(
            observation=text,
            tool_calls=1,
            tool_errors=int(failed),
            tool_s=time.perf_counter() - started,
        )

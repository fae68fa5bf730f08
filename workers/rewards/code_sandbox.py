"""Code reward: run the response's Python program against its tests in a sandbox, and judge it outside.

The pieces live in ``workers/rewards/sandbox/``: ``formats`` (the ``test_cases`` schema), ``harness`` (the code
that runs inside), ``checker`` + ``relay`` (assert-style and ``check(candidate)`` tests, run in a sandbox of their
own against the program's), ``isolation`` + ``layers`` (bubblewrap, limits, and the start-up check of what works on
this host), ``process`` + ``prestarted`` (pre-started local sandboxes), ``remote`` (a SandboxFusion-compatible service)
and ``verdicts`` (verdicts from reported data). docs/code-sandbox.md has the
whole story, including what each hostile program in the regression suite tries.

Reward: the fraction of tests passed (``reward_mode: fraction``) or 1/0 (``all_or_nothing``). Metrics:
``pass_rate`` and, one-hot, the kind of the first failing test: ``syntax_error``, ``runtime_error``, ``timeout``,
``memory_limit``, ``output_limit``, ``wrong_answer`` (all 0 when every test passed). A sample without usable tests
is not applicable (``None``); a sandbox or service failure raises, so the reward worker masks the sample.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import replace

from roll_core.config.rewards import scoring_budget_s
from roll_core.rewards.scorer import RewardResult, RewardScorer
from workers.rewards.registry import register_reward_worker
from workers.rewards.sandbox.cgroup import find_memory_cgroups
from workers.rewards.sandbox.formats import (
    CallTests,
    CheckedTests,
    StdioTests,
    TestSuite,
    extract_code,
    parse_test_cases,
)
from workers.rewards.sandbox.isolation import (
    SandboxLimits,
    SandboxSpec,
    choose_python,
    compile_harness,
    find_bwrap,
    sandbox_identity,
)
from workers.rewards.sandbox.layers import LAYERS, LayerReport, probe_layers, require_layers
from workers.rewards.sandbox.prestarted import SandboxPool
from workers.rewards.sandbox.process import HARNESS_SOURCE, TIMEOUT, RunOutput, kill_orphaned_sandboxes
from workers.rewards.sandbox.remote import SandboxFusionClient
from workers.rewards.sandbox.seccomp import compiled_filter
from workers.rewards.sandbox.stdio_tests import output_budget, per_test_outputs, stdio_tests_job
from workers.rewards.sandbox.verdicts import (
    FAILURE_KINDS,
    PASSED,
    UnsupportedTest,
    judge_calls,
    judge_checked,
    judge_stdio,
)

logger = logging.getLogger(__name__)

_REWARD_MODES = ("fraction", "all_or_nothing")
_BACKENDS = ("local", "remote")
_ISOLATION = ("zygote", "strict")


def _positive_int(name: str, value: object, minimum: int = 1) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"code_sandbox option {name} must be an integer >= {minimum}, got {value!r}")
    return value


def _positive_number(name: str, value: object) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
        raise ValueError(f"code_sandbox option {name} must be a positive number, got {value!r}")
    return float(value)


@register_reward_worker("code_sandbox")
class CodeSandboxScorer(RewardScorer):
    """Scores code against ``test_cases`` (JSON, see ``sandbox/formats.py``); options from
    ``rewards.<domain>.options``:

    - ``timeout_s`` (5.0): wall-clock limit of one program run (one run per sample for assert-style,
      check-function and call-based tests, one per test for stdin/stdout).
    - ``sample_timeout_s`` (20.0): wall-clock budget of all of one sample's runs; a run gets what is left of it
      when that is less than ``timeout_s``, and the tests left when it is spent are timeouts (scored 0). Keep it
      below the reward worker's ``timeout_s`` (30 by default), which masks the sample instead.
    - ``reward_mode`` (``fraction``): or ``all_or_nothing``.
    - ``memory_mb`` (512), ``processes`` (16), ``file_mb`` (16), ``open_files`` (64), ``output_kb`` (1024),
      ``tmp_mb`` (64), ``total_memory_mb`` (1024, all of a run's processes and files together): limits of each
      run (see ``SandboxLimits``).
    - ``float_tolerance`` (1e-6): for numbers in call-based results and stdin/stdout output.
    - ``backend`` (``local``): or ``remote`` (a SandboxFusion-compatible service at ``remote_url``).
    - ``concurrency`` (2): local runs at once in this scorer's process; ``pool_size`` (2 x concurrency):
      sandboxes kept started ahead (deeper is faster, at ~13 MiB per idle sandbox).
    - ``isolation`` (``zygote``): each sandbox is reused, run after run, by a zygote that forks a child per run
      and removes all a run leaves before the next (``sandbox/zygote.py``; a stdin/stdout suite is one run, a
      forked child per test: ``sandbox/stdio_tests.py``); ``strict``: a new sandbox (its own namespaces) per run.
      Without bubblewrap or the system-call filter every run is ``strict``.
    - ``python``: interpreter inside the sandbox (default: this worker's own when the sandbox user can reach it,
      else ``/usr/bin/python3``); ``sandbox_user`` (``nobody``): whom to run as when the worker is root.
    - ``allow_missing_layers`` ([]): isolation layers (``sandbox/layers.py``) this host may lack; any other
      missing layer stops the scorer at start-up.
    - ``remote_url``, ``remote_concurrency`` (8), ``remote_retries`` (3), ``remote_backoff_s`` (0.5).
    """

    #: The default of ``sample_timeout_s``.
    SAMPLE_TIMEOUT_S = 20.0

    @classmethod
    def within_timeout(cls, options: dict, timeout_s: float) -> dict:
        """Without ``sample_timeout_s``, a sample gets the default budget or what the worker's limit leaves
        (``scoring_budget_s``), whichever is less: stdin/stdout tests that are each under ``timeout_s`` but
        together slow would otherwise reach the worker's limit and be masked. A given value is checked against
        the same bound when the config loads."""
        if "sample_timeout_s" in options:
            return options
        return {**options, "sample_timeout_s": min(cls.SAMPLE_TIMEOUT_S, scoring_budget_s(timeout_s))}

    @classmethod
    def io_bound(cls, options) -> bool:
        return options.get("backend") == "remote"  # a SandboxFusion service runs the code; the scorer waits

    def __init__(
        self,
        *,
        timeout_s: float = 5.0,
        sample_timeout_s: float = SAMPLE_TIMEOUT_S,
        reward_mode: str = "fraction",
        memory_mb: int = 512,
        processes: int = 16,
        file_mb: int = 16,
        open_files: int = 64,
        output_kb: int = 1024,
        tmp_mb: int = 64,
        total_memory_mb: int = 1024,
        float_tolerance: float = 1e-6,
        backend: str = "local",
        concurrency: int = 2,
        pool_size: int | None = None,
        isolation: str = "zygote",
        python: str | None = None,
        sandbox_user: str = "nobody",
        allow_missing_layers: list[str] | tuple[str, ...] = (),
        remote_url: str | None = None,
        remote_concurrency: int = 8,
        remote_retries: int = 3,
        remote_backoff_s: float = 0.5,
        **options: object,
    ) -> None:
        super().__init__(**options)
        if reward_mode not in _REWARD_MODES:
            raise ValueError(
                f"code_sandbox option reward_mode must be one of {_REWARD_MODES}, got {reward_mode!r}"
            )
        if isolation not in _ISOLATION:
            raise ValueError(f"code_sandbox option isolation must be one of {_ISOLATION}, got {isolation!r}")
        if backend not in _BACKENDS:
            raise ValueError(f"code_sandbox option backend must be one of {_BACKENDS}, got {backend!r}")
        unknown = sorted(set(allow_missing_layers) - set(LAYERS))
        if unknown:
            raise ValueError(
                f"code_sandbox option allow_missing_layers names unknown layers {unknown}; known: {list(LAYERS)}"
            )
        self.limits = SandboxLimits(
            timeout_s=_positive_number("timeout_s", timeout_s),
            memory_mb=_positive_int("memory_mb", memory_mb, 64),
            processes=_positive_int("processes", processes, 2),
            file_mb=_positive_int("file_mb", file_mb),
            open_files=_positive_int("open_files", open_files, 16),
            output_bytes=_positive_int("output_kb", output_kb) * 1024,
            tmp_mb=_positive_int("tmp_mb", tmp_mb),
            total_memory_mb=_positive_int("total_memory_mb", total_memory_mb, 64),
        )
        self.sample_timeout_s = _positive_number("sample_timeout_s", sample_timeout_s)
        self.reward_mode = reward_mode
        self.float_tolerance = _positive_number("float_tolerance", float_tolerance)
        self.backend = backend
        self.concurrency = _positive_int("concurrency", concurrency)
        self.pool_size = None if pool_size is None else _positive_int("pool_size", pool_size)
        self.isolation = isolation
        self.remote = None
        self.spec: SandboxSpec | None = None
        self.layers: LayerReport | None = None
        if backend == "remote":
            if not isinstance(remote_url, str):
                raise ValueError("code_sandbox option remote_url is required with backend: remote")
            self.remote = {
                "url": remote_url,
                "concurrency": _positive_int("remote_concurrency", remote_concurrency),
                "retries": _positive_int("remote_retries", remote_retries, 0),
                "backoff_s": _positive_number("remote_backoff_s", remote_backoff_s),
            }
        else:
            self.spec, self.layers = _checked_spec(
                python, sandbox_user, tuple(allow_missing_layers), self.limits
            )
        self._lock = threading.Lock()
        self._executor: SandboxPool | SandboxFusionClient | None = None
        self._executor_pid = -1

    # A scorer may be sent to another process: the pool's threads and processes stay behind and are rebuilt there.
    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        for key in ("_lock", "_executor"):
            state.pop(key)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _lock=threading.Lock(), _executor=None, _executor_pid=-1)

    def _executor_here(self) -> SandboxPool | SandboxFusionClient:
        with self._lock:
            if self._executor is None or self._executor_pid != os.getpid():
                self._executor_pid = os.getpid()
                if self.remote is not None:
                    self._executor = SandboxFusionClient(
                        self.remote["url"],
                        self.limits,
                        concurrency=self.remote["concurrency"],
                        retries=self.remote["retries"],
                        backoff_s=self.remote["backoff_s"],
                    )
                else:
                    self._executor = SandboxPool(self.spec, self.concurrency, self.pool_size, reuse=self.reuses())
            return self._executor

    #: Stdin/stdout suites of at least this many tests run in one run (``stdio_tests.py``); fewer, a run each.
    _BATCH_STDIO_FROM = 2

    def reuses(self) -> bool:
        """Whether runs reuse sandboxes: ``isolation: zygote`` on a host where the layers a zygote's clean-up
        stands on were seen working (its kill of every other process is confined by the PID namespace, its
        emptying of /tmp by the mount namespace; the filter keeps IPC objects from outliving a run)."""
        needed = ("bubblewrap", "pid_namespace", "mount_namespace", "ipc_namespace", "seccomp")
        return (
            self.isolation == "zygote"
            and self.layers is not None
            and all(self.layers.available.get(name, False) for name in needed)
        )

    def _run(self, job: dict, stdin: bytes = b"", timeout_s: float | None = None) -> RunOutput:
        executor = self._executor_here()
        if isinstance(executor, SandboxFusionClient):
            return executor.run({**job, "limits": self.limits.for_job()}, stdin)
        return executor.run({**job, "limits": self.limits.for_job()}, stdin, timeout_s)

    def close(self) -> None:
        """Stop the local sandboxes kept started (they also die with the process)."""
        with self._lock:
            if isinstance(self._executor, SandboxPool):
                self._executor.close()
            self._executor = None

    def outcomes(self, suite: TestSuite, code: str) -> list[str]:
        """One outcome (``passed`` or a failure kind) per test of ``suite``, within ``sample_timeout_s``."""
        deadline = time.monotonic() + self.sample_timeout_s
        if isinstance(suite, CheckedTests):
            return judge_checked(self._run_checked(suite, code, self.sample_timeout_s))
        if isinstance(suite, CallTests):
            job = {"mode": "call", "code": code, "fn_name": suite.fn_name, "calls": list(suite.inputs)}
            return judge_calls(suite, self._run(job, timeout_s=self.sample_timeout_s), self.float_tolerance)
        assert isinstance(suite, StdioTests)
        executor = self._executor_here()
        if isinstance(executor, SandboxPool) and executor.reuse and len(suite.inputs) >= self._BATCH_STDIO_FROM:
            # One run: the program compiled once, a forked child per test (``stdio_tests.py``).
            job = stdio_tests_job(code, suite.inputs, self.limits)
            run = executor.run_tests(job, output_budget(len(suite.inputs), self.limits), self.sample_timeout_s)
            outputs = per_test_outputs(run, len(suite.inputs))
            return [
                judge_stdio(expected, output, self.float_tolerance)
                for expected, output in zip(suite.outputs, outputs, strict=True)
            ]
        results: list[str] = []
        for stdin, expected in zip(suite.inputs, suite.outputs, strict=True):
            remaining = deadline - time.monotonic()
            if TIMEOUT in results or remaining <= 0:
                results.append(TIMEOUT)
                continue
            output = self._run({"mode": "stdio", "code": code}, stdin.encode(), timeout_s=remaining)
            results.append(judge_stdio(expected, output, self.float_tolerance))
        return results

    def _run_checked(self, suite: CheckedTests, code: str, timeout_s: float) -> list[str]:
        executor = self._executor_here()
        if isinstance(executor, SandboxFusionClient):
            raise ValueError(
                "code_sandbox: assert-style and check(candidate) tests need backend: local (their test code runs in "
                "a second sandbox that talks to the program's; a remote service runs one script, which would put the "
                "expected values in the program's reach). Use call-based or stdin/stdout tests with a remote backend."
            )
        limits = self.limits.for_job()
        program = {"mode": "serve", "code": code, "limits": limits}
        checker = {
            "mode": "check",
            "tests": list(suite.tests),
            "entry_point": suite.entry_point,
            "setup": suite.setup,
            # The checker serves many jobs: the worker's clock bounds each, not a lifetime CPU limit.
            "limits": {**limits, "cpu_s": 10**6},
        }
        return executor.run_checked(program, checker, timeout_s)

    @classmethod
    def check_row(cls, row: Mapping[str, object]) -> Iterator[tuple[str, str]]:
        """The row's tests must parse (the ground truth, a reference solution, is not needed): ``test_cases``,
        or, as in ``score``, a ground truth that is itself a test suite when ``test_cases`` is absent."""
        raw = row.get("test_cases")
        if isinstance(raw, str) and not raw.strip():
            yield "test_cases", "empty"
            return
        try:
            parse_test_cases(row.get("ground_truth") if raw is None else raw)
        except ValueError as err:
            yield "test_cases", "missing" if raw is None else str(err)

    def score(self, response: str, ground_truth: str, **fields: object) -> RewardResult | None:
        # `roll rewards score --ground-truth @tests.json` passes the tests as the ground truth.
        raw = fields.get("test_cases")
        try:
            suite = parse_test_cases(ground_truth if raw is None else raw)
        except ValueError as err:
            logger.warning(
                "code_sandbox: sample %r has no usable test_cases (%s); not scored", fields.get("id"), err
            )
            return None
        try:
            results = self.outcomes(suite, extract_code(response or ""))
        except UnsupportedTest as err:
            logger.warning(
                "code_sandbox: sample %r has a test that cannot be run (%s); not scored",
                fields.get("id"),
                err,
            )
            return None
        passed = sum(1 for r in results if r == PASSED)
        pass_rate = passed / len(results)
        all_passed = passed == len(results)
        first_failure = next((r for r in results if r != PASSED), None)
        metrics = {"pass_rate": pass_rate}
        metrics.update({kind: float(kind == first_failure) for kind in FAILURE_KINDS})
        return RewardResult(
            score=pass_rate if self.reward_mode == "fraction" else float(all_passed),
            correct=all_passed,
            metrics=metrics,
        )


def _checked_spec(
    python: str | None, sandbox_user: str, allow_missing: tuple[str, ...], limits: SandboxLimits
) -> tuple[SandboxSpec, LayerReport]:
    """The sandbox to use on this host, after checking its layers; raises ``IsolationUnavailable`` if short."""
    uid, gid, problem = sandbox_identity(sandbox_user)
    if problem:
        logger.warning("code_sandbox: %s", problem)
    bwrap = find_bwrap()
    bpf, seccomp_problem = compiled_filter()
    kill_orphaned_sandboxes(uid if uid is not None else os.getuid())
    cgroups, cgroup_problem = find_memory_cgroups()
    interpreter = choose_python(python, needs_world_access=uid is not None)
    spec = SandboxSpec(
        python=interpreter,
        uid=uid,
        gid=gid,
        bwrap=bwrap,
        limits=limits,
        seccomp=bpf,
        memory_cgroups=cgroups,
        harness_bytecode=compile_harness(interpreter, HARNESS_SOURCE),
    )
    report = probe_layers(spec) if bwrap else None
    if report is None or not report.available["bubblewrap"]:
        why = report.error if report is not None else "no `bwrap` on PATH"
        spec = replace(spec, bwrap=None)
        if "bubblewrap" in allow_missing:
            plain = probe_layers(spec)
            report = LayerReport(plain.available, error="; ".join(e for e in (why, plain.error) if e))
        else:
            report = LayerReport(dict.fromkeys(LAYERS, False), error=why)
    problems = [e for e in (report.error, seccomp_problem, cgroup_problem) if e]
    if problems:
        report = LayerReport(report.available, error="; ".join(problems))
    require_layers(report, allow_missing)
    if report.missing:
        logger.warning("code_sandbox: running WITHOUT isolation layers %s, as configured", report.missing)
    return spec, report

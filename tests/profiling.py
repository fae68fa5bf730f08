"""`make test-profile`: where the suite's time goes, per test file, per fixture and per start-up stage.

A pytest plugin, active with `--profile-out=PATH` (tests/conftest.py's hooks call `add_option` and `configure`). Every test's report carries what
its worker timed (in `user_properties`, which pytest-xdist sends to the controller): each fixture set up for it
(`pytest_fixture_setup`), and each start-up stage run in the test's own process (STAGES: a local Ray cluster, a
pipeline's set-up and shutdown, a model's load, a vLLM engine). The controller adds them up and writes PATH
(Markdown) and PATH with `.json`. Stages that run in other processes (a `roll run` subprocess, Ray's workers) are
inside their test's time, not in a stage of their own. No test asserts on any of it: it is a report.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

#: Named stages: (module, attribute path) of what is timed, by what it starts.
STAGES = {
    "ray start": [("roll_pipeline.driver.runtime", "start_local_ray"), ("ray", "init")],
    "ray shutdown": [("ray", "shutdown")],
    "pipeline setup": [("roll_pipeline.driver.pipeline", "RLVRPipeline.setup")],
    "pipeline run": [("roll_pipeline.driver.pipeline", "RLVRPipeline.run")],
    "pipeline shutdown": [("roll_pipeline.driver.pipeline", "RLVRPipeline.shutdown")],
    "model load": [("transformers.modeling_utils", "PreTrainedModel.from_pretrained")],
    "vllm engine": [("vllm", "LLM.__init__")],
}
PROPERTY = "roll_profile"

_pending: dict[str, list] = {"fixtures": [], "stages": []}
_depth: dict[str, int] = defaultdict(int)


def add_option(parser: pytest.Parser) -> None:
    parser.addoption("--profile-out", default=None, metavar="PATH",
                     help="write where the time goes (per file, fixture and start-up stage) to PATH (Markdown) "
                          "and PATH.json")


def configure(config: pytest.Config) -> None:
    if not config.getoption("--profile-out"):
        return
    config.pluginmanager.register(_WorkerTimer(), "roll-profile-worker")
    if not hasattr(config, "workerinput"):  # the controller (or the one process of -n 0) writes the report
        config.pluginmanager.register(_Report(Path(config.getoption("--profile-out"))), "roll-profile-report")


def _timed(stage: str, function):
    """`function`, recording its wall time under `stage` (an outermost call only: ray.init inside
    start_local_ray counts once)."""

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        _depth[stage] += 1
        started = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            _depth[stage] -= 1
            if _depth[stage] == 0:
                _pending["stages"].append((stage, time.perf_counter() - started))

    wrapper.__roll_profiled__ = True
    return wrapper


def _install_stage_timers() -> None:
    """Wrap STAGES' functions where they are defined, before the test modules import them by name."""
    for stage, places in STAGES.items():
        for module_name, path in places:
            try:
                owner: Any = importlib.import_module(module_name)
                *parents, name = path.split(".")
                for parent in parents:
                    owner = getattr(owner, parent)
                function = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
            except (ImportError, AttributeError, KeyError):
                continue  # not installed here (vLLM on a host without it): nothing of it to time
            if isinstance(function, classmethod):
                wrapped = classmethod(_timed(stage, function.__func__))
            else:
                if getattr(function, "__roll_profiled__", False):
                    continue
                wrapped = _timed(stage, function)
            setattr(owner, name, wrapped)


class _WorkerTimer:
    """In each process that runs tests: times fixtures and stages, and attaches them to the test's reports."""

    def __init__(self) -> None:
        _install_stage_timers()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_fixture_setup(self, fixturedef, request):
        started = time.perf_counter()
        yield
        _pending["fixtures"].append((fixturedef.argname, fixturedef.scope, time.perf_counter() - started))

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        report = outcome.get_result()
        report.user_properties.append((PROPERTY, {"fixtures": _pending["fixtures"], "stages": _pending["stages"]}))
        _pending["fixtures"], _pending["stages"] = [], []


class _Report:
    """In the controller: adds up the reports and writes the profile at the end of the session."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.started = time.time()
        self.tests: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.fixtures: dict[tuple[str, str], list[float]] = defaultdict(list)
        self.fixture_files: dict[tuple[str, str], set[str]] = defaultdict(set)
        self.stages: dict[str, list[float]] = defaultdict(list)
        self.stage_files: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        file = report.nodeid.split("::", 1)[0]
        self.tests[report.nodeid][report.when] += report.duration
        self.tests[report.nodeid]["outcome_" + report.outcome] = 1
        for key, value in report.user_properties:
            if key != PROPERTY:
                continue
            for name, scope, seconds in value["fixtures"]:
                self.fixtures[(name, scope)].append(seconds)
                self.fixture_files[(name, scope)].add(file)
            for stage, seconds in value["stages"]:
                self.stages[stage].append(seconds)
                self.stage_files[stage][file] += seconds

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        wall = time.time() - self.started
        data = self.summary(wall, session.config)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
        self.out.write_text(markdown(data))

    def summary(self, wall: float, config: pytest.Config) -> dict:
        files: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        for nodeid, phases in self.tests.items():
            file = files[nodeid.split("::", 1)[0]]
            file["tests"] += 1
            for phase in ("setup", "call", "teardown"):
                file[phase] += phases.get(phase, 0.0)
            file["total"] += sum(phases.get(p, 0.0) for p in ("setup", "call", "teardown"))
        load = os.getloadavg()
        return {
            "wall_s": round(wall, 1),
            "workers": config.getoption("numprocesses", None) if config.pluginmanager.has_plugin("xdist") else 0,
            "load_at_end": [round(x, 2) for x in load],
            "files": {f: {k: round(v, 1) for k, v in d.items()} for f, d in
                      sorted(files.items(), key=lambda kv: -kv[1]["total"])},
            "fixtures": [
                {"fixture": name, "scope": scope, "setups": len(times), "total_s": round(sum(times), 1),
                 "max_s": round(max(times), 1), "files": len(self.fixture_files[(name, scope)])}
                for (name, scope), times in sorted(self.fixtures.items(), key=lambda kv: -sum(kv[1]))
                if sum(times) >= 0.5
            ],
            "stages": [
                {"stage": stage, "count": len(times), "total_s": round(sum(times), 1),
                 "max_s": round(max(times), 1),
                 "top_files": {f: round(s, 1) for f, s in
                               sorted(self.stage_files[stage].items(), key=lambda kv: -kv[1])[:5]}}
                for stage, times in sorted(self.stages.items(), key=lambda kv: -sum(kv[1]))
            ],
            "slowest_tests": [
                {"test": nodeid, **{p: round(phases.get(p, 0.0), 1) for p in ("setup", "call", "teardown")}}
                for nodeid, phases in sorted(self.tests.items(), key=lambda kv: -sum(
                    kv[1].get(p, 0.0) for p in ("setup", "call", "teardown")))[:40]
            ],
        }


def markdown(data: dict) -> str:
    test_time = sum(f["total"] for f in data["files"].values())
    lines = [
        "# Where the suite's time goes",
        "",
        f"Wall time {data['wall_s']:.0f} s on {data['workers'] or 1} worker(s); the tests' own time adds up to "
        f"{test_time:.0f} s (set-up, call and teardown; a worker's idle time is in neither). Load average at the end: "
        f"{', '.join(map(str, data['load_at_end']))}.",
        "",
        "## Per test file",
        "",
        "| file | tests | total s | set-up s | call s | teardown s |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for file, d in data["files"].items():
        lines.append(f"| {file} | {d['tests']:.0f} | {d['total']:.1f} | {d['setup']:.1f} | {d['call']:.1f} | "
                     f"{d['teardown']:.1f} |")
    lines += ["", "## Start-up stages (in the tests' own processes)", "",
              "| stage | count | total s | max s | most in |", "| --- | ---: | ---: | ---: | --- |"]
    for s in data["stages"]:
        top = ", ".join(f"{f.rsplit('/', 1)[-1]} {v:.0f}" for f, v in list(s["top_files"].items())[:3])
        lines.append(f"| {s['stage']} | {s['count']} | {s['total_s']:.1f} | {s['max_s']:.1f} | {top} |")
    lines += ["", "## Fixtures (set-up time, 0.5 s or more in all)", "",
              "| fixture | scope | set-ups | total s | max s | files |", "| --- | --- | ---: | ---: | ---: | ---: |"]
    for f in data["fixtures"]:
        lines.append(f"| {f['fixture']} | {f['scope']} | {f['setups']} | {f['total_s']:.1f} | {f['max_s']:.1f} | "
                     f"{f['files']} |")
    lines += ["", "## Slowest tests", "", "| test | set-up s | call s | teardown s |", "| --- | ---: | ---: | ---: |"]
    for t in data["slowest_tests"]:
        lines.append(f"| {t['test']} | {t['setup']:.1f} | {t['call']:.1f} | {t['teardown']:.1f} |")
    return "\n".join(lines) + "\n"

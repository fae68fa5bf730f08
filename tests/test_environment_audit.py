"""Environment audits (workers/environments/audit.py, roll_pipeline/driver/reward_audit.py): panels load and filter
by the environment's options, a tool that drifts fails them with each item named, one whose infrastructure fails
counts as unavailable, and the driver's audit stops the run or warns. The packaged python panel against the real
sandbox: tests/test_environments.py; through a run's scheduler: tests/test_multi_turn_async.py."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from roll_core.environment import Environment, EnvironmentUnavailable, EnvStep
from roll_pipeline.driver.names import load_run_config
from roll_pipeline.driver.reward_audit import RewardAuditError, environment_plan, run_audit
from tests.conftest import EXAMPLES
from workers.environments.audit import EnvAuditItem, load_panel, panel_for, panel_results, run_panel
from workers.environments.python_tool import PythonToolEnvironment

PRODUCT = EnvAuditItem("product", "answer", ["<python>\nprint(2 * 3)\n</python>"], 0, observation="6\n")
FAILS = EnvAuditItem("fails", "error", ["<python>\n1/0\n</python>"], 1, contains="ZeroDivisionError")
FINAL = EnvAuditItem("final", "final", ["It is 6."], 0)


class Calculator(Environment):
    """A python tool stand-in: evaluates the call's expression; `drift` makes it answer wrong."""

    def __init__(self, *, drift: bool = False, down: bool = False, **options):
        super().__init__(**options)
        self.drift, self.down = drift, down

    def step(self, message):
        if self.down:
            raise EnvironmentUnavailable("the sandbox pool is gone")
        if "<python>" not in message:
            return EnvStep(done=True)
        code = message.split("<python>\n", 1)[1].split("\n</python>", 1)[0].removeprefix("print(").removesuffix(")")
        try:
            value = eval(code)
        except ZeroDivisionError as err:
            return EnvStep(observation=f"ZeroDivisionError: {err}\n", tool_calls=1, tool_errors=1)
        return EnvStep(observation=f"{value + 1 if self.drift else value}\n", tool_calls=1)


def test_an_honest_tool_passes_and_a_drifting_one_fails_naming_each_item():
    items = [PRODUCT, FAILS, FINAL]
    assert panel_results(items, run_panel(Calculator, items)).failures == []
    result = panel_results(items, run_panel(lambda: Calculator(drift=True), items))
    assert result.failures == ["product (answer): expected '6\\n', got '7\\n'"] and result.passed == 2
    down = panel_results(items, run_panel(lambda: Calculator(down=True), items))
    assert down.masked == 3 and down.passed == 0
    assert down.failures[0] == "product (answer): the environment was unavailable: the sandbox pool is gone"


def test_a_final_answer_must_end_and_a_call_must_not():
    class Silent(Calculator):
        def step(self, message):
            return EnvStep(done=True)

    class Chatty(Calculator):
        def step(self, message):
            return EnvStep(observation="more?")

    assert panel_results([PRODUCT], run_panel(Silent, [PRODUCT])).failures == [
        "product (answer): expected an answer, the trajectory ended; expected '6\\n', got ''"
    ]
    assert panel_results([FINAL, FAILS], run_panel(Chatty, [FINAL, FAILS])).failures == [
        "final (final): expected the trajectory to end, got the answer 'more?'",
        "fails (error): expected an answer holding 'ZeroDivisionError', got 'more?'; expected 1 tool error(s), got 0",
    ]


def test_panels_name_bad_lines_and_keep_the_items_for_the_environments_options(tmp_path):
    path = tmp_path / "p.jsonl"
    for line, message in (
        ('{"id": "a", "kind": "answer", "messages": ["x"]}', "p.jsonl:1: not an environment audit item"),
        ('{"id": "a", "kind": "guess", "messages": ["x"], "tool_errors": 0, "observation": ""}', "kind must be"),
        ('{"id": "a", "kind": "answer", "messages": ["x"], "tool_errors": 0}', "exactly one of observation and"),
        ('{"id": "a", "kind": "final", "messages": ["x"], "tool_errors": 0, "extra": 1}', r"unknown field\(s\)"),
    ):
        path.write_text(line + "\n")
        with pytest.raises(ValueError, match=message):
            load_panel(path)
    plain = {"id": "p", "kind": "final", "messages": ["x"], "tool_errors": 0, "environment_options": {"call_format": "plain"}}
    hermes = {**plain, "id": "h", "environment_options": {"call_format": "hermes"}}
    path.write_text(f"{json.dumps(plain)}\n\n{json.dumps(hermes)}\n")

    class Named(PythonToolEnvironment):
        audit_panel = str(path)

    # the option's default (plain) counts where the config leaves it out
    assert [i.id for i in panel_for("x", Named, {})] == ["p"]
    assert [i.id for i in panel_for("x", Named, {"call_format": "hermes", "timeout_s": 2})] == ["h"]
    assert panel_for("nothing-packaged", Calculator, {}) is None


def test_the_plan_audits_the_multi_turn_domains_whose_environment_has_a_panel():
    config = EXAMPLES / "tool_math.yaml"
    plan = environment_plan(load_run_config(config, []).config)
    assert list(plan) == ["tool_math"] and all(i.environment_options["call_format"] == "plain" for i in plan["tool_math"])
    assert environment_plan(load_run_config(config, ["rewards.tool_math.rollout=single_turn"]).config) == {}


class Scheduler:
    """A domain scheduler actor's `__ray_call__`, called as the driver calls it; its rollout's environment is
    `make`'s."""

    def __init__(self, make):
        self.__ray_call__ = self
        self.rollout = SimpleNamespace(environment_cls=make, config=SimpleNamespace(environment_options={}))

    def remote(self, fn, *args):
        return fn(self, *args)


def test_the_drivers_audit_stops_or_warns_on_a_drifting_tool(caplog):
    items = [PRODUCT, FAILS, FINAL]
    clusters = {"tools": {"tools": object()}}
    schedulers = {"tools": Scheduler(lambda: Calculator(drift=True))}

    def audit(on_change, schedulers):
        return run_audit(2, {}, [], clusters, lambda refs, names: refs, judge_items=0, on_change=on_change,
                         environments={"tools": items}, schedulers=schedulers)

    with pytest.raises(RewardAuditError, match=r"reward audit at step 2: 1 panel item\(s\) .*tools environment: "
                                               r"product \(answer\): expected '6\\n', got '7\\n'"):
        audit("stop", schedulers)
    metrics = audit("warn", schedulers)
    assert metrics == {"reward_audit/tools/environment/pass": 2 / 3, "reward_audit/tools/environment/failed": 1.0,
                       "reward_audit/tools/environment/unavailable": 0.0}
    assert "tools environment: product (answer)" in caplog.text
    honest = audit("stop", {"tools": Scheduler(Calculator)})
    assert honest["reward_audit/tools/environment/pass"] == 1.0

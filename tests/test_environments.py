"""Environments of multi-turn rollouts: the contract, the registry, the python tool's call formats, and the python
tool in the real code sandbox (state replayed call to call; errors, timeouts, floods and hostile code answered as
the tool's answer, the host and other trajectories untouched)."""

from __future__ import annotations

import importlib.metadata
import json
import os

import pytest

from roll_core.environment import Environment, EnvironmentUnavailable, EnvStep
from tests.test_code_sandbox_hostile import canary, leftover_processes  # noqa: F401 (a fixture)
from workers.environments import registry
from workers.environments.python_tool import PythonToolEnvironment
from workers.environments.tool_calls import cut, parse_call, replay_program
from workers.rewards.sandbox.layers import IsolationUnavailable

# ---------------------------------------------------------------------------------------------- call formats


def test_a_plain_call_ends_the_message():
    assert parse_call("I will compute.\n<python>\nprint(2 + 3)\n</python>", "plain").code == "print(2 + 3)"
    assert parse_call("<python>x = 1\nprint(x)</python>\n  ", "plain").code == "x = 1\nprint(x)"
    # the last call is the one that ends the message
    assert parse_call("<python>a</python> then <python>b</python>", "plain").code == "b"
    assert parse_call("<python>  \n</python>", "plain").problem == "the call holds no code"


@pytest.mark.parametrize(
    "message",
    ["The answer is 5.", "<python>print(1)</python> so the answer is 1", "<python>\nprint(1)\n", "</python>"],
    ids=["no-call", "call-then-text", "unclosed", "closing-only"],
)
def test_a_message_not_ending_in_a_call_is_the_final_answer(message):
    assert parse_call(message, "plain") is None


def test_hermes_calls_and_what_is_wrong_with_them():
    def call(body):
        return parse_call(f"thinking\n<tool_call>\n{body}\n</tool_call>", "hermes")

    assert call(json.dumps({"name": "python", "arguments": {"code": "print(6 * 7)"}})).code == "print(6 * 7)"
    as_string = json.dumps({"name": "python", "arguments": json.dumps({"code": "print(1)"})})
    assert call(as_string).code == "print(1)"
    assert call("{not json").problem.startswith("the tool call is not valid JSON")
    assert call(json.dumps({"name": "search", "arguments": {}})).problem == (
        "unknown tool 'search'; the only tool is 'python'"
    )
    assert call("[1, 2]").problem == "unknown tool None; the only tool is 'python'"
    assert "needs" in call(json.dumps({"name": "python", "arguments": {"code": " "}})).problem
    assert parse_call("<python>print(1)</python>", "hermes") is None  # the other format's call is text


def test_cut_says_how_much_it_cut():
    assert cut("abc", 3) == "abc"
    assert cut("abcdef", 4) == "abcd\n[output cut: 2 more characters]"


def test_the_replay_program_quotes_cells_as_data():
    cells = ["x = 1", "print('CELLS', x)\n_run_cells(CELLS)"]
    program = replay_program(cells)
    compile(program, "<replay>", "exec")
    assert program.count("_run_cells([") == 1 and program.endswith(f"\n_run_cells({cells!r})\n")


# ---------------------------------------------------------------------------------------------- contract


def test_an_environment_refuses_unknown_options():
    class Echo(Environment):
        def __init__(self, *, loud: bool = False, **options):
            super().__init__(**options)

    with pytest.raises(TypeError, match=r"Echo: unknown option\(s\) \['lod'\]; accepted options: \['loud'\]"):
        Echo(lod=True)
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['timeout'\]; accepted options: \["):
        PythonToolEnvironment(timeout=3)
    with pytest.raises(ValueError, match="call_format must be one of"):
        PythonToolEnvironment(call_format="json")
    with pytest.raises(ValueError, match="give timeout_s beside sandbox"):
        PythonToolEnvironment(sandbox={"timeout_s": 3})


@pytest.fixture
def clean_registry(monkeypatch):
    registry.ENVIRONMENTS.import_builtins()
    monkeypatch.setattr(registry.ENVIRONMENTS, "items", dict(registry.ENVIRONMENTS.items))


def test_environments_are_found_by_name_path_and_entry_point(clean_registry, monkeypatch):
    assert registry.get_environment_cls("python") is PythonToolEnvironment
    assert registry.get_environment_cls("workers.environments.python_tool:PythonToolEnvironment") is (
        PythonToolEnvironment
    )
    with pytest.raises(ValueError, match=r"unknown environment 'pyton'; available: python \(or give"):
        registry.get_environment_cls("pyton")
    with pytest.raises(TypeError, match="must be a subclass of Environment"):
        registry.register_environment("not_one")(dict)
    with pytest.raises(TypeError, match="is not a subclass of Environment"):
        registry.get_environment_cls("json:JSONDecoder")

    @registry.register_environment("countdown")
    class Countdown(Environment):
        def reset(self, row):
            self.left = row["turns"]

        def step(self, message):
            self.left -= 1
            return EnvStep(observation=str(self.left), done=self.left == 0)

    entry_point = importlib.metadata.EntryPoint(
        name="third_party", value=f"{__name__}:ScriptedEnvironment", group=registry.ENTRY_POINT_GROUP
    )
    monkeypatch.setattr(
        importlib.metadata, "entry_points",
        lambda *, group: [entry_point] if group == registry.ENTRY_POINT_GROUP else [],
    )
    assert registry.ENVIRONMENTS.available() == {
        "countdown": f"{__name__}:test_environments_are_found_by_name_path_and_entry_point.<locals>.Countdown",
        "python": "workers.environments.python_tool:PythonToolEnvironment",
        "third_party": f"{__name__}:ScriptedEnvironment",
    }
    assert registry.get_environment_cls("third_party") is ScriptedEnvironment
    env = registry.get_environment_cls("countdown")()
    env.reset({"turns": 2})
    assert [env.step("a"), env.step("b")] == [EnvStep("1"), EnvStep("0", done=True)]


class ScriptedEnvironment(Environment):
    """An environment a plugin package could ship (its entry point is faked in the test above)."""

    def step(self, message):
        return EnvStep(done=True)


# ---------------------------------------------------------------------------------------------- the python tool


@pytest.fixture(scope="module")
def make_env():
    made = []

    def make(**options):
        env = PythonToolEnvironment(**{"timeout_s": 5.0, **options})
        try:
            env.runner()
        except IsolationUnavailable as err:
            pytest.skip(f"this host cannot isolate the sandbox: {err}")
        env.reset({"prompt": "p"})
        made.append(env)
        return env

    yield make
    PythonToolEnvironment.close_runners()


def call(env, code):
    return env.step(f"Let me compute.\n<python>\n{code}\n</python>")


def test_a_call_answers_with_its_output_and_the_final_answer_ends(make_env):
    env = make_env()
    step = call(env, "print(123 * 456)")
    assert step.observation == "56088\n" and not step.done and (step.tool_calls, step.tool_errors) == (1, 0)
    assert 0 < step.tool_s < 5
    assert env.step("The product is 56088.") == EnvStep(done=True)


def test_state_carries_to_the_next_call_by_replay(make_env):
    env = make_env()
    assert call(env, "import random\nx = 6\nr = random.random()\nprint('first', x)").observation == "first 6\n"
    # the earlier cell's output is not shown again; its names and its random draw are there
    again = call(env, "print(x * 7, r == __import__('random').Random(0).random())")
    assert again.observation == "42 True\n"
    other = make_env()  # another trajectory sees none of it
    assert call(other, "print(x)").observation.endswith("NameError: name 'x' is not defined\n")
    env.reset({"prompt": "q"})  # nor does the same environment's next trajectory
    assert "NameError" in call(env, "print(x)").observation


def test_an_exception_is_the_answer_and_its_cell_is_not_replayed(make_env):
    env = make_env()
    step = call(env, "print('before')\ny = 1 / 0")
    assert step.observation == "before\nZeroDivisionError: division by zero\n" and step.tool_errors == 1
    syntax = call(env, "print(")
    assert "SyntaxError" in syntax.observation and syntax.tool_errors == 1
    # the failed cells left nothing: this one runs alone (a replayed `1 / 0` would fail it too)
    assert call(env, "print('after', 'y' in globals())").observation == "after False\n"
    assert call(env, "raise SystemExit(0)").tool_errors == 0
    assert call(env, "raise SystemExit(3)").observation.endswith("SystemExit: 3\n")


def test_a_timeout_a_flood_and_a_long_answer_are_answers(make_env):
    env = make_env(timeout_s=1.0, max_output_chars=300, sandbox={"output_kb": 4})
    slow = call(env, "print('start', flush=True)\nwhile True:\n    pass")
    assert slow.observation == "start\nTimeoutError: the code ran past 1 s" and slow.tool_errors == 1
    flood = call(env, "while True:\n    print('x' * 1000)")
    assert flood.tool_errors == 1 and flood.observation == (
        "x" * 300 + "\n[output cut: 3796 more characters]\n[the run was stopped: it printed more than 4096 bytes]"
    )
    assert len(call(env, "print('y' * 299)").observation) == 300  # the line and its newline: not cut
    long = call(env, "print('y' * 500)")
    assert long.tool_errors == 0 and long.observation == "y" * 300 + "\n[output cut: 201 more characters]"
    # a call that is not code is answered too
    empty = env.step("<python>\n</python>")
    assert empty == EnvStep(observation="error: the call holds no code", tool_calls=1, tool_errors=1)


def test_hostile_calls_leave_the_host_and_other_trajectories_untouched(make_env, canary):  # noqa: F811
    """Code from the sandbox's hostile suite as tool calls: each is the tool's answer (an error, not a crash of
    the rollout), nothing is left running, the host's files are as they were, and a trajectory beside it carries
    on with its state."""
    bystander = make_env(timeout_s=15.0)
    assert call(bystander, "total = 41").tool_errors == 0
    env = make_env(timeout_s=15.0)
    hostile = {
        "memory": ("chunks = []\nwhile True:\n    chunks.append(bytearray(10 ** 7))", "MemoryError"),
        "fork bomb": (
            "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
            "TimeoutError",
        ),
        "kill -1": ("import os, signal\nos.kill(-1, signal.SIGKILL)\nos.kill(os.getppid(), signal.SIGKILL)", ""),
        "files": (
            f"import os\nopen({str(canary / 'keep.txt')!r}, 'w').write('changed')",
            "Error: [Errno",
        ),
    }
    for name, (code, expected) in hostile.items():
        step = call(env, code)
        assert step.tool_calls == 1 and not step.done, name
        assert expected in step.observation, (name, step.observation)
        assert step.tool_errors == 1, (name, step)
    assert (canary / "keep.txt").read_text() == "original" and sorted(os.listdir(canary)) == ["keep.txt"]
    assert call(bystander, "print(total + 1)").observation == "42\n"
    assert call(env, "print('still here')").observation == "still here\n"
    PythonToolEnvironment.close_runners()
    assert leftover_processes(wait_s=60.0) == []


@pytest.mark.parametrize("failure", [OSError("no bwrap"), IsolationUnavailable("no bwrap")])
def test_a_sandbox_that_cannot_start_is_the_infrastructures_failure(monkeypatch, failure):
    from workers.rewards import code_sandbox

    def refuse(**options):
        raise failure

    monkeypatch.setattr(code_sandbox, "CodeSandboxScorer", refuse)
    env = PythonToolEnvironment(timeout_s=2.5)
    with pytest.raises(EnvironmentUnavailable, match="the sandbox cannot start: no bwrap"):
        call(env, "print(1)")
    assert env.step("no call, so no sandbox needed") == EnvStep(done=True)


def test_a_bug_in_starting_the_sandbox_is_not_called_the_infrastructures(monkeypatch):
    from workers.rewards import code_sandbox

    def broken(**options):
        raise KeyError("memory_mb")

    monkeypatch.setattr(code_sandbox, "CodeSandboxScorer", broken)
    with pytest.raises(KeyError, match="memory_mb"):
        call(PythonToolEnvironment(timeout_s=2.5), "print(1)")


# ---------------------------------------------------------------------------------------------- roll env


def test_roll_env_run_plays_a_script_and_roll_env_list_names_python(make_env, tmp_path, capsys):
    from roll_pipeline.driver.cli import main

    make_env()  # skips where the host cannot isolate the sandbox
    script = tmp_path / "turns.json"
    script.write_text(json.dumps(["<python>\nx = 7\nprint(x * 6)\n</python>", "The answer is 42.", "unsent"]))
    assert main(["env", "run", "python", "--row", '{"prompt": "6 * 7?"}', "--message",
                 "<python>\nprint(len('abc'))\n</python>", "--messages", f"@{script}"]) == 0
    out, err = capsys.readouterr()
    steps = [json.loads(line) for line in out.splitlines()]
    assert [(s["turn"], s["observation"], s["done"], s["tool_calls"]) for s in steps] == [
        (1, "3\n", False, 1), (2, "42\n", False, 1), (3, "", True, 0)
    ]
    assert "1 message(s) not sent: the environment was done at turn 3" in err
    assert main(["env", "run", "python", "--option", "timeout=3", "--message", "hi"]) == 2
    assert "unknown option(s) ['timeout']" in capsys.readouterr().err
    assert main(["env", "run", "python", "--row", "[1]", "--message", "hi"]) == 2
    assert "--row must be a JSON object, got list" in capsys.readouterr().err
    assert main(["env", "run", "python"]) == 2
    assert "give the model's messages" in capsys.readouterr().err
    assert main(["env", "list"]) == 0
    listing = capsys.readouterr().out.splitlines()
    assert listing[0].split() == ["NAME", "SOURCE", "CLASS"]
    assert listing[1].split() == ["python", "built-in", "workers.environments.python_tool:PythonToolEnvironment"]


# ---------------------------------------------------------------------------------------------- docs/environments.md


def test_the_documented_environment_runs_as_the_page_shows(tmp_path, monkeypatch, capsys):
    """docs/environments.md: its my_env.py imports only roll_pipeline.api, and its `roll env run` example prints
    what the page says (tool_s aside)."""
    import re
    import shlex
    import sys

    from roll_pipeline.driver.cli import main
    from tests.conftest import ROOT

    page = (ROOT / "docs" / "environments.md").read_text(encoding="utf-8")
    source = re.findall(r"```python\n(.*?)```", page, re.DOTALL)[0]
    assert source.startswith("# my_env.py\n")
    imports = re.findall(r"^(?:from|import) (\S+)", source, re.MULTILINE)
    assert set(imports) - {"re"} == {"roll_pipeline.api"}, imports
    (tmp_path / "my_env.py").write_text(source, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    console = re.findall(r"```console\n(.*?)```", page, re.DOTALL)[0].strip().splitlines()
    words = shlex.split(console[0][2:])
    assert words[:2] == ["PYTHONPATH=.", "roll"]
    try:
        assert main(words[2:]) == 0
    finally:
        sys.modules.pop("my_env", None)
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    documented = [json.loads(line) for line in console[1:]]
    assert [{**s, "tool_s": 0.0} for s in printed] == documented


def test_the_documented_multi_turn_config_loads():
    """docs/environments.md's rollout block, given to the example config's math domain, passes every check."""
    import re

    import yaml

    from roll_pipeline.driver.names import load_run_config
    from tests.conftest import EXAMPLES, ROOT

    page = (ROOT / "docs" / "environments.md").read_text(encoding="utf-8")
    block = yaml.safe_load(re.findall(r"```yaml\n(.*?)```", page, re.DOTALL)[0])
    rollout = block["rewards"]["math"]["rollout"]
    override = "rewards.math.rollout=" + json.dumps(rollout)
    loaded = load_run_config(EXAMPLES / "math_code.yaml", [override]).config.rewards["math"].rollout
    assert (loaded.type, loaded.environment, loaded.max_turns, loaded.stop) == ("multi_turn", "python", 4, ["</python>"])
    assert loaded.environment_options == {"timeout_s": 5, "call_format": "plain"}


@pytest.mark.parametrize("call_format", ["plain", "hermes"])
def test_the_packaged_python_panel_passes_on_the_real_tool(make_env, call_format):
    from workers.environments.audit import panel_for, panel_results, run_panel

    make_env()  # skips where the host cannot isolate the sandbox
    options = {"timeout_s": 5.0, "call_format": call_format}
    items = panel_for("python", PythonToolEnvironment, options)
    assert {i.kind for i in items} == {"answer", "error", "final"}
    assert any(i.id.endswith("_isolated") for i in items)  # the sandbox's own layers, seen from inside
    result = panel_results(items, run_panel(lambda: PythonToolEnvironment(**options), items))
    assert result.failures == [] and result.passed == result.items == len(items)

"""`roll env list` and `roll env run`: the environment subcommands of the `roll` command.

`roll env run` plays a scripted conversation against an environment, the way a multi-turn rollout does (reset with
the row, then a step per model message), and prints one JSON object per step on stdout:
``{"turn", "observation", "done", "reward", "tool_calls", "tool_errors", "tool_s"}``. Users debug their
environment plugins and their tool-call format with it, without a model. Messages left when the environment says
done are named on stderr; an infrastructure failure (EnvironmentUnavailable) ends the command with status 1.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from roll_core.console import EXIT_USAGE, echo, error
from roll_pipeline.driver.reward_commands import (
    UsageError,
    option_argument,
    parse_assignments,
    print_plugins,
    read_value,
    yaml_value,
)


def cmd_env_list(args: argparse.Namespace) -> int:
    from workers.environments.registry import ENVIRONMENTS

    print_plugins(
        ENVIRONMENTS.describe(), "rewards.<domain>.rollout.environment also takes a class by path: package.module:Class"
    )
    return 0


def _messages(args: argparse.Namespace) -> list[str]:
    messages = [read_value(m) for m in args.message]
    if args.messages is not None:
        try:
            listed = json.loads(read_value(args.messages))
        except ValueError as err:
            raise UsageError(f"--messages must be a JSON list of strings: {err}") from err
        if not (isinstance(listed, list) and all(isinstance(m, str) for m in listed)):
            raise UsageError("--messages must be a JSON list of strings")
        messages += listed
    if not messages:
        raise UsageError("give the model's messages: --message TEXT (repeated) or --messages @FILE.json")
    return messages


def cmd_env_run(args: argparse.Namespace) -> int:
    from roll_core.environment import EnvironmentUnavailable
    from workers.environments.registry import get_environment_cls

    try:
        row = json.loads(read_value(args.row))
        if not isinstance(row, dict):
            raise UsageError(f"--row must be a JSON object, got {type(row).__name__}")
        messages = _messages(args)
        options = parse_assignments(args.option, "--option", yaml_value)
        env = get_environment_cls(args.environment)(**options)
    except json.JSONDecodeError as err:
        error(f"--row is not JSON: {err}")
        return EXIT_USAGE
    except (UsageError, ValueError, TypeError) as err:
        error(str(err))
        return EXIT_USAGE
    try:
        env.reset(row)
        for turn, message in enumerate(messages, 1):
            step = env.step(message)
            echo(json.dumps({"turn": turn, **asdict(step)}))
            if step.done:
                if turn < len(messages):
                    print(f"{len(messages) - turn} message(s) not sent: the environment was done at turn {turn}",
                          file=sys.stderr, flush=True)
                break
    except EnvironmentUnavailable as err:
        error(f"the environment's infrastructure failed (a run would mask this trajectory): {err}")
        return 1
    finally:
        env.close()
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    env = sub.add_parser("env", help="environments of multi-turn rollouts: list them, run one on a script")
    commands = env.add_subparsers(dest="env_command", required=True)

    listing = commands.add_parser("list", help="environments available by name, and where each comes from")
    listing.set_defaults(func=cmd_env_list)

    run = commands.add_parser(
        "run",
        help="play scripted model messages against an environment; prints one JSON object per step",
        description="Reset the environment with a data row, send it the model's messages one by one (as a "
        "multi-turn rollout does) and print each step as one JSON object. A value given as @FILE is read from "
        "that file (@- from standard input; @@ for a literal leading @).",
    )
    run.add_argument("environment", help="a name from `roll env list`, or package.module:Class")
    run.add_argument("--row", default="{}", metavar="JSON_OR_@FILE", help="the data row (a JSON object)")
    run.add_argument(
        "--message", action="append", default=[], metavar="TEXT_OR_@FILE", help="a model message (repeat, in order)"
    )
    run.add_argument("--messages", metavar="JSON_OR_@FILE", help="the model messages as a JSON list of strings")
    option_argument(run, "an environment option, as in rewards.<domain>.rollout.environment_options; the value is YAML")
    run.set_defaults(func=cmd_env_run)

"""`roll rewards list` and `roll rewards score`: the reward worker subcommands of the `roll` command.

`roll rewards score` scores one sample through `RewardWorker`, the code a run uses (the scorer runs in the
worker's process pool, under its timeout), and prints one JSON object on stdout:
``{"score": number or null, "correct": true/false/null, "masked": true/false, "metrics": {...}}``. Users and
scripts read that object to debug their data and their plugins: keep its format stable. Why a sample was
masked, and the scorer's traceback when it failed, go to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from roll_core.console import EXIT_USAGE, echo, error


class UsageError(ValueError):
    """A command-line value that cannot be used; its message is shown after ``error:``."""


def read_value(text: str) -> str:
    """A command-line value: ``@path`` is the text of that file, ``@-`` standard input, ``@@...`` a literal
    ``@...``; anything else is the value itself."""
    if text.startswith("@@"):
        return text[1:]
    if not text.startswith("@"):
        return text
    if text == "@-":
        return sys.stdin.read()
    path = Path(text[1:])
    try:
        return path.read_text(encoding="utf-8")
    except OSError as err:
        raise UsageError(f"cannot read {path}: {err.strerror or err}") from err


def parse_assignments(pairs: list[str], what: str, parse: Any = None) -> dict[str, Any]:
    """``["key=value", ...]`` -> ``{key: value}``; values through ``read_value``, then ``parse`` if given."""
    result: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise UsageError(f"{what} must look like key=value, got {pair!r}")
        if key in result:
            raise UsageError(f"{what} {key!r} given twice")
        value = read_value(value)
        result[key] = parse(value) if parse is not None else value
    return result


def yaml_value(text: str) -> Any:
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise UsageError(f"cannot read option value {text!r} as YAML: {err}") from err


def print_plugins(described: list, footer: str) -> None:
    """A registry's names as a table (NAME, SOURCE, CLASS; roll_core/plugins.py's PluginInfo rows), then `footer`."""
    rows = [(r.name, r.source, r.target) for r in described]
    header = ("NAME", "SOURCE", "CLASS")
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(2)]
    for name, source, target in [header, *rows]:
        echo(f"{name:<{widths[0]}}  {source:<{widths[1]}}  {target}")
    echo("")
    echo(footer)


def cmd_rewards_list(args: argparse.Namespace) -> int:
    from workers.rewards.registry import describe_reward_workers

    print_plugins(describe_reward_workers(), "rewards.<domain>.worker also takes a scorer class by path: package.module:Class")
    return 0


def cmd_rewards_score(args: argparse.Namespace) -> int:
    from workers.rewards.pool import PoolStartError
    from workers.rewards.worker import RewardWorker

    try:
        response = read_value(args.response)
        ground_truth = read_value(args.ground_truth)
        fields = parse_assignments(args.field, "--field")
        options = parse_assignments(args.option, "--option", yaml_value)
        reserved = {"response", "ground_truth"}.intersection(fields)
        if reserved:
            raise UsageError(f"--field cannot set {sorted(reserved)}: use --response / --ground-truth")
        if "prompt_messages" in fields:
            raise UsageError("--field cannot set 'prompt_messages' (a run fills it); give a judge the question "
                             "as --field question=TEXT")
        if args.timeout_s <= 0:
            raise UsageError(f"--timeout-s must be positive, got {args.timeout_s}")
        worker = RewardWorker("cli", args.worker, options, timeout_s=args.timeout_s, processes=1)
    except (UsageError, ValueError, TypeError) as err:
        error(str(err))
        return EXIT_USAGE
    try:
        with worker:
            (record,) = worker.score_batch([{"response": response, "ground_truth": ground_truth, **fields}])
    except PoolStartError as err:
        error(str(err))
        return EXIT_USAGE
    if record.masked:
        print(f"masked: {record.mask_reason}", file=sys.stderr, flush=True)
    echo(json.dumps(record.to_json(), sort_keys=False))
    return 0


def option_argument(parser: argparse.ArgumentParser, help: str) -> None:
    """`--option KEY=VALUE`, repeatable: a plugin's option (parse_assignments with yaml_value reads them)."""
    parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE", help=help)


def add_commands(sub: argparse._SubParsersAction) -> None:
    rewards = sub.add_parser("rewards", help="reward workers: list them, score one sample")
    commands = rewards.add_subparsers(dest="rewards_command", required=True)

    listing = commands.add_parser("list", help="reward workers available by name, and where each comes from")
    listing.set_defaults(func=cmd_rewards_list)

    score = commands.add_parser(
        "score",
        help="score one sample through a reward worker; prints one JSON object",
        description="Score one sample through the reward worker a run would use and print "
        '{"score", "correct", "masked", "metrics"} as one JSON object. A value given as @FILE is read from '
        "that file (@- from standard input; @@ for a literal leading @).",
    )
    score.add_argument("worker", help="a name from `roll rewards list`, or package.module:Class")
    score.add_argument("--response", required=True, metavar="TEXT_OR_@FILE")
    score.add_argument("--ground-truth", required=True, metavar="TEXT_OR_@FILE")
    score.add_argument(
        "--field",
        action="append",
        default=[],
        metavar="KEY=VALUE_OR_@FILE",
        help="another column of the sample, passed to the scorer as text (e.g. test_cases=@tests.json)",
    )
    option_argument(score, "a scorer option, as in rewards.<domain>.options; the value is YAML (e.g. format_score=0.1)")
    score.add_argument(
        "--timeout-s", type=float, default=30.0, help="scoring time limit, as rewards.<domain>.timeout_s"
    )
    score.set_defaults(func=cmd_rewards_score)

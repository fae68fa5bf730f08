"""What every `roll` subcommand prints with, and the exit statuses they share."""

from __future__ import annotations

import sys

EXIT_FAILED = 1
EXIT_USAGE = 2


def echo(msg: str = "") -> None:
    print(msg, flush=True)


def error(msg: str) -> None:
    """A message for the user on stderr, after ``error:`` (no traceback)."""
    print(f"error: {msg}", file=sys.stderr, flush=True)


def warn(msg: str) -> None:
    """A warning for the user on stderr, after ``warning:``; the command goes on."""
    print(f"warning: {msg}", file=sys.stderr, flush=True)

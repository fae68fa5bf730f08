"""The python tool's call formats and cell replay: pure functions over text.

Two call formats (``call_format``), each a turn that ends at the call's closing tag (the rollout stops generation
there):

- ``plain``, for models without a tools chat template (the embedded ones)::

      <python>
      print(123 * 456)
      </python>

  and the tool's answer goes back as ``<output>\\n...\\n</output>``.
- ``hermes``, the tools format of Qwen2.5 and other Hermes-style templates::

      <tool_call>
      {"name": "python", "arguments": {"code": "print(123 * 456)"}}
      </tool_call>

  whose answer goes back through the template's ``tool`` role; the prompt describes the tool (TOOL_DESCRIPTION,
  rendered by the template's ``tools`` support).

A message that does not end with a call is the final answer. A call the tool cannot read (broken JSON, another
tool's name, no code) is answered with what is wrong: the policy wrote it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

CALL_FORMATS = ("plain", "hermes")
TAGS = {"plain": ("<python>", "</python>"), "hermes": ("<tool_call>", "</tool_call>")}
TOOL_NAME = "python"
#: The python tool as a function description, for chat templates that list tools in the prompt (``hermes``).
TOOL_DESCRIPTION = {
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": (
            "Runs Python code in a sandbox and returns what it prints (a traceback's last line on an error). "
            "The conversation's earlier calls run again first, so what they defined is defined."
        ),
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "the Python code to run"}},
            "required": ["code"],
        },
    },
}


@dataclass(frozen=True)
class ToolCall:
    """A call at the end of a message: its code, or why it cannot be run (``problem``)."""

    code: str = ""
    problem: str | None = None


def parse_call(message: str, call_format: str) -> ToolCall | None:
    """The tool call that ends `message`, or None when the message is a final answer."""
    opening, closing = TAGS[call_format]
    text = message.rstrip()
    if not text.endswith(closing):
        return None
    start = text.rfind(opening, 0, len(text) - len(closing))
    if start < 0:
        return None
    body = text[start + len(opening) : len(text) - len(closing)]
    if call_format == "plain":
        code = body.strip("\n")
        return ToolCall(code) if code.strip() else ToolCall(problem="the call holds no code")
    return _hermes_call(body)


def _hermes_call(body: str) -> ToolCall:
    try:
        call = json.loads(body)
    except ValueError as err:
        return ToolCall(problem=f"the tool call is not valid JSON ({err})")
    if not isinstance(call, dict) or call.get("name") != TOOL_NAME:
        name = call.get("name") if isinstance(call, dict) else None
        return ToolCall(problem=f"unknown tool {name!r}; the only tool is {TOOL_NAME!r}")
    arguments = call.get("arguments")
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            arguments = None
    code = arguments.get("code") if isinstance(arguments, dict) else None
    if not isinstance(code, str) or not code.strip():
        return ToolCall(problem='the call needs {"arguments": {"code": "..."}} with the code to run')
    return ToolCall(code)


def cut(text: str, max_chars: int) -> str:
    """`text` cut to `max_chars` characters, saying so."""
    if len(text) <= max_chars:
        return text
    return text[:max_chars] + f"\n[output cut: {len(text) - max_chars} more characters]"


# The program one call runs: the trajectory's earlier cells that ran cleanly, replayed with their output
# discarded, then the new cell. `random` is seeded first, so a replayed cell draws what it drew the first time.
_REPLAY = '''\
import contextlib as _contextlib, io as _io, random as _random, sys as _sys, traceback as _traceback


def _run_cells(cells):
    namespace = {"__name__": "__main__"}
    _random.seed(0)
    for number, cell in enumerate(cells[:-1], 1):
        with _contextlib.redirect_stdout(_io.StringIO()), _contextlib.redirect_stderr(_io.StringIO()):
            try:
                exec(compile(cell, f"<cell {number}>", "exec"), namespace)
            except BaseException:
                pass
    try:
        exec(compile(cells[-1], f"<cell {len(cells)}>", "exec"), namespace)
    except BaseException as err:
        if isinstance(err, SystemExit) and err.code in (None, 0):
            return
        _sys.stdout.flush()
        print("".join(_traceback.format_exception_only(type(err), err)).rstrip(), flush=True)
        raise


_run_cells(CELLS)
'''


def replay_program(cells: list[str]) -> str:
    """The program that runs the last of `cells` after replaying the others (their output discarded; an
    exception in one of them is ignored). An exception in the last cell is printed as its last line and raised
    again, so the sandbox reports the run as failed."""
    return _REPLAY.replace("_run_cells(CELLS)", f"_run_cells({cells!r})")

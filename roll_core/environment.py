"""The contract of a multi-turn domain's environment: what the policy's messages meet between its turns.

A multi-turn rollout (``rewards.<domain>.rollout: {type: multi_turn, environment: ...}``) gives each trajectory
an environment of its own: ``reset(row)`` before the first turn, then ``step(message)`` with each message the
model wrote. A step answers with an observation (a tool's output), which goes back to the model as a tool message,
or says the trajectory is done (the message was the final answer). The domain's reward worker then scores the
final answer with the whole trajectory in its sample.

An environment's options come from ``rewards.<domain>.rollout.environment_options`` as keyword arguments
(unknown ones are an error naming them, as for scorers). Everything the policy's message controls ends in an
observation (a tool's error is the tool's answer); raise `EnvironmentUnavailable` only for a failure of the
infrastructure (the sandbox could not start, a service is down): the trajectory is then masked, never scored.

Environments are registered by name like reward workers (roll_core/plugins.py): ``@register_environment("name")``,
a ``package.module:Class`` path, or the entry-point group ``roll_pipeline.environments``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from roll_core.plugins import refuse_unknown_options


class EnvironmentUnavailable(RuntimeError):
    """The environment's infrastructure failed (not the policy): the trajectory is masked."""


@dataclass(frozen=True)
class EnvStep:
    """An environment's answer to one model message."""

    #: What goes back to the model as a tool message ("" when done).
    observation: str = ""
    #: The trajectory ends here: the message was the final answer.
    done: bool = False
    #: A reward the environment gives for this step (None: the domain's reward worker alone judges).
    reward: float | None = None
    #: Tool calls this step made, how many of them failed (an error, a timeout, a crash: the policy's doing),
    #: and the seconds they took; summed per trajectory into the validation report and the step's metrics.
    tool_calls: int = 0
    tool_errors: int = 0
    tool_s: float = 0.0


class Environment:
    """One trajectory's environment. Subclasses take their options as keyword-only arguments."""

    def __init__(self, **options: object) -> None:
        refuse_unknown_options(self, options)

    def tools(self) -> list[dict[str, Any]] | None:
        """The tools this environment answers, described for the prompt: function descriptions (a JSON schema
        each, what transformers' ``apply_chat_template(tools=...)`` takes), which the domain's prompts then render
        through the model's chat template (Qwen2.5-style templates list them in the system message). None (the
        default): nothing is described, the model was taught its call format."""
        return None

    def reset(self, row: Mapping[str, Any]) -> None:
        """A new trajectory for the data set's `row` (its prompt, ground truth and any fields of its own)."""

    def step(self, message: str) -> EnvStep:
        """The answer to the model's `message` (its last turn's text)."""
        raise NotImplementedError

    def close(self) -> None:
        """The trajectory is over: free what it holds."""

"""Environment audits: a fixed panel of scripted conversations whose answers are known, run again during a run.

A tool that drifts mid-run (a sandbox whose pool broke, a host without its isolation layers, a parser changed
under the policy) teaches the policy that calls fail, or that they succeed when they should not. A panel
(``audit_panels/<environment>.jsonl``, or the file an environment class names in ``audit_panel``) holds, per
line, the model messages to step through a fresh environment in order and what the last step must answer:

- ``id``, ``kind``: ``answer`` (a call whose output is known), ``error`` (a call the policy got wrong, or one that
  fails: the tool's answer says so and counts a tool error, the trajectory is not masked), ``final`` (a message
  that is no call: the environment ends the trajectory);
- ``messages``: the model's messages, in order;
- ``observation`` (exact) or ``contains`` (a part of it): the last step's answer;
- ``tool_errors``: the tool errors of all the steps together;
- optional ``environment_options``: only environments built with these options run the item (the python tool's
  items are written per ``call_format``).

An item passes when every step answered without EnvironmentUnavailable and the last answer and the error count
are the known ones. `run_panel` runs a panel where the domain's environments run (the scheduler actor);
`panel_results` compares. The driver (roll_pipeline/driver/reward_audit.py) runs them beside the reward panels.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from roll_core.environment import Environment, EnvironmentUnavailable
from workers.rewards.audit import AuditResult

PANELS = Path(__file__).parent / "audit_panels"
KINDS = ("answer", "error", "final")


@dataclass(frozen=True)
class EnvAuditItem:
    id: str
    kind: str
    messages: list[str]
    tool_errors: int
    observation: str | None = None
    contains: str | None = None
    environment_options: dict[str, Any] = field(default_factory=dict)

    def applies_to(self, options: Mapping[str, Any]) -> bool:
        """Whether an environment built with `options` runs this item (its own options agree with them)."""
        return all(options.get(k) == v for k, v in self.environment_options.items())


def load_panel(path: Path) -> list[EnvAuditItem]:
    """The items of a panel file."""
    items = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            raw = json.loads(line)
            item = EnvAuditItem(
                id=str(raw.pop("id")),
                kind=raw.pop("kind"),
                messages=list(raw.pop("messages")),
                tool_errors=int(raw.pop("tool_errors")),
                observation=raw.pop("observation", None),
                contains=raw.pop("contains", None),
                environment_options=dict(raw.pop("environment_options", {})),
            )
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(f"{path}:{number}: not an environment audit item ({err})") from None
        if raw:
            raise ValueError(f"{path}:{number}: unknown field(s) {sorted(raw)}")
        if item.kind not in KINDS or not item.messages or not all(isinstance(m, str) for m in item.messages):
            raise ValueError(f"{path}:{number}: kind must be one of {KINDS}, messages a list of strings")
        if (item.observation is None) == (item.contains is None) and item.kind != "final":
            raise ValueError(f"{path}:{number}: give exactly one of observation and contains")
        items.append(item)
    return items


def panel_for(name: str, cls: type[Environment], options: Mapping[str, Any]) -> list[EnvAuditItem] | None:
    """The items of an environment's panel that apply to its `options` (its keyword defaults filled in): the file
    its class names (``audit_panel``), else the packaged one for a built-in environment's name; None when it has
    none."""
    named = getattr(cls, "audit_panel", None)
    path = Path(named) if named else PANELS / f"{name}.jsonl"
    if not path.exists():
        return None
    defaults = {
        p.name: p.default for p in inspect.signature(cls.__init__).parameters.values()
        if p.kind is p.KEYWORD_ONLY and p.default is not p.empty
    }
    return [i for i in load_panel(path) if i.applies_to({**defaults, **options})]


@dataclass(frozen=True)
class EnvAuditOutcome:
    """What a fresh environment answered to an item's messages: the last answer, whether a step ended the
    trajectory, the tool errors of all the steps, and why it could not answer (EnvironmentUnavailable)."""

    observation: str = ""
    done: bool = False
    tool_errors: int = 0
    unavailable: str | None = None


def run_item(make: Callable[[], Environment], item: EnvAuditItem) -> EnvAuditOutcome:
    env = make()
    errors = 0
    try:
        env.reset({"id": f"audit/{item.id}"})
        step = None
        for message in item.messages:
            step = env.step(message)
            errors += step.tool_errors
        return EnvAuditOutcome(step.observation, step.done, errors)
    except EnvironmentUnavailable as err:
        return EnvAuditOutcome(unavailable=str(err))
    finally:
        env.close()


def run_panel(make: Callable[[], Environment], items: Sequence[EnvAuditItem]) -> list[EnvAuditOutcome]:
    """Each item through a fresh environment from `make`, one after another."""
    return [run_item(make, item) for item in items]


def run_panel_on_scheduler(scheduler: Any, items: Sequence[EnvAuditItem]) -> list[EnvAuditOutcome]:
    """`run_panel` with the environment of a domain scheduler's multi-turn rollout (its class and options), for
    the scheduler actor's ``__ray_call__``: it runs there, where the domain's trajectories meet their environments
    (that node's sandbox). It holds the scheduler's event loop while it runs (the python panel: a tenth of a second, docs/reward-audits.md)."""
    rollout = scheduler.rollout
    return run_panel(lambda: rollout.environment_cls(**rollout.config.environment_options), items)


def _shown(text: str, limit: int = 80) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


def panel_results(items: Sequence[EnvAuditItem], outcomes: Sequence[EnvAuditOutcome]) -> AuditResult:
    """An AuditResult whose `masked` counts the items the environment could not answer (infrastructure)."""
    failures = []
    for item, got in zip(items, outcomes, strict=True):
        if got.unavailable is not None:
            failures.append(f"{item.id} ({item.kind}): the environment was unavailable: {got.unavailable}")
            continue
        problems = []
        if item.kind == "final" and not got.done:
            problems.append(f"expected the trajectory to end, got the answer {_shown(got.observation)}")
        if item.kind != "final" and got.done:
            problems.append("expected an answer, the trajectory ended")
        if item.observation is not None and got.observation != item.observation:
            problems.append(f"expected {_shown(item.observation)}, got {_shown(got.observation)}")
        if item.contains is not None and item.contains not in got.observation:
            problems.append(f"expected an answer holding {_shown(item.contains)}, got {_shown(got.observation)}")
        if got.tool_errors != item.tool_errors:
            problems.append(f"expected {item.tool_errors} tool error(s), got {got.tool_errors}")
        if problems:
            failures.append(f"{item.id} ({item.kind}): " + "; ".join(problems))
    unavailable = sum(1 for o in outcomes if o.unavailable is not None)
    return AuditResult(len(items), len(items) - len(failures), unavailable, failures)

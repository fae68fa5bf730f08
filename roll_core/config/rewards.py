"""The `rewards.<domain>` sections (each domain's reward worker or weighted components) and `reward_audit`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from roll_core.config.clusters import custom_resource_problems
from roll_core.config.shaping import RewardShapingConfig

COMPONENT_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]*")


@dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    """How a domain's groups are made (`rewards.<domain>.rollout`): a name, or a mapping with `type` and the
    multi-turn keys. `single_turn`: one generation per response, scored once. `multi_turn`: the model and an
    environment take turns (docs/environments.md): a turn ends at a tool call or at the end of the answer, the
    environment's answer goes back as a tool message, up to `max_turns` model turns; the reward worker scores the
    final answer with the whole trajectory in its sample (the `trajectory` column)."""

    type: str = "single_turn"
    """A registered rollout kind (schedulers/rollout.py's ROLLOUTS): `single_turn` or `multi_turn`."""
    max_turns: int = 4
    """multi_turn: model turns per trajectory at most (the last one is the answer, whatever it holds)."""
    environment: str = "python"
    """multi_turn: the environment (`roll env list`, or a `package.module:Class` path)."""
    environment_options: dict[str, Any] = field(default_factory=dict)
    """multi_turn: keyword options of the environment (the python tool's: call_format, timeout_s, ...)."""
    stop: list[str] = field(default_factory=lambda: ["</python>"])
    """multi_turn: the strings that end a turn at a tool call (the call format's closing tag: `</python>`, or
    `</tool_call>` for call_format hermes)."""
    tool_message: Literal["template", "inline"] = "template"
    """multi_turn: how a tool's answer reaches the model: `template`, a tool message of the model's chat template
    (the turn is closed, the next assistant turn opened); `inline`, `<output>...</output>` in the same message."""
    max_tool_output_tokens: int = 256
    """multi_turn: a tool answer is cut at this many tokens (the model reads no more of it)."""
    max_total_tokens: int | None = None
    """multi_turn: a trajectory's response tokens at most, the model's and the tools' together (None:
    max_new_tokens times max_turns); a turn may generate what is left of it, at most max_new_tokens."""

    def validate(self) -> Iterator[tuple[str, str]]:
        if self.max_turns < 1:
            yield "max_turns", "must be >= 1"
        if self.max_tool_output_tokens < 1:
            yield "max_tool_output_tokens", "must be >= 1"
        if self.max_total_tokens is not None and self.max_total_tokens < 1:
            yield "max_total_tokens", "must be >= 1 (or null)"
        if not self.stop or not all(isinstance(s, str) and s for s in self.stop):
            yield "stop", f"must be a list of non-empty strings, got {self.stop!r}"


@dataclass(frozen=True, kw_only=True)
class RewardComponentConfig:
    """One of several rewards of a domain (`rewards.<domain>.workers`): its scorer, its weight in the domain's
    reward, and what its masking does to the sample. Unset resources are the domain's."""

    worker: str
    """A registered reward worker name (`roll rewards list`) or a `package.module:Class` path."""
    weight: float = 1.0
    """The domain's reward of a sample is the weighted sum of its components' scores."""
    name: str | None = None
    """Its metrics' name (`reward/<domain>/<name>/...`) and its Ray cluster's (`reward_<domain>_<name>`); default:
    the worker's registered name (or the class name of a path)."""
    options: dict[str, Any] = field(default_factory=dict)
    on_masked: str = "mask"
    """This component masked a sample (an infrastructure failure, or a sample it cannot judge): `mask` masks the
    sample; `skip` leaves the component out of that sample's sum, the other components' weights scaled up so the
    sum keeps its scale (a sample that every component skips is masked)."""
    world_size: int | None = None
    num_cpus_per_worker: float | None = None
    num_gpus_per_worker: float | None = None
    timeout_s: float | None = None
    num_processes: int | None = None
    resources: dict[str, float] | None = None

    @property
    def label(self) -> str:
        return self.name or self.worker.rsplit(":", 1)[-1].rsplit(".", 1)[-1]


def scoring_budget_s(worker_timeout_s: float) -> float:
    """The most time a scorer with a time budget of its own (code_sandbox's `sample_timeout_s`) may give one
    sample under a reward worker that masks a sample after `worker_timeout_s`: the worker's limit less a margin
    for the scorer's own work around the runs (a sandbox's start, its teardown, the verdict), max(2 s, 20%), and
    never less than half of it. A program that is slow on purpose then ends in a score (timeouts, 0) before the
    worker's limit turns it into a mask, which a policy could learn to prefer to a wrong answer."""
    return max(worker_timeout_s - max(2.0, 0.2 * worker_timeout_s), 0.5 * worker_timeout_s)


def _budget_problems(where: str, options: dict[str, Any], timeout_s: float) -> Iterator[tuple[str, str]]:
    budget = options.get("sample_timeout_s")
    if isinstance(budget, int | float) and not isinstance(budget, bool) and budget > scoring_budget_s(timeout_s):
        yield (
            f"{where}sample_timeout_s",
            f"must be at most {scoring_budget_s(timeout_s):g} (timeout_s {timeout_s:g} less a margin for the "
            f"sandbox's own work): a sample that outlasts the worker's timeout is masked instead of scored, "
            f"got {budget}",
        )


@dataclass(frozen=True, kw_only=True)
class RewardConfig:
    """One domain: the worker(s) that score it and the data tags routed to it."""

    tag_included: list[str]
    """Rows whose `tag` is in this list belong to this domain."""
    worker: str | None = None
    """A registered reward worker name (`roll rewards list`) or a `package.module:Class` path. Or, instead,
    `workers`: several weighted rewards."""
    workers: list[RewardComponentConfig] = field(default_factory=list)
    """Several rewards combined per sample, e.g. `[{worker: math_rule, weight: 1.0}, {worker: reward_model,
    weight: 0.5, options: {model_path: ...}}]`; the first one's `correct` is the domain's accuracy."""
    options: dict[str, Any] = field(default_factory=dict)
    """Keyword options for the worker's scorer (e.g. timeout_s for code_sandbox)."""
    world_size: int = 1
    num_cpus_per_worker: float = 1.0
    num_gpus_per_worker: float = 0.0
    """GPUs each reward worker asks Ray for (a reward model on a GPU); 0: it runs on the CPU."""
    resources: dict[str, float] = field(default_factory=dict)
    """Custom Ray resources each reward worker asks for, to pin it to the nodes that offer them, e.g.
    {sandbox: 1} for code_sandbox workers on the nodes that have bubblewrap (`ray start --resources='{"sandbox":
    4}'` there)."""
    timeout_s: float = 30.0
    """Per-sample scoring time limit; a sample that runs past it is masked, never scored 0."""
    num_processes: int = 2
    """Samples scored at once, each in its own process of the worker's pool; for an I/O-bound scorer (llm_judge,
    remote code_sandbox), requests in flight on the worker's asyncio loop (the old name `num_threads` is still
    read, with a warning)."""
    group_filters: dict[str, dict[str, Any] | None] = field(default_factory=dict)
    """Dynamic sampling: named group filters (schedulers/filters.py) with their parameters, applied in order; a
    dropped group's slot goes to a fresh prompt. `{std_filter: {}}` is DAPO's rule (drop groups whose rewards
    are all equal); `{mean_filter: {low: 0.1, high: 0.9}}` drops too-easy and too-hard prompts."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """How one prompt's group is made: `single_turn` (one generation per response, scored once), or
    `{type: multi_turn, environment: python, max_turns: 4, ...}` (tool calls between turns; RolloutConfig)."""
    max_prompts_factor: float | None = None
    """This domain's redraw bound, overriding dynamic_sampling.max_prompts_factor (e.g. a domain whose groups
    rarely pass its filters may get a lower bound, so redraws do not hold up the step)."""
    response_filters: dict[str, dict[str, Any] | None] = field(default_factory=dict)
    """Named response filters: a rejected response stays in its group but leaves the loss (in_loss 0);
    `{truncated: {}}` masks responses cut off by max_new_tokens (DAPO's overlong filtering)."""
    reward_shaping: RewardShapingConfig | None = None
    """This domain's reward shaping, replacing the top-level `reward_shaping` block for it (the whole block: keys
    left out take their defaults, not the top-level values); None: the top-level block."""
    whiten_advantages: bool | None = None
    """This domain's `whiten_advantages` (None: the top-level value); needs advantage_scope: domain."""
    advantage_clip: float | None = None
    """This domain's `advantage_clip` (None: the top-level value); needs advantage_scope: domain."""

    def components(self) -> list[RewardComponentConfig]:
        """The domain's rewards with every resource set: `workers`, or the one `worker` (weight 1)."""
        listed = self.workers or [RewardComponentConfig(worker=self.worker or "", options=self.options)]
        return [
            replace(
                c,
                name=c.label,
                world_size=self.world_size if c.world_size is None else c.world_size,
                num_cpus_per_worker=self.num_cpus_per_worker if c.num_cpus_per_worker is None else c.num_cpus_per_worker,
                num_gpus_per_worker=self.num_gpus_per_worker if c.num_gpus_per_worker is None else c.num_gpus_per_worker,
                timeout_s=self.timeout_s if c.timeout_s is None else c.timeout_s,
                num_processes=self.num_processes if c.num_processes is None else c.num_processes,
                resources=dict(self.resources if c.resources is None else c.resources),
            )
            for c in listed
        ]

    def validate(self) -> Iterator[tuple[str, str]]:
        # Filter names are checked against their registry by the driver (roll_pipeline/driver/names.py).
        if not self.tag_included:
            yield "tag_included", "must list at least one tag"
        if (self.worker is None) == (not self.workers):
            yield "worker", "set either worker (one reward) or workers (several weighted rewards), not both or neither"
        if self.workers and self.options:
            yield "options", "with workers, each component has its own options: move them to workers[i].options"
        if self.num_gpus_per_worker < 0:
            yield "num_gpus_per_worker", "must be >= 0"
        yield from custom_resource_problems(self.resources)
        if self.workers and self.workers[0].on_masked != "mask":
            yield "workers[0].on_masked", "the first component decides `correct` (accuracy), so it must be `mask`"
        names: set[str] = set()
        for i, c in enumerate(self.workers):
            where = f"workers[{i}]"
            if not c.worker:
                yield f"{where}.worker", "must name a reward worker"
            if c.on_masked not in ("mask", "skip"):
                yield f"{where}.on_masked", f"must be one of ['mask', 'skip'], got {c.on_masked!r}"
            if not (c.weight > 0 and math.isfinite(c.weight)):
                yield f"{where}.weight", f"must be a number > 0, got {c.weight}"
            if not COMPONENT_NAME.fullmatch(c.label):
                yield f"{where}.name", f"{c.label!r} must be letters, digits and _ (it names metrics and a Ray cluster)"
            elif c.label in names:
                yield f"{where}.name", f"{c.label!r} names two components: give one a `name`"
            names.add(c.label)
            for key in ("world_size", "num_processes"):
                if getattr(c, key) is not None and getattr(c, key) < 1:
                    yield f"{where}.{key}", "must be >= 1"
            if c.timeout_s is not None and c.timeout_s <= 0:
                yield f"{where}.timeout_s", "must be > 0"
            for key, problem in custom_resource_problems(c.resources or {}):
                yield f"{where}.{key}", problem
        if self.max_prompts_factor is not None and self.max_prompts_factor < 1:
            yield "max_prompts_factor", f"must be >= 1 (a domain must be able to draw its share), got {self.max_prompts_factor}"
        if self.world_size < 1:
            yield "world_size", "must be >= 1"
        if self.timeout_s <= 0:
            yield "timeout_s", "must be > 0"
        for i, c in enumerate(self.components()):
            where = f"workers[{i}].options." if self.workers else "options."
            yield from _budget_problems(where, c.options, c.timeout_s if c.timeout_s is not None else self.timeout_s)


@dataclass(frozen=True, kw_only=True)
class RewardAuditConfig:
    """Reward audits during a run (roll_pipeline/driver/reward_audit.py): every reward worker with an audit panel
    scores it at step 0 and every `every_steps` steps; judges are checked against the math rule."""

    every_steps: int = 0
    """0: no audits."""
    on_change: Literal["stop", "warn"] = "stop"
    """When a panel item gets a verdict other than its known one: stop the run with an error naming the items,
    or log a warning and go on."""
    judge_items: int = 8
    """Rule-checkable items (the math panel's right and wrong answers) a judge domain scores, to report how often
    it agrees with the rule; 0: none."""

    def validate(self) -> Iterator[tuple[str, str]]:
        if self.every_steps < 0:
            yield "every_steps", "must be >= 0 (0: no audits)"
        if self.judge_items < 0:
            yield "judge_items", "must be >= 0"

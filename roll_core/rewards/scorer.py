"""The pure layer of a reward: one ``RewardScorer`` per domain, returning a ``RewardResult`` per sample.

A scorer knows nothing about Ray, batches, tensors or timeouts; ``workers.rewards.worker.RewardWorker`` adds
those. ``score`` returns ``None`` when the sample is not something this scorer can judge (no test cases, a
ground truth in the wrong form): the worker masks such a sample instead of rewarding it with 0.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Hashable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import ClassVar

from roll_core.plugins import refuse_unknown_options

_CHECKING_OPTIONS = contextvars.ContextVar("roll_checking_reward_options", default=False)


@contextlib.contextmanager
def checking_options() -> Iterator[None]:
    """Scorers built inside are built to check their options (`roll run --dry-run`'s checks): a scorer that starts
    something of its own when built (the llm_judge's judge actor, in a process connected to Ray) starts nothing."""
    token = _CHECKING_OPTIONS.set(True)
    try:
        yield
    finally:
        _CHECKING_OPTIONS.reset(token)


def checking_options_only() -> bool:
    """Whether the scorer being built is only checked (`checking_options`)."""
    return _CHECKING_OPTIONS.get()


#: Metric names the reward worker and the rollout metrics write; a scorer's own metrics must not shadow them.
RESERVED_METRIC_NAMES = frozenset(
    {
        "score",
        "std",
        "correct",
        "count",
        "masked",
        "masked_error",
        "masked_crash",
        "masked_timeout",
        "masked_not_applicable",
        "timed_out",
    }
)


@dataclass(frozen=True)
class RewardResult:
    """The judgement of one response."""

    #: The reward given to the response.
    score: float
    #: Whether the response counts as correct, for accuracy metrics (independent of reward shaping).
    correct: bool
    #: Extra per-sample metrics, averaged per domain by the worker, e.g. ``{"answer_found": 1.0}``.
    metrics: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if (
            not isinstance(self.score, int | float)
            or isinstance(self.score, bool)
            or not math.isfinite(self.score)
        ):
            raise ValueError(f"RewardResult.score must be a finite number, got {self.score!r}")
        if not isinstance(self.correct, bool):
            raise TypeError(f"RewardResult.correct must be a bool, got {type(self.correct).__name__}")
        shadowed = RESERVED_METRIC_NAMES.intersection(self.metrics)
        if shadowed:
            raise ValueError(
                f"RewardResult.metrics uses names reserved for the reward worker: {sorted(shadowed)}"
            )


#: Names the reward contract gives a sample beside the row's columns (``response``: the policy's response,
#: ``prompt_messages``: the chat messages its prompt was rendered from); a row column of either name would be
#: hidden from the scorer, so the data check refuses it.
CONTRACT_FIELDS = ("response", "prompt_messages")


def reward_sample(row: Mapping[str, object], response: str, prompt_messages: object = None) -> dict[str, object]:
    """The sample a scorer gets for one response to ``row``: every column of the row, the response, and the
    prompt's chat messages. ``id`` is the row's ``id`` column or, without one, where the row was read
    (``file:line``); the loader's own ``_source`` column is not passed on. ``ground_truth`` is None when the
    row has none."""
    sample: dict[str, object] = {k: v for k, v in row.items() if k != "_source"}
    sample["id"] = row.get("id", row.get("_source"))
    sample.setdefault("ground_truth", None)
    sample["response"] = response
    sample["prompt_messages"] = prompt_messages
    return sample


def contract_problems(row: Mapping[str, object]) -> Iterator[tuple[str, str]]:
    """``(column, problem)`` for each row column the reward contract would hide (``CONTRACT_FIELDS``)."""
    for name in CONTRACT_FIELDS:
        if name in row:
            yield name, (
                f"the reward contract passes the policy's {name.replace('_', ' ')} under this name, so the "
                "scorer would never see this column; rename it"
            )


def missing_text(row: Mapping[str, object], name: str) -> Iterator[tuple[str, str]]:
    """``(name, "missing")`` or ``(name, "empty")`` when the row's ``name`` column has no text, for ``check_row``."""
    value = row.get(name)
    if value is None:
        yield name, "missing"
    elif not str(value).strip():
        yield name, "empty"


class RewardScorer:
    """Base class of a domain's pure scorer.

    Subclasses declare their options as keyword-only parameters of ``__init__`` (with defaults) and pass any
    remaining keyword arguments on to ``super().__init__``, which rejects them by name. Options come from the
    YAML block ``rewards.<domain>.options``.

    The reward worker builds one scorer in each of its scoring processes from the class and the options, so a
    scorer class must be importable by its ``module:Class`` path (defined at module level) and its options
    must be plain data.
    """

    #: Modules the worker's process pool imports once, before it starts the scoring processes, so that each
    #: process (the first ones, and a replacement for one killed at the timeout) starts with them loaded.
    preload_modules: ClassVar[tuple[str, ...]] = ()

    def __init__(self, **options: object) -> None:
        refuse_unknown_options(self, options)

    @classmethod
    def within_timeout(cls, options: dict, timeout_s: float) -> dict:
        """The options to score with under a worker that masks a sample after ``timeout_s`` seconds. A scorer
        with a time budget of its own fits it inside that limit here, so that whatever the response does ends in
        a score, not a mask (masks are for infrastructure failures). Default: the options unchanged."""
        return options

    def warm_up(self) -> None:
        """Called once in each scoring process before its first sample (import what ``score`` needs, open a
        client); the time it takes is not counted against any sample's timeout."""

    @classmethod
    def check_row(cls, row: Mapping[str, object]) -> Iterator[tuple[str, str]]:
        """Problems that make a dataset row one this scorer can never judge, as ``(field, what is wrong)``.

        ``roll run`` checks every row before anything starts, so such a row is an error naming its file, line
        and field rather than a sample masked at every step. The default needs a non-empty ``ground_truth``;
        a scorer that needs other fields, or no ground truth, overrides this.
        """
        yield from missing_text(row, "ground_truth")

    def score(self, response: str, ground_truth: str, **fields: object) -> RewardResult | None:
        """Judge ``response`` against ``ground_truth``; ``fields`` are every other column of the sample's
        dataset row (``tag``, ``domain``, ``id``, ``test_cases``, and any column of the user's own), plus
        ``prompt_messages``, the chat messages the prompt was rendered from (see ``reward_sample``).

        Returns ``None`` when the sample cannot be judged by this scorer (never 0 for that case).
        """
        raise NotImplementedError

    #: Whether the scorer judges whole batches in the reward worker's own process (``BatchedRewardScorer``).
    batched: ClassVar[bool] = False

    @classmethod
    def io_bound(cls, options: Mapping[str, object]) -> bool:
        """Whether, with these options, scoring mostly waits on the network (a remote judge or sandbox): the
        worker then keeps many samples in flight on an asyncio loop (workers/rewards/io_loop.py) instead of one
        per process of its pool."""
        return False

    #: Whether ``answer_key`` is defined, so that validation reports maj@k for this scorer's domains.
    has_answer_key: ClassVar[bool] = False

    def answer_key(self, response: str) -> Hashable | None:
        """The answer ``response`` states, in a form where equal answers compare equal (None: it states none),
        for majority voting over a prompt's validation responses (``maj@k``). A scorer that defines it sets
        ``has_answer_key = True``."""
        raise NotImplementedError(f"{type(self).__name__} has no answer key")


class BatchedRewardScorer(RewardScorer):
    """A scorer that judges a whole batch at once in the reward worker's own process: a model (a reward model)
    that would be loaded once per scoring process and run one sample at a time in the process pool.

    The worker calls ``load(device)`` once (its device: a GPU when the domain's ``num_gpus_per_worker`` > 0),
    then ``score_batch`` with each batch. There is no per-sample time limit (nothing to kill but the worker);
    a batch call that raises masks every sample of the batch as ``error``; ``None`` for a sample masks it as
    ``not_applicable``, as with ``score``."""

    batched: ClassVar[bool] = True

    def load(self, device) -> None:
        """Load the model onto ``device`` (a ``torch.device``)."""

    def score_batch(self, samples: list[dict]) -> list[RewardResult | None]:
        """One result per ``{"response", "ground_truth", **fields}`` sample, in order."""
        raise NotImplementedError

    def score(self, response: str, ground_truth: str, **fields: object) -> RewardResult | None:
        return self.score_batch([{"response": response, "ground_truth": ground_truth, **fields}])[0]

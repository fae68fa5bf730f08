"""Reward scorers found by name: built-in names, ``package.module:Class`` paths, and third-party entry points.

Config names a scorer with a string (``rewards.<domain>.worker``); this module is the only place that turns
that string into a class. Three sources, in order:

1. names registered with ``@register_reward_worker("name")`` (the built-in modules are imported on first
   lookup, so importing this module stays cheap);
2. a ``package.module:Class`` path, imported on demand;
3. the entry-point group ``roll_pipeline.reward_workers`` of installed packages
   (``name = "package.module:Class"``), loaded on first lookup of a name not found above.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from roll_core.rewards.scorer import RewardScorer

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "roll_pipeline.reward_workers"

#: Modules whose import registers the built-in scorers.
_BUILTIN_MODULES = (
    "workers.rewards.math_rule",
    "workers.rewards.code_sandbox",
    "workers.rewards.llm_judge",
    "workers.rewards.reward_model",
)

_REGISTRY: dict[str, type[RewardScorer]] = {}

_ScorerT = TypeVar("_ScorerT", bound=type[RewardScorer])


def _class_path(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def register_reward_worker(name: str) -> Callable[[_ScorerT], _ScorerT]:
    """Class decorator: make a ``RewardScorer`` subclass available under ``name``.

    A name can be registered once. Registering the same ``module:Class`` again (a module reloaded) replaces
    the entry; any other class under a taken name is an error.
    """
    if not isinstance(name, str) or not name or ":" in name:
        raise ValueError(f"reward worker name must be a non-empty string without ':', got {name!r}")

    def decorator(cls: _ScorerT) -> _ScorerT:
        _add(name, cls)
        return cls

    return decorator


def _add(name: str, cls: type) -> None:
    if not (isinstance(cls, type) and issubclass(cls, RewardScorer)):
        raise TypeError(f"reward worker {name!r} must be a subclass of RewardScorer, got {cls!r}")
    existing = _REGISTRY.get(name)
    if existing is not None and _class_path(existing) != _class_path(cls):
        raise ValueError(
            f"reward worker name {name!r} is already registered to {_class_path(existing)}; "
            f"cannot register {_class_path(cls)} under the same name"
        )
    _REGISTRY[name] = cls


def _import_builtins() -> None:
    for module in _BUILTIN_MODULES:
        importlib.import_module(module)


def _entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def _load_path(spec: str) -> type[RewardScorer]:
    module_name, _, qualname = spec.partition(":")
    if not module_name or not qualname:
        raise ValueError(f"reward worker path must look like 'package.module:Class', got {spec!r}")
    try:
        obj: object = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"cannot import reward worker {spec!r}: {err}") from err
    for part in qualname.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as err:
            raise ValueError(f"reward worker {spec!r}: module {module_name!r} has no {qualname!r}") from err
    if not (isinstance(obj, type) and issubclass(obj, RewardScorer)):
        raise TypeError(f"reward worker {spec!r} is not a subclass of RewardScorer: {obj!r}")
    return obj


def get_reward_scorer_cls(spec: str) -> type[RewardScorer]:
    """The scorer class for ``spec``: a registered name, an entry-point name, or ``package.module:Class``."""
    if ":" in spec:
        return _load_path(spec)
    if spec not in _REGISTRY:
        _import_builtins()
    if spec in _REGISTRY:
        return _REGISTRY[spec]
    entry_point = _entry_points().get(spec)
    if entry_point is not None:
        cls = _load_path(entry_point.value)
        _add(spec, cls)
        logger.info("loaded reward worker %r from entry point %s", spec, entry_point.value)
        return cls
    available = ", ".join(sorted(available_reward_workers())) or "none"
    raise ValueError(
        f"unknown reward worker {spec!r}; available: {available} (or give a 'package.module:Class' path)"
    )


def available_reward_workers() -> dict[str, str]:
    """Every known scorer name mapped to its ``module:Class``, entry points included (without loading them)."""
    _import_builtins()
    names = {ep_name: ep.value for ep_name, ep in _entry_points().items()}
    names.update({name: _class_path(cls) for name, cls in _REGISTRY.items()})
    return dict(sorted(names.items()))


@dataclass(frozen=True)
class RewardWorkerInfo:
    """One name ``rewards.<domain>.worker`` can take, for ``roll rewards list``."""

    name: str
    #: The scorer class, as ``module:Class``.
    target: str
    #: Where the name comes from: ``built-in``, ``entry point of <distribution> <version>``, or
    #: ``registered by <module>`` (a ``@register_reward_worker`` outside the built-in modules).
    source: str


def _entry_point_source(entry_point: importlib.metadata.EntryPoint) -> str:
    dist = entry_point.dist
    return f"entry point of {dist.name} {dist.version}" if dist is not None else "entry point"


def describe_reward_workers() -> list[RewardWorkerInfo]:
    """Every known name with its class and where it comes from, sorted by name; entry points are not loaded.

    A registered name wins over an entry point of the same name (that is the lookup order of
    ``get_reward_scorer_cls``); the entry point it hides is listed with ``(hidden by ...)`` in its source.
    """
    _import_builtins()
    entry_points = _entry_points()
    rows: list[RewardWorkerInfo] = []
    for name, cls in _REGISTRY.items():
        target = _class_path(cls)
        entry_point = entry_points.get(name)
        if entry_point is not None and entry_point.value == target:
            rows.append(RewardWorkerInfo(name, target, _entry_point_source(entry_point)))
            continue
        builtin = cls.__module__ in _BUILTIN_MODULES
        source = "built-in" if builtin else f"registered by {cls.__module__}"
        rows.append(RewardWorkerInfo(name, target, source))
        if entry_point is not None:
            hidden = f"{_entry_point_source(entry_point)} (hidden by {target})"
            rows.append(RewardWorkerInfo(name, entry_point.value, hidden))
    for name, entry_point in entry_points.items():
        if name not in _REGISTRY:
            rows.append(RewardWorkerInfo(name, entry_point.value, _entry_point_source(entry_point)))
    return sorted(rows, key=lambda row: (row.name, row.source))

"""Plugin classes found by name: built-in names, ``package.module:Class`` paths, and third-party entry points.

A config names a plugin class with a string (``rewards.<domain>.worker``, ``rewards.<domain>.rollout.environment``);
a `PluginRegistry` is the only place that turns that string into a class. Three sources, in order:

1. names registered with the registry's ``register("name")`` decorator (the built-in modules are imported on
   first lookup, so importing a registry stays cheap);
2. a ``package.module:Class`` path, imported on demand;
3. the registry's entry-point group of installed packages (``name = "package.module:Class"``), loaded on first
   lookup of a name not found above.

The reward workers (workers/rewards/registry.py) and the environments of multi-turn rollouts
(workers/environments/registry.py) are the two registries.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T", bound=type)


def refuse_unknown_options(obj: object, options: dict[str, object]) -> None:
    """A plugin's __init__ got `options` it does not take: a TypeError naming them and the accepted ones (the
    keyword-only arguments of the class's __init__)."""
    if options:
        accepted = sorted(
            name
            for name, param in inspect.signature(type(obj).__init__).parameters.items()
            if param.kind is inspect.Parameter.KEYWORD_ONLY
        )
        raise TypeError(
            f"{type(obj).__name__}: unknown option(s) {sorted(options)}; accepted options: {accepted or 'none'}"
        )


def class_path(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


@dataclass(frozen=True)
class PluginInfo:
    """One name a registry knows, for ``roll rewards list`` and ``roll env list``."""

    name: str
    #: The class, as ``module:Class``.
    target: str
    #: Where the name comes from: ``built-in``, ``entry point of <distribution> <version>``, or
    #: ``registered by <module>`` (a ``register`` outside the built-in modules).
    source: str


def _entry_point_source(entry_point: importlib.metadata.EntryPoint) -> str:
    dist = entry_point.dist
    return f"entry point of {dist.name} {dist.version}" if dist is not None else "entry point"


class PluginRegistry(Generic[T]):
    """Subclasses of `base` by name; `kind` names them in messages (``reward worker``, ``environment``)."""

    def __init__(self, kind: str, base: type, entry_point_group: str, builtin_modules: tuple[str, ...]) -> None:
        self.kind, self.base = kind, base
        self.entry_point_group, self.builtin_modules = entry_point_group, builtin_modules
        self.items: dict[str, type] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Class decorator: make a subclass of the registry's base available under ``name``.

        A name can be registered once. Registering the same ``module:Class`` again (a module reloaded) replaces
        the entry; any other class under a taken name is an error.
        """
        if not isinstance(name, str) or not name or ":" in name:
            raise ValueError(f"{self.kind} name must be a non-empty string without ':', got {name!r}")

        def decorator(cls: T) -> T:
            self.add(name, cls)
            return cls

        return decorator

    def add(self, name: str, cls: type) -> None:
        if not (isinstance(cls, type) and issubclass(cls, self.base)):
            raise TypeError(f"{self.kind} {name!r} must be a subclass of {self.base.__name__}, got {cls!r}")
        existing = self.items.get(name)
        if existing is not None and class_path(existing) != class_path(cls):
            raise ValueError(
                f"{self.kind} name {name!r} is already registered to {class_path(existing)}; "
                f"cannot register {class_path(cls)} under the same name"
            )
        self.items[name] = cls

    def import_builtins(self) -> None:
        for module in self.builtin_modules:
            importlib.import_module(module)

    def entry_points(self) -> dict[str, importlib.metadata.EntryPoint]:
        return {ep.name: ep for ep in importlib.metadata.entry_points(group=self.entry_point_group)}

    def load_path(self, spec: str) -> type:
        module_name, _, qualname = spec.partition(":")
        if not module_name or not qualname:
            raise ValueError(f"{self.kind} path must look like 'package.module:Class', got {spec!r}")
        try:
            obj: object = importlib.import_module(module_name)
        except ImportError as err:
            raise ValueError(f"cannot import {self.kind} {spec!r}: {err}") from err
        for part in qualname.split("."):
            try:
                obj = getattr(obj, part)
            except AttributeError as err:
                raise ValueError(f"{self.kind} {spec!r}: module {module_name!r} has no {qualname!r}") from err
        if not (isinstance(obj, type) and issubclass(obj, self.base)):
            raise TypeError(f"{self.kind} {spec!r} is not a subclass of {self.base.__name__}: {obj!r}")
        return obj

    def get(self, spec: str) -> type:
        """The class for ``spec``: a registered name, an entry-point name, or ``package.module:Class``."""
        if ":" in spec:
            return self.load_path(spec)
        if spec not in self.items:
            self.import_builtins()
        if spec in self.items:
            return self.items[spec]
        entry_point = self.entry_points().get(spec)
        if entry_point is not None:
            cls = self.load_path(entry_point.value)
            self.add(spec, cls)
            logger.info("loaded %s %r from entry point %s", self.kind, spec, entry_point.value)
            return cls
        available = ", ".join(sorted(self.available())) or "none"
        raise ValueError(f"unknown {self.kind} {spec!r}; available: {available} (or give a 'package.module:Class' path)")

    def available(self) -> dict[str, str]:
        """Every known name mapped to its ``module:Class``, entry points included (without loading them)."""
        self.import_builtins()
        names = {ep_name: ep.value for ep_name, ep in self.entry_points().items()}
        names.update({name: class_path(cls) for name, cls in self.items.items()})
        return dict(sorted(names.items()))

    def describe(self) -> list[PluginInfo]:
        """Every known name with its class and where it comes from, sorted by name; entry points are not loaded.

        A registered name wins over an entry point of the same name (that is the lookup order of `get`); the entry
        point it hides is listed with ``(hidden by ...)`` in its source.
        """
        self.import_builtins()
        entry_points = self.entry_points()
        rows: list[PluginInfo] = []
        for name, cls in self.items.items():
            target = class_path(cls)
            entry_point = entry_points.get(name)
            if entry_point is not None and entry_point.value == target:
                rows.append(PluginInfo(name, target, _entry_point_source(entry_point)))
                continue
            builtin = cls.__module__ in self.builtin_modules
            rows.append(PluginInfo(name, target, "built-in" if builtin else f"registered by {cls.__module__}"))
            if entry_point is not None:
                hidden = f"{_entry_point_source(entry_point)} (hidden by {target})"
                rows.append(PluginInfo(name, entry_point.value, hidden))
        for name, entry_point in entry_points.items():
            if name not in self.items:
                rows.append(PluginInfo(name, entry_point.value, _entry_point_source(entry_point)))
        return sorted(rows, key=lambda row: (row.name, row.source))

"""Loading a config: YAML -> `${ref}` interpolation -> CLI overrides -> strict dataclasses -> resolve().

Loading is strict: an unknown key, a wrong type, a missing required key or a value out of range raises one
`ConfigError` that names every offending key path. Derived values (model paths that default to `pretrain`,
per-domain prompt shares, absolute paths) come from `resolve()` only, so what `roll config show` prints is
exactly what a run uses.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import re
import types
import typing
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dacite
import yaml

from roll_core.config.errors import ConfigError
from roll_core.config.pipeline import PipelineConfig
from roll_core.config.rewards import RewardConfig, RolloutConfig
from roll_core.config.shares import domain_shares

_REF = re.compile(r"\$\{([A-Za-z0-9_.\-]+)\}")


def _lookup(tree: Any, dotted: str) -> Any:
    node = tree
    for part in dotted.split("."):
        if isinstance(node, Mapping) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            raise KeyError(dotted)
    return node


def interpolate(tree: Any) -> Any:
    """Replace `${a.b}` references by the referenced values (a whole-string reference keeps the value's type)."""

    def resolve(value: Any, path: str, stack: tuple[str, ...]) -> Any:
        if isinstance(value, Mapping):
            return {k: resolve(v, f"{path}.{k}" if path else str(k), stack) for k, v in value.items()}
        if isinstance(value, list):
            return [resolve(v, f"{path}.{i}", stack) for i, v in enumerate(value)]
        if not isinstance(value, str) or "${" not in value:
            return value

        def target(ref: str) -> Any:
            if ref in stack:
                raise ConfigError(f"{path}: circular reference ${{{ref}}} ({' -> '.join((*stack, ref))})")
            try:
                raw = _lookup(tree, ref)
            except KeyError:
                raise ConfigError(f"{path}: reference ${{{ref}}} names no key in the config") from None
            return resolve(raw, ref, (*stack, ref))

        whole = _REF.fullmatch(value)
        if whole:
            return target(whole.group(1))
        return _REF.sub(lambda m: str(target(m.group(1))), value)

    return resolve(tree, "", ())


def parse_override(item: str) -> tuple[list[str], Any]:
    """`a.b.c=value` -> (["a", "b", "c"], value parsed as YAML, so 3 is an int and [1, 2] a list)."""
    key, sep, raw = item.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {item!r}: expected key.path=value")
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {item!r}: value is not valid YAML ({exc})") from None
    return key.split("."), value


def apply_overrides(tree: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for item in overrides:
        keys, value = parse_override(item)
        node = tree
        for depth, part in enumerate(keys):
            if isinstance(node, list):  # a list item by its index: rewards.math.workers.1.weight=0.3
                if not (part.isdigit() and int(part) < len(node)):
                    raise ConfigError(
                        f"override {item!r}: {'.'.join(keys[:depth])} is a list of {len(node)}; "
                        f"{part!r} is not one of its indices"
                    )
                part = int(part)
            if depth == len(keys) - 1:
                node[part] = value
                break
            nxt = node[part] if isinstance(node, list) else node.get(part)
            if nxt is None:
                nxt = node[part] = {}
            elif not isinstance(nxt, dict | list):
                raise ConfigError(f"override {item!r}: {'.'.join(keys[: depth + 1])} is not a section")
            node = nxt
    return tree


def _unwrap_optional(tp: Any) -> Any:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def _unknown_keys(cls: type, data: Any, path: str) -> Iterator[str]:
    """Key paths in `data` that `cls` has no field for, with a close match when there is one."""
    if not isinstance(data, Mapping):
        return
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key, value in data.items():
        where = f"{path}.{key}" if path else str(key)
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            yield f"{where}: unknown key" + (f" (did you mean {close[0]!r}?)" if close else "")
            continue
        tp = _unwrap_optional(hints[key])
        if dataclasses.is_dataclass(tp):
            yield from _unknown_keys(tp, value, where)
        elif typing.get_origin(tp) is dict and isinstance(value, Mapping):
            item_tp = _unwrap_optional(typing.get_args(tp)[1])
            if dataclasses.is_dataclass(item_tp):
                for k, v in value.items():
                    yield from _unknown_keys(item_tp, v, f"{where}.{k}")


def _validation_errors(obj: Any, path: str) -> Iterator[str]:
    if dataclasses.is_dataclass(obj):
        if hasattr(obj, "validate"):
            for key, message in obj.validate():
                yield f"{path}.{key}: {message}" if path else f"{key}: {message}"
        for f in dataclasses.fields(obj):
            yield from _validation_errors(getattr(obj, f.name), f"{path}.{f.name}" if path else f.name)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            if dataclasses.is_dataclass(v):
                yield from _validation_errors(v, f"{path}.{k}")


def _dacite_message(exc: dacite.DaciteError, prefix: str = "") -> str:
    if isinstance(exc, dacite.MissingValueError):
        return f"{prefix}{exc.field_path}: required key is missing"
    if isinstance(exc, dacite.WrongTypeError):
        choices = _literal_choices(exc.field_type)
        if choices is not None:
            return f"{prefix}{exc.field_path}: expected one of {choices}, got {exc.value!r}"
        expected = getattr(exc.field_type, "__name__", str(exc.field_type))
        return f"{prefix}{exc.field_path}: expected {expected}, got {exc.value!r} ({type(exc.value).__name__})"
    return str(exc)


def _literal_choices(field_type: Any) -> list[Any] | None:
    """The values a Literal field takes (None among them where the field is optional: YAML's null); None for
    other types."""
    if typing.get_origin(field_type) is typing.Literal:
        return list(typing.get_args(field_type))
    args = typing.get_args(field_type)
    literals = [a for a in args if typing.get_origin(a) is typing.Literal]
    if len(literals) == 1 and set(args) == {literals[0], type(None)}:
        return [*typing.get_args(literals[0]), None]
    return None


_FLOAT = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


def _as_float(value: Any) -> Any:
    """Accept 3 and "1e-5" for a float field (PyYAML reads 1e-5 without a dot as a string); leave the rest to
    dacite, which then reports the wrong type."""
    if isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str) and _FLOAT.fullmatch(value.strip()):
        return float(value)
    return value


def _as_tuple(value: Any) -> Any:
    """A YAML list for a tuple of strings (generation's `stop`), or one string as a list of one; anything else is
    left to dacite to report."""
    if isinstance(value, str):
        return (value,)
    return tuple(value) if isinstance(value, list) else value


def _as_rollout(value: Any) -> Any:
    """`rewards.<domain>.rollout: NAME` is `{type: NAME}`."""
    return {"type": value} if isinstance(value, str) else value


#: Keys of a rewards.<domain> block that were renamed: the old name is still read, with a FutureWarning.
RENAMED_REWARD_KEYS = {"num_threads": "num_processes"}


def _renamed_keys(data: Mapping[str, Any]) -> Mapping[str, Any]:
    """`data` with each renamed key under its new name (a FutureWarning names both); both names at once is an
    error."""
    rewards = data.get("rewards")
    if not isinstance(rewards, Mapping):
        return data
    renamed = {}
    for domain, block in rewards.items():
        if isinstance(block, Mapping):
            block = dict(block)
            for old, new in RENAMED_REWARD_KEYS.items():
                if old not in block:
                    continue
                if new in block:
                    raise ConfigError(f"rewards.{domain}.{old}: the old name of {new}, which is set too; keep only {new}")
                warnings.warn(
                    f"rewards.{domain}.{old} is deprecated (it counts processes, not threads): write "
                    f"rewards.{domain}.{new}",
                    FutureWarning,
                    stacklevel=2,
                )
                block[new] = block.pop(old)
        renamed[domain] = block
    return {**data, "rewards": renamed}


Check = Callable[[PipelineConfig], Iterable[tuple[str, str]]]
"""More (key path, message) findings on a built config, from outside the core (roll_pipeline/driver/names.py)."""


def from_dict(data: Mapping[str, Any], checks: Sequence[Check] = ()) -> PipelineConfig:
    """Build a PipelineConfig from an already interpolated mapping, strictly; raise ConfigError on any problem
    (the schema's, and those of `checks`)."""
    if not isinstance(data, Mapping):
        raise ConfigError("the config must be a YAML mapping at the top level")
    data = _renamed_keys(data)
    unknown = list(_unknown_keys(PipelineConfig, data, ""))
    if unknown:
        raise ConfigError("\n".join(unknown))
    config = dacite.Config(strict=True, type_hooks={float: _as_float, tuple[str, ...]: _as_tuple,
                                                    RolloutConfig: _as_rollout})
    rewards = data.get("rewards")
    for domain, block in (rewards.items() if isinstance(rewards, Mapping) else ()):
        # dacite's paths stop at a dict's values (`rewards.world_size`): each domain's block on its own first
        if isinstance(block, Mapping):
            try:
                dacite.from_dict(RewardConfig, dict(block), config=config)
            except dacite.DaciteError as exc:
                raise ConfigError(_dacite_message(exc, f"rewards.{domain}.")) from None
    try:
        cfg = dacite.from_dict(PipelineConfig, dict(data), config=config)
    except dacite.DaciteError as exc:
        raise ConfigError(_dacite_message(exc)) from None
    problems = list(_validation_errors(cfg, ""))
    problems += [f"{key}: {message}" for check in checks for key, message in check(cfg)]
    if problems:
        raise ConfigError("\n".join(problems))
    return cfg


def _yaml_error(path: Path, exc: yaml.YAMLError) -> str:
    """`file:line:column: problem`, the offending line with a caret under the column, and what the parser was
    in the middle of (PyYAML's own text names an anonymous "<unicode string>" instead of the file)."""
    mark = getattr(exc, "problem_mark", None)
    if mark is None:
        return f"{path}: not valid YAML: {exc}"
    message = (
        f"{path}:{mark.line + 1}:{mark.column + 1}: not valid YAML: {getattr(exc, 'problem', None) or exc}"
    )
    context, context_mark = getattr(exc, "context", None), getattr(exc, "context_mark", None)
    if context and context_mark is not None:
        message += f" ({context} at line {context_mark.line + 1})"
    snippet = mark.get_snippet(indent=4, max_length=100)
    return message + (f"\n{snippet}" if snippet else "")


def key_lines(text: str) -> dict[str, int]:
    """The 1-based line of every mapping key in a YAML text, by dotted key path (list items by index)."""
    lines: dict[str, int] = {}

    def walk(node: yaml.Node | None, path: str) -> None:
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                if isinstance(key, yaml.ScalarNode):
                    where = f"{path}.{key.value}" if path else str(key.value)
                    lines.setdefault(where, key.start_mark.line + 1)
                    walk(value, where)
        elif isinstance(node, yaml.SequenceNode):
            for i, value in enumerate(node.value):
                walk(value, f"{path}.{i}")

    with contextlib.suppress(yaml.YAMLError):  # an unparsable file has no lines to give
        walk(yaml.compose(text), "")
    return lines


def _with_lines(message: str, path: Path, overrides: list[str]) -> str:
    """Prefix each `key.path: problem` line of a ConfigError with `file:line` of that key (or of its nearest
    enclosing key) in the config file; keys set by a command-line override are left as they are."""
    try:
        lines = key_lines(path.read_text())
    except OSError:
        return message
    overridden = [item.partition("=")[0] for item in overrides]
    out = []
    for line in message.splitlines():
        key = line.split(": ", 1)[0]
        if " " in key or any(key == o or key.startswith(o + ".") for o in overridden):
            out.append(line)
            continue
        parts = key.split(".")
        found = next(
            (lines[p] for p in (".".join(parts[:n]) for n in range(len(parts), 0, -1)) if p in lines), None
        )
        out.append(line if found is None else f"{path}:{found}: {line}")
    return "\n".join(out)


def load_raw(path: str | Path, overrides: list[str] | None = None) -> dict[str, Any]:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    try:
        raw = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(_yaml_error(path, exc)) from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the config must be a YAML mapping at the top level")
    return interpolate(apply_overrides(raw, overrides or []))


@dataclass(frozen=True, kw_only=True)
class ResolvedConfig:
    """A validated config with every derived value filled in; what a run actually uses."""

    config: PipelineConfig
    config_path: str
    domain_shares: dict[str, int]

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": dataclasses.asdict(self.config),
            "config_path": self.config_path,
            "derived": {"domain_shares": dict(self.domain_shares)},
        }


def _resolve_input_path(value: str, base: Path) -> str:
    p = Path(value).expanduser()
    if p.is_absolute():
        return str(p)
    return str((base / p).resolve())


def _looks_like_hub_id(value: str) -> bool:
    """`org/name` that is not an existing path; a path written with ./, ../, ~ or / is always local."""
    if value.startswith(("./", "../", "~", "/")):
        return False
    return bool(re.fullmatch(r"[A-Za-z0-9][\w.\-]*/[\w.\-]+", value))


def model_reference(value: str, base: Path) -> str:
    """A config's model value as a run uses it: an absolute folder path (relative ones from the config's folder),
    or, for `org/name` where no such folder exists, the hub id unchanged. (`roll serve` and the local judge find
    the weights in a folder or a run's checkpoint: workers/inference/model_path.py, `resolve_model_path`.)"""
    local = Path(value).expanduser()
    if not local.is_absolute():
        local = base / local
    if local.exists() or not _looks_like_hub_id(value):
        return str(local.resolve())
    return value


def resolve(cfg: PipelineConfig, config_path: str | Path) -> ResolvedConfig:
    """Fill in derived values: model paths default to `pretrain`; input paths become absolute."""
    base = Path(config_path).resolve().parent
    pretrain = model_reference(cfg.pretrain, base)

    def with_model(section: Any) -> Any:
        if section is None:
            return None
        name = section.model_args.model_name_or_path
        path = pretrain if name is None else model_reference(name, base)
        return dataclasses.replace(
            section, model_args=dataclasses.replace(section.model_args, model_name_or_path=path)
        )

    data = dataclasses.replace(
        cfg.data,
        train_files=[_resolve_input_path(f, base) for f in cfg.data.train_files],
        val_files=[_resolve_input_path(f, base) for f in cfg.data.val_files],
    )
    tracking = cfg.tracking
    if tracking.run_name is None:
        tracking = dataclasses.replace(tracking, run_name=cfg.exp_name)
    output_dir = cfg.output_dir if cfg.output_dir is not None else f"runs/{cfg.exp_name}"
    resolved = dataclasses.replace(
        cfg,
        pretrain=pretrain,
        output_dir=str(Path(output_dir).expanduser().resolve()),
        data=data,
        tracking=tracking,
        actor_train=with_model(cfg.actor_train),
        actor_infer=with_model(cfg.actor_infer),
        reference=with_model(cfg.reference),
        critic=with_model(cfg.critic),
    )
    return ResolvedConfig(
        config=resolved,
        config_path=str(Path(config_path).resolve()),
        domain_shares=domain_shares(cfg.domain_interleave_probs, cfg.rollout_batch_size),
    )


def load_config(
    path: str | Path, overrides: list[str] | None = None, checks: Sequence[Check] = ()
) -> ResolvedConfig:
    """Read, interpolate, override, validate and resolve a pipeline config file. The names of algorithms and
    filters are not checked here (the core imports no registering module): `checks` adds such findings, and
    `roll_pipeline.driver.names.load_run_config` is the load a run uses."""
    raw = load_raw(path, overrides)
    try:
        cfg = from_dict(raw, checks)
    except ConfigError as exc:
        raise ConfigError(_with_lines(str(exc), Path(path), overrides or [])) from None
    return resolve(cfg, path)

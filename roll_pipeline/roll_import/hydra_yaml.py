"""Reading a ROLL YAML: Hydra's `${...}` references resolved by OmegaConf (the library Hydra itself uses), and a
tree that records which of its keys the importer took, so that every key left over is reported."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

_MISSING = object()


class RollConfigError(ValueError):
    """The file is not a ROLL config the importer can read (YAML, a reference to no key); the message says where."""


def load_roll_yaml(path: str | Path) -> dict[str, Any]:
    """The file's mapping with every Hydra interpolation resolved (`${a.b}`, `${oc.env:X}`, relative `${.x}`)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException
    from yaml import YAMLError

    try:
        tree = OmegaConf.to_container(OmegaConf.load(Path(path)), resolve=True)
    except OSError as exc:
        raise RollConfigError(f"{path}: {exc.strerror or exc}") from None
    except (YAMLError, OmegaConfBaseException) as exc:
        raise RollConfigError(f"{path}: {' '.join(str(exc).split())}") from None
    if not isinstance(tree, dict):
        raise RollConfigError(f"{path}: a ROLL config is a YAML mapping at the top level")
    return tree


def dig(tree: dict[str, Any], path: str, default: Any = None) -> Any:
    """The value at a dotted path of nested mappings, or `default` where any part is missing."""
    node: Any = tree
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


class RollTree:
    """A resolved ROLL config whose keys are taken by dotted path; `left()` lists the leaves nobody took."""

    def __init__(self, tree: dict[str, Any]) -> None:
        self.tree = tree
        self.taken: set[str] = set()

    def get(self, path: str, default: Any = None) -> Any:
        return dig(self.tree, path, default)

    def has(self, path: str) -> bool:
        return self.get(path, _MISSING) is not _MISSING

    def take(self, path: str, default: Any = None) -> Any:
        """The value at `path` (default where absent); the key and everything under it count as handled."""
        self.taken.add(path)
        return self.get(path, default)

    def keys(self, path: str) -> list[str]:
        node = self.get(path)
        return [str(k) for k in node] if isinstance(node, dict) else []

    def is_taken(self, path: str) -> bool:
        """Whether `path` or a section above it was taken."""
        parts = path.split(".")
        return any(".".join(parts[:i]) in self.taken for i in range(1, len(parts) + 1))

    def leaves(self) -> Iterator[tuple[str, Any]]:
        def walk(node: Any, prefix: str) -> Iterator[tuple[str, Any]]:
            if isinstance(node, dict) and node:
                for key, value in node.items():
                    yield from walk(value, f"{prefix}.{key}" if prefix else str(key))
            else:
                yield prefix, node

        yield from walk(self.tree, "")

    def left(self) -> list[tuple[str, Any]]:
        """The leaves (path, value) that no handler took, in file order."""
        return [(path, value) for path, value in self.leaves() if not self.is_taken(path)]

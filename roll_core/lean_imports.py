"""Imports a process of ours need not pay for.

transformers imports scikit-learn (installed here because MLflow depends on it) when `transformers.generation` is
imported, for one function, `sklearn.metrics.roc_curve`, that only assisted generation's dynamic confidence
threshold uses; the project never runs assisted generation. That import costs 1.5 s of CPU in every process that
loads a tokenizer or a model: each pipeline worker and scheduler, the driver (measured with `python -c "import
workers.actor_train"` on a 2-core AMD EPYC Zen 4, 2026-12-06: 6.2-7.4 s user+sys with it, 5.3-5.5 s without, three
runs each). `install()` makes `transformers.generation.candidate_generator` see scikit-learn as absent while its
module body runs (transformers' own branch for an environment without it), and only that module: everything else
that asks transformers whether scikit-learn is there is told the truth.

Every package of the project installs it on import (roll_core/__init__.py and the packages above it), so a Ray
worker, which imports its actor's module before anything of transformers, has it before transformers comes in."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

TARGET = "transformers.generation.candidate_generator"


class _CandidateGeneratorWithoutSklearn(importlib.abc.MetaPathFinder):
    """Finds TARGET as the path finder does, and runs its body with `transformers.utils.is_sklearn_available`
    answering False (restored right after)."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        run_body = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            utils: Any = sys.modules["transformers.utils"]  # the package's parent, imported first
            answer = utils.is_sklearn_available
            utils.is_sklearn_available = lambda: False
            try:
                run_body(module)
            finally:
                utils.is_sklearn_available = answer

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install() -> None:
    """Put the finder first on sys.meta_path (once); nothing to do once TARGET is imported."""
    if TARGET in sys.modules or any(isinstance(f, _CandidateGeneratorWithoutSklearn) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _CandidateGeneratorWithoutSklearn())

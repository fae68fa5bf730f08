"""Imports a process of ours need not pay for: modules of our dependencies whose bodies import a heavy package
for a feature the project never uses, run here as if that package were absent (each module's own branch for an
environment without it), and only those modules: everyone else importing or asking about the package gets it.

- `transformers.generation.candidate_generator` imports scikit-learn (installed here because MLflow depends on it)
  for one function, `sklearn.metrics.roc_curve`, that only assisted generation's dynamic confidence threshold uses;
  the project never runs assisted generation. It runs with `transformers.utils.is_sklearn_available` answering
  False. The import cost 1.5 s of CPU in every process that loads a tokenizer or a model: each pipeline worker
  and scheduler, the driver (measured with `python -c "import workers.actor_train"` on a 2-core AMD EPYC Zen 4,
  2026-12-06: 6.2-7.4 s user+sys with it, 5.3-5.5 s without, three runs each).
- `deepspeed.autotuning.autotuner` (imported by `import deepspeed`) imports MLflow to log DeepSpeed's autotuning
  experiments; the project never runs DeepSpeed's autotuner. It runs with `import mlflow` failing, unless MLflow is
  already imported (the driver's tracking: then it costs nothing). MLflow and what it imports (pandas, pyarrow,
  FastAPI) cost 1.3-1.8 s of CPU in every actor_train and critic process (an actor_train's imports, its actor
  module, torch, transformers' model classes and deepspeed: 7.4-8.0 s user+sys with it, 6.1-6.3 s with this
  rule, three runs each, 2026-12-06, same machine). MLflow is marked absent in sys.modules while the module body
  runs: a second thread importing MLflow for the first time in that instant would be refused too; DeepSpeed is
  imported by a training worker's strategy, before the worker runs anything else.
- `transformers.models.auto.auto_factory` (imported by AutoTokenizer and AutoConfig, every process that loads a
  tokenizer) imports `transformers.generation` for one name, GenerationMixin, which only loading a model with remote
  code (`trust_remote_code`) uses; with it come torch's compiler (torch._dynamo) and transformers' distributed
  modules. A process that loads a model imports generation anyway (the model's module does); a scheduler, which
  loads only the tokenizer, and the driver do not need it. Its body runs with `transformers.utils.is_torch_available`
  answering False (the module's branch for an environment without torch skips the import); then the module's own
  name is the true function again (the modules the body imports are imported before it, so none of them binds the
  false answer), and the function that uses GenerationMixin imports it on its first call. About 2 s of CPU less
  per scheduler (its modules' imports and its tokenizer: 5.7-6.1 s user+sys without this rule, 3.7-4.0 s with it,
  four runs each, alternating, 2026-12-06, same machine).

Every package of the project installs the finder on import (roll_core/__init__.py and the packages above it), so a
Ray worker, which imports its actor's module before anything of transformers or DeepSpeed, has it before they come
in."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

#: How a module's body runs under its rule: rule(module, run_body), where run_body(module) runs the body as is.
Rule = Callable[[ModuleType, Callable[[ModuleType], None]], None]


def _answering_false(name: str, module: ModuleType, run_body: Callable[[ModuleType], None]) -> None:
    """Run the body with `transformers.utils.<name>` answering False, the true function again right after."""
    utils: Any = sys.modules["transformers.utils"]  # the module's package's parent, imported first
    answer = getattr(utils, name)
    setattr(utils, name, lambda: False)
    try:
        run_body(module)
    finally:
        setattr(utils, name, answer)


def _sklearn_absent_to_transformers(module: ModuleType, run_body: Callable[[ModuleType], None]) -> None:
    _answering_false("is_sklearn_available", module, run_body)


def _mlflow_unimportable(module: ModuleType, run_body: Callable[[ModuleType], None]) -> None:
    if "mlflow" in sys.modules:  # imported already (or marked by someone else): nothing to save
        run_body(module)
        return
    sys.modules["mlflow"] = None  # type: ignore[assignment]  # `import mlflow` raises ModuleNotFoundError
    try:
        run_body(module)
    finally:
        if sys.modules.get("mlflow", ...) is None:
            del sys.modules["mlflow"]


#: The modules of transformers that auto_factory's body imports (transformers 5.19).
AUTO_FACTORY_IMPORTS = (
    "transformers.configuration_utils",
    "transformers.dynamic_module_utils",
    "transformers.models.auto.configuration_auto",
)


def _auto_factory_without_generation(module: ModuleType, run_body: Callable[[ModuleType], None]) -> None:
    # What the body imports, imported first, so that no module but this one binds the answer below.
    for name in AUTO_FACTORY_IMPORTS:
        importlib.import_module(name)
    # the body binds this name (`from ...utils import is_torch_available`): afterwards it is the true one again
    _answering_false("is_torch_available", module, run_body)
    module.is_torch_available = sys.modules["transformers.utils"].is_torch_available  # type: ignore[attr-defined]
    add_mixin = module.add_generation_mixin_to_remote_model

    def add_generation_mixin_to_remote_model(model_class: Any) -> Any:
        if "GenerationMixin" not in module.__dict__:
            from transformers.generation import GenerationMixin

            module.GenerationMixin = GenerationMixin  # type: ignore[attr-defined]
        return add_mixin(model_class)

    module.add_generation_mixin_to_remote_model = add_generation_mixin_to_remote_model  # type: ignore[attr-defined]


#: Module -> the rule its body runs under.
RULES: dict[str, Rule] = {
    "transformers.generation.candidate_generator": _sklearn_absent_to_transformers,
    "deepspeed.autotuning.autotuner": _mlflow_unimportable,
    "transformers.models.auto.auto_factory": _auto_factory_without_generation,
}


class _LeanFinder(importlib.abc.MetaPathFinder):
    """Finds a module of RULES as the path finder does, and runs its body under its rule."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        rule = RULES.get(fullname)
        if rule is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        run_body = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            rule(module, run_body)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install() -> None:
    """Put the finder first on sys.meta_path (once)."""
    if any(isinstance(f, _LeanFinder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _LeanFinder())

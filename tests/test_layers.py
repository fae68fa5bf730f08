"""The layers import one way (roll_pipeline/driver/__init__.py): the core, then workers/ and schedulers/, then
the driver. Checked two ways: what a fresh interpreter holds after loading a config, and every import statement
of the source (those inside functions included)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys

from tests.conftest import ROOT

#: The core: modules (or packages) that import nothing from the layers above.
CORE = (
    "roll_pipeline.config",
    "roll_pipeline.batch",
    "roll_pipeline.registry",
    "roll_pipeline.algorithms",
    "roll_pipeline.tracking.metadata",
    "roll_pipeline.tracking.mlflow_tracker",
    "roll_pipeline.tracking.spool",
    "roll_pipeline.tracking.system",
    "roll_pipeline.data.loading",
    "roll_pipeline.console",
    "roll_pipeline.models.forward",
    "roll_pipeline.models.sampling",
    "roll_pipeline.models.pretrained",
    "roll_pipeline.models.embedded",
)
#: The middle layer.
MIDDLE = ("workers", "schedulers")
#: Imports of the middle layer that still point up, into modules of roll_pipeline/ outside the core: none. (An
#: entry here would be a known debt, listed so that no new one comes in unseen.)
MIDDLE_UPWARD_KNOWN: set[tuple[str, str]] = set()


def in_layer(module: str, layer: tuple[str, ...]) -> bool:
    return any(module == name or module.startswith(name + ".") for name in layer)


def is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imports_of_source() -> dict[str, set[str]]:
    """module -> the project modules its source imports (absolute imports, at any depth of the code)."""
    found: dict[str, set[str]] = {}
    for package in ("roll_pipeline", "workers", "schedulers"):
        for path in (ROOT / package).rglob("*.py"):
            module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            names: set[str] = set()
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Import):
                    names.update(alias.name for alias in node.names)
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    # `from package import module` imports the module; `from module import name` the module
                    for alias in node.names:
                        full = f"{node.module}.{alias.name}"
                        names.add(full if is_module(full) else node.module)
            found[module] = {n for n in names if n.split(".")[0] in ("roll_pipeline", "workers", "schedulers")}
    return found


def test_the_core_imports_nothing_from_the_layers_above():
    upward = sorted(
        (module, name)
        for module, names in imports_of_source().items()
        if in_layer(module, CORE)
        for name in names
        if not in_layer(name, CORE) and name != "roll_pipeline"
    )
    assert upward == []


def test_workers_and_schedulers_import_only_the_core_from_roll_pipeline():
    upward = {
        (module, name)
        for module, names in imports_of_source().items()
        if in_layer(module, MIDDLE)
        for name in names
        if name.startswith("roll_pipeline.") and not in_layer(name, CORE)
    }
    assert upward - MIDDLE_UPWARD_KNOWN == set(), "new imports from workers/ or schedulers/ into the driver"
    assert MIDDLE_UPWARD_KNOWN - upward == set(), "a known upward import is gone: remove it from the list"


def test_loading_a_config_pulls_in_no_torch_ray_workers_or_schedulers():
    """In a fresh interpreter, as `roll config show` starts: import the core config and load the example."""
    code = (
        "import json, sys\n"
        "from roll_pipeline.config import load_config\n"
        "load_config('examples/math_code.yaml', ['max_steps=3'])\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    loaded = json.loads(done.stdout)
    heavy = sorted({m.split(".")[0] for m in loaded} & {"torch", "ray", "workers", "schedulers", "transformers"})
    assert heavy == []
    assert "roll_pipeline.config.loader" in loaded  # the check looked at a real load

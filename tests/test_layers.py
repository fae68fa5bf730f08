"""The folders are the layers: roll_pipeline/ on top of schedulers/ on top of workers/ on top of roll_core/, each
importing only the ones below it. The map is written once, in pyproject.toml ([tool.importlinter]); import-linter
checks every import statement of the source against it (those inside functions included), and a fresh
interpreter shows what loading a config really pulls in."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

from tests.conftest import ROOT


def layer_map() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["importlinter"]


def test_every_import_points_down():
    lint = Path(sys.executable).parent / "lint-imports"
    done = subprocess.run(
        [str(lint), "--no-cache"], capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    contracts = layer_map()["contracts"]
    for contract in contracts:
        assert f"{contract['name']} KEPT" in done.stdout
    assert f"Contracts: {len(contracts)} kept, 0 broken." in done.stdout


def test_the_layer_map_names_every_package_the_project_installs():
    """A new top-level package is either placed on a floor or the map is incomplete."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    installed = {name.rstrip("*") for name in project["tool"]["setuptools"]["packages"]["find"]["include"]}
    layers = next(c for c in layer_map()["contracts"] if c["type"] == "layers")["layers"]
    assert set(layers) == installed == set(layer_map()["root_packages"])
    assert all((ROOT / name / "__init__.py").is_file() for name in layers)


def test_loading_a_config_pulls_in_no_torch_ray_workers_or_schedulers():
    """In a fresh interpreter, as `roll config show` starts: import the core config and load the example."""
    code = (
        "import json, sys\n"
        "from roll_core.config import load_config\n"
        "load_config('examples/math_code.yaml', ['max_steps=3'])\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    loaded = json.loads(done.stdout)
    heavy = sorted({m.split(".")[0] for m in loaded} & {"torch", "ray", "workers", "schedulers", "transformers"})
    assert heavy == []
    assert "roll_core.config.loader" in loaded  # the check looked at a real load

"""roll_pipeline/api.py: the entry points the benchmarks (and users' scripts) build on."""

from __future__ import annotations

import ast
import json
import subprocess
import sys

import pytest

import roll_pipeline.api as api
from tests.conftest import ROOT


@pytest.mark.parametrize("name", sorted(api.ENTRY_POINTS))
def test_every_entry_point_resolves(name):
    """A refactoring that moves one of them fails here, in `make test`, instead of in a benchmark run."""
    value = getattr(api, name)
    assert value is not None
    assert getattr(value, "__name__", name) == name


def test_an_unknown_name_is_an_error_that_lists_the_known_ones():
    with pytest.raises(AttributeError, match="no 'RLVRPipline'.*RLVRPipeline"):
        api.RLVRPipline  # noqa: B018


def test_benchmarks_import_the_project_only_through_the_api():
    offenders = []
    for path in sorted((ROOT / "benchmarks").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            for name in names:
                if name.split(".")[0] in ("roll_core", "roll_pipeline", "workers", "schedulers") and name != "roll_pipeline.api":
                    offenders.append(f"{path.name}:{node.lineno} imports {name}")
    assert offenders == []


def test_importing_the_api_loads_nothing_heavy():
    code = "import json, sys\nimport roll_pipeline.api\nprint(json.dumps(sorted(sys.modules)))\n"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    loaded = {m.split(".")[0] for m in json.loads(done.stdout)}
    assert loaded & {"torch", "ray", "workers", "schedulers", "transformers"} == set()

"""roll_core/lean_imports.py: a process of the project imports transformers' generation utilities without
scikit-learn, and transformers still tells everyone else the truth about it."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import ROOT

PROBE = """
import sys
{first}
from transformers.generation import candidate_generator
import transformers.utils
print("sklearn" in sys.modules, candidate_generator.is_sklearn_available(), transformers.utils.is_sklearn_available())
"""


def probe(first: str) -> list[str]:
    done = subprocess.run([sys.executable, "-c", PROBE.format(first=first)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, check=True)
    return done.stdout.split()


def test_without_the_project_transformers_imports_sklearn():
    # The cost the finder saves: if transformers stops importing scikit-learn here, roll_core/lean_imports.py has
    # nothing left to do and can go.
    assert probe("") == ["True", "True", "True"]


def test_each_package_of_the_project_installs_it_before_transformers_comes_in():
    # A Ray worker's first import is its actor's module (workers.actor_train for actor_train); the driver's is the
    # CLI's; a module's third-party imports (transformers) run before its own package's modules, never before its
    # package, so each package's __init__ installs it.
    for first in ("workers.actor_train", "roll_pipeline.driver.cli", "schedulers", "roll_core"):
        assert probe(f"import {first}") == ["False", "False", "True"], first

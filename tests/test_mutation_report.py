"""MUTATION.md describes the sources it names: every saved mutation result was made from its module as it is now,
with the tests, marker selection and functions its target names, every survivor is explained, and the report is
what the results give (mutation/run.py's `--check`; seconds, no cosmic-ray). A change to a mutated module fails
here until its target is run again: `make mutation MODULES=<module>`."""

from __future__ import annotations

from mutation import run


def test_mutation_results_are_current_and_every_survivor_is_explained():
    problems = run.check()
    assert problems == [], "\n".join(problems)

"""The math_rule benchmark's generated cases: mixed, reproducible, and judged as their labels say."""

from __future__ import annotations

from benchmarks.bench_math_rule import KINDS, make_cases, run_pool, run_single


def test_cases_are_mixed_and_reproducible():
    cases = make_cases(1000, seed=0)
    assert len(cases) == 1000
    assert make_cases(1000, seed=0) == cases and make_cases(1000, seed=1) != cases
    assert {kind for kind, *_ in cases} == set(KINDS)
    assert 400 < sum(expected for *_, expected in cases) < 700
    assert len({(response, truth) for _, response, truth, _ in cases}) > 800


def test_every_generated_case_gets_its_expected_verdict():
    cases = make_cases(len(KINDS) * 5, seed=3)
    _, verdicts = run_single(cases)
    assert verdicts == [expected for *_, expected in cases]


def test_the_pool_gives_the_same_verdicts_as_one_process():
    cases = make_cases(len(KINDS) * 2, seed=4)
    _, _, pooled = run_pool(cases, processes=2)
    assert pooled == [expected for *_, expected in cases]

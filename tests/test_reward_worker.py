"""The generic reward worker and the scorer registry."""

from __future__ import annotations

import importlib.metadata
import threading
import time

import pytest

from workers.rewards import registry
from workers.rewards.base import RewardResult, RewardScorer
from workers.rewards.code_sandbox import CodeSandboxScorer
from workers.rewards.math_rule import MathRuleScorer
from workers.rewards.registry import available_reward_workers, get_reward_scorer_cls, register_reward_worker
from workers.rewards.worker import RewardWorker


class EchoScorer(RewardScorer):
    """Scores by the sample's fields: ``mode`` picks a result, an exception, None or a sleep."""

    def __init__(self, *, bonus: float = 0.0, **options: object) -> None:
        super().__init__(**options)
        self.bonus = bonus

    def score(self, response: str, ground_truth: str, **fields: object) -> RewardResult | None:
        mode = fields.get("mode", "ok")
        if mode == "raise":
            raise RuntimeError("judge unreachable")
        if mode == "none":
            return None
        if mode == "sleep":
            time.sleep(float(fields["sleep_s"]))
        if mode == "wrong_type":
            return 1.0  # type: ignore[return-value]
        correct = response == ground_truth
        return RewardResult(
            score=float(correct) + self.bonus, correct=correct, metrics={"length": len(response)}
        )


class SlowScorer(RewardScorer):
    """Sleeps for as long as the sample asks, recording how many calls overlap."""

    active = 0
    peak = 0
    lock = threading.Lock()

    def score(self, response: str, ground_truth: str, **fields: object) -> RewardResult | None:
        with SlowScorer.lock:
            SlowScorer.active += 1
            SlowScorer.peak = max(SlowScorer.peak, SlowScorer.active)
        try:
            time.sleep(float(fields.get("sleep_s", 0.0)))
        finally:
            with SlowScorer.lock:
                SlowScorer.active -= 1
        return RewardResult(score=1.0, correct=True)


ECHO = "tests.test_reward_worker:EchoScorer"
SLOW = "tests.test_reward_worker:SlowScorer"


def sample(response: str = "a", ground_truth: str = "a", **fields: object) -> dict:
    return {"response": response, "ground_truth": ground_truth, **fields}


@pytest.fixture
def clean_registry(monkeypatch):
    """A registry copy, so that names registered by a test do not leak into others."""
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))


# --- worker ---------------------------------------------------------------------------------------------------


def test_score_batch_keeps_order_and_passes_fields_and_options():
    worker = RewardWorker("echo", ECHO, {"bonus": 0.5})
    results = worker.score_batch([sample("a", "a"), sample("b", "a"), sample("abc", "abc", tag="t", id=3)])
    assert [r["score"] for r in results] == [1.5, 0.5, 1.5]
    assert [r["correct"] for r in results] == [True, False, True]
    assert [r["masked"] for r in results] == [False, False, False]
    assert [r["metrics"] for r in results] == [{"length": 1}, {"length": 1}, {"length": 3}]
    assert worker.score_batch([]) == []


@pytest.mark.parametrize(
    ("fields", "reason"),
    [({"mode": "none"}, "not_applicable"), ({"mode": "raise"}, "error"), ({"mode": "wrong_type"}, "error")],
)
def test_none_and_failures_are_masked_not_zero(fields, reason):
    results = RewardWorker("echo", ECHO, {}).score_batch([sample(), sample(**fields)])
    assert results[0]["masked"] is False
    assert results[1] == {
        "score": None,
        "correct": None,
        "masked": True,
        "mask_reason": reason,
        "metrics": {},
    }


def test_timeout_masks_the_sample_and_the_rest_of_the_batch_goes_on():
    worker = RewardWorker("echo", ECHO, {}, timeout_s=0.3, num_threads=1)
    batch = [sample(mode="sleep", sleep_s=5.0), sample("a", "a"), sample("b", "a")]
    start = time.monotonic()
    results = worker.score_batch(batch)
    assert time.monotonic() - start < 2.0
    assert results[0]["masked"] and results[0]["mask_reason"] == "timeout"
    assert [r["score"] for r in results[1:]] == [1.0, 0.0]


def test_timeout_is_per_sample_running_time_not_queue_time():
    """2 threads run 8 samples of 0.2 s in four waves (0.8 s); counted from submission, waves 3-4 would time out."""
    worker = RewardWorker("slow", SLOW, {}, timeout_s=0.5, num_threads=2)
    results = worker.score_batch([sample(sleep_s=0.2) for _ in range(8)])
    assert not any(r["masked"] for r in results)


def test_scores_concurrently_up_to_num_threads():
    SlowScorer.peak = 0
    worker = RewardWorker("slow", SLOW, {}, num_threads=3)
    start = time.monotonic()
    worker.score_batch([sample(sleep_s=0.2) for _ in range(6)])
    assert SlowScorer.peak == 3
    assert time.monotonic() - start < 1.0


def test_missing_response_or_ground_truth_is_an_error():
    with pytest.raises(KeyError, match="ground_truth"):
        RewardWorker("echo", ECHO, {}).score_batch([{"response": "a"}])


def test_domain_metrics():
    worker = RewardWorker("math", ECHO, {})
    results = worker.score_batch(
        [sample("a", "a"), sample("abc", "x"), sample(mode="none"), sample(mode="raise"), sample("ab", "ab")]
    )
    assert worker.domain_metrics(results) == {
        "reward/math/count": 5.0,
        "reward/math/masked": 2.0,
        "reward/math/masked_not_applicable": 1.0,
        "reward/math/masked_error": 1.0,
        "reward/math/masked_timeout": 0.0,
        "reward/math/score": pytest.approx(2 / 3),
        "reward/math/correct": pytest.approx(2 / 3),
        "reward/math/length": 2.0,
    }


def test_domain_metrics_with_everything_masked_has_no_means():
    worker = RewardWorker("math", ECHO, {})
    metrics = worker.domain_metrics(worker.score_batch([sample(mode="none")]))
    assert metrics["reward/math/masked"] == 1.0
    assert "reward/math/score" not in metrics and "reward/math/correct" not in metrics


def test_unknown_option_fails_at_construction():
    with pytest.raises(TypeError, match="bonsu"):
        RewardWorker("echo", ECHO, {"bonsu": 1.0})


def test_math_and_code_through_the_worker():
    math = RewardWorker("math", "math_rule", {})
    assert [
        r["score"] for r in math.score_batch([sample("The answer is 4.", "4"), sample("\\boxed{5}", "4")])
    ] == [
        1.0,
        0.0,
    ]
    code = RewardWorker("code", "code_sandbox", {"timeout_s": 2.0})
    tests = '{"asserts": ["assert f(2) == 4"]}'
    results = code.score_batch([sample("def f(x):\n    return 2 * x", "", test_cases=tests), sample("x", "")])
    assert results[0]["score"] == 1.0
    assert results[1]["mask_reason"] == "not_applicable"


# --- registry -------------------------------------------------------------------------------------------------


def test_builtin_names():
    assert get_reward_scorer_cls("math_rule") is MathRuleScorer
    assert get_reward_scorer_cls("code_sandbox") is CodeSandboxScorer
    assert available_reward_workers()["math_rule"] == "workers.rewards.math_rule:MathRuleScorer"


def test_module_class_path():
    assert get_reward_scorer_cls(ECHO) is EchoScorer
    assert get_reward_scorer_cls("workers.rewards.math_rule:MathRuleScorer") is MathRuleScorer


@pytest.mark.parametrize(
    ("spec", "error", "match"),
    [
        ("tests.no_such_module:Scorer", ValueError, "cannot import"),
        ("tests.test_reward_worker:Missing", ValueError, "no 'Missing'"),
        ("tests.test_reward_worker:sample", TypeError, "not a subclass of RewardScorer"),
        (":EchoScorer", ValueError, "package.module:Class"),
    ],
)
def test_bad_module_class_path(spec, error, match):
    with pytest.raises(error, match=match):
        get_reward_scorer_cls(spec)


def test_unknown_name_lists_available():
    with pytest.raises(ValueError, match="unknown reward worker 'math_rules'") as info:
        get_reward_scorer_cls("math_rules")
    assert "code_sandbox" in str(info.value) and "math_rule" in str(info.value)


def test_duplicate_name_is_refused(clean_registry):
    register_reward_worker("echo_once")(EchoScorer)
    with pytest.raises(
        ValueError, match="'echo_once' is already registered to tests.test_reward_worker:EchoScorer"
    ):
        register_reward_worker("echo_once")(SlowScorer)
    with pytest.raises(ValueError, match="already registered"):
        register_reward_worker("math_rule")(SlowScorer)
    assert get_reward_scorer_cls("echo_once") is EchoScorer


def test_register_rejects_non_scorers(clean_registry):
    with pytest.raises(TypeError, match="RewardScorer"):
        register_reward_worker("not_a_scorer")(dict)


def test_entry_point_plugins_load_lazily(clean_registry, monkeypatch):
    entry_point = importlib.metadata.EntryPoint(
        name="third_party_echo", value=ECHO, group=registry.ENTRY_POINT_GROUP
    )

    def entry_points(*, group):
        return [entry_point] if group == registry.ENTRY_POINT_GROUP else []

    monkeypatch.setattr(registry.importlib.metadata, "entry_points", entry_points)
    assert available_reward_workers()["third_party_echo"] == ECHO
    assert "third_party_echo" not in registry._REGISTRY
    assert get_reward_scorer_cls("third_party_echo") is EchoScorer
    assert registry._REGISTRY["third_party_echo"] is EchoScorer


# --- Ray ------------------------------------------------------------------------------------------------------


def test_worker_as_a_ray_actor():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        actor = ray.remote(RewardWorker).remote("math", "math_rule", {}, 10.0, 2)
        results = ray.get(
            actor.score_batch.remote(
                [
                    sample("The answer is 57.", "57"),
                    sample("\\boxed{\\frac{1}{2}}", "0.5"),
                    sample("no idea", "3"),
                ]
            ),
            timeout=120,
        )
        assert [r["score"] for r in results] == [1.0, 1.0, 0.0]
        metrics = ray.get(actor.domain_metrics.remote(results), timeout=60)
        assert metrics["reward/math/correct"] == pytest.approx(2 / 3)
    finally:
        ray.shutdown()

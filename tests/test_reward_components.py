"""Several weighted rewards per domain (rewards.<domain>.workers): the config, and the per-sample combination
(workers/rewards/combine.py)."""

from __future__ import annotations

import pytest

from roll_core.config import ConfigError, load_config
from roll_core.rewards.scored import MASK_ERROR, MASK_TIMEOUT, ScoredSample
from tests.conftest import EXAMPLES
from workers.rewards.combine import Component, combine

RULE, RM = Component("math_rule", 1.0), Component("reward_model", 0.5, "skip")


def ok(score: float, correct: bool = True, **metrics: float) -> ScoredSample:
    return ScoredSample(score=score, correct=correct, metrics=metrics)


def test_the_domains_reward_is_the_weighted_sum_and_the_first_component_decides_correct():
    rule = [ok(1.0, True, answer_found=1.0), ok(0.0, False)]
    rm = [ok(-2.0, False, rm_logit=-2.0), ok(3.0, True, rm_logit=3.0)]
    first, second = combine([RULE, RM], {"math_rule": rule, "reward_model": rm})
    assert (first.score, first.correct, dict(first.metrics)) == (1.0 - 1.0, True, {"answer_found": 1.0})
    assert (second.score, second.correct) == (1.5, False)  # the model liked it; the rule decides accuracy
    assert second.components == {"math_rule": rule[1], "reward_model": rm[1]}


def test_one_component_passes_its_judgements_through_unchanged():
    rule = [ok(1.0), ScoredSample.masked_as(MASK_TIMEOUT)]
    assert combine([RULE], {"math_rule": rule}) == rule


def test_a_masking_component_masks_the_sample_and_a_skipped_one_leaves_the_sum_at_the_same_scale():
    strict = Component("reward_model", 0.5, "mask")
    rule = [ok(1.0), ok(1.0), ScoredSample.masked_as(MASK_TIMEOUT)]
    rm = [ScoredSample.masked_as(MASK_ERROR), ok(2.0), ok(2.0)]
    masked, scored, rule_masked = combine([RULE, strict], {"math_rule": rule, "reward_model": rm})
    assert masked.mask_reason == MASK_ERROR and scored.score == 2.0
    assert rule_masked.mask_reason == MASK_TIMEOUT  # the first component's masking always masks
    skipped, _, _ = combine([RULE, RM], {"math_rule": rule, "reward_model": rm})
    # the rule alone, its weight scaled from 1.0 to the whole 1.5: a sample's reward keeps the scale of the sum
    assert not skipped.masked and skipped.score == pytest.approx(1.5) and skipped.correct is True


def test_the_first_masking_component_in_config_order_gives_the_reason():
    # on_masked as the config loader gives it: a string built at run time, equal to "mask" but not the literal
    mask = "".join(["ma", "sk"])
    a, b = Component("a", 1.0, mask), Component("b", 1.0, mask)
    results = {"math_rule": [ok(1.0)], "a": [ScoredSample.masked_as(MASK_ERROR)], "b": [ScoredSample.masked_as(MASK_TIMEOUT)]}
    (sample,) = combine([RULE, a, b], results)
    assert sample.masked and sample.mask_reason == MASK_ERROR
    (sample,) = combine([RULE, b, a], results)
    assert sample.mask_reason == MASK_TIMEOUT
    # A component is a value: frozen, hashable, equal by its fields
    assert {RULE, Component("math_rule", 1.0)} == {RULE}
    with pytest.raises(AttributeError):
        RULE.weight = 2.0


def test_components_must_judge_every_sample():
    with pytest.raises(ValueError, match="different numbers"):
        combine([RULE, RM], {"math_rule": [ok(1.0)], "reward_model": []})


def test_the_config_takes_one_worker_or_several_weighted_ones():
    cfg = load_config(EXAMPLES / "reward_model.yaml").config
    rule, rm = cfg.rewards["math"].components()
    assert (rule.label, rule.weight, rule.on_masked, rule.num_processes) == ("math_rule", 1.0, "mask", 2)
    assert (rm.label, rm.weight, rm.on_masked, rm.num_processes) == ("reward_model", 0.5, "skip", 1)
    assert rm.options["model_path"].endswith("tiny-qwen2-rm") and rm.timeout_s == 30.0  # unset: the domain's
    (single,) = load_config(EXAMPLES / "math_code.yaml").config.rewards["math"].components()
    assert (single.worker, single.weight) == ("math_rule", 1.0)


@pytest.mark.parametrize(
    "override, message",
    [
        ("rewards.math.worker=math_rule", r"rewards\.math\.worker: set either worker .* or workers"),
        ("rewards.math.options={x: 1}", r"rewards\.math\.options: with workers, each component has its own options"),
        ("rewards.math.workers.1.weight=0", r"rewards\.math\.workers\[1\]\.weight: must be a number > 0"),
        ("rewards.math.workers.1.name=math_rule", r"'math_rule' names two components"),
        ("rewards.math.workers.1.name=rm-1", r"workers\[1\]\.name: 'rm-1' must be letters, digits and _"),
        ("rewards.math.workers.0.on_masked=skip", r"workers\[0\]\.on_masked: the first component decides"),
        ("rewards.math.workers.1.on_masked=drop", r"workers\[1\]\.on_masked: must be one of \['mask', 'skip'\]"),
        ("rewards.math.workers.2.weight=1", r"workers is a list of 2; '2' is not one of its indices"),
    ],
)
def test_bad_components_are_named_by_their_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(EXAMPLES / "reward_model.yaml", [override])


@pytest.mark.slow
def test_a_run_scores_with_both_rewards_and_logs_each_under_its_name(tmp_path, tiny_model, mlflow_db):
    """examples/reward_model.yaml for one step on real Ray actors: one cluster per reward, each reward's metrics
    under its name, and the domain's reward their weighted sum (means are linear: nothing is masked); the step
    (tracking.logging_steps 1) logs its training samples as an MLflow table."""
    from mlflow.tracking import MlflowClient

    from roll_pipeline.driver.report import train_table_file
    from tests.test_tracking import read_table

    uri = mlflow_db(tmp_path / "mlflow.db")

    from roll_pipeline.driver.pipeline import RLVRPipeline
    from tests.conftest import shared_ray

    overrides = [
        "max_steps=1", "eval_steps=0", "save_steps=0", "rollout_batch_size=4", "num_return_sequences_in_group=4",
        "actor_train.training_args.per_device_train_batch_size=16",
        "actor_train.training_args.gradient_accumulation_steps=1", "actor_infer.generating_args.max_new_tokens=8",
        f"output_dir={tmp_path / 'run'}", f"tracking.tracking_uri={uri}", "tracking.logging_steps=1",
        "tracking.train_sample_rows_per_domain=5",
    ]
    shared_ray()
    pipeline = RLVRPipeline(load_config(EXAMPLES / "reward_model.yaml", overrides))
    try:
        pipeline.setup()
        assert sorted(c.name for c in pipeline.runtime.reward_clusters()) == ["reward_math_math_rule", "reward_math_reward_model"]
        pipeline.run()
    finally:
        pipeline.shutdown()
    m = pipeline.loop.history[1]
    assert m["reward/math/masked"] == m["reward/math/math_rule/masked"] == m["reward/math/reward_model/masked"] == 0
    assert m["reward/math/count"] == m["reward/math/reward_model/count"] >= 16
    assert m["reward/math/score"] == pytest.approx(
        m["reward/math/math_rule/score"] + 0.5 * m["reward/math/reward_model/score"], abs=1e-9
    )
    assert m["reward/math/correct"] == m["reward/math/math_rule/correct"]
    assert "reward/math/reward_model/rm_logit" in m and "reward/math/answer_found" in m
    client = MlflowClient(uri)
    run_id = pipeline.tracker.run_id
    assert [a.path for a in client.list_artifacts(run_id, "train_samples")] == [train_table_file(1)]
    table = read_table(client, run_id, train_table_file(1), tmp_path)
    assert len(table["response"]) == 5 and set(table["domain"]) == {"math"}
    assert all(isinstance(r, float) for r in table["reward"]) and all(isinstance(a, float) for a in table["advantage"])
    assert all("+" in prompt for prompt in table["prompt"])  # the math questions, decoded

"""Multi-turn rollouts generated a step ahead (`async_generation_ratio: 1`): each step's trajectories are made while
the previous step trains, with the weights from before its update, and train with importance weights."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.test_multi_turn import GAE_WHATEVER_THE_SCORES, Echo


class AuditedEcho(Echo):
    """Echo with an environment audit panel (workers/environments/audit.py): the run audits it on the scheduler."""

    audit_panel = str(Path(__file__).parent / "fixtures" / "echo_audit_panel.jsonl")


@pytest.mark.slow
def test_asynchronous_multi_turn_trajectories_are_generated_one_update_behind_and_train(
    tmp_path, tiny_model, mlflow_db
):
    from roll_core.config import load_config
    from roll_pipeline.driver.pipeline import RLVRPipeline
    from tests.conftest import EXAMPLES, shared_ray
    from tests.test_pipeline_integration import SMALL

    steps = 3
    overrides = [
        *SMALL,
        f"max_steps={steps}",
        "eval_steps=0",
        "validation.eval_at_start=false",
        f"output_dir={tmp_path / 'run'}",
        f"tracking.tracking_uri={mlflow_db(tmp_path / 'mlflow.db')}",
        "async_generation_ratio=1.0",
        "infer_is_cap=2.0",
        "rewards.math.rollout={type: multi_turn, environment: 'tests.test_multi_turn_async:AuditedEcho', max_turns: 3}",
        "reward_audit={every_steps: 2}",  # the environment's panel too, on the math scheduler, at steps 0 and 2
        # Seeded sampling. A trajectory ends early, by design, when a turn runs to its token budget (24 tokens with
        # no stop: MultiTurnRollout.answer); unseeded, whether one of step 3's twelve turns does after two updates
        # at lr 1e-3 is chance, and which random draws a request gets follows how the request batcher grouped the
        # requests, i.e. timing: a loaded make test saw 2.917 turns a trajectory at step 3 (one trajectory of
        # twelve with two turns; 2026-12-05). An update does not cut a trajectory short: nothing aborts a request
        # but a filled share (schedulers/step.py, and those results are dropped), and a sync only changes the
        # weights that sample the tokens after it (workers/inference/weight_swap.py). Seeded, each
        # turn's draws follow the request and turn numbers alone (turn_seed), so this run samples the same
        # tokens under any load.
        "deterministic=true",
        *GAE_WHATEVER_THE_SCORES,
    ]
    shared_ray()
    pipeline = RLVRPipeline(load_config(EXAMPLES / "math_code.yaml", overrides))
    try:
        pipeline.setup()
        summary = pipeline.run()
        history = pipeline.loop.history
    finally:
        pipeline.shutdown()
    assert summary["steps"] == steps
    at = {key: [history[s][key] for s in range(1, steps + 1)] for key in (
        "offpolicy/staleness", "offpolicy/kl_infer_old", "offpolicy/is_weight_mean", "tool_use/math/turns",
        "tool_use/math/tool_calls", "actor/minibatches_trained",
    )}
    # the first batch comes from the weights it trains, every later one from the weights one update before
    assert at["offpolicy/staleness"] == [0.0] + [1.0] * (steps - 1)
    kl = at["offpolicy/kl_infer_old"]
    assert kl[0] < 1e-5 and min(kl[1:]) > 1e-5, kl  # and those weights differ: the updates moved the policy
    # every step's math trajectories, the ones generated during an update too, kept their three turns
    assert at["tool_use/math/turns"] == [3.0] * steps and at["tool_use/math/tool_calls"] == [2.0] * steps
    assert all(w > 0 for w in at["offpolicy/is_weight_mean"]) and all(n > 0 for n in at["actor/minibatches_trained"])
    audited = {s: history[s].get("reward_audit/math/environment/pass") for s in range(steps + 1)}
    assert audited == {0: 1.0, 1: None, 2: 1.0, 3: None}, audited
    assert history[2]["reward_audit/math/environment/failed"] == 0.0

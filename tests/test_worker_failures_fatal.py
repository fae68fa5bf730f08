"""Worker failures a pipeline does not recover from, on a pipeline of its own (no other pipeline is alive beside
it): a reward worker that stays dead has its samples masked and counted, and the run goes on; a dead actor_train
then stops the run with a message that says where to resume from. (Two tests with a pipeline each until
2026-12-06: docs/testing.md.)"""

from __future__ import annotations

import pytest
import ray

from roll_pipeline.driver.runtime import WorkerDiedError
from tests.test_worker_failures import SHARE, N, during_rollout, start_pipeline


@pytest.mark.slow
def test_a_dead_reward_worker_has_its_samples_masked_and_a_dead_actor_train_stops_the_run(
    tmp_path, tiny_model, mlflow_db
):
    pipeline = start_pipeline(tmp_path, tiny_model, mlflow_db, save_steps=1)
    try:
        # A reward worker that stays dead: the samples it held are masked and counted...
        worker = pipeline.runtime.rewards["math"]["SlowMathScorer"].workers[0]
        batch, metrics = during_rollout(pipeline, pipeline.marks, lambda: ray.kill(worker, no_restart=True))
        assert len(batch) == SHARE * N
        assert metrics["scheduler/math/reward_worker_failures"] >= 1
        assert metrics["reward/math/masked_worker_lost"] >= 1
        assert metrics["reward/math/masked_worker_lost"] == metrics["reward/math/masked"]
        # ...and the run goes on: the next rollout masks everything the dead worker would have scored, and completes.
        rollout = pipeline.rollout()
        batch, metrics = rollout.batch, rollout.metrics
        assert metrics["reward/math/masked_worker_lost"] == metrics["reward/math/count"] > 0
        assert float(batch["in_loss"].sum()) == 0.0

        # A dead actor_train stops the run at the next step, naming the checkpoint to resume from.
        def kill_after_first(step, metrics):
            if step == 1:
                ray.kill(pipeline.runtime.actor_train.workers[0])

        with pytest.raises(WorkerDiedError) as info:
            pipeline.run(on_step=kill_after_first)
    finally:
        pipeline.shutdown()
    message = str(info.value)
    assert message.startswith("actor_train[0] died at step 2")
    assert f"{tmp_path / 'run' / 'checkpoints' / 'step_1'}" in message
    assert "roll run CONFIG --resume" in message

"""Every wait of the driver on its workers is bounded (ray.rpc_timeout_s): a worker that stops answering without
dying ends the wait with an error naming it, on real Ray actors."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import ray

from roll_core.config import ConfigError, load_config
from roll_pipeline.distributed.cluster import Cluster
from roll_pipeline.distributed.waiting import (
    ActorStartFailed,
    ActorStartTimeout,
    RpcTimeoutError,
    wait_started,
)
from tests.conftest import EXAMPLES


class Stuck:
    """Rank 1 hangs in `work` (a hung collective, say); rank 0 answers."""

    def __init__(self, name: str, rank: int, world_size: int, done_dir: str | None = None) -> None:
        self.rank = rank
        self.done_dir = done_dir

    def work(self, seconds: float) -> int:
        if self.rank == 1:
            time.sleep(seconds)
            if self.done_dir:  # the hang is over: a caller that waited for it would see this file
                Path(self.done_dir, f"done-{seconds}").touch()
        return self.rank


class Refuses:
    def __init__(self, name: str, rank: int, world_size: int) -> None:
        raise RuntimeError(f"rank {rank} cannot start here: no such tool")


def test_an_actor_that_cannot_be_placed_is_named_within_the_start_bound(local_ray):
    # A custom resource no node offers: Ray keeps the actor pending for ever.
    cluster = Cluster("reward_code", Stuck, world_size=2, num_cpus=0.1, num_gpus=0, worker_kwargs={},
                      resources={"nowhere": 1})
    try:
        refs, names = cluster.ready_calls()
        # the pending actors hold none of it, and the cluster is otherwise idle: all its CPUs are free (read as the
        # total: the free count may lag behind a moment after the actors are asked for, 7.8 of 8.0 once)
        free = ray.cluster_resources()["CPU"]
        with pytest.raises(ActorStartTimeout, match=(
            r"^2 actor\(s\) did not start within 2 s \(ray.actor_start_timeout_s\): reward_code\[0\].start, "
            rf"reward_code\[1\].start. The Ray cluster has \{{'CPU': {free}\}} free"
        )):
            wait_started(refs, names, 2.0)
    finally:
        cluster.shutdown()


def test_an_actor_whose_start_raises_is_named_with_its_error(local_ray):
    cluster = Cluster("reward_code", Refuses, world_size=1, num_cpus=0.1, num_gpus=0, worker_kwargs={})
    try:
        with pytest.raises(ActorStartFailed) as info:
            wait_started(*cluster.ready_calls(), 30.0)
        assert str(info.value) == (
            "actor(s) failed to start:\nreward_code[0].start: RuntimeError: rank 0 cannot start here: no such tool"
        )
    finally:
        cluster.shutdown()


def test_a_worker_that_does_not_answer_is_named_within_the_bound(local_ray, tmp_path):
    cluster = Cluster("actor_train", Stuck, world_size=2, num_cpus=0.1, num_gpus=0,
                      worker_kwargs={"done_dir": str(tmp_path)}, rpc_timeout_s=5.0)
    try:
        # Started first, under its own bound: on a loaded machine starting the actors alone took over 2 s, and the
        # first call, bounded by rpc_timeout_s, failed before any work (a fresh-clone run of make test).
        wait_started(*cluster.ready_calls(), 120.0)
        assert cluster.call("work", 0.0) == [0, 1]
        with pytest.raises(RpcTimeoutError, match=r"^actor_train\[1\]\.work did not answer within 5 s \(ray\.rpc_timeout_s\)"):
            cluster.call("work", 300.0)
        # An event, not a clock: the call gave up while rank 1 still hangs (its 300 s are not over).
        assert not (tmp_path / "done-300.0").exists()
        assert cluster.call_rank0("work", 300.0) == 0  # rank 0 alone is not stuck
    finally:
        cluster.shutdown()


def test_the_bound_is_a_positive_number_or_none():
    assert load_config(EXAMPLES / "math_code.yaml").config.ray.rpc_timeout_s == 3600.0
    assert load_config(EXAMPLES / "math_code.yaml", ["ray.rpc_timeout_s=null"]).config.ray.rpc_timeout_s is None
    with pytest.raises(ConfigError, match=r"ray\.rpc_timeout_s: must be > 0"):
        load_config(EXAMPLES / "math_code.yaml", ["ray.rpc_timeout_s=0"])

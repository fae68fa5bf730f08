"""Clusters spread over several Ray nodes: a two-node Ray cluster on this machine (ray.cluster_utils), workers
placed one per node by `placement: strict_spread`, and a short run that completes across them."""

from __future__ import annotations

import os

import pytest
import ray
from ray.cluster_utils import Cluster as RayTestCluster

from roll_core.config import load_config
from roll_pipeline.driver.pipeline import RLVRPipeline
from roll_pipeline.driver.runtime import LOCAL_RAY_SYSTEM_CONFIG, start_local_ray
from tests.conftest import EXAMPLES
from tests.test_pipeline_integration import SMALL

#: Every test here runs on a Ray cluster of its own (nodes, fake GPUs, other sizes): the worker's shared one is
#: stopped first (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("own_ray")


@pytest.fixture
def two_nodes():
    # The run's own settings (workers at the driver's niceness, not Ray's 15: under two busy processes a worker at
    # 15 compiling DeepSpeed's C++ op got 3% of a core and the test timed out).
    head = {"num_cpus": 4, "_system_config": LOCAL_RAY_SYSTEM_CONFIG}
    cluster = RayTestCluster(initialize_head=True, head_node_args=head)
    cluster.add_node(num_cpus=4)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


@pytest.mark.slow
def test_workers_land_on_different_nodes_and_a_run_completes(tmp_path, tiny_model, two_nodes, mlflow_db):
    overrides = [
        *SMALL,
        "max_steps=2",
        "eval_steps=0",
        "validation.eval_at_start=false",
        "actor_infer.world_size=2",
        "actor_infer.placement=strict_spread",
        "actor_infer.torch_threads=1",
        "actor_train.world_size=2",
        "actor_train.placement=strict_spread",
        "actor_train.torch_threads=1",
        "actor_train.training_args.per_device_train_batch_size=4",
        f"output_dir={tmp_path / 'run'}",
        f"tracking.tracking_uri={mlflow_db(tmp_path / 'mlflow.db')}",
    ]
    pipeline = RLVRPipeline(load_config(EXAMPLES / "math_code.yaml", overrides))
    try:
        pipeline.setup()
        nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        assert len(nodes) == 2
        for cluster in (pipeline.runtime.actor_infer, pipeline.runtime.actor_train):
            placed = cluster.node_ids()
            assert len(set(placed)) == 2 and set(placed) == nodes, (
                f"{cluster.name} ranks share a node: {placed}"
            )
            niceness = ray.get([w.__ray_call__.remote(lambda self: os.nice(0)) for w in cluster.workers])
            assert niceness == [os.nice(0)] * 2, f"{cluster.name} on both nodes at the driver's priority"
        summary = pipeline.run()
        assert summary["steps"] == 2
        # both actor_infer ranks served generation requests
        served = [ray.get(w.batch_sizes.remote()) for w in pipeline.runtime.actor_infer.workers]
        assert all(sum(s) > 0 for s in served), served
    finally:
        pipeline.shutdown()


@pytest.mark.slow
def test_an_impossible_placement_fails_with_a_clear_error():
    from roll_pipeline.distributed.cluster import reserve_bundles

    start_local_ray(2, log_to_driver=False)
    try:
        with pytest.raises(
            RuntimeError,
            match=r"actor_infer: could not place 2 worker\(s\) .* 'strict_spread' .* over 1 node",
        ):
            reserve_bundles("actor_infer", 2, 1.0, 0.0, "strict_spread", timeout_s=2)
    finally:
        ray.shutdown()

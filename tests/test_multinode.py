"""Clusters spread over several Ray nodes: a placement no cluster of the run's nodes can give is refused, naming
it. (A run whose workers land one per node by `placement: strict_spread` and complete across two nodes was this
file's too until 2026-12-06: it is tests/test_ray_cluster.py's run on the user's two-node cluster, which makes the
same checks; docs/testing.md.)"""

from __future__ import annotations

import pytest
import ray

from roll_pipeline.driver.runtime import start_local_ray

#: Every test here runs on a Ray cluster of its own (nodes, fake GPUs, other sizes): the worker's shared one is
#: stopped first (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("own_ray")


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

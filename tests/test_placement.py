"""ROLL-style device mappings: parsing without eval, validation at load, the pure mapping-to-bundles plan, and
on Ray with declared (not real) GPUs, that workers land on the bundles the plan gives them."""

from __future__ import annotations

import os
import random

import pytest
import ray

from roll_core.config import ConfigError, load_config
from roll_core.config.devices import parse_device_mapping
from roll_pipeline.distributed.placement import (
    ClusterDemand,
    DevicePool,
    PlanError,
    check_capacity,
    describe,
    plan_devices,
    plan_for,
)
from roll_pipeline.driver.runtime import LOCAL_RAY_SYSTEM_CONFIG, start_local_ray
from tests.conftest import EXAMPLES

#: Every test here runs on a Ray cluster of its own (nodes, fake GPUs, other sizes): the worker's shared one is
#: stopped first (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("own_ray")


def demand(name: str, devices, gpus_per_worker: int = 1, cpus: float = 1.0) -> ClusterDemand:
    devices = tuple(devices)
    return ClusterDemand(
        name=name,
        world_size=len(devices) // gpus_per_worker,
        gpus_per_worker=gpus_per_worker,
        cpus_per_worker=cpus,
        devices=devices,
    )


# --- parsing ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "devices"),
    [
        ("list(range(0,8))", list(range(8))),
        ("list(range(8, 16))", list(range(8, 16))),
        ("range(0, 8, 2)", [0, 2, 4, 6]),
        ("range(4)", [0, 1, 2, 3]),
        ("[0, 1, 2, 3]", [0, 1, 2, 3]),
        ("list([4, 5, 12, 13])", [4, 5, 12, 13]),
        ("0, 1", [0, 1]),
        ("3", [3]),
        ("list(range(0,4)) + list(range(8,12))", [0, 1, 2, 3, 8, 9, 10, 11]),
    ],
)
def test_roll_string_forms_parse_to_indices(text, devices):
    assert parse_device_mapping(text) == devices


def test_a_list_passes_through():
    assert parse_device_mapping([3, 1, 2]) == [3, 1, 2]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("__import__('os').system('touch /tmp/roll_pwned')", "is not understood"),
        ("list(map(int, '012'))", "is not understood"),
        ("range(0, 8, 0)", "step must not be 0"),
        ("range(0, 10000000000)", "more than the 65536 accepted"),
        ("[0, 1.5]", "'1.5' is not a whole number"),
        ("range(x)", "'x' is not a whole number"),
        ("list(range(0,8)", "cannot parse"),
    ],
)
def test_anything_else_is_refused_without_running_it(text, message):
    with pytest.raises(ValueError, match=message):
        parse_device_mapping(text)
    assert not os.path.exists("/tmp/roll_pwned")


# --- validation at load ---------------------------------------------------------------------------------------


def _load(*overrides: str):
    return load_config(EXAMPLES / "math_code.yaml", list(overrides))


def _error(*overrides: str) -> str:
    with pytest.raises(ConfigError) as info:
        _load(*overrides)
    return str(info.value)


def test_a_valid_mapping_loads_in_either_form():
    listed = _load(
        "actor_infer.device_mapping=[0,1]", "actor_infer.world_size=2", "actor_infer.num_gpus_per_worker=1"
    )
    text = _load(
        "actor_infer.device_mapping='list(range(0,2))'",
        "actor_infer.world_size=2",
        "actor_infer.num_gpus_per_worker=1",
    )
    assert listed.config.actor_infer.devices == text.config.actor_infer.devices == [0, 1]
    assert text.config.actor_infer.device_mapping == "list(range(0,2))"  # what the user wrote is kept


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            [
                "actor_infer.device_mapping=[0,1,1]",
                "actor_infer.num_gpus_per_worker=1",
                "actor_infer.world_size=3",
            ],
            "actor_infer.device_mapping: lists GPU(s) [1] more than once",
        ),
        (
            ["actor_infer.device_mapping='list(range(0,8))'", "actor_infer.num_gpus_per_worker=1"],
            "actor_infer.world_size: world_size 1 x num_gpus_per_worker 1 = 1 GPU(s), but device_mapping lists 8; "
            "set world_size: 8",
        ),
        (
            ["actor_infer.device_mapping=[0,1,2]", "actor_infer.num_gpus_per_worker=2"],
            "device_mapping lists 3; list a multiple of 2 GPUs",
        ),
        (["actor_infer.device_mapping=[0]"], "actor_infer.num_gpus_per_worker: with a device_mapping"),
        (
            ["actor_infer.device_mapping=[0]", "actor_infer.num_gpus_per_worker=0.5"],
            "a whole number >= 1, got 0.5",
        ),
        (
            ["actor_infer.device_mapping=[-1]"],
            "actor_infer.device_mapping: GPU indices must be whole numbers >= 0",
        ),
        (["actor_infer.device_mapping=[]"], "actor_infer.device_mapping: must list at least one GPU index"),
        (
            ["actor_infer.device_mapping='eval(1)'"],
            "actor_infer.device_mapping: 'eval(1)': 'eval(1)' is not understood",
        ),
        (
            [
                "actor_infer.device_mapping=[0]",
                "actor_infer.num_gpus_per_worker=1",
                "actor_infer.placement=spread",
            ],
            "actor_infer.placement: must be default with a device_mapping",
        ),
        (["ray.num_gpus_per_node=0"], "ray.num_gpus_per_node: must be >= 1"),
    ],
)
def test_bad_mappings_are_config_errors_naming_their_key(overrides, message):
    assert message in _error(*overrides)


# --- the plan (pure) ------------------------------------------------------------------------------------------


def test_colocated_clusters_share_every_bundle():
    plan = plan_devices([demand("actor_train", range(8)), demand("actor_infer", range(8))], gpus_per_node=8)
    assert plan.num_nodes == 1
    for name in ("actor_train", "actor_infer"):
        slots = plan.slots[name]
        assert [(s.rank, s.devices, s.node, s.bundle, s.num_gpus) for s in slots] == [
            (r, (r,), 0, r, 0.5) for r in range(8)
        ]
    assert plan.sharing_groups() == [(("actor_train", "actor_infer"), list(range(8)))]
    assert plan.bundle_cpus(0) == [2.0] * 8


def test_disjoint_clusters_get_separate_bundles():
    plan = plan_devices(
        [demand("actor_train", range(4)), demand("actor_infer", range(4, 8))], gpus_per_node=8
    )
    assert [s.bundle for s in plan.slots["actor_infer"]] == [4, 5, 6, 7]
    assert {s.num_gpus for slots in plan.slots.values() for s in slots} == {1.0}
    assert plan.sharing_groups() == [(("actor_train",), [0, 1, 2, 3]), (("actor_infer",), [4, 5, 6, 7])]


def test_a_partial_overlap_shares_only_the_common_gpus():
    plan = plan_devices([demand("actor_train", range(4)), demand("actor_infer", range(8))], gpus_per_node=8)
    assert [s.num_gpus for s in plan.slots["actor_infer"]] == [0.5] * 4 + [1.0] * 4
    assert plan.sharing_groups() == [
        (("actor_train", "actor_infer"), [0, 1, 2, 3]),
        (("actor_infer",), [4, 5, 6, 7]),
    ]


def test_two_nodes_and_multi_gpu_workers():
    plan = plan_devices(
        [demand("actor_train", range(16)), demand("actor_infer", range(16), gpus_per_worker=2)],
        gpus_per_node=8,
    )
    assert plan.num_nodes == 2 and plan.num_devices == 16
    infer = plan.slots["actor_infer"]
    assert len(infer) == 8
    assert (infer[3].devices, infer[3].node, infer[3].bundle) == ((6, 7), 0, 6)
    assert (infer[4].devices, infer[4].node, infer[4].bundle) == ((8, 9), 1, 0)
    train = plan.slots["actor_train"]
    assert (train[9].node, train[9].bundle, train[9].num_gpus) == (1, 1, 0.5)
    text = "\n".join(describe(plan))
    assert "GPU pool: 2 nodes x 8 GPUs" in text
    assert (
        "GPUs 0-15 (nodes 0-1): actor_train (16 workers x 1 GPU), actor_infer (8 workers x 2 GPUs): colocated"
        in text
    )


def test_three_way_sharing_never_oversubscribes_a_gpu():
    plan = plan_devices(
        [demand(n, range(8)) for n in ("actor_train", "actor_infer", "reference")], gpus_per_node=8
    )
    assert plan.slots["reference"][0].num_gpus == 0.3333
    assert sum(plan.slots[n][0].num_gpus for n in plan.slots) <= 1.0


def test_random_mappings_keep_each_worker_on_its_devices_within_one_gpu():
    rng = random.Random(0)
    for _ in range(200):
        gpus_per_node = rng.choice([2, 4, 8])
        pool = list(range(gpus_per_node * rng.randint(1, 3)))
        demands = []
        for name in ("actor_train", "actor_infer", "reference"):
            per_worker = rng.choice([1, 2])
            nodes = rng.sample(range(len(pool) // gpus_per_node), k=1)
            # whole multi-GPU runs inside one node, so the plan must accept them
            local = [n * gpus_per_node + i for n in nodes for i in range(gpus_per_node)]
            size = per_worker * rng.randint(1, gpus_per_node // per_worker)
            start = rng.randrange(0, gpus_per_node - size + 1, per_worker)
            demands.append(demand(name, local[start : start + size], gpus_per_worker=per_worker))
        plan = plan_devices(demands, gpus_per_node)
        claimed: dict[int, float] = {}
        for d in demands:
            slots = plan.slots[d.name]
            assert [device for s in slots for device in s.devices] == list(d.devices)
            for s in slots:
                assert s.node == s.devices[0] // gpus_per_node and s.bundle == s.devices[0] % gpus_per_node
                assert {device // gpus_per_node for device in s.devices} == {s.node}
                claimed[s.devices[0]] = claimed.get(s.devices[0], 0.0) + s.num_gpus
        assert max(claimed.values()) <= 1.0


def test_a_worker_split_across_nodes_is_refused():
    with pytest.raises(
        PlanError,
        match=r"actor_infer.device_mapping: worker 0 gets GPUs \[7, 8\], which lie on nodes \[0, 1\]",
    ):
        plan_devices([demand("actor_infer", [7, 8, 9, 10], gpus_per_worker=2)], gpus_per_node=8)


def test_a_gpu_cluster_without_a_mapping_beside_mapped_ones_is_refused():
    unmapped = ClusterDemand(name="reference", world_size=1, gpus_per_worker=1, cpus_per_worker=1)
    with pytest.raises(
        PlanError, match="reference.device_mapping: reference asks for 1 GPU.*while actor_train map"
    ):
        plan_devices([demand("actor_train", range(8)), unmapped], gpus_per_node=8)


def test_capacity_against_the_ray_cluster():
    plan = plan_devices(
        [demand("actor_train", range(16)), demand("actor_infer", range(8, 16))], gpus_per_node=8
    )
    assert check_capacity(plan, [8, 8]) == []
    assert check_capacity(plan, [16]) == []
    problems = check_capacity(plan, [8, 4])
    assert [p.split(":")[0] for p in problems] == ["actor_train.device_mapping", "actor_infer.device_mapping"]
    assert "GPU(s) 8-15 lie beyond the 8 GPUs" in problems[0] and "nodes have GPUs: 8, 4" in problems[0]


def test_plan_for_a_config_covers_the_clusters_that_run():
    resolved = _load(
        "actor_train.device_mapping=[0,1]",
        "actor_train.world_size=2",
        "actor_train.num_gpus_per_worker=1",
        "actor_train.training_args.gradient_accumulation_steps=1",
        "actor_infer.device_mapping=[0,1]",
        "actor_infer.world_size=2",
        "actor_infer.num_gpus_per_worker=1",
        "reference.device_mapping=[5]",  # not started: math_code.yaml has no KL term
        "reference.num_gpus_per_worker=1",
    )
    plan = plan_for(resolved.config)
    assert list(plan.slots) == ["actor_train", "actor_infer"]
    assert [d.name for d in plan.unmapped] == [f"reward_{d}" for d in resolved.config.rewards]


# --- on Ray, with declared GPUs -------------------------------------------------------------------------------


class Probe:
    """A worker that reports where Ray put it."""

    def __init__(self, *, name: str, rank: int, world_size: int) -> None:
        self.name = name

    def where(self) -> dict:
        context = ray.get_runtime_context()
        return {
            "gpu_ids": [str(i) for i in ray.get_gpu_ids()],
            "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "node": context.get_node_id(),
            "group": context.get_placement_group_id(),
        }


def _start(pool: DevicePool, name: str):
    from roll_pipeline.distributed.cluster import Cluster

    slots = pool.worker_options(name)
    return Cluster(
        name, Probe, world_size=len(slots), num_cpus=1, num_gpus=0, worker_kwargs={}, device_slots=slots
    )


@pytest.fixture
def eight_declared_gpus():
    # Ray accepts GPUs that do not exist as long as nothing touches CUDA.
    start_local_ray(4, num_gpus=8, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.mark.slow
def test_workers_land_on_their_planned_bundles(eight_declared_gpus):
    plan = plan_devices(
        [
            demand("actor_train", [0, 1], cpus=0.5),
            demand("actor_infer", [0, 1], cpus=0.5),  # colocated with actor_train
            demand("reference", [2, 3], gpus_per_worker=2, cpus=0.5),  # one worker on a GPU pair
        ],
        gpus_per_node=4,
    )
    pool = DevicePool.reserve(plan, timeout_s=60)
    clusters = [_start(pool, name) for name in plan.slots]
    try:
        where = {c.name: c.call("where") for c in clusters}
        group = pool.groups[0].id.hex()
        assert all(w["group"] == group for ws in where.values() for w in ws)
        train, infer, (reference,) = where["actor_train"], where["actor_infer"], where["reference"]
        for rank in range(2):  # colocated ranks share one GPU, distinct from the other rank's
            assert train[rank]["gpu_ids"] == infer[rank]["gpu_ids"] and len(train[rank]["gpu_ids"]) == 1
        assert train[0]["gpu_ids"] != train[1]["gpu_ids"]
        # the pair's worker sees both of its GPUs, which are neither of the others'
        assert reference["visible"] == f"{pool.gpu_ids[2]},{pool.gpu_ids[3]}"
        pair = set(reference["visible"].split(","))
        assert len(pair) == 2 and not pair & {train[0]["gpu_ids"][0], train[1]["gpu_ids"][0]}
        # every GPU of the pool is reserved, so nothing outside it can take one
        assert ray.available_resources().get("GPU", 0) == 4
    finally:
        for c in clusters:
            c.shutdown()
        pool.release()


@pytest.mark.slow
def test_a_plan_bigger_than_the_ray_cluster_fails_before_reserving(eight_declared_gpus):
    plan = plan_devices([demand("actor_train", range(16))], gpus_per_node=8)
    with pytest.raises(PlanError, match="actor_train.device_mapping: GPU\\(s\\) 8-15 lie beyond the 8 GPUs"):
        DevicePool.reserve(plan, timeout_s=5)
    assert ray.available_resources().get("GPU") == 8


@pytest.mark.slow
def test_two_nodes_hold_one_placement_group_each():
    from ray.cluster_utils import Cluster as RayTestCluster

    head = {"num_cpus": 2, "num_gpus": 8, "_system_config": LOCAL_RAY_SYSTEM_CONFIG}
    cluster = RayTestCluster(initialize_head=True, head_node_args=head)
    cluster.add_node(num_cpus=2, num_gpus=8)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        plan = plan_devices(
            [demand("actor_train", [0, 8], cpus=0.5), demand("actor_infer", [0, 8], cpus=0.5)],
            gpus_per_node=8,
        )
        pool = DevicePool.reserve(plan, timeout_s=60)
        clusters = [_start(pool, name) for name in plan.slots]
        try:
            train, infer = (c.call("where") for c in clusters)
            nodes = [ray.util.placement_group_table(g)["bundles_to_node_id"][0] for g in pool.groups]
            assert len(set(nodes)) == 2
            assert [w["node"] for w in train] == nodes == [w["node"] for w in infer]
        finally:
            for c in clusters:
                c.shutdown()
            pool.release()
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.mark.slow
def test_a_run_with_colocated_device_mapped_clusters_completes(tmp_path, tiny_model, mlflow_db, monkeypatch):
    from roll_pipeline.driver.pipeline import RLVRPipeline
    from tests.test_pipeline_integration import SMALL
    from workers.devices import LOGICAL_GPUS

    monkeypatch.setenv(LOGICAL_GPUS, "1")  # Ray's one GPU below is logical: the workers compute on the CPU

    overrides = [
        *SMALL,
        "max_steps=1",
        "eval_steps=0",
        "validation.eval_at_start=false",
        "ray.num_gpus_per_node=1",
        *(
            f"{c}.{k}"
            for c in ("actor_train", "actor_infer")
            for k in ("device_mapping=[0]", "num_gpus_per_worker=1")
        ),
        f"output_dir={tmp_path / 'run'}",
        f"tracking.tracking_uri={mlflow_db(tmp_path / 'mlflow.db')}",
    ]
    pipeline = RLVRPipeline(load_config(EXAMPLES / "math_code.yaml", overrides))
    start_local_ray(5, num_gpus=1, log_to_driver=False)  # 4 workers and the schedulers
    try:
        pipeline.setup()
        (group,) = pipeline.runtime.device_pool.groups
        for cluster in (pipeline.runtime.actor_train, pipeline.runtime.actor_infer):
            (worker,) = cluster.workers
            placed = ray.get(
                worker.__ray_call__.remote(
                    lambda self: (ray.get_runtime_context().get_placement_group_id(), ray.get_gpu_ids())
                )
            )
            assert placed == (group.id.hex(), [0]), cluster.name
        assert pipeline.run()["steps"] == 1
    finally:
        pipeline.shutdown()
        ray.shutdown()

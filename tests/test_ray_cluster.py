"""Runs on a Ray cluster the user already has, as a user would run them: `roll run` (and `ray job submit`) joining
a real two-node Ray cluster on this machine. The head node is Ray's own test cluster (ray.cluster_utils, with its
dashboard for job submission); the second node is `ray start --address=...` in a mount namespace of its own, where
a tmpfs hides one folder (`private`): a path there is what a node without shared storage sees. It offers the
custom resource `far`, so a config can pin a worker to it."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray

from roll_core.console import EXIT_FAILED, EXIT_USAGE
from roll_pipeline.driver.runtime import LOCAL_RAY_SYSTEM_CONFIG
from tests.conftest import EXAMPLES, TINY_MODEL, stop_shared_ray

#: Every test here runs on a Ray cluster of its own (nodes, fake GPUs, other sizes): the worker's shared one is
#: stopped first (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("own_ray")

BIN = Path(sys.executable).parent
ROOT = EXAMPLES.parent
SMALL_RUN = [
    "rollout_batch_size=8",
    "actor_train.training_args.per_device_train_batch_size=32",
    "eval_steps=0",
    "validation.eval_at_start=false",
    "actor_infer.generating_args.max_new_tokens=16",
    "validation.max_prompts=16",  # per domain, at each run's end (all of them: ~450 prompts, code ones sandboxed)
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _can_unshare() -> bool:
    return shutil.which("unshare") is not None and subprocess.run(
        ["unshare", "-m", "true"], capture_output=True
    ).returncode == 0


class Nodes:
    """The head (ray.cluster_utils) and `ray start` nodes joined to it, each in a mount namespace of its own."""

    def __init__(self, root: Path) -> None:
        from ray.cluster_utils import Cluster

        self.root = root
        self.private = root / "private"  # hidden on the far node by a tmpfs
        self.private.mkdir()
        self.dashboard_port = _free_port()
        self.head = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": 3,
                "include_dashboard": True,
                "dashboard_host": "127.0.0.1",
                "dashboard_port": self.dashboard_port,
                # Not the default port (52365): a local Ray cluster of a test on the other pytest-xdist worker may
                # hold it, and then this head's agent has no HTTP server and `ray job submit` finds "No available
                # agent to submit job".
                "dashboard_agent_listen_port": _free_port(),
                "_system_config": LOCAL_RAY_SYSTEM_CONFIG,
            },
        )
        self.address = self.head.address
        self.started: list[subprocess.Popen] = []

    def join(self, resources: dict[str, float], mounts: list[str]) -> str:
        """Start a node with 3 CPUs and `resources`, after the shell `mounts` in its namespace; its node id."""
        before = self.node_ids()
        # Its own /tmp/ray, as on another machine: nodes of one machine share session folders by name, and one
        # node unpacking a job's working_dir there pulled it from under the job's driver on the other.
        own = self.root / f"node{len(self.started)}-tmp-ray"
        own.mkdir()
        command = " && ".join([
            f"mount --bind {own} /tmp/ray",
            *mounts,
            f"exec {BIN / 'ray'} start --address={self.address} --num-cpus=3 --resources='{json.dumps(resources)}' "
            f"--dashboard-agent-listen-port={_free_port()} --disable-usage-stats --block",
        ])
        log = (self.root / f"node{len(self.started)}.log").open("w")
        self.started.append(subprocess.Popen(
            ["unshare", "-m", "sh", "-c", command], stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        ))
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            new = self.node_ids() - before
            if new:
                return new.pop()
            assert self.started[-1].poll() is None, (self.root / f"node{len(self.started) - 1}.log").read_text()
            time.sleep(1)
        raise AssertionError("the node did not join within 90 s")

    def node_ids(self) -> set[str]:
        ray.init(address=self.address, log_to_driver=False)
        try:
            return {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        finally:
            ray.shutdown()

    def leave(self, process: subprocess.Popen) -> None:
        for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
            try:
                os.killpg(process.pid, sig)
                process.wait(wait)
                break
            except ProcessLookupError:
                break
            except subprocess.TimeoutExpired:
                continue
        self.started.remove(process)

    def shutdown(self) -> None:
        for process in list(self.started):
            self.leave(process)
        self.head.shutdown()


@pytest.fixture(scope="module")
def user_cluster(tmp_path_factory):
    if not _can_unshare():
        pytest.fail("these tests need `unshare -m` (util-linux, root) to give the second node its own mounts")
    # Before `own_ray` can (a module fixture is set up before a test's): a test of another file on this worker may
    # have left this process connected to the shared cluster, and the head's `ray.init`s would fail.
    stop_shared_ray()
    path = os.environ["PATH"]
    os.environ["PATH"] = f"{BIN}{os.pathsep}{path}"  # the cluster's processes find `roll`, as on a user's nodes
    nodes = Nodes(tmp_path_factory.mktemp("cluster"))
    try:
        nodes.head_id = nodes.node_ids().pop()
        nodes.far_id = nodes.join({"far": 4}, [f"mount -t tmpfs tmpfs {nodes.private}"])
        yield nodes
    finally:
        nodes.shutdown()
        os.environ["PATH"] = path


def roll(args: list[str], address: str | None, timeout: float = 600, **env: str) -> subprocess.CompletedProcess:
    environ = dict(os.environ, **env)
    environ.pop("RAY_ADDRESS", None)
    if address:
        environ["RAY_ADDRESS"] = address
    return subprocess.run(
        [str(BIN / "roll"), *args], cwd=ROOT, env=environ, capture_output=True, text=True, timeout=timeout
    )


def _free_resources(address: str) -> tuple[dict, dict]:
    ray.init(address=address, log_to_driver=False)
    try:
        return ray.available_resources(), ray.cluster_resources()
    finally:
        ray.shutdown()


@pytest.mark.slow
def test_a_run_spans_both_nodes_checkpoints_there_and_resumes(tmp_path, tiny_model, user_cluster, mlflow_db):
    """A run whose clusters span both nodes (actor_train's two ranks `spread`, one process group over the nodes;
    actor_infer's two `strict_spread`, both serving; the code reward pinned to the far node), its checkpoint
    written there by each rank, and `roll run --resume` joining the cluster to go on from it. The first run is
    driven in this process, joined to the cluster as `roll run` joins it (ray.address), so that its workers can be
    asked where they run; the resume is `roll run` itself. (test_multinode.py's run on two nodes of its own, merged
    here on 2026-12-06: docs/testing.md.)"""
    from roll_core.config import load_config
    from roll_pipeline.driver.pipeline import RLVRPipeline

    out = tmp_path / "run"
    args = [
        *SMALL_RUN,
        "max_steps=2", "save_steps=2",
        "actor_train.world_size=2", "actor_train.placement=spread",
        "actor_train.training_args.per_device_train_batch_size=16",
        "actor_infer.world_size=2", "actor_infer.placement=strict_spread", "actor_infer.num_cpus_per_worker=0.5",
        "actor_train.torch_threads=1", "actor_infer.torch_threads=1",  # 2 cores under 2 ranks of each
        # a start that hangs names its workers and what the cluster has free before pytest-timeout's 600 s
        # stops the test without saying (a suite run of 2026-12-07 hung here once; 88 s alone, passed after)
        "ray.actor_start_timeout_s=300",
        "rewards.code.resources={far: 1}",
        f"output_dir={out}", f"tracking.tracking_uri={mlflow_db(tmp_path / 'mlflow.db')}",
    ]
    nodes = {user_cluster.head_id, user_cluster.far_id}
    pipeline = RLVRPipeline(load_config(EXAMPLES / "math_code.yaml", [*args, f"ray.address={user_cluster.address}"]))
    try:
        pipeline.setup()
        for cluster in (pipeline.runtime.actor_infer, pipeline.runtime.actor_train):
            placed = cluster.node_ids()
            assert len(placed) == 2 and set(placed) == nodes, f"{cluster.name}'s ranks share a node: {placed}"
            # the cluster's own setting (LOCAL_RAY_SYSTEM_CONFIG, as a run's local cluster has it) reaches the
            # node that joined: its workers run at the driver's priority, not Ray's 15
            niceness = ray.get([w.__ray_call__.remote(lambda self: os.nice(0)) for w in cluster.workers])
            assert niceness == [os.nice(0)] * 2, f"{cluster.name} on both nodes at the driver's priority"
        assert pipeline.run()["steps"] == 2
        served = [ray.get(w.batch_sizes.remote()) for w in pipeline.runtime.actor_infer.workers]
        assert all(sum(s) > 0 for s in served), f"both actor_infer ranks serve generation: {served}"
    finally:
        pipeline.shutdown()
        ray.shutdown()
    placed = json.loads((out / "placement.json").read_text())
    train = placed["workers"]["actor_train"]
    assert len(set(train)) == 2, f"actor_train's ranks share a node: {train}"  # the process group spans both
    assert placed["workers"]["reward_code"] == [user_cluster.far_id]
    assert set(placed["nodes"]) == nodes
    # Each rank wrote its part of the checkpoint from its own node into output_dir (shared storage here).
    step = out / "checkpoints" / "step_2"
    assert {p.name for p in (step / "actor_train").iterdir()} >= {"rng_rank0.pt", "rng_rank1.pt", "hf_model"}
    assert (step / "pipeline_state.json").is_file() and (step / "actor_train" / "hf_model" / "config.json").is_file()

    resumed = roll(["run", "examples/math_code.yaml", *args, "max_steps=3", "--resume"], user_cluster.address)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming math_code from {step}" in resumed.stdout and "finished 3 steps" in resumed.stdout
    # the first validation (at step 2: none at the start here) came back with the checkpoint, and the resumed run's
    # end is paired with it
    assert "validation accuracy, step 2 against step 3 (paired by prompt):" in resumed.stdout
    assert (out / "checkpoints" / "step_3" / "pipeline_state.json").is_file()
    assert set(json.loads((out / "placement.json").read_text())["nodes"]) == nodes


@pytest.mark.slow
def test_a_cluster_too_small_is_refused_before_anything_starts(tmp_path, user_cluster):
    # 6 CPUs in the cluster; actor_train alone asks for 6 more than the rest.
    started = time.monotonic()
    result = roll(
        ["run", "examples/math_code.yaml", "actor_train.world_size=4",
         "actor_train.training_args.per_device_train_batch_size=16", f"output_dir={tmp_path / 'run'}"],
        user_cluster.address, timeout=60,
    )
    assert result.returncode == EXIT_FAILED, result.stderr[-2000:]
    message = result.stderr
    assert f"the run does not fit the Ray cluster at {user_cluster.address}: nothing was started" in message
    assert "2 node(s), 6 CPU in all" in message and "The run asks for 7.1 CPU" in message
    assert "Short by 1.1 CPU" in message and "actor_train.world_size" in message
    print(f"refused in {time.monotonic() - started:.1f} s")
    free, total = _free_resources(user_cluster.address)
    assert free.get("CPU") == total.get("CPU") == 6.0  # nothing left holding a CPU


@pytest.mark.slow
def test_a_cluster_whose_cpus_other_work_holds_is_refused_saying_so(tmp_path, user_cluster):
    from ray.util.placement_group import placement_group, remove_placement_group

    ray.init(address=user_cluster.address, log_to_driver=False)
    try:
        held = placement_group([{"CPU": 1.5}, {"CPU": 1.5}], strategy="SPREAD")  # another job's, say
        ray.get(held.ready(), timeout=60)
        result = roll(["run", "examples/math_code.yaml", f"output_dir={tmp_path / 'run'}"], user_cluster.address,
                      timeout=90)
        remove_placement_group(held)
    finally:
        ray.shutdown()
    assert result.returncode == EXIT_FAILED, result.stderr[-2000:]
    assert (
        f"the run fits the Ray cluster at {user_cluster.address} by its size, but other work holds 3 CPU of it now"
        in result.stderr
    )
    assert "so 1.1 CPU of the run's 4.1 CPU is not free; nothing was started" in result.stderr


@pytest.mark.slow
def test_dry_run_checks_every_node_and_names_the_one_without_the_files(tmp_path, user_cluster):
    good = roll(["run", "examples/math_code.yaml", f"output_dir={tmp_path / 'run'}", "--dry-run"],
                user_cluster.address, timeout=120)
    assert good.returncode == 0, good.stdout[-3000:]
    assert "[ok] ray fit: every actor of the run fits (4.1 CPU in all)" in good.stdout
    for node in (user_cluster.head_id, user_cluster.far_id):
        assert f"[ok] ray node {node[:8]}" in good.stdout

    # Data and output_dir in the folder the far node does not share.
    data = user_cluster.private / "data"
    data.mkdir(exist_ok=True)
    shutil.copy(EXAMPLES / "data" / "math_train.jsonl", data)
    bad = roll(
        ["run", "examples/math_code.yaml", f"output_dir={user_cluster.private / 'run'}",
         f"data.train_files=[{data / 'math_train.jsonl'},data/code_train.jsonl]", "--dry-run"],
        user_cluster.address, timeout=120,
    )
    assert bad.returncode == EXIT_USAGE
    far = next(line for line in bad.stdout.splitlines() if f"ray node {user_cluster.far_id[:8]}" in line)
    assert far.lstrip().startswith("[FAIL]")
    assert f"cannot read data.train_files[0] {data / 'math_train.jsonl'}" in far
    assert f"output_dir {user_cluster.private / 'run'} is not the driver's" in far
    assert f"[ok] ray node {user_cluster.head_id[:8]}" in bad.stdout


@pytest.mark.slow
def test_a_job_ships_its_folder_with_a_module_path_reward_plugin_and_finds_installed_entry_point_ones(
    tmp_path, user_cluster, mlflow_db
):
    # A job folder of its own: a config whose math domain adds docs/reward-plugins.md's KeywordScorer by module
    # path (a file that exists only in the folder Ray ships) and the plugin example's entry-point worker, pinned to
    # the far node. (One job that trains is enough for what a job ships: the project itself is shipped below.)
    import yaml

    from tests.test_reward_plugins import code_blocks, plugin_page

    folder = tmp_path / "job"
    folder.mkdir()
    (folder / "my_rewards.py").write_text(code_blocks(plugin_page(), "python")[0])
    raw = yaml.safe_load((EXAMPLES / "math_code.yaml").read_text())
    raw["pretrain"] = str(TINY_MODEL)
    raw["data"] = {**raw["data"], "train_files": [str(EXAMPLES / "data" / "math_train.jsonl")],
                   "val_files": [str(EXAMPLES / "data" / "math_val.jsonl")]}
    raw["domain_interleave_probs"] = {"math": 1.0}
    raw["rewards"] = {"math": {
        "tag_included": ["add"], "resources": {"far": 1}, "num_cpus_per_worker": 0.5,
        "workers": [{"worker": "math_rule"},
                    {"worker": "my_rewards:KeywordScorer", "name": "keyword", "weight": 0.5},
                    {"worker": "exact_match_example", "name": "exact", "weight": 0.5, "on_masked": "skip"}],
    }}
    (folder / "run.yaml").write_text(yaml.safe_dump(raw))
    out = tmp_path / "run"
    result = _submit([
        str(BIN / "ray"), "job", "submit", "--address", f"http://127.0.0.1:{user_cluster.dashboard_port}",
        "--working-dir", str(folder), "--", "roll", "run", "run.yaml", *SMALL_RUN, "max_steps=1",
        f"output_dir={out}", f"tracking.tracking_uri={mlflow_db(tmp_path / 'mlflow.db')}",
    ])
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    assert "finished 1 steps" in result.stdout
    # The job's driver ran from Ray's copy of the working dir: the config it ran was shipped, not this folder.
    resolved = json.loads((out / "resolved_config.json").read_text())
    assert "runtime_resources/working_dir_files" in resolved["config_path"]
    placed = json.loads((out / "placement.json").read_text())["workers"]
    assert placed["reward_math_keyword"] == placed["reward_math_exact"] == [user_cluster.far_id]
    # each component scored: the run's MLflow records hold their metrics
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name(raw["tracking"]["experiment_name"]).experiment_id])
    assert {"reward/math/keyword/score", "reward/math/exact/score"} <= set(run.data.metrics)


@pytest.mark.slow
def test_a_job_that_ships_the_project_is_told_what_git_does_not_ship(tmp_path, user_cluster):
    # The project itself as the job's working dir, the example as it is: Ray's copy holds no models/ (.gitignore),
    # and an output_dir inside that copy would be deleted with it. The checks stop the job before any actor starts.
    result = _submit([
        str(BIN / "ray"), "job", "submit", "--address", f"http://127.0.0.1:{user_cluster.dashboard_port}",
        "--working-dir", ".", "--", "roll", "run", "examples/math_code.yaml", *SMALL_RUN, "max_steps=1",
    ])
    assert result.returncode != 0
    assert "pretrain: " in result.stdout and "ships what git tracks, not models/" in result.stdout
    assert "lies in Ray's copy of the job's working_dir, which Ray deletes" in result.stdout


def _submit(command: list[str]) -> subprocess.CompletedProcess:
    deadline = time.monotonic() + 60
    while True:  # the head's job agent starts a little after the node
        result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
        if "No available agent" not in result.stdout + result.stderr or time.monotonic() > deadline:
            return result
        time.sleep(2)


@pytest.mark.slow
def test_a_driver_of_another_ray_version_gets_both_versions(user_cluster, tmp_path):
    script = (
        "import sys, ray\nray.__version__ = '2.0.0'  # what another install would report\n"
        "from roll_pipeline.driver.cli import main\nsys.exit(main(sys.argv[1:]))\n"
    )
    environ = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    result = subprocess.run(
        [sys.executable, "-c", script, "run", "examples/math_code.yaml", f"output_dir={tmp_path / 'run'}"],
        cwd=ROOT, env={**environ, "RAY_ADDRESS": user_cluster.address}, capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == EXIT_FAILED
    assert "its Ray or Python version differs from this driver's (here: Ray 2.0.0" in result.stderr
    assert f"Ray: {ray.__version__}" in result.stderr and "Ray: 2.0.0" in result.stderr  # Ray's own message


@pytest.mark.slow
def test_a_code_sandbox_worker_on_a_node_without_bubblewrap_names_the_node(tmp_path, user_cluster):
    # A third node whose bwrap is /dev/null (not executable): what a node without the package sees.
    bare = user_cluster.join({"bare": 1}, ["mount --bind /dev/null /usr/bin/bwrap"])
    process = user_cluster.started[-1]
    try:
        result = roll(
            ["run", "examples/math_code.yaml", *SMALL_RUN, "max_steps=1", "rewards.code.resources={bare: 1}",
             f"output_dir={tmp_path / 'run'}"],
            user_cluster.address, timeout=300,
        )
    finally:
        user_cluster.leave(process)
    assert result.returncode == EXIT_FAILED, result.stderr[-3000:]
    assert "reward_code[0].start: " in result.stderr
    assert f"Ray node {bare[:8]}" in result.stderr
    assert "apt-get install bubblewrap" in result.stderr


def test_an_unreachable_address_is_an_error_in_seconds(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]  # nothing listens once the socket is closed
    result = roll(["run", "examples/math_code.yaml", f"output_dir={tmp_path / 'run'}"], f"127.0.0.1:{closed}",
                  timeout=60)
    assert result.returncode == EXIT_FAILED
    assert f"cannot reach the Ray cluster at 127.0.0.1:{closed}" in result.stderr
    assert "Connection refused" in result.stderr


def test_a_port_that_is_not_a_ray_head_is_an_error(tmp_path):
    # Something answers, in another protocol: Ray alone would retry for 20 s and more.
    import http.server
    import threading

    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        address = f"127.0.0.1:{server.server_address[1]}"
        result = roll(["run", "examples/math_code.yaml", f"output_dir={tmp_path / 'run'}"], address, timeout=60)
    finally:
        server.shutdown()
    assert result.returncode == EXIT_FAILED
    assert f"cannot join the Ray cluster at {address}" in result.stderr
    assert "the port answers, but not as a Ray head node's GCS" in result.stderr

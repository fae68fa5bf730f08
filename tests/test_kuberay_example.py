"""examples/kuberay/rayjob-math-code.yaml against what it runs: its entrypoint loads as a run of the config it names
(as the image lays the project out), every pod runs the same image of the project with the Ray version installed
here, output_dir lies on storage every pod mounts at the same path, and the run's actors fit the cluster the
manifest declares (the fit check of roll_pipeline/distributed/fit.py on its nodes)."""

from __future__ import annotations

import json
import re
import shlex

import ray
import yaml

from roll_core.config import load_config
from roll_pipeline.distributed.fit import Node, fit_report, run_actors
from tests.conftest import EXAMPLES, ROOT

MANIFEST = EXAMPLES / "kuberay" / "rayjob-math-code.yaml"
DOCKERFILE = EXAMPLES / "kuberay" / "Dockerfile"


def _job() -> dict:
    documents = list(yaml.safe_load_all(MANIFEST.read_text()))
    (job,) = [d for d in documents if d["kind"] == "RayJob"]
    assert job["apiVersion"] == "ray.io/v1"
    return job


def _groups(job: dict) -> list[tuple[dict, int]]:
    """(group spec, pods) for the head group and each worker group."""
    spec = job["spec"]["rayClusterSpec"]
    return [(spec["headGroupSpec"], 1)] + [(g, g["replicas"]) for g in spec["workerGroupSpecs"]]


def _image_root() -> str:
    workdirs = re.findall(r"^WORKDIR (\S+)$", DOCKERFILE.read_text(), re.MULTILINE)
    assert len(workdirs) == 1
    return workdirs[0]


def _entrypoint_run(job: dict):
    argv = shlex.split(job["spec"]["entrypoint"])
    assert argv[:2] == ["roll", "run"]
    config, overrides = argv[2], argv[3:]
    assert not config.startswith("/"), "relative to the image's project folder, the containers' workingDir"
    return load_config(ROOT / config, overrides).config, overrides


def test_the_entrypoint_is_a_valid_run_of_the_config_it_names():
    cfg, overrides = _entrypoint_run(_job())
    assert cfg.exp_name == "math_code"
    # The model the config names is the embedded one, which the image builds (`make model`) at the same place.
    assert cfg.pretrain == str(EXAMPLES / "models" / "tiny-qwen2")
    assert "make model" in DOCKERFILE.read_text()


def test_every_pod_runs_the_same_image_from_the_project_folder_with_this_ray():
    job = _job()
    assert job["spec"]["rayClusterSpec"]["rayVersion"] == ray.__version__
    containers = [c for group, _ in _groups(job) for c in group["template"]["spec"]["containers"]]
    assert len({c["image"] for c in containers}) == 1
    assert {c["workingDir"] for c in containers} == {_image_root()}


def test_output_dir_is_on_a_volume_every_pod_mounts_at_the_same_path():
    job = _job()
    cfg, _ = _entrypoint_run(job)
    for group, _ in _groups(job):
        pod = group["template"]["spec"]
        claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"]}
        (container,) = pod["containers"]
        mounts = [m["mountPath"] for m in container["volumeMounts"] if claims.get(m["name"]) == "roll-shared"]
        assert any(cfg.output_dir.startswith(m.rstrip("/") + "/") for m in mounts), (group, cfg.output_dir)


def _resources(params: dict) -> dict[str, float]:
    out = {"CPU": float(params.get("num-cpus", 0)), "GPU": float(params.get("num-gpus", 0))}
    if "resources" in params:  # KubeRay's form: a JSON object inside an extra pair of quotes
        out |= json.loads(params["resources"].strip('"').replace('\\"', '"'))
    return out


def test_the_run_fits_the_cluster_the_manifest_declares():
    job = _job()
    cfg, _ = _entrypoint_run(job)
    nodes = [
        Node(f"{group.get('groupName', 'head')}-{i}", "pod", _resources(group["rayStartParams"]))
        for group, pods in _groups(job)
        for i in range(pods)
    ]
    groups = run_actors(cfg)
    assert fit_report(groups, nodes, "of the RayJob") is None
    # and the code_sandbox workers are pinned to the pods that offer the resource their image's bubblewrap backs
    (code,) = [g for g in groups if g.name == "reward_code"]
    assert code.resources.get("sandbox") == 1 and all(
        "sandbox" in n.resources for n in nodes if n.resources["CPU"] > 0
    )
    # one pod fewer, and it would not
    assert fit_report(groups, nodes[:-1], "of the RayJob") is not None

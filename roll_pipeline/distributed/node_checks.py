"""`roll run --dry-run` on a joined Ray cluster: a small task on every node checks that the node can read the run's
model and data paths and write its output_dir, and that its output_dir is the driver's (shared storage: a file
the driver wrote there is seen, and what the node writes the driver sees); a node without bubblewrap is named
where a code_sandbox worker may land on it. Every problem names its node."""

from __future__ import annotations

import os
import shutil
import socket
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

NODE_CHECK_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class NodeInputs:
    """What every node of a run must reach: (config key, path) pairs to read, the output_dir to write."""

    reads: tuple[tuple[str, str], ...]
    output_dir: str
    sandbox: bool
    """A code_sandbox domain runs: its workers need bubblewrap on the node they land on."""


def run_inputs(cfg: Any) -> NodeInputs:
    """The local paths a run of `cfg` (a PipelineConfig) reads on its workers' nodes, and its output_dir."""
    reads = {"pretrain": cfg.pretrain}
    for name in ("actor_train", "actor_infer", "reference", "critic"):
        section = getattr(cfg, name)
        if section is not None:
            reads[f"{name}.model_args.model_name_or_path"] = section.model_args.model_name_or_path
    for split in ("train_files", "val_files"):  # the driver reads them: with `ray job submit`, on the head node
        for i, path in enumerate(getattr(cfg.data, split) or []):
            reads[f"data.{split}[{i}]"] = path
    for domain, reward in cfg.rewards.items():  # a reward model's or a local judge's weights, read by its workers
        for i, c in enumerate(reward.components()):
            path = (c.options or {}).get("model_path")
            if isinstance(path, str):
                key = f"rewards.{domain}.workers[{i}]" if reward.workers else f"rewards.{domain}"
                reads[f"{key}.options.model_path"] = path
    local = tuple((key, path) for key, path in reads.items() if Path(path).is_absolute())  # hub ids are not paths
    sandbox = any(c.worker == "code_sandbox" for r in cfg.rewards.values() for c in r.components())
    return NodeInputs(local, cfg.output_dir, sandbox)


def check_this_node(inputs: NodeInputs, token_name: str, token: str) -> dict[str, Any]:
    """Run on a node: its problems with `inputs`, each a sentence. `token_name` in output_dir holds `token`, written
    by the driver; this node writes `<token_name>.<node>` there for the driver to find."""
    import ray

    node = ray.get_runtime_context().get_node_id()
    problems = []
    for key, path in inputs.reads:
        p = Path(path)
        try:
            if p.is_dir():
                os.listdir(p)
            else:
                with p.open("rb") as f:
                    f.read(1)
        except OSError as exc:
            problems.append(f"cannot read {key} {path}: {exc.strerror or exc}")
    out = Path(inputs.output_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{token_name}.{node}").write_text(node)
    except OSError as exc:
        problems.append(f"cannot write output_dir {out}: {exc.strerror or exc}")
    else:
        try:
            seen = (out / token_name).read_text()
        except OSError:
            seen = None
        if seen != token:
            problems.append(
                f"output_dir {out} is not the driver's: the file the driver wrote there is not seen from this node, "
                "so checkpoints and models written here would not reach the driver (output_dir must be on storage "
                "every node shares, at the same path)"
            )
    if inputs.sandbox and shutil.which("bwrap") is None:
        problems.append(
            "has no bubblewrap (`bwrap` on PATH), which code_sandbox workers need: install it there (Debian/Ubuntu: "
            "apt-get install bubblewrap), or keep code_sandbox workers off this node with rewards.<domain>.resources"
        )
    return {"node": node, "host": socket.gethostname(), "ip": ray.util.get_node_ip_address(), "problems": problems}


def check_every_node(inputs: NodeInputs, timeout_s: float = NODE_CHECK_TIMEOUT_S) -> list[tuple[str, list[str]]]:
    """On the connected Ray cluster, `check_this_node` on every alive node; returns (node label, problems) per
    node, including the driver's own checks: that it sees what each node wrote in output_dir."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    out = Path(inputs.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    token_name, token = f".roll-node-check-{uuid.uuid4().hex[:12]}", uuid.uuid4().hex
    (out / token_name).write_text(token)
    check = ray.remote(num_cpus=0)(check_this_node)
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    try:
        refs = [
            check.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote(
                inputs, token_name, token
            )
            for n in nodes
        ]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        results = []
        for n, ref in zip(nodes, refs, strict=True):
            label = f"node {n['NodeID'][:8]} ({n.get('NodeManagerAddress', '?')})"
            if ref not in ready:
                results.append((label, [f"its check task did not run within {timeout_s:g} s"]))
                continue
            found = ray.get(ref)
            problems = list(found["problems"])
            written = out / f"{token_name}.{found['node']}"
            if not any("output_dir" in p for p in problems) and not written.is_file():
                problems.append(
                    f"wrote output_dir {out} where the driver does not see it (output_dir must be on storage every "
                    "node shares, at the same path)"
                )
            results.append((f"node {found['node'][:8]} ({found['host']}, {found['ip']})", problems))
        return results
    finally:
        for leftover in out.glob(f"{token_name}*"):
            leftover.unlink(missing_ok=True)

"""Starting a local Ray node on a machine that is busy. Ray 2.60's raylet waits a fixed 15 s (not configurable:
agent_register_timeout_ms does not reach it) for its dashboard agent to write its port files and aborts when the
agent is later; `ray.init` then reports "The current node timed out during startup" 30 s after it began. The agent
is a Python process that imports a good part of Ray: about 1 s on an idle 2-core machine, 28 s once with one core
busy and three Ray nodes starting beside it (2026-12-06). A start that fails so is retried with the failed
attempt's processes stopped (its GCS, log monitor and agents outlive the failure until this process exits); the
next attempt finds Ray's modules in the page cache."""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any

import psutil
import ray

logger = logging.getLogger(__name__)

START_ATTEMPTS = 3
NODE_START_TIMED_OUT = "The current node timed out during startup"
"""The start of node.py's message when the new node never registered (Ray 2.60)."""
LOG_DIR_FLAGS = ("--log_dir=", "--logs-dir=", "--log-dir=")
RAY_BINARIES = {"gcs_server", "raylet"}
RAY_PACKAGE = os.path.dirname(ray.__file__)


class RayStartError(RuntimeError):
    """The local Ray node did not start in START_ATTEMPTS attempts; the message names the logs to read."""


def init_local_ray(attempts: int = START_ATTEMPTS, **init_kwargs: Any) -> None:
    """`ray.init(**init_kwargs)` for a node of this process's own, tried again (up to `attempts` in all) when the
    node did not register in time; any other failure is raised at once."""
    for attempt in range(1, attempts + 1):
        before = {p.pid for p in psutil.Process().children(recursive=True)}
        try:
            ray.init(**init_kwargs)
            return
        except Exception as exc:
            if NODE_START_TIMED_OUT not in str(exc):
                raise
            ray.shutdown()
            logs = stop_new_children(before)
            where = f" (its logs: {logs}; raylet.out says whether the raylet aborted)" if logs else ""
            if attempt == attempts:
                raise RayStartError(
                    f"Ray's local node did not start in {attempts} attempts{where}: its raylet most likely stopped "
                    "when its dashboard agent did not report its ports within Ray's fixed 15 s, which happens when "
                    "the machine's CPUs are busy. Retry when the machine is less loaded."
                ) from exc
            logger.warning("Ray's local node did not start (attempt %d of %d)%s; its processes stopped, starting "
                           "it again", attempt, attempts, where)


def stop_new_children(before: set[int]) -> str | None:
    """SIGKILL this process's descendants that are Ray's and not in `before` (a failed start's) and reap them; the
    failed node's log folder, where one of them named it."""
    new = [p for p in psutil.Process().children(recursive=True) if p.pid not in before and is_rays(p)]
    logs = next(filter(None, map(log_dir, new)), None)
    for process in new:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    psutil.wait_procs(new, timeout=30)
    return logs


def is_rays(process: psutil.Process) -> bool:
    """Ray's GCS, raylet (a zombie once aborted), workers, or a Python process running one of Ray's modules."""
    try:
        name = process.name()
        if name in RAY_BINARIES or name.startswith("ray::"):
            return True
        return any(RAY_PACKAGE in arg for arg in process.cmdline())
    except psutil.Error:
        return False


def log_dir(process: psutil.Process) -> str | None:
    try:
        argv = process.cmdline()
    except psutil.Error:  # gone, or a zombie (the aborted raylet)
        return None
    return next((arg.split("=", 1)[1] for arg in argv for flag in LOG_DIR_FLAGS if arg.startswith(flag)), None)

"""Joining a Ray cluster that already runs (`ray.address`, `RAY_ADDRESS`): an address that cannot be reached is
an error within seconds (Ray alone retries for a minute or more), and a driver whose Ray or Python version differs
from the cluster's gets Ray's own message, both versions in it, with what to do."""

from __future__ import annotations

import platform
import socket

import ray

REACH_TIMEOUT_S = 5.0
GCS_PROBE_TIMEOUT_MS = 1000
"""The probe's own bound; Ray adds about 10 s of retries to it where the port answers in another protocol."""


class RayJoinError(RuntimeError):
    """The Ray cluster at the configured address cannot be joined; the message says why and what to do."""


def gcs_endpoint(address: str) -> tuple[str, int] | None:
    """The host and port an address names (`host:port`, `ray://host:port`), or None for `auto` and forms
    without a port, which Ray resolves itself."""
    bare = address.split("://", 1)[-1]
    host, _, port = bare.rpartition(":")
    if not host or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def join_ray(address: str, reach_timeout_s: float = REACH_TIMEOUT_S) -> None:
    """`ray.init(address=address)`, after checking within `reach_timeout_s` that its port answers."""
    endpoint = gcs_endpoint(address)
    if endpoint is not None:
        try:
            socket.create_connection(endpoint, timeout=reach_timeout_s).close()
        except OSError as exc:
            raise RayJoinError(
                f"cannot reach the Ray cluster at {address} (ray.address or RAY_ADDRESS): {exc or 'timed out'} "
                f"after at most {reach_timeout_s:g} s. Is Ray running there (`ray start --head --port="
                f"{endpoint[1]}` on the head node, `ray status` on it shows the cluster), and can this machine reach "
                "that port? Unset ray.address and RAY_ADDRESS to run on a local cluster of this machine instead."
            ) from exc
        if "://" not in address:
            _probe_gcs(address)
    try:
        ray.init(address=address, log_to_driver=True)
    except Exception as exc:  # Ray raises RuntimeError, ConnectionError, ValueError for a cluster it cannot join
        text = str(exc).strip()
        if "Version mismatch" in text:
            raise RayJoinError(
                f"cannot join the Ray cluster at {address}: its Ray or Python version differs from this driver's "
                f"(here: Ray {ray.__version__}, Python {platform.python_version()}); a driver must run the "
                "cluster's versions. Install them here (pip install 'ray[default]==<the cluster's>' in a Python "
                "of the cluster's version), or run the driver on the cluster with `ray job submit`. Ray says: "
                f"{text}"
            ) from exc
        raise RayJoinError(f"cannot join the Ray cluster at {address} (ray.address or RAY_ADDRESS): {text}") from exc


def _probe_gcs(address: str) -> None:
    """Connect to the address's GCS once, with a short bound (Ray's own join retries for 20 s or more): a port
    that answers but is not a Ray head's GCS (another service, a proxy, the dashboard's port) fails here, in 10 ms
    to 11 s as measured (a proxy's refusal, an HTTP server)."""
    try:
        from ray._raylet import InnerGcsClient
        from ray.exceptions import RpcError

        connect = InnerGcsClient.standalone
    except (ImportError, AttributeError):  # Ray's internals moved: ray.init still reports the failure, only later
        return
    try:
        connect(address, None, GCS_PROBE_TIMEOUT_MS)
    except RpcError as exc:
        raise RayJoinError(
            f"cannot join the Ray cluster at {address} (ray.address or RAY_ADDRESS): the port answers, but not as a "
            f"Ray head node's GCS ({exc}). Is the port the one `ray start --head` printed (6379 by default), not "
            "the dashboard's (8265, which `ray job submit` takes)?"
        ) from exc

"""Every wait of the driver on its workers is bounded (`ray.rpc_timeout_s`): a worker that stops answering
without dying (a hung collective, a deadlocked engine, a node that lost its network) ends the run with an error
that names it, instead of a run that hangs without a word."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import ray

DEFAULT_RPC_TIMEOUT_S = 3600.0


class RpcTimeoutError(TimeoutError):
    """Calls to workers that did not answer within the bound; the message names each one."""


def wait_for(refs: Sequence[ray.ObjectRef], names: Sequence[str], timeout_s: float | None) -> list[Any]:
    """`ray.get(refs)` within `timeout_s` seconds (None: no bound); `names[i]` says whose call `refs[i]` is
    (`actor_train[1].train_step`), for the error that lists the calls still unanswered."""
    refs, names = list(refs), list(names)
    if len(refs) != len(names):
        raise ValueError(f"{len(refs)} calls but {len(names)} names")
    if timeout_s is not None and refs:
        _, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        if pending:
            late = [name for ref, name in zip(refs, names, strict=True) if ref in pending]
            raise RpcTimeoutError(
                f"{', '.join(late)} did not answer within {timeout_s:g} s (ray.rpc_timeout_s); the worker is alive "
                "but stuck, or far slower than this bound allows: see its log (Ray's dashboard or "
                "/tmp/ray/session_latest/logs), and raise ray.rpc_timeout_s if the work is that long"
            )
    return ray.get(refs)


class ActorStartTimeout(TimeoutError):
    """Actors that Ray did not place, or that did not finish starting, within the bound; the message names them."""


def wait_started(refs: Sequence[ray.ObjectRef], names: Sequence[str], timeout_s: float) -> None:
    """Wait for actors' `__ray_ready__` calls (`names[i]` names `refs[i]`'s actor); an actor that failed to start
    raises its error, and after `timeout_s` the ones still waiting are named with what the cluster has free."""
    refs, names = list(refs), list(names)
    _, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    if pending:
        late = [name for ref, name in zip(refs, names, strict=True) if ref in pending]
        free = {k: round(v, 4) for k, v in ray.available_resources().items() if k in ("CPU", "GPU")}
        raise ActorStartTimeout(
            f"{len(late)} actor(s) did not start within {timeout_s:g} s (ray.actor_start_timeout_s): "
            f"{', '.join(late)}. The Ray cluster has {free or 'no CPU or GPU'} free of "
            f"{ {k: v for k, v in ray.cluster_resources().items() if k in ('CPU', 'GPU')} }: an actor whose "
            "resources no node has free waits for them (other jobs hold them, or a node was lost); one that is "
            "placed but slow is loading its model (raise ray.actor_start_timeout_s). `ray status` shows the "
            "pending demand"
        )
    failed = []
    for ref, name in zip(refs, names, strict=True):
        try:
            ray.get(ref)
        except ray.exceptions.RayActorError as exc:
            failed.append(f"{name}: {start_error(exc)}")
    if failed:
        raise ActorStartFailed("actor(s) failed to start:\n" + "\n".join(failed))


class ActorStartFailed(RuntimeError):
    """Actors whose start-up raised; the message names each one with its error."""


def start_error(exc: BaseException) -> str:
    """The error an actor's constructor raised, from Ray's report of the actor's death (the traceback's last
    exception and its message), or Ray's report itself."""
    text = str(exc)
    cause = getattr(exc, "cause", None) or getattr(exc, "error_msg", None)
    if cause is not None and not isinstance(cause, str):
        text = str(cause)
    lines = text.rstrip().splitlines()
    # The traceback ends with "<module>.<ExceptionClass>: <message>" and the message's further lines.
    for i in range(len(lines) - 1, -1, -1):
        head = lines[i].split(":", 1)[0]
        if head and " " not in head and head[0].isalpha() and (head.endswith(("Error", "Unavailable", "Exception"))):
            return "\n".join(lines[i:])
    return text

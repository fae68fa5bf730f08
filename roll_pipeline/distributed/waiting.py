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

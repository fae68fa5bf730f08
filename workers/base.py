"""What every Ray worker does first: pin its thread count, seed itself, and join its cluster's process group."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import random
import socket
import time
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)


class Worker:
    """Base of all role workers. Plain Python: `Cluster` wraps subclasses in `ray.remote`, tests may not."""

    def __init__(self, *, name: str, rank: int, world_size: int, seed: int, torch_threads: int) -> None:
        self.name = name
        self.rank = rank
        self.world_size = world_size
        # Several workers share the box; each uses at most its own share of intra-op threads.
        torch.set_num_threads(torch_threads)
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        if not torch.cuda.is_available():
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        seed_everything(seed + rank)
        logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s {name}[{rank}] %(levelname)s %(message)s")
        quiet_libraries()

    def address(self) -> tuple[str, int]:
        """This worker's IP and a free TCP port on it, for rank 0 to host the process group's rendezvous.

        The IP is the one Ray knows this node by (what other nodes reach it at): the host name's address is
        127.0.1.1 on stock Debian and Ubuntu hosts, which no other node can connect to."""
        ip = node_ip() if self.world_size > 1 else "127.0.0.1"
        with socket.socket() as s:
            s.bind(("", 0))
            return ip, s.getsockname()[1]

    def set_distributed_env(self, master_addr: str, master_port: int) -> None:
        os.environ.update(
            MASTER_ADDR=master_addr,
            MASTER_PORT=str(master_port),
            RANK=str(self.rank),
            LOCAL_RANK="0",
            WORLD_SIZE=str(self.world_size),
        )

    def ready(self) -> bool:
        return True


def node_ip() -> str:
    """This node's IP as Ray reports it, inside a Ray worker; else loopback (a group that cannot span hosts)."""
    import ray

    return ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"


def quiet_libraries() -> None:
    """Keep library chatter (loading bars, accelerator notes) out of the driver's terminal."""
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    for noisy in ("DeepSpeed", "deepspeed", "datasets"):
        logging.getLogger(noisy).setLevel(logging.ERROR)


@functools.cache
def _libc_malloc_trim():
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to call
        return None


_last_release = -float("inf")  # time.monotonic() of this process's last release (malloc_trim is process-wide)


def release_free_memory(min_interval_s: float = 0.0) -> bool:
    """Give the C heap's free pages back to the OS (glibc's `malloc_trim(0)`; nothing elsewhere), unless this
    process did so less than `min_interval_s` ago. Returns whether it did.

    glibc keeps what a batch freed for later mallocs. With batches of ever-changing shapes, in a process with many
    threads (Ray's, the request batcher's), those free pages stay resident: actor_infer grew 12% over a 500-step
    soak without a leak. The call itself takes under a millisecond, but the pages it hands back must be faulted
    in and zeroed again by the next batch that needs them: on CPU, where a train step's activations live in this
    heap, a release after every step cost actor_train 15-20% of its step time. So a caller on such a hot path
    passes a `min_interval_s`, which still bounds what the heap can keep."""
    global _last_release
    now = time.monotonic()
    if now - _last_release < min_interval_s:
        return False
    trim = _libc_malloc_trim()
    if trim is not None:
        trim(0)
    _last_release = time.monotonic()
    return True


def rng_states() -> dict[str, Any]:
    """This process's global RNG states (Python, NumPy, torch CPU and, where there is one, CUDA)."""
    states = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def load_rng_states(states: dict[str, Any]) -> None:
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)

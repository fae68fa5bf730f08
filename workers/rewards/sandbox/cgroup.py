"""One memory cgroup per sandbox: a bound on everything its processes hold together.

RLIMIT_AS bounds each process alone, so ``processes`` x ``memory_mb`` is what a run could hold without this. A
cgroup counts all its processes' memory, and the files they write to the sandbox's tmpfs, against one limit;
past it, the kernel's OOM killer kills inside the cgroup only. The worker makes the cgroup under its own (cgroup
v2, or the v1 ``memory`` hierarchy), puts the sandbox's processes in it before the job is handed over, so that
every process the program starts is born inside, and removes it when the sandbox is killed. The program cannot
leave it: it runs in its own cgroup namespace, as a user without write access to the hierarchy.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import queue
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

_COUNTER = itertools.count()
_to_remove: queue.SimpleQueue[str] = queue.SimpleQueue()
_remover: threading.Thread | None = None
_remover_lock = threading.Lock()
_queued = 0
_NAME = re.compile(r"roll-sandbox-(\d+)-\d+")


@dataclass(frozen=True)
class MemoryCgroups:
    """Where this worker makes its sandboxes' cgroups."""

    #: The worker's own cgroup directory in the hierarchy that has the memory controller.
    base: str
    #: 1 or 2.
    version: int

    def create(self, limit_bytes: int) -> str:
        """A new, empty cgroup limited to ``limit_bytes`` (swap included); raises ``OSError`` if refused."""
        path = os.path.join(self.base, f"roll-sandbox-{os.getpid()}-{next(_COUNTER)}")
        os.mkdir(path)
        try:
            if self.version == 2:
                _write(path, "memory.max", limit_bytes)
                with contextlib.suppress(FileNotFoundError):
                    _write(path, "memory.swap.max", 0)
            else:
                _write(path, "memory.limit_in_bytes", limit_bytes)
                with contextlib.suppress(FileNotFoundError):
                    _write(path, "memory.memsw.limit_in_bytes", limit_bytes)
        except BaseException:
            remove(path)
            raise
        return path

    def oom_killed(self, path: str) -> bool:
        """Whether the kernel killed a process of ``path`` for going past its limit."""
        return self.oom_kills(path) > 0

    def oom_kills(self, path: str) -> int:
        """How many processes of ``path`` the kernel has killed for going past its limit."""
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        try:
            text = Path(path, name).read_text()
        except OSError:
            return 0
        counts = dict(line.split() for line in text.splitlines() if len(line.split()) == 2)
        try:
            return int(counts.get("oom_kill", "0"))
        except ValueError:
            return 0


def add(path: str, pid: int) -> None:
    """Move process ``pid`` into the cgroup ``path``."""
    _write(path, "cgroup.procs", pid)


def remove_later(path: str) -> None:
    """Remove the cgroup ``path`` from a background thread: a removal can take milliseconds (the kernel lets the
    killed processes go first), which a run should not wait for."""
    global _remover, _queued
    with _remover_lock:
        _queued += 1
        if _remover is None or not _remover.is_alive():
            _remover = threading.Thread(target=_remove_queued, name="sandbox-cgroup-remover", daemon=True)
            _remover.start()
    _to_remove.put(path)


def _remove_queued() -> None:
    global _queued
    while True:
        path = _to_remove.get()
        try:
            if not remove(path, wait_s=10.0):
                logger.warning("code sandbox: could not remove the cgroup %s", path)
        finally:
            with _remover_lock:
                _queued -= 1


def drain_removals(timeout_s: float = 10.0) -> bool:
    """Wait until the cgroups handed to ``remove_later`` are removed; whether that happened in time."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with _remover_lock:
            if _queued == 0:
                return True
        time.sleep(0.005)
    return False


def remove(path: str, wait_s: float = 2.0) -> bool:
    """Remove the cgroup ``path`` once its processes are gone (they die asynchronously after a kill)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            os.rmdir(path)
            return True
        except FileNotFoundError:
            return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.005)


def remove_orphans(base: str) -> list[str]:
    """Remove the sandbox cgroups that workers which no longer exist left behind (a worker killed by SIGKILL
    cannot remove its own); returns those removed. Usually the kernel has emptied them; a sandbox process still in
    one (a spare sandbox whose bubblewrap was caught in its set-up, just killed by ``kill_orphaned_sandboxes`` and
    not yet gone) belongs to no live worker: it is killed, and the cgroup removed once it has died."""
    removed = []
    with contextlib.suppress(OSError):
        for name in os.listdir(base):
            worker = creator(name)
            if worker is None or _alive(worker):
                continue
            path = os.path.join(base, name)
            if remove(path, wait_s=0.0) or (_kill_members(path) and remove(path, wait_s=ORPHAN_WAIT_S)):
                removed.append(name)
    return removed


#: How long a cgroup left by a dead worker is waited for once its last processes have been killed.
ORPHAN_WAIT_S = 5.0


def _kill_members(path: str) -> bool:
    """SIGKILL every process of the cgroup ``path`` (``cgroup.kill`` where the kernel has it); whether it tried."""
    try:
        _write(path, "cgroup.kill", 1)
        return True
    except OSError:
        pass
    try:
        pids = Path(path, "cgroup.procs").read_text().split()
    except OSError:
        return False
    for pid in pids:
        with contextlib.suppress(OSError, ValueError):
            os.kill(int(pid), 9)
    return True


def creator(name: str) -> int | None:
    """The pid of the worker that made the sandbox cgroup named ``name`` (names carry it), or ``None`` if ``name``
    is not a sandbox cgroup's."""
    match = _NAME.fullmatch(name)
    return int(match.group(1)) if match else None


def process_creator(pid: int) -> int | None:
    """The pid of the worker whose sandbox cgroup process ``pid`` is in (its program's processes are born there
    and cannot leave), or ``None`` if it is in none (or is gone)."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        worker = creator(line.rsplit("/", 1)[-1])
        if worker is not None:
            return worker
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _write(path: str, name: str, value: int) -> None:
    with open(os.path.join(path, name), "w") as f:
        f.write(str(value))


def locate(mountinfo: str, cgroups: str) -> tuple[str, int] | None:
    """``(directory, version)`` of this process's own cgroup in a hierarchy with the memory controller, from the
    text of ``/proc/self/mountinfo`` and ``/proc/self/cgroup``; v1's ``memory`` hierarchy first (a hybrid host's
    v2 hierarchy has no memory controller)."""
    own = {}
    for line in cgroups.splitlines():
        number, controllers, path = line.split(":", 2)
        if number == "0":
            own["v2"] = path
        elif "memory" in controllers.split(","):
            own["v1"] = path
    mounts = {}
    for line in mountinfo.splitlines():
        fields, _, tail = line.partition(" - ")
        parts, rest = fields.split(), tail.split()
        if len(parts) < 5 or len(rest) < 3:
            continue
        root, mountpoint, fstype, options = parts[3], parts[4], rest[0], rest[2].split(",")
        if fstype == "cgroup" and "memory" in options:
            mounts.setdefault("v1", (root, mountpoint))
        elif fstype == "cgroup2":
            mounts.setdefault("v2", (root, mountpoint))
    for key, version in (("v1", 1), ("v2", 2)):
        if key in own and key in mounts:
            root, mountpoint = mounts[key]
            path = own[key]
            if root != "/" and (path == root or path.startswith(root + "/")):
                path = path[len(root) :]
            return os.path.normpath(os.path.join(mountpoint, path.lstrip("/"))), version
    return None


def find_memory_cgroups() -> tuple[MemoryCgroups | None, str]:
    """Where to make sandbox cgroups on this host, checked by making one; or ``None`` and why not."""
    try:
        located = locate(Path("/proc/self/mountinfo").read_text(), Path("/proc/self/cgroup").read_text())
    except OSError as err:
        return None, f"cannot read this process's cgroups ({err})"
    if located is None:
        return None, "no cgroup hierarchy with the memory controller is mounted"
    base, version = located
    if version == 2:
        try:
            controllers = Path(base, "cgroup.subtree_control").read_text().split()
        except OSError as err:
            return None, f"cannot read {base}/cgroup.subtree_control ({err})"
        if "memory" not in controllers:
            return None, (
                f"the memory controller is not enabled for the children of {base} (cgroup v2: enable it in "
                "cgroup.subtree_control, e.g. run the worker in a delegated systemd scope)"
            )
    cgroups = MemoryCgroups(base, version)
    remove_orphans(base)
    try:
        remove(cgroups.create(64 * 1024 * 1024))
    except OSError as err:
        return None, f"cannot make a cgroup under {base} ({err.strerror or err})"
    return cgroups, ""

"""Which isolation layers actually work on this host, checked by starting a real sandbox with a probe program.

A layer counts only if it is seen working: namespaces by comparing the inode numbers bubblewrap reports for the
sandbox with the worker's own, the user by the sandbox's uid in the host's /proc, the rest from inside (the probe
runs before any untrusted code, so what it reports can be believed). The scorer refuses to start when a layer is
missing, unless the config lists that layer in ``allow_missing_layers``.
"""

from __future__ import annotations

import functools
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from workers.rewards.sandbox.isolation import SandboxSpec
from workers.rewards.sandbox.process import EXITED, Sandbox, SandboxUnavailable

#: Every layer, with what it stands for.
LAYERS: dict[str, str] = {
    "bubblewrap": "the program runs inside bubblewrap (the `bwrap` command, Debian package `bubblewrap`)",
    "unprivileged_user": "the program runs as a user other than root on the host",
    "pid_namespace": "a PID namespace: the program sees only its own processes and dies with its sandbox",
    "network_namespace": "a network namespace with nothing but its own loopback interface",
    "ipc_namespace": "an IPC namespace: no System V IPC or POSIX queues shared with the host",
    "mount_namespace": "a mount namespace: read-only system, private /tmp, nothing else of the host's files",
    "empty_environment": "the program's environment is empty",
    "memory_cgroup": (
        "a memory cgroup per sandbox: all its processes and files together stay under total_memory_mb"
        " (RLIMIT_AS bounds each process alone)"
    ),
    "seccomp": (
        "a system-call filter (libseccomp through the pyseccomp package): no kernel keyring, io_uring, ptrace, bpf,"
        " mounts or new namespaces, and no clearing of the signal that kills the sandbox with its worker"
    ),
}

_PROBE = """
import json, os, socket
report = {"interfaces": sorted(name for _, name in socket.if_nameindex()), "environ": sorted(os.environ)}
report["system_writable"] = []
for path in ("/usr/.roll-sandbox-probe", "/.roll-sandbox-probe", "/dev/.roll-sandbox-probe"):
    try:
        open(path, "w").close()
        report["system_writable"].append(path)
    except OSError:
        pass
try:
    with open(".roll-sandbox-probe", "w") as f:
        f.write("x")
    report["tmp_writable"] = True
except OSError:
    report["tmp_writable"] = False
report["canary_visible"] = os.path.exists(CANARY)
status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines() if ":" in line)
report["seccomp_mode"] = status.get("Seccomp", "").strip()
try:
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    # PR_SET_PDEATHSIG with the signal it already has: harmless if allowed, EPERM (1) under the filter.
    report["pdeathsig_refused"] = libc.prctl(1, 9, 0, 0, 0) == -1 and ctypes.get_errno() == 1
except Exception:
    report["pdeathsig_refused"] = False
print(json.dumps(report))
"""


@dataclass(frozen=True)
class LayerReport:
    """What the probe found."""

    #: Layer name -> whether it works.
    available: dict[str, bool]
    #: Why the probe sandbox failed, if it did.
    error: str = ""

    @property
    def missing(self) -> list[str]:
        return [name for name in LAYERS if not self.available.get(name, False)]


class IsolationUnavailable(RuntimeError):
    """The host lacks isolation layers that the config did not allow to be missing."""


def _process_in(pid: int, cgroup_dir: str) -> bool:
    """Whether the host's /proc places ``pid`` in the cgroup ``cgroup_dir``."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return False
    return any(cgroup_dir.endswith(line.split(":", 2)[2]) and line.split(":", 2)[2] != "/" for line in lines)


def _own_namespace(kind: str) -> int:
    return os.stat(f"/proc/self/ns/{kind}").st_ino


@functools.lru_cache(maxsize=8)
def probe_layers(spec: SandboxSpec) -> LayerReport:
    """Start one sandbox as ``spec`` describes, run the probe in it, and judge every layer (cached per process)."""
    available = dict.fromkeys(LAYERS, False)
    fd, canary = tempfile.mkstemp(prefix="roll-sandbox-canary-")
    os.close(fd)
    try:
        sandbox = Sandbox(spec)
        sandbox.wait_ready(30.0)
        uid = sandbox.host_uid()
        in_cgroup = sandbox.cgroup is not None and _process_in(
            sandbox.info.get("child-pid", sandbox.proc.pid), sandbox.cgroup
        )
        info = dict(sandbox.info)
        job = {
            "mode": "stdio",
            "code": _PROBE.replace("CANARY", repr(canary)),
            "limits": spec.limits.for_job(),
        }
        output = sandbox.run(job, b"", spec.limits.output_bytes, 30.0)
        ended = [e for e in output.events if e.get("ev") == "exit"]
        if output.status != EXITED or not ended or not ended[0].get("ok"):
            raise SandboxUnavailable(
                f"the probe program failed ({output.status}): {output.stderr.decode(errors='replace')[-2000:]}"
            )
        report = json.loads(output.stdout)
    except (OSError, SandboxUnavailable, ValueError) as err:
        return LayerReport(available, error=str(err))
    finally:
        os.unlink(canary)
    if spec.bwrap is not None:
        available["bubblewrap"] = True
        available["pid_namespace"] = info.get("pid-namespace", _own_namespace("pid")) != _own_namespace("pid")
        available["network_namespace"] = info.get("net-namespace", _own_namespace("net")) != _own_namespace(
            "net"
        ) and report["interfaces"] == ["lo"]
        available["ipc_namespace"] = info.get("ipc-namespace", _own_namespace("ipc")) != _own_namespace("ipc")
        available["mount_namespace"] = (
            info.get("mnt-namespace", _own_namespace("mnt")) != _own_namespace("mnt")
            and not report["system_writable"]
            and not report["canary_visible"]
            and report["tmp_writable"]
        )
        available["seccomp"] = report["seccomp_mode"] == "2" and report["pdeathsig_refused"]
    available["memory_cgroup"] = in_cgroup
    available["unprivileged_user"] = uid not in (None, 0)
    available["empty_environment"] = report["environ"] == []
    return LayerReport(available)


def require_layers(report: LayerReport, allow_missing: tuple[str, ...]) -> None:
    """Raise ``IsolationUnavailable`` naming every missing layer that ``allow_missing`` does not list."""
    refused = [name for name in report.missing if name not in allow_missing]
    if not refused:
        return
    lines = [f"  {name}: {LAYERS[name]}" for name in refused]
    reason = f"\nprobe error: {report.error}" if report.error else ""
    install = (
        "\nInstall bubblewrap on that node (Debian/Ubuntu: apt-get install bubblewrap; RHEL/Fedora: dnf install "
        "bubblewrap), or keep code_sandbox workers off it (rewards.<domain>.resources names a custom Ray resource "
        "that only nodes with bubblewrap offer)."
        if "bubblewrap" in refused
        else ""
    )
    raise IsolationUnavailable(
        "code_sandbox: refusing to run untrusted code with less isolation than configured; missing on "
        f"{this_host()}:\n"
        + "\n".join(lines)
        + reason
        + install
        + f"\nTo run without them anyway, set rewards.<domain>.options.allow_missing_layers: {refused}"
    )


def this_host() -> str:
    """`host <name>`, with its Ray node id and IP when this process is a Ray worker: which node an error is about."""
    import socket

    where = f"host {socket.gethostname()}"
    try:
        import ray

        if ray.is_initialized():
            context = ray.get_runtime_context()
            where += f" (Ray node {context.get_node_id()[:8]}, {ray.util.get_node_ip_address()})"
    except Exception:  # naming the node is a courtesy; the error it decorates is what matters
        pass
    return where

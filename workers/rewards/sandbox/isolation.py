"""How a local sandbox is started: limits, the sandbox user, the interpreter, and the bubblewrap command line.

Pure description; nothing here starts a process (``process.py`` does, ``layers.py`` checks what works).

With bubblewrap, the program runs in new user, PID, network, IPC, UTS and mount namespaces, under a system-call filter (``seccomp.py``). It sees ``/usr`` (and
the top-level links into it, such as ``/bin`` and ``/lib``) read-only, the interpreter's own installation read-only
when it lives elsewhere, its own ``/proc``, a minimal ``/dev`` and nothing else of the host: no ``/etc``,
``/home``, ``/root``, ``/var`` or project tree. Only two size-limited tmpfs mounts are writable: ``/tmp`` (its
working directory) and a small ``/dev/shm``; ``/`` and ``/dev`` are read-only. The environment is empty; only
the loopback interface exists; further user namespaces are disabled inside. The interpreter is PID 1 of its
namespace: when it exits, every other process of the run dies with it (and, as for any PID 1, signals it sends
itself without a handler are ignored). In a reused sandbox that PID 1 is the zygote (``zygote.py``), and each
run is a child of it; when the child exits, the zygote kills every other process of the namespace. When the worker runs as root,
bubblewrap itself is started as ``sandbox_user`` (``nobody`` by default), so the program never runs as root on the
host, not even mapped.

Without bubblewrap (only when the config allows the missing layers explicitly) the program runs as a plain child:
the same interpreter, user, empty environment and limits, in a private temporary directory, in its own session.
"""

from __future__ import annotations

import math
import os
import pwd
import shutil
import stat
import subprocess
import sys
from dataclasses import dataclass

from workers.rewards.sandbox.cgroup import MemoryCgroups

#: Size of the sandbox's /dev/shm (for multiprocessing's semaphores and the like).
SHM_BYTES = 8 * 1024 * 1024
#: Top-level entries that usually point into /usr (merged /usr) or hold libraries the interpreter needs.
_SYSTEM_LINKS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one program run; every process of the run inherits the rlimits."""

    #: Wall-clock seconds from the moment the job is handed over; then the whole process tree is killed.
    timeout_s: float = 5.0
    #: Address space of each process (RLIMIT_AS), in MiB.
    memory_mb: int = 512
    #: Processes and threads of the sandbox user inside the sandbox (RLIMIT_NPROC).
    processes: int = 16
    #: Largest file the program may write (RLIMIT_FSIZE), in MiB.
    file_mb: int = 16
    #: Open file descriptors per process (RLIMIT_NOFILE).
    open_files: int = 64
    #: Bytes of stdout, of stderr and of the result channel, each, that the worker reads; more ends the run.
    output_bytes: int = 1024 * 1024
    #: Size of the private /tmp (a tmpfs, so a program that fills it fills memory, not the disk), in MiB.
    tmp_mb: int = 64
    #: Memory of all the run's processes together, its /tmp and /dev/shm files included (a memory cgroup), in MiB.
    total_memory_mb: int = 1024

    def for_job(self) -> dict[str, int]:
        """The rlimits the harness applies to itself before it touches the program."""
        return {
            # CPU seconds: past the wall limit, so that the worker's clock normally ends the run first.
            "cpu_s": math.ceil(self.timeout_s) + 1,
            "memory_bytes": self.memory_mb * 1024 * 1024,
            "file_bytes": self.file_mb * 1024 * 1024,
            "open_files": self.open_files,
            "processes": self.processes,
        }


@dataclass(frozen=True)
class SandboxSpec:
    """Everything needed to start one local sandbox."""

    #: The interpreter that runs inside (absolute path, resolved).
    python: str
    #: Host uid/gid to start the sandbox as (``None``: the worker's own, which then must not be root).
    uid: int | None
    gid: int | None
    #: Path of the ``bwrap`` executable, or ``None`` to run without bubblewrap.
    bwrap: str | None
    limits: SandboxLimits = SandboxLimits()
    #: The system-call filter bubblewrap loads (``seccomp.py``), or ``None`` for none.
    seccomp: bytes | None = None
    #: Where each sandbox gets its memory cgroup (``cgroup.py``), or ``None`` for none.
    memory_cgroups: MemoryCgroups | None = None
    #: The harness compiled by ``python`` itself (``compile_harness``): loading it is cheaper than compiling the
    #: source at every start; ``None`` to pass the source.
    harness_bytecode: bytes | None = None

    def interpreter(
        self, harness_source: str, channel_fd: int, code_fd: int | None = None, entry: str = "serve"
    ) -> list[str]:
        """The interpreter's command line: the harness from ``code_fd`` (holding ``harness_bytecode``), or from
        its source; ``entry`` is ``serve`` (one job) or ``zygote`` (a job per forked child)."""
        if code_fd is None or self.harness_bytecode is None:
            return [self.python, "-I", "-S", "-B", "-c", harness_source, entry, str(channel_fd)]
        size = len(self.harness_bytecode)
        return [
            self.python,
            "-I",
            "-S",
            "-B",
            "-c",
            LOAD_HARNESS,
            entry,
            str(channel_fd),
            str(code_fd),
            str(size),
        ]

    def argv(
        self,
        harness_source: str,
        channel_fd: int,
        info_fd: int | None,
        seccomp_fd: int | None = None,
        code_fd: int | None = None,
        entry: str = "serve",
    ) -> list[str]:
        """The command line of a sandbox whose harness serves one job and reports on ``channel_fd`` (``entry``
        ``serve``), or forks a child per job (``zygote``: ``channel_fd`` is its control socket); bubblewrap
        reads the system-call filter from ``seccomp_fd``, the interpreter its compiled harness from ``code_fd``."""
        interpreter = self.interpreter(harness_source, channel_fd, code_fd, entry)
        if self.bwrap is None:
            return interpreter
        argv = [
            self.bwrap,
            "--unshare-user",
            "--unshare-pid",
            "--unshare-net",
            "--unshare-ipc",
            "--unshare-uts",
            "--unshare-cgroup-try",
            "--disable-userns",
            # The interpreter is the namespace's PID 1 and bubblewrap's own child, which bubblewrap reaps; with
            # bubblewrap's init in between, that init outlives bubblewrap by a moment and is left to the host's
            # init to reap.
            "--as-pid-1",
            "--die-with-parent",
            "--new-session",
            "--clearenv",
            "--hostname",
            "sandbox",
            "--ro-bind",
            "/usr",
            "/usr",
        ]
        for name in _SYSTEM_LINKS:
            path = f"/{name}"
            if os.path.islink(path):
                argv += ["--symlink", os.readlink(path), path]
            elif os.path.isdir(path):
                argv += ["--ro-bind", path, path]
        prefix = python_prefix(self.python)
        if prefix is not None:
            argv += ["--ro-bind", prefix, prefix]
        if self.effective_uid() == 0:
            argv += ["--cap-drop", "ALL"]
        argv += ["--proc", "/proc", "--dev", "/dev"]
        argv += ["--size", str(SHM_BYTES), "--tmpfs", "/dev/shm"]
        argv += ["--size", str(self.limits.tmp_mb * 1024 * 1024), "--tmpfs", "/tmp"]
        # bubblewrap builds / and /dev on unlimited tmpfs mounts: left writable, they would let a program fill the
        # host's memory; only /tmp and /dev/shm (both size-limited) stay writable.
        argv += ["--remount-ro", "/dev", "--remount-ro", "/", "--chdir", "/tmp"]
        if info_fd is not None:
            argv += ["--info-fd", str(info_fd)]
        if seccomp_fd is not None:
            argv += ["--seccomp", str(seccomp_fd)]
        return [*argv, *interpreter]

    def effective_uid(self) -> int:
        """The host uid the sandbox runs as."""
        return os.getuid() if self.uid is None else self.uid


def find_bwrap() -> str | None:
    """The ``bwrap`` executable on PATH, if any."""
    return shutil.which("bwrap")


def python_prefix(python: str) -> str | None:
    """The installation directory to mount for ``python`` when it lives outside /usr (``None`` if inside)."""
    if python.startswith("/usr/"):
        return None
    # <prefix>/bin/python3.x: the standard library is under <prefix>/lib.
    return os.path.dirname(os.path.dirname(python))


def sandbox_identity(sandbox_user: str) -> tuple[int | None, int | None, str | None]:
    """``(uid, gid, problem)``: whom to start the sandbox as; ``problem`` says why that is not an unprivileged user."""
    if os.getuid() != 0:
        return None, None, None
    try:
        entry = pwd.getpwnam(sandbox_user)
    except KeyError:
        return None, None, f"the worker runs as root and the sandbox user {sandbox_user!r} does not exist"
    if entry.pw_uid == 0:
        return None, None, f"the sandbox user {sandbox_user!r} is root"
    return entry.pw_uid, entry.pw_gid, None


def reachable_by_others(path: str) -> bool:
    """Whether every directory on the way to ``path`` and the file itself can be used by any user."""
    current = "/"
    for part in path.strip("/").split("/"):
        current = os.path.join(current, part)
        try:
            mode = os.stat(current).st_mode
        except OSError:
            return False
        if not mode & stat.S_IXOTH:
            return False
    return True


#: The ``-c`` program that loads the compiled harness (``argv[3]``: the descriptor, ``argv[4]``: its size) and runs
#: it as ``__main__``.
LOAD_HARNESS = (
    "import marshal, os, sys\n"
    "fd, size = int(sys.argv[3]), int(sys.argv[4])\n"
    "code = marshal.loads(os.pread(fd, size, 0))\n"
    "os.close(fd)\n"
    "del fd, size\n"
    "exec(code)\n"
)
_COMPILE = "import marshal, sys; sys.stdout.buffer.write(marshal.dumps(compile(sys.stdin.read(), 'harness.py', 'exec')))"


def compile_harness(python: str, harness_source: str) -> bytes | None:
    """The harness compiled by ``python`` (bytecode is specific to its version), or ``None`` if that failed."""
    try:
        done = subprocess.run(
            [python, "-I", "-S", "-B", "-c", _COMPILE],
            input=harness_source.encode(),
            capture_output=True,
            timeout=60,
            env={},
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 and done.stdout else None


def choose_python(configured: str | None, needs_world_access: bool) -> str:
    """The interpreter to run inside: the configured one, else this worker's base interpreter when the sandbox user
    can reach it, else the system ``python3``."""
    if configured:
        return os.path.realpath(configured)
    own = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
    if not needs_world_access or reachable_by_others(own):
        return own
    system = shutil.which("python3", path="/usr/bin:/bin")
    return os.path.realpath(system) if system else own

"""The sandbox's system-call filter: what a program may not ask the kernel for, compiled once per scorer.

bubblewrap loads the filter (``--seccomp FD``, a compiled BPF program) just before it starts the interpreter, and
nothing inside can remove it. libseccomp writes the BPF program (through ``pyseccomp``, its ctypes binding), so the
syscall numbers are those of this machine's architecture. Denied calls fail with ``EPERM`` (``ENOSYS`` for
``clone3``, so that the C library falls back to ``clone``, whose namespace flags are filtered instead):

* kernel interfaces a test program never needs and that widen the attack surface: ``io_uring``, ``userfaultfd``,
  ``perf_event_open``, ``bpf``, module and kexec loading, ``reboot``, swap, ``syslog``, ``acct``, quotas, file
  handles;
* the kernel keyring (``keyctl``, ``add_key``, ``request_key``): keyrings are not namespaced, so a program could
  read keys of the host's session or leave keys for a later run;
* looking into or controlling other processes: ``ptrace``, ``process_vm_readv`` / ``writev``, ``kcmp``,
  ``pidfd_getfd``;
* new namespaces and mounts: ``unshare``, ``setns``, ``mount`` and the new mount API, ``pivot_root``, ``chroot``,
  and ``clone`` with a namespace flag;
* System V IPC objects and POSIX message queues (``shmget``, ``semget``, ``msgget``, ``mq_open``): they would
  outlive the run in its IPC namespace, which a reused sandbox keeps (``zygote.py``); Python's own shared memory
  and semaphores are files in ``/dev/shm`` instead;
* ``prctl(PR_SET_PDEATHSIG)``: the interpreter is the sandbox's PID 1 and dies with bubblewrap because of that
  signal; a program that could clear it would outlive a killed worker.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import tempfile

DENIED = (
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "userfaultfd",
    "perf_event_open",
    "bpf",
    "init_module",
    "finit_module",
    "delete_module",
    "kexec_load",
    "kexec_file_load",
    "reboot",
    "swapon",
    "swapoff",
    "syslog",
    "acct",
    "quotactl",
    "open_by_handle_at",
    "name_to_handle_at",
    "keyctl",
    "add_key",
    "request_key",
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "kcmp",
    "pidfd_getfd",
    "unshare",
    "setns",
    "mount",
    "umount2",
    "pivot_root",
    "chroot",
    "open_tree",
    "move_mount",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "mount_setattr",
    "shmget",
    "semget",
    "msgget",
    "mq_open",
)
PR_SET_PDEATHSIG = 1
#: CLONE_NEWNS | CLONE_NEWCGROUP | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWNET
CLONE_NAMESPACES = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000


@functools.lru_cache(maxsize=1)
def compiled_filter() -> tuple[bytes | None, str]:
    """``(bpf, problem)``: the filter as a BPF program for ``bwrap --seccomp``, or ``None`` and why not."""
    try:
        import pyseccomp as seccomp
    except (ImportError, OSError, AttributeError) as err:
        return None, f"the pyseccomp package or the libseccomp library is missing ({err})"
    try:
        rules = seccomp.SyscallFilter(seccomp.ALLOW)
        deny = seccomp.ERRNO(errno.EPERM)
        for name in DENIED:
            # A system call this architecture or libseccomp does not know: nothing to deny.
            with contextlib.suppress(ValueError, OSError, RuntimeError):
                rules.add_rule(deny, name)
        rules.add_rule(deny, "prctl", seccomp.Arg(0, seccomp.EQ, PR_SET_PDEATHSIG))
        # One rule per flag: any of them set in clone's first argument refuses the call.
        for bit in range(31):
            flag = 1 << bit
            if CLONE_NAMESPACES & flag:
                rules.add_rule(deny, "clone", seccomp.Arg(0, seccomp.MASKED_EQ, flag, flag))
        rules.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")
        with tempfile.TemporaryFile() as out:
            rules.export_bpf(out)
            out.seek(0)
            return out.read(), ""
    except (OSError, ValueError, RuntimeError, AttributeError) as err:
        return None, f"libseccomp could not build the filter ({err})"

"""Taking a file descriptor from another process of this host: `pidfd_open` + `pidfd_getfd`.

An exported POSIX-FD CUDA handle is a file descriptor in the exporter; an importer on the same
host duplicates it with `pidfd_getfd(pidfd_open(pid), fd)` (Linux >= 5.6). The kernel allows
that when the importer may ptrace the exporter: same user (and, under Yama `ptrace_scope` 1,
the exporter must name a ptracer: `allow_fd_takers`), or CAP_SYS_PTRACE.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform

from engram_ray.tables.backends.base import PeerMemoryError

SYS_PIDFD_GETFD = {"x86_64": 438, "aarch64": 438}
PR_SET_PTRACER = 0x59616D61
PR_SET_PTRACER_ANY = ctypes.c_ulong(-1).value
YAMA_SCOPE = "/proc/sys/kernel/yama/ptrace_scope"

_libc = ctypes.CDLL(None, use_errno=True)


def ptrace_scope() -> int | None:
    """Yama ptrace scope (0 classic, 1 restricted to descendants, 2 admin, 3 none), or None."""
    try:
        with open(YAMA_SCOPE) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def allow_fd_takers() -> None:
    """Under Yama scope 1, let other processes of this user take our fds (PR_SET_PTRACER)."""
    if ptrace_scope() == 1:
        _libc.prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0)


def pidfd_getfd(pid: int, target_fd: int) -> int:
    """A duplicate, in this process, of file descriptor `target_fd` of process `pid`."""
    number = SYS_PIDFD_GETFD.get(platform.machine())
    if number is None:
        raise PeerMemoryError(f"pidfd_getfd: no syscall number known for {platform.machine()}")
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        raise PeerMemoryError(f"process {pid} (a peer that exported a slice) is gone") from None
    try:
        fd = _libc.syscall(number, pidfd, target_fd, 0)
        if fd < 0:
            err = ctypes.get_errno()
            raise PeerMemoryError(_explain(err, pid, target_fd))
        return fd
    finally:
        os.close(pidfd)


def _explain(err: int, pid: int, target_fd: int) -> str:
    text = f"pidfd_getfd(pid {pid}, fd {target_fd}) failed: {os.strerror(err)}"
    if err == errno.EPERM:
        return (f"{text}: taking a peer's exported handle needs the same user in every member "
                f"or CAP_SYS_PTRACE (Yama ptrace_scope is {ptrace_scope()}; 1 is handled by the "
                "exporter, 2 and 3 need CAP_SYS_PTRACE)")
    if err == errno.ENOSYS:
        return f"{text}: the kernel is older than 5.6; use FABRIC handles or a newer kernel"
    return text

"""The C library's calls that :mod:`os` lacks, from one place (Linux).

:func:`libc` is the process's C library (``dlopen(NULL)``), loaded once per process and
shared by every caller (a fork inherits it), with ``errno`` kept per call
(``ctypes.get_errno()``). The ``prctl`` options Stadium uses are named here, and the two
set by more than one process kind have a function each: :func:`die_with_parent` (a
supervisor's worker, a template and a family's init, a launched server) and
:func:`become_subreaper` (a template, a workspace's supervisor). Mounts, namespaces and
seccomp stay with their callers (``isolation/``), which call through :func:`libc`.
"""

from __future__ import annotations

import ctypes
import functools

#: ``prctl`` options (``<linux/prctl.h>``).
PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_SET_SECCOMP = 22
PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38


@functools.cache
def libc() -> ctypes.CDLL:
    """The process's C library, loaded once (``errno`` kept: ``ctypes.get_errno()``)."""
    return ctypes.CDLL(None, use_errno=True)


def die_with_parent(signum: int) -> None:
    """Ask the kernel to send ``signum`` to this process when the thread that forked it
    ends (``PR_SET_PDEATHSIG``; kept across ``exec``, cleared by a ``fork``)."""
    if libc().prctl(PR_SET_PDEATHSIG, signum, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")


def become_subreaper() -> None:
    """Make this process its descendants' reaper: an orphan below it is re-parented to it,
    not to init (``PR_SET_CHILD_SUBREAPER``)."""
    if libc().prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


__all__ = [
    "PR_SET_CHILD_SUBREAPER",
    "PR_SET_DUMPABLE",
    "PR_SET_NO_NEW_PRIVS",
    "PR_SET_PDEATHSIG",
    "PR_SET_SECCOMP",
    "become_subreaper",
    "die_with_parent",
    "libc",
]

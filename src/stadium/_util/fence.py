"""A full memory barrier callable from Python, for counters in shared memory that
several processes write without a lock (``admission.SharedSlots``,
``client_counts.SharedClientCounts``)."""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

from stadium._util.libc import libc

_MEMORY_ORDER_SEQ_CST = 5  # C11 memory_order_seq_cst


@functools.cache
def full_fence() -> Callable[[], object]:
    """A full memory barrier, callable from Python.

    Without it, a CPU may let this process's read of another counter pass its own
    earlier increment (x86's store buffer does), and two workers could each miss
    the other's increment. libatomic's ``atomic_thread_fence(seq_cst)`` is the
    barrier; where libatomic is missing, any foreign call serves: ctypes releases
    and re-takes the GIL around it, a mutex unlock then lock, which orders a
    store before a later load on x86-64 and arm64.
    """
    try:
        fence = ctypes.CDLL("libatomic.so.1").atomic_thread_fence
    except (OSError, AttributeError):
        getpid: Callable[[], object] = libc().getpid
        return getpid
    fence.argtypes = [ctypes.c_int]
    fence.restype = None
    return functools.partial(fence, _MEMORY_ORDER_SEQ_CST)

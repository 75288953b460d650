"""Process set-up shared by server workers and load-generator workers: open-file limit, loop,
resident memory, and the exit code of a worker that asks to be replaced."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import resource
import sys
import threading

log = logging.getLogger("stadium.process")

RECYCLE_EXIT_CODE = 75
"""A worker's exit code for "replace me" (EX_TEMPFAIL): its event loop stalled past
``--stall-limit``, it grew past ``--max-worker-memory`` or too many of its threads
are stuck. The supervisor restarts it at once without counting a crash; a single
worker (no supervisor) exits with it so that a process manager restarts it."""

_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> int:
    """This process's resident memory in bytes (``/proc/self/statm``; 0 where unreadable)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE_SIZE
    except (OSError, ValueError, IndexError):
        return 0


def raise_nofile_limit() -> int:
    """Raise this process's soft limit on open files to its hard limit; the new soft limit.

    Every session is a socket, so the soft limit (often 1024) caps the sessions a
    process can hold. Forked children inherit the raised limit.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard
    if hard == resource.RLIM_INFINITY:  # the kernel caps it at fs.nr_open
        try:
            with open("/proc/sys/fs/nr_open") as f:
                target = int(f.read())
        except (OSError, ValueError):
            target = 1 << 20
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (OSError, ValueError) as exc:
            log.debug("cannot raise the open-file limit from %d to %d: %s", soft, target, exc)
    return soft


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A uvloop event loop (asyncio's own where uvloop is not installed)."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        return asyncio.new_event_loop()
    loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    return loop


def flush_logs(limit_s: float = 1.0) -> None:
    """Flush and close the logging handlers, and stdout/stderr, before ``os._exit`` (which
    skips that). Bounded: done on a helper thread given ``limit_s``, in case a handler's
    lock is held by a thread that will never let it go."""

    def flush() -> None:
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()

    thread = threading.Thread(target=flush, name="stadium-flush-logs", daemon=True)
    thread.start()
    thread.join(limit_s)

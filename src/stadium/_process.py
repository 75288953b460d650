"""Process set-up shared by server workers and load-generator workers: open-file limit, loop."""

from __future__ import annotations

import asyncio
import logging
import resource

log = logging.getLogger("stadium.process")


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

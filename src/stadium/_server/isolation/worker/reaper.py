"""Teardown of isolated sessions off the event loop, in batches.

When many sessions end at once (a trainer closing 1,000 sandboxed sessions after a
rollout), each one's teardown is work the kernel does slowly: closing the socket of
its env process wakes that process (in the sandbox's cgroup, weighted above the
worker, so the close often waits for it to run), and removing its cgroups waits for
the kernel to let go of them. Done on the event loop, one by one, that held the
worker's loop for over a second; done as one executor job per session, it queued a
thousand jobs behind the worker's other uses of the pool.

A :class:`Reaper` takes both off the loop: the loop hands it file descriptors to
close and cgroups to remove (a list append under a lock), and one thread at a time
drains them, in order, while the loop goes on. A cgroup still holding a process (it
has not exited yet) has that process killed and is tried again a little later; one
that cannot be removed after :data:`REMOVE_TRIES` rounds is logged and given up.

Making a cgroup is slow too (v1: three ``mkdir`` and five writes, 1-3 ms, serialized
by the kernel's cgroup lock), and in a burst of new sessions it was on each one's path.
So an ended session's cgroups are not removed but *recycled*: once empty (anything
left in them killed) they are kept as spares (at most :data:`MAX_SPARES`), and a new
session takes a spare before it makes one. The limits are the worker's, the same for
every session; the counters a session's errors are told from (memory kills, refused
forks) are read when it takes them, as its baseline. ``--warm-pool`` sessions aside,
:meth:`Reaper.make_spares` makes a few ahead at the worker's start.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import re
import threading
import time
from collections.abc import Callable

from stadium._server.isolation.sandbox import Cgroups

log = logging.getLogger("stadium.isolation")

#: Rounds a cgroup's removal is tried (``RETRY_S`` apart) before it is given up.
REMOVE_TRIES = 100
RETRY_S = 0.05
#: Empty session cgroups kept for new sessions (above: removed).
MAX_SPARES = 256
#: Numbers the spare cgroups of every reaper of the process (names never shared).
_SPARE_NUMBERS = itertools.count(1)
_SESSION_CGROUP = re.compile(r"w(\d+)-[a-z0-9]+")


class Reaper:
    """Closes env processes' sockets and removes their cgroups on one thread at a time.

    Args:
        cgroups: the worker's sandbox cgroups (``None``: ``process`` isolation, sockets only).
        submit: runs a callable off the loop (``loop.run_in_executor(None, fn)`` by
            default; tests pass their own).
    """

    def __init__(
        self, cgroups: Cgroups | None, submit: Callable[[Callable[[], None]], object] | None = None
    ) -> None:
        self.cgroups = cgroups
        self._submit = submit
        self._lock = threading.Lock()
        self._fds: list[int] = []
        self._removals: list[tuple[list[str], int]] = []
        self._spares: list[list[str]] = []
        self._to_make = 0
        self._running = False
        self._flushed = False
        """After :meth:`flush` (the worker's shutdown): cgroups handed over later (a spawn
        the dying template never answered) are removed, never kept as spares."""
        self.closed = 0
        """Sockets closed so far."""
        self.removed = 0
        """Cgroup sets removed so far."""

    def pending(self) -> int:
        """Sockets and cgroup sets not torn down yet."""
        with self._lock:
            return len(self._fds) + len(self._removals)

    def close_fd(self, fd: int) -> None:
        """Close ``fd`` (an env process's socket, detached from its socket object) soon."""
        with self._lock:
            self._fds.append(fd)
            start = not self._running
            self._running = True
        if start:
            self._start()

    def remove(self, paths: list[str]) -> None:
        """Recycle (or remove) a session's cgroups soon, killing what is left in them."""
        with self._lock:
            self._removals.append((paths, 0))
            start = not self._running
            self._running = True
        if start:
            self._start()

    def make_spares(self, count: int) -> None:
        """Make ``count`` cgroups ahead (off the loop), for the first sessions to take."""
        if self.cgroups is None or count <= 0:
            return
        with self._lock:
            if self._flushed:
                return
            self._to_make += count
            start = not self._running
            self._running = True
        if start:
            self._start()

    def take(self, name: str) -> list[str]:
        """Cgroups for a new session: a spare, else made now (named ``name``). Call off the
        loop (the executor)."""
        assert self.cgroups is not None
        with self._lock:
            if self._spares:
                return self._spares.pop()
        return self.cgroups.create(name)

    def spares(self) -> int:
        """Empty cgroups kept for new sessions."""
        with self._lock:
            return len(self._spares)

    def _start(self) -> None:
        if self._submit is not None:
            self._submit(self._drain)
            return
        try:
            asyncio.get_running_loop().run_in_executor(None, self._drain)
        except RuntimeError:  # no loop (shutting down): here and now
            self._drain()

    def _drain(self) -> None:
        while True:
            with self._lock:
                fds, self._fds = self._fds, []
                removals, self._removals = self._removals, []
                make, self._to_make = self._to_make, 0
                if not fds and not removals and not make:
                    self._running = False
                    return
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
                self.closed += 1
            self._make(make)
            left = self._recycle_all(removals)
            if left:
                time.sleep(RETRY_S)  # their processes are still exiting
                with self._lock:
                    self._removals[:0] = left

    def _make(self, count: int) -> None:
        cgroups = self.cgroups
        if cgroups is None or not count:
            return
        self._sweep(cgroups)
        for _ in range(count):
            try:
                paths = cgroups.create(f"spare{next(_SPARE_NUMBERS)}")
            except OSError as exc:
                log.warning("could not make a spare cgroup: %s", exc)
                return
            with self._lock:
                self._spares.append(paths)

    @staticmethod
    def _sweep(cgroups: Cgroups) -> None:
        """Remove the cgroups left by workers that are gone (killed: nothing removed them)."""
        names: set[str] = set()
        for parent in cgroups.parents:
            with contextlib.suppress(OSError):
                names.update(os.listdir(parent))
        for name in names:
            match = _SESSION_CGROUP.fullmatch(name)
            if match is None or os.path.exists(f"/proc/{match.group(1)}"):
                continue  # not a session's, or its worker lives
            paths = [os.path.join(parent, name) for parent in cgroups.parents]
            cgroups.kill(paths)
            cgroups.remove(paths)

    def _recycle_all(self, removals: list[tuple[list[str], int]]) -> list[tuple[list[str], int]]:
        """Keep the empty ones as spares (up to :data:`MAX_SPARES`), remove the others."""
        cgroups = self.cgroups
        if cgroups is None:
            return []
        rest: list[tuple[list[str], int]] = []
        for paths, tries in removals:
            with self._lock:
                room = len(self._spares) < MAX_SPARES and not self._flushed
            # Empty when first seen: nothing was left in it (one that held a process, killed
            # and being retried, is removed, not kept).
            if not tries and room and not cgroups.kill(paths):
                cgroups.reclaim(paths)  # its page cache: not charged to the next session
                with self._lock:
                    self._spares.append(paths)
                continue
            rest.append((paths, tries))
        return self._remove_all(rest)

    def _remove_all(self, removals: list[tuple[list[str], int]]) -> list[tuple[list[str], int]]:
        cgroups = self.cgroups
        left: list[tuple[list[str], int]] = []
        if cgroups is None:
            return left
        for paths, tries in removals:
            if cgroups.remove(paths):
                self.removed += 1
                continue
            cgroups.kill(paths)  # a process is left in it: killed, tried again
            if tries + 1 >= REMOVE_TRIES:
                log.warning("could not remove the cgroups %s (a process is left in them)", paths)
                continue
            left.append((paths, tries + 1))
        return left

    def flush(self, timeout: float, also: list[list[str]] | None = None) -> None:
        """Tear down everything pending, the spares and the cgroups ``also`` now, on this
        thread (the worker's shutdown), for at most ``timeout`` seconds; what a draining
        thread still adds meanwhile (a spare it was making) is taken down too."""
        deadline = time.monotonic() + timeout
        removals = [(paths, 0) for paths in also or []]
        while True:
            with self._lock:
                self._flushed = True
                fds, self._fds = self._fds, []
                removals += self._removals
                removals += [(paths, 0) for paths in self._spares]
                self._removals, self._spares = [], []
                self._to_make = 0
                running = self._running
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
            if removals:
                removals = self._remove_all(removals)
            if (not removals and not running) or time.monotonic() >= deadline:
                return
            time.sleep(0.01)


__all__ = ["Reaper"]

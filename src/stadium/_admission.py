"""Session admission: a server-wide limit on concurrent sessions, across worker processes.

:class:`LocalSlots` counts in-process (one worker). :class:`SharedSlots` keeps one
counter per worker in shared memory behind a process-shared lock, so exactly
``limit`` sessions are admitted whatever the number of workers, and the
supervisor can zero a crashed worker's counter. :class:`Admission` adds the
asyncio side: a FIFO of waiting connections, a hand-off of freed slots to local
waiters, and a poll for slots freed by other workers, with a deadline per waiter.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import multiprocessing
import multiprocessing.sharedctypes
from collections.abc import Callable
from typing import Any, Protocol

#: How often waiters look for slots freed by other workers.
POLL_INTERVAL_S = 0.005


class Slots(Protocol):
    """A counter of busy session slots with a fixed limit."""

    limit: int

    def try_acquire(self) -> bool: ...

    def release(self) -> None: ...

    def active(self) -> int: ...


class LocalSlots:
    """Slots counted in this process only (a single worker)."""

    __slots__ = ("_count", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._count = 0

    def try_acquire(self) -> bool:
        if self._count < self.limit:
            self._count += 1
            return True
        return False

    def release(self) -> None:
        self._count -= 1

    def active(self) -> int:
        return self._count


class SharedSlots:
    """Slots shared by forked workers: per-worker counters in shared memory plus a lock.

    Create it in the supervisor before forking; each worker calls :meth:`bind`.
    """

    def __init__(self, limit: int, workers: int) -> None:
        ctx = multiprocessing.get_context("fork")
        self.limit = limit
        self._lock = ctx.Lock()
        self._counts: Any = multiprocessing.sharedctypes.RawArray("q", workers)
        self._index = 0

    def bind(self, index: int) -> None:
        """Make this process count as worker ``index``."""
        self._index = index

    def try_acquire(self) -> bool:
        with self._lock:
            if sum(self._counts) < self.limit:
                self._counts[self._index] += 1
                return True
        return False

    def release(self) -> None:
        with self._lock:
            self._counts[self._index] -= 1

    def active(self) -> int:
        return int(sum(self._counts))

    def forget_worker(self, index: int) -> None:
        """Free the slots of a worker that died (called by the supervisor)."""
        with self._lock:
            self._counts[index] = 0


Waiter = Callable[[bool], None]


class Verdict(enum.Enum):
    """What :meth:`Admission.admit` decided."""

    ADMITTED = "admitted"
    QUEUED = "queued"
    """The waiter will be called with the outcome."""
    REFUSED = "refused"


class Admission:
    """Admit sessions now or queue them until a slot frees or their deadline passes."""

    __slots__ = ("_loop", "_poller", "_queue", "slots", "timeout")

    def __init__(self, slots: Slots, timeout: float) -> None:
        self.slots = slots
        self.timeout = timeout
        self._queue: collections.deque[tuple[Waiter, float]] = collections.deque()
        self._poller: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def waiting(self) -> int:
        """Sessions of this worker queued for a slot (``GET /metadata``'s ``waiting_sessions``)."""
        return len(self._queue)

    def admit(self, waiter: Waiter) -> Verdict:
        """Take a slot now, refuse now (no admission timeout), or queue ``waiter``."""
        if not self._queue and self.slots.try_acquire():
            return Verdict.ADMITTED
        if self.timeout <= 0:
            return Verdict.REFUSED
        loop = self._loop or asyncio.get_running_loop()
        self._loop = loop
        self._queue.append((waiter, loop.time() + self.timeout))
        if self._poller is None:
            self._poller = loop.call_later(POLL_INTERVAL_S, self._poll)
        return Verdict.QUEUED

    def cancel(self, waiter: Waiter) -> None:
        """Forget a queued waiter (its connection went away)."""
        for i, (w, _) in enumerate(self._queue):
            if w is waiter:
                del self._queue[i]
                return

    def release(self) -> None:
        """Give a slot back; hand it straight to the first local waiter if there is one."""
        if self._queue:
            waiter, _ = self._queue.popleft()
            waiter(True)
        else:
            self.slots.release()

    def refuse_all(self) -> None:
        """Refuse every queued waiter (the server is draining)."""
        while self._queue:
            waiter, _ = self._queue.popleft()
            waiter(False)

    def _poll(self) -> None:
        self._poller = None
        assert self._loop is not None
        now = self._loop.time()
        queue = self._queue
        while queue and self.slots.try_acquire():
            waiter, _ = queue.popleft()
            waiter(True)
        while queue and queue[0][1] <= now:
            waiter, _ = queue.popleft()
            waiter(False)
        if queue:
            self._poller = self._loop.call_later(POLL_INTERVAL_S, self._poll)

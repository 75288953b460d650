"""Session admission: a server-wide limit on concurrent sessions, across worker processes.

:class:`LocalSlots` counts in-process (one worker). :class:`SharedSlots` keeps one
counter per worker process in shared memory, written only by that process, and
takes no lock: never more than ``limit`` sessions are admitted whatever the
number of workers, no process (alive, stopped or killed at any instruction) can
make another wait, and the supervisor zeroes a dead worker's counter.
:class:`Admission` adds the asyncio side: a FIFO of waiting connections, a
hand-off of freed slots to local waiters, and a poll for slots freed by other
workers, with a deadline per waiter. WebSocket sessions (:meth:`Admission.admit`)
and the HTTP requests that build an environment (:meth:`Admission.acquire`) share
the one limit and the one queue.
"""

from __future__ import annotations

import asyncio
import collections
import ctypes
import enum
import functools
import multiprocessing.sharedctypes
from collections.abc import Callable
from typing import Protocol

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
    """Slots shared by forked workers: one counter per process in shared memory, no lock.

    Create it in the supervisor before forking, with one counter per worker
    process that may be alive at once; each worker calls :meth:`bind` with a
    counter no other live process uses. A counter is written only by its own
    process (and, once that process is dead and reaped, zeroed by the supervisor
    with :meth:`forget_worker`), so there is no lock for a dead or stopped
    process to hold.

    :meth:`try_acquire` is optimistic: it increments its own counter, then
    (after a full memory fence) reads the sum of all counters; over the limit,
    it takes its increment back and refuses. This never admits more than
    ``limit``: of any set of holders, the last to increment saw every other
    holder's increment in its sum. It may *under*-admit transiently: processes
    racing for the last free slot can each see the others' tentative increments
    and all refuse; a queued session then gets the slot on its next poll
    (:data:`POLL_INTERVAL_S`), an unqueued one (admission timeout 0) is refused.
    """

    def __init__(self, limit: int, counters: int) -> None:
        self.limit = limit
        shared = multiprocessing.sharedctypes.RawArray("q", counters)
        # A memoryview reads and writes the same shared memory, ~7x faster to sum than ctypes.
        self._counts = memoryview(shared).cast("B").cast("q")
        self._index = 0
        self._fence = _full_fence()

    @property
    def counters(self) -> int:
        """How many worker processes can hold slots at once (one counter each)."""
        return len(self._counts)

    def bind(self, index: int) -> None:
        """Make this process count on counter ``index`` (no other live process may use it)."""
        self._index = index

    def try_acquire(self) -> bool:
        counts = self._counts
        index = self._index
        counts[index] += 1  # only this process writes this counter
        self._fence()  # the increment is visible before the counters are read
        if sum(counts) <= self.limit:
            return True
        counts[index] -= 1
        return False

    def release(self) -> None:
        self._counts[self._index] -= 1

    def active(self) -> int:
        # A refused try_acquire's tentative increment can make the sum pass the limit briefly.
        return min(int(sum(self._counts)), self.limit)

    def forget_worker(self, index: int) -> None:
        """Free the slots of the dead, reaped worker that used counter ``index`` (supervisor)."""
        self._counts[index] = 0


_MEMORY_ORDER_SEQ_CST = 5  # C11 memory_order_seq_cst


@functools.cache
def _full_fence() -> Callable[[], object]:
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
        getpid: Callable[[], object] = ctypes.CDLL(None).getpid
        return getpid
    fence.argtypes = [ctypes.c_int]
    fence.restype = None
    return functools.partial(fence, _MEMORY_ORDER_SEQ_CST)


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

    async def acquire(self) -> bool:
        """Take a slot for one request/response caller (an HTTP request), as :meth:`admit`
        does for a session: at once, after waiting in the same queue (up to ``timeout``),
        or not at all (``False``). The caller :meth:`release` s a slot it got. Cancelling
        the caller gives up its place in the queue, or the slot it was just handed.
        """
        granted: asyncio.Future[bool] = asyncio.get_running_loop().create_future()

        def waiter(ok: bool) -> None:
            if granted.done():  # the caller was cancelled first
                if ok:
                    self.release()
                return
            granted.set_result(ok)

        verdict = self.admit(waiter)
        if verdict is not Verdict.QUEUED:
            return verdict is Verdict.ADMITTED
        try:
            return await granted
        except asyncio.CancelledError:
            if granted.done() and not granted.cancelled() and granted.result():
                self.release()
            else:
                self.cancel(waiter)
            raise

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

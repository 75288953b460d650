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

The queue is bounded per connection (a batch connection can ask for thousands of
sessions in one frame) and per client address: past either bound a session is
refused at once (``CAPACITY_REACHED``, saying which bound) instead of queued. A
queued waiter is forgotten in O(1) (the queue is an ordered hash of waiters), so a
connection that closes with ``k`` waiting sessions costs ``O(k)``, whatever the
length of the queue.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import multiprocessing.sharedctypes
from collections.abc import Callable
from typing import Protocol

from stadium._core.access import Tenant
from stadium._errors import CapacityError
from stadium._server.admission.client_counts import (
    SharedClientCounts,
    SharedClientRates,
    buckets_for,
    rate_buckets_for,
)
from stadium._server.admission.tenants import SharedTenants
from stadium._util.fence import full_fence

#: How often waiters look for slots freed by other workers.
POLL_INTERVAL_S = 0.005
#: Sessions one connection may have waiting for a slot (a full batch frame's worth).
MAX_WAITING_PER_CONNECTION = 4096
#: Sessions one client address may have waiting for a slot, over all its connections.
MAX_WAITING_PER_CLIENT = 16384


class Slots(Protocol):
    """A counter of busy session slots with a fixed limit."""

    limit: int
    clients: SharedClientCounts | None
    """The per-client quota over every worker (``None``: one worker, or no quota)."""
    rates: SharedClientRates | None
    """The per-client rate over every worker (``None``: one worker, or no rate limit)."""

    def try_acquire(self) -> bool: ...

    def release(self) -> None: ...

    def active(self) -> int: ...


class LocalSlots:
    """Slots counted in this process only (a single worker)."""

    __slots__ = ("_count", "clients", "limit", "rates")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._count = 0
        self.clients: SharedClientCounts | None = None
        self.rates: SharedClientRates | None = None

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

    def __init__(
        self, limit: int, counters: int, *, per_client: int = 0, rate: float = 0.0,
        burst: int = 1, tenants: SharedTenants | None = None,
    ) -> None:  # fmt: skip
        self.limit = limit
        self.clients = (
            SharedClientCounts(per_client, counters, buckets=buckets_for(limit))
            if per_client > 0
            else None
        )
        """``--max-sessions-per-client`` over every worker (``client_counts``)."""
        self.rates = (
            SharedClientRates(rate, burst, counters, buckets=rate_buckets_for(limit))
            if rate > 0
            else None
        )
        """``--rate-limit`` over every worker (``client_counts``)."""
        self.tenants = tenants
        """``--tenants``' counters over every worker (``tenants``), or ``None``."""
        shared = multiprocessing.sharedctypes.RawArray("q", counters)
        # A memoryview reads and writes the same shared memory, ~7x faster to sum than ctypes.
        self._counts = memoryview(shared).cast("B").cast("q")
        self._index = 0
        self._fence = full_fence()

    @property
    def counters(self) -> int:
        """How many worker processes can hold slots at once (one counter each)."""
        return len(self._counts)

    def bind(self, index: int) -> None:
        """Make this process count on counter ``index`` (no other live process may use it)."""
        self._index = index
        if self.clients is not None:
            self.clients.bind(index)
        if self.rates is not None:
            self.rates.bind(index)
        if self.tenants is not None:
            self.tenants.bind(index)

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
        if self.clients is not None:
            self.clients.forget_worker(index)
        if self.rates is not None:
            self.rates.forget_worker(index)
        if self.tenants is not None:
            self.tenants.forget_worker(index)


Waiter = Callable[[bool], None]


class Verdict(enum.Enum):
    """What :meth:`Admission.admit` decided."""

    ADMITTED = "admitted"
    QUEUED = "queued"
    """The waiter will be called with the outcome."""
    REFUSED = "refused"
    TOO_MANY_WAITING = "too many waiting"
    """Refused: the connection or the client already has its bound of waiting sessions
    (:meth:`Admission.queue_error` says which)."""


class _Queued:
    """A queued waiter: its deadline, the connection and client it counts against, and
    its tenant's row (``fair``; -1 here)."""

    __slots__ = ("client", "deadline", "group", "row")

    def __init__(
        self, deadline: float, group: object | None, client: str | None, row: int = -1
    ) -> None:
        self.deadline = deadline
        self.group = group
        self.client = client
        self.row = row


class Admission:
    """Admit sessions now or queue them until a slot frees or their deadline passes.

    Args:
        slots: the session slots (this worker's, or shared by the workers).
        timeout: seconds a waiter may wait (0: refuse at once when full).
        per_connection: sessions one connection (``group``) may have waiting (0: no bound).
        per_client: sessions one client address may have waiting (0: no bound).
    """

    __slots__ = (
        "_by_client",
        "_by_group",
        "_loop",
        "_poller",
        "_queue",
        "per_client",
        "per_connection",
        "slots",
        "timeout",
    )

    def __init__(
        self,
        slots: Slots,
        timeout: float,
        per_connection: int = MAX_WAITING_PER_CONNECTION,
        per_client: int = MAX_WAITING_PER_CLIENT,
    ) -> None:
        self.slots = slots
        self.timeout = timeout
        self.per_connection = per_connection
        self.per_client = per_client
        # Insertion-ordered, O(1) removal of any waiter and of the first one.
        self._queue: collections.OrderedDict[Waiter, _Queued] = collections.OrderedDict()
        self._by_group: dict[object, int] = {}
        self._by_client: dict[str | None, int] = {}
        self._poller: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def waiting(self) -> int:
        """Sessions of this worker queued for a slot (``GET /metadata``'s ``waiting_sessions``)."""
        return len(self._queue)

    def waiting_for(self, group: object) -> int:
        """Sessions of connection ``group`` queued for a slot."""
        return self._by_group.get(group, 0)

    def admit(
        self,
        waiter: Waiter,
        group: object | None = None,
        client: str | None = None,
        tenant: Tenant | None = None,
    ) -> Verdict:
        """Take a slot now, refuse now (no admission timeout, or ``group`` — the
        connection — or ``client`` — its address — has its bound of waiting sessions),
        or queue ``waiter``. ``client`` is counted only when ``group`` is given or
        ``client`` is not ``None``. ``tenant``: for
        :class:`~stadium._server.admission.fair.FairAdmission` only."""
        if not self._queue and self.slots.try_acquire():
            return Verdict.ADMITTED
        if self.timeout <= 0:
            return Verdict.REFUSED
        verdict = self._bounds(group, client)
        if verdict is not None:
            return verdict
        loop = self._loop_now()
        self._queue[waiter] = _Queued(loop.time() + self.timeout, group, client)
        self._count(group, client)
        if self._poller is None:
            self._poller = loop.call_later(POLL_INTERVAL_S, self._poll)
        return Verdict.QUEUED

    def _bounds(self, group: object | None, client: str | None) -> Verdict | None:
        """:attr:`Verdict.TOO_MANY_WAITING` if ``group`` or ``client`` has its bound waiting."""
        if group is not None and 0 < self.per_connection <= self._by_group.get(group, 0):
            return Verdict.TOO_MANY_WAITING
        if client is not None and 0 < self.per_client <= self._by_client.get(client, 0):
            return Verdict.TOO_MANY_WAITING
        return None

    def _count(self, group: object | None, client: str | None) -> None:
        """Count a queued waiter against its connection and client."""
        if group is not None:
            self._by_group[group] = self._by_group.get(group, 0) + 1
        if client is not None:
            self._by_client[client] = self._by_client.get(client, 0) + 1

    def _loop_now(self) -> asyncio.AbstractEventLoop:
        loop = self._loop or asyncio.get_running_loop()
        self._loop = loop
        return loop

    def try_seat(self, tenant: Tenant | None = None) -> bool:
        """Take a slot now or not at all, queue or no queue (a fork)."""
        return self.slots.try_acquire()

    def queue_error(
        self, group: object | None = None, client: str | None = None, tenant: Tenant | None = None
    ) -> CapacityError:
        """The refusal of a :attr:`Verdict.TOO_MANY_WAITING` session: which bound it met
        (``tenant``'s: ``fair``)."""
        slots = self.slots
        if group is not None and 0 < self.per_connection <= self._by_group.get(group, 0):
            why = (
                f"this connection already has {self.per_connection} sessions waiting for a "
                "slot (the most one connection may queue); wait for some to open or be "
                "refused before opening more"
            )
        else:
            why = (
                f"this client ({client}) already has {self.per_client} sessions waiting for "
                "a slot (the most one client address may queue); wait for some to open or "
                "be refused before opening more"
            )
        return CapacityError(
            f"server at capacity ({slots.active()}/{slots.limit} sessions) and {why}",
            active_sessions=slots.active(),
            max_sessions=slots.limit,
            retry_after_s=1.0,
        )

    def _forget(self, entry: _Queued) -> None:
        group, client = entry.group, entry.client
        if group is not None:
            left = self._by_group[group] - 1
            if left:
                self._by_group[group] = left
            else:
                del self._by_group[group]
        if client is not None:
            left = self._by_client[client] - 1
            if left:
                self._by_client[client] = left
            else:
                del self._by_client[client]

    def _pop_first(self) -> Waiter:
        waiter, entry = self._queue.popitem(last=False)
        self._forget(entry)
        return waiter

    async def acquire(self, tenant: Tenant | None = None) -> bool:
        """Take a slot for one request/response caller (an HTTP request), as :meth:`admit`
        does for a session: at once, after waiting in the same queue (up to ``timeout``),
        or not at all (``False``; :class:`~stadium.CapacityError` past a bound of waiting
        sessions). The caller :meth:`release` s a slot it got. Cancelling
        the caller gives up its place in the queue, or the slot it was just handed.
        """
        granted: asyncio.Future[bool] = asyncio.get_running_loop().create_future()

        def waiter(ok: bool) -> None:
            if granted.done():  # the caller was cancelled first
                if ok:
                    self.release(tenant)
                return
            granted.set_result(ok)

        verdict = self.admit(waiter, tenant=tenant)
        if verdict is Verdict.TOO_MANY_WAITING:  # its tenant's bound (``fair``)
            raise self.queue_error(tenant=tenant)
        if verdict is not Verdict.QUEUED:
            return verdict is Verdict.ADMITTED
        try:
            return await granted
        except asyncio.CancelledError:
            if granted.done() and not granted.cancelled() and granted.result():
                self.release(tenant)
            else:
                self.cancel(waiter)
            raise

    def cancel(self, waiter: Waiter) -> None:
        """Forget a queued waiter (its connection went away), in O(1)."""
        entry = self._queue.pop(waiter, None)
        if entry is not None:
            self._forget(entry)

    def release(self, tenant: Tenant | None = None) -> None:
        """Give a slot back (of ``tenant``: ``fair``); hand it straight to the first
        local waiter if there is one."""
        if self._queue:
            self._pop_first()(True)
        else:
            self.slots.release()

    def refuse_all(self) -> None:
        """Refuse every queued waiter (the server is draining)."""
        while self._queue:
            self._pop_first()(False)

    def _poll(self) -> None:
        self._poller = None
        assert self._loop is not None
        now = self._loop.time()
        queue = self._queue
        while queue and self.slots.try_acquire():
            self._pop_first()(True)
        while queue and next(iter(queue.values())).deadline <= now:
            self._pop_first()(False)
        if queue:
            self._poller = self._loop.call_later(POLL_INTERVAL_S, self._poll)

"""Fair admission between tenants (``--tenants``): whose waiting session gets a free slot.

:class:`FairAdmission` is an :class:`~stadium._server.admission.slots.Admission` whose queue
is kept per tenant, and which gives each free slot to the tenant that is furthest
below its weighted share: the one, among the tenants with sessions waiting on any
worker of the node, with the fewest slots held per unit of weight (held / weight,
over the node, from :class:`~stadium._server.admission.tenants.SharedTenants`). Serving the
smallest normalized holding first converges to the weighted max-min fair shares: two
tenants of weights 1 and 3, both asking for more than the node has, hold a quarter
and three quarters of the slots; a tenant alone (or the only one waiting) gets every
slot (work-conserving: a slot is never left free while anyone waits).

Each worker's queue is its own; the counts that decide are the node's. When a slot
frees on worker A and the neediest tenant's waiters are all on worker B, A gives the
slot back to the shared pool and B's poll (every
:data:`~stadium._server.admission.slots.POLL_INTERVAL_S`) takes it for that tenant. So that
no slot idles should B be slow, A serves its own neediest waiter after the slot has
stayed free for :data:`FALLBACK_POLLS` of its polls.

A decision reads two counters per tenant and worker: O(tenants × workers) word reads,
with tenants ≤ :data:`~stadium._server.admission.tenants.MAX_TENANTS` (64) and a handful of
workers, whatever the number of sessions or waiters; none when nobody waits anywhere
(the first check: one word per worker). Quotas (``max_sessions``) are charged at the
door (``doorway``), not here: a slot never goes to a tenant over its quota because a
waiting session is charged already. A tenant has at most ``per_client``
(``--max-waiting-per-client``) sessions waiting in a worker, whatever their addresses. A
fork, which never waits, takes a free slot only when no needier tenant waits anywhere.
"""

from __future__ import annotations

import collections
import math
from bisect import bisect_left

from stadium._core.access import Tenant
from stadium._errors import CapacityError
from stadium._server.admission.slots import (
    POLL_INTERVAL_S,
    Admission,
    Slots,
    Verdict,
    Waiter,
    _Queued,
)
from stadium._server.admission.tenants import (
    ANON,
    HELD,
    NFIELDS,
    REFUSED,
    WAIT_BUCKETS,
    WAIT_HIST,
    WAIT_US,
    WAITING,
    TenantDirectory,
)

__all__ = ["FALLBACK_POLLS", "FairAdmission"]

FALLBACK_POLLS = 4
"""Polls a worker leaves a free slot to the neediest tenant's waiters on another worker
before it serves its own (about 20 ms)."""


class FairAdmission(Admission):
    """Admission with a queue per tenant, served in weighted max-min fair order (see the
    module docstring). ``directory``: the node's tenants and their shared counters."""

    __slots__ = ("_by_tenant", "_deferred", "directory")

    def __init__(
        self,
        slots: Slots,
        timeout: float,
        directory: TenantDirectory,
        per_connection: int,
        per_client: int,
    ) -> None:
        super().__init__(slots, timeout, per_connection, per_client)
        self.directory = directory
        self._by_tenant: dict[int, collections.OrderedDict[Waiter, None]] = {}
        self._deferred = 0

    # -- the choice ------------------------------------------------------------------

    def neediest(self, extra: int = -1) -> int:
        """The row of the tenant furthest below its weighted share among those waiting
        anywhere (and ``extra``); -1 when none is."""
        shared = self.directory.shared
        counts, width, weights = shared.counts, shared.width, self.directory.weights
        best, best_score = -1, math.inf
        for row in self.directory.active:
            base = row * NFIELDS * width
            waiting = base + WAITING * width
            if row != extra and not any(counts[waiting : waiting + width]):
                continue
            held = base + HELD * width
            score = sum(counts[held : held + width]) / weights[row]
            if score < best_score:
                best, best_score = row, score
        return best

    def _local_neediest(self) -> int:
        """The neediest of the tenants waiting in this worker (the fallback)."""
        shared = self.directory.shared
        weights = self.directory.weights
        return min(self._by_tenant, key=lambda row: shared.total(row, HELD) / weights[row])

    # -- admission ---------------------------------------------------------------------

    def admit(
        self,
        waiter: Waiter,
        group: object | None = None,
        client: str | None = None,
        tenant: Tenant | None = None,
    ) -> Verdict:
        row = ANON if tenant is None else tenant.row
        shared = self.directory.shared
        if (not any(shared.any_waiting) or self.timeout <= 0 or self.neediest(row) == row) and (
            self.slots.try_acquire()
        ):
            mine = shared.mine[row]  # self._seat(row, 0.0), inlined (most sessions)
            mine[HELD] += 1
            mine[WAIT_HIST] += 1
            return Verdict.ADMITTED
        verdict = Verdict.REFUSED if self.timeout <= 0 else self._bounds(group, client)
        if verdict is None and tenant is not None and self._tenant_full(row):
            verdict = Verdict.TOO_MANY_WAITING  # a tenant is at least one client
        if verdict is not None:
            shared.add(row, REFUSED)
            return verdict
        loop = self._loop_now()
        self._queue[waiter] = _Queued(loop.time() + self.timeout, group, client, row)
        self._count(group, client)
        queue = self._by_tenant.get(row)
        if queue is None:
            queue = self._by_tenant[row] = collections.OrderedDict()
        queue[waiter] = None
        shared.add(row, WAITING)
        shared.any_waiting[shared.column] += 1
        if self._poller is None:
            self._poller = loop.call_later(POLL_INTERVAL_S, self._poll)
        return Verdict.QUEUED

    def _tenant_full(self, row: int) -> bool:
        """Whether ``row`` has its bound of sessions waiting in this worker (those of
        ``--max-waiting-per-client``, whatever addresses they come from)."""
        return 0 < self.per_client <= len(self._by_tenant.get(row, ()))

    def queue_error(
        self, group: object | None = None, client: str | None = None, tenant: Tenant | None = None
    ) -> CapacityError:
        if tenant is None or self._bounds(group, client) or not self._tenant_full(tenant.row):
            return super().queue_error(group, client)
        slots = self.slots
        return CapacityError(
            f"server at capacity ({slots.active()}/{slots.limit} sessions) and tenant "
            f"{tenant.name!r} already has {self.per_client} sessions waiting for a slot here "
            "(the most one tenant may queue); wait for some to open or be refused before "
            "opening more",
            active_sessions=slots.active(),
            max_sessions=slots.limit,
            retry_after_s=1.0,
        )

    def try_seat(self, tenant: Tenant | None = None) -> bool:
        """A slot now or not at all (a fork): not one owed to a needier tenant that waits
        anywhere (a slot left for another worker's waiters: :data:`FALLBACK_POLLS`)."""
        row = ANON if tenant is None else tenant.row
        shared = self.directory.shared
        if any(shared.any_waiting) and self.neediest(row) != row:
            return False
        if not self.slots.try_acquire():
            return False
        self._seat(row, 0.0)
        return True

    def _seat(self, row: int, waited: float) -> None:
        """Count a slot given to ``row`` after ``waited`` seconds in the queue."""
        mine = self.directory.shared.mine[row]
        mine[HELD] += 1  # (and opened: the wait histogram's count)
        if not waited:  # admitted at once (most sessions): the first bucket
            mine[WAIT_HIST] += 1
            return
        mine[WAIT_US] += int(waited * 1e6)
        mine[WAIT_HIST + bisect_left(WAIT_BUCKETS, waited)] += 1

    def _take(self, row: int) -> tuple[Waiter, float]:
        """Take ``row``'s first local waiter out of the queue: it and its wait so far."""
        queue = self._by_tenant[row]
        waiter, _ = queue.popitem(last=False)
        if not queue:
            del self._by_tenant[row]
        entry = self._queue.pop(waiter)
        self._forget(entry)
        self._unwait(row)
        assert self._loop is not None
        return waiter, self._loop.time() - (entry.deadline - self.timeout)

    def _unwait(self, row: int) -> None:
        shared = self.directory.shared
        shared.add(row, WAITING, -1)
        shared.any_waiting[shared.column] -= 1

    def _pop_first(self) -> Waiter:
        waiter, entry = self._queue.popitem(last=False)
        self._forget(entry)
        self._drop(waiter, entry.row)
        return waiter

    def _drop(self, waiter: Waiter, row: int) -> None:
        queue = self._by_tenant[row]
        del queue[waiter]
        if not queue:
            del self._by_tenant[row]
        self._unwait(row)

    def cancel(self, waiter: Waiter) -> None:
        entry = self._queue.pop(waiter, None)
        if entry is not None:
            self._forget(entry)
            self._drop(waiter, entry.row)

    def release(self, tenant: Tenant | None = None) -> None:
        """Give ``tenant``'s slot back: straight to a local waiter if its tenant is the
        neediest waiting anywhere, else to the shared pool."""
        self.directory.shared.mine[ANON if tenant is None else tenant.row][HELD] -= 1
        if self._queue:
            best = self.neediest()
            if best in self._by_tenant:
                waiter, waited = self._take(best)
                self._seat(best, waited)
                waiter(True)
                return
        self.slots.release()

    def refuse_all(self) -> None:
        while self._queue:
            row = next(iter(self._queue.values())).row
            self.directory.shared.add(row, REFUSED)
            self._pop_first()(False)

    def _poll(self) -> None:
        self._poller = None
        assert self._loop is not None
        queue, slots = self._queue, self.slots
        for _ in range(len(queue)):  # bounded: one seat per waiter at most
            best = self.neediest()
            if best not in self._by_tenant:  # the neediest waits on another worker
                if slots.active() >= slots.limit:
                    self._deferred = 0
                    break
                self._deferred += 1
                if self._deferred <= FALLBACK_POLLS:
                    break
                best = self._local_neediest()
            if not slots.try_acquire():
                break
            self._deferred = 0
            waiter, waited = self._take(best)
            self._seat(best, waited)
            waiter(True)
        now = self._loop.time()
        shared = self.directory.shared
        while queue:
            entry = next(iter(queue.values()))
            if entry.deadline > now:
                break
            shared.add(entry.row, REFUSED)
            self._pop_first()(False)
        if queue:
            self._poller = self._loop.call_later(POLL_INTERVAL_S, self._poll)

"""One door for every session: the limits, the ids and tokens, the count, decided once.

A session comes into being through one of several doors (:class:`Door`): a WebSocket
at ``/ws``, an entry of a batch connection, an HTTP request that builds an env for its
duration (``POST /reset``, ``POST /step``, ``GET /state``, a stateless ``POST /mcp``
tool call), a ``fork``, an MCP ``openenv/session/create``, a WebSocket attached to an
MCP session (``/ws?session_id=``), a restore from the durable store. Each goes through
the worker's :class:`Doorway`, which

* charges the session to the client that made it (``--max-sessions-per-client``,
  :class:`~stadium._core.limits.ClientLimits`): refused at once with
  ``CAPACITY_REACHED`` over the quota; a fork is charged to the client of the session
  it forks, an MCP session to the client that created it; with several workers, the
  quota holds over all of them (:mod:`~stadium._server.admission.client_counts`);
* gives it its client's token bucket (``--rate-limit``): every request on it, whatever
  door it came through, spends one token; with several workers the bucket is the
  client's view of windowed counters all workers share
  (:class:`~stadium._server.admission.client_counts.SharedClientRates`): one budget per client;
  a WebSocket attached to an MCP session holds its client's record without a session
  of the quota (it rides on the MCP session's slot and env) and its requests are
  rate-limited like any other;
* takes its slot (``--max-sessions``, :class:`~stadium._server.admission.slots.Admission`):
  queued (a WebSocket, batch or restored session), awaited (HTTP, MCP create) or now
  or never (a fork);
* counts it in ``stadium_sessions_opened_total{door}`` (``/metrics``) and in the
  worker's ``sessions_total`` (``/metadata``) once admitted;
* mints session ids, resume tokens and MCP session ids (:mod:`stadium._core.resume`).

With tenants (``--tenants``, :mod:`~stadium._server.admission.tenants`), a session is also charged
to the tenant its token names: its quota (``max_sessions``, over every worker: counted
at the door, waiting or seated, refused at once over it), its rate (``rate_limit``,
over every worker, spent with the client's), its slot through
:class:`~stadium._server.admission.fair.FairAdmission` (weighted fair order), and its counts
(sessions, refusals, steps, queue wait) for ``/metrics`` and ``GET /tenant/usage``.

What a session is charged is its :class:`Pass`; :meth:`Doorway.leave` gives it back
(once, however often it is called). Nothing here runs per step.
"""

from __future__ import annotations

import contextvars
import enum
import math
import os
import uuid

from stadium._core.access import Tenant
from stadium._core.limits import Bucket, ClientLimits, ClientRecord, window_take
from stadium._core.resume import new_session_id, new_token
from stadium._env.cost import EpisodeCost
from stadium._errors import CapacityError, RateLimitError
from stadium._server.admission.client_counts import Keys
from stadium._server.admission.fair import FairAdmission
from stadium._server.admission.slots import Admission, Verdict, Waiter
from stadium._server.admission.tenants import (
    CHARGED,
    EP_CPU_US,
    EP_IN,
    EP_OUT,
    EP_STEPS,
    EP_WALL_US,
    EPISODES,
    REFUSED,
    STEPS,
    TenantDirectory,
)
from stadium._server.metrics import DOORS

CALLER: contextvars.ContextVar[tuple[str | None, Tenant | None]] = contextvars.ContextVar(
    "stadium_caller", default=(None, None)
)
"""The client address and tenant of the HTTP request being answered (set by the HTTP
endpoints for each request): what a route not told them (the Task API) charges."""


class Door(enum.IntEnum):
    """How a session came into being: ``stadium_sessions_opened_total``'s ``door`` is the
    name in lower case, the value its place in :data:`~stadium._server.metrics.DOORS`
    (an ``IntEnum``: indexing and hashing one costs no Python call)."""

    WEBSOCKET = 0
    BATCH = 1
    HTTP = 2
    FORK = 3
    MCP_CREATE = 4
    MCP_ATTACH = 5
    RESTORE = 6


class Pass:
    """What one session is charged: its door, its client's record (``None``: no
    per-client limits), its tenant (``None``: no tenants) and its bucket (``None``: no
    rate limit)."""

    __slots__ = ("bucket", "counted", "door", "inherited", "keys", "record", "tenant")

    def __init__(
        self, door: Door, record: ClientRecord | None, counted: bool, keys: Keys | None = None
    ) -> None:
        self.door = door
        self.record = record
        self.bucket: Bucket | None = None if record is None else record.bucket
        self.counted = counted
        """Whether it counts against the client's quota (all but an MCP attach)."""
        self.keys = keys
        """Its client's counters over every worker (``client_counts``), when counted there."""
        self.tenant: Tenant | None = None
        """The tenant it is charged to (``--tenants``)."""
        self.inherited = 0
        """Steps of its running episode taken before it was forked off (its parent's,
        counted to the tenant by the parent): not counted again."""


class TenantBucket:
    """A tenant's ``rate_limit`` over every worker: sliding windows of about a second
    in :class:`~stadium._server.admission.tenants.SharedTenants` (as ``client_counts``' rates)."""

    __slots__ = ("directory", "tenant")

    def __init__(self, directory: TenantDirectory, tenant: Tenant) -> None:
        self.directory = directory
        self.tenant = tenant

    def take(self, now: float) -> float:
        tenant = self.directory.current(self.tenant)  # its rate as last reloaded
        rate = tenant.rate_limit
        if rate <= 0:
            return 0.0
        shared = self.directory.shared
        burst = max(1, math.ceil(rate))
        width = shared.rate_width
        wait = window_take(
            shared.rate_words, (tenant.row * 2 * width,), width, shared.column, burst,
            burst / rate, now,
        )  # fmt: skip
        if wait:
            shared.add(tenant.row, REFUSED)
        return wait

    def full(self, now: float) -> bool:
        return True


class _Both:
    """Two budgets a request spends from: the client's, then its tenant's."""

    __slots__ = ("first", "second")

    def __init__(self, first: Bucket, second: Bucket) -> None:
        self.first = first
        self.second = second

    def take(self, now: float) -> float:
        return self.first.take(now) or self.second.take(now)

    def full(self, now: float) -> bool:
        return self.first.full(now)


class Doorway:
    """The one admission of a worker's sessions (see the module docstring).

    Args:
        admission: the session slots and their queue (``--max-sessions``).
        limits: the per-client quota and rate (``None``: both off).
        opened: the worker's ``stadium_sessions_opened_total`` counts, one per door in
            :data:`~stadium._server.metrics.DOORS`' order (its row of the metrics board).
    """

    __slots__ = ("_free", "admission", "limits", "opened", "sessions_total", "tenants")

    def __init__(
        self, admission: Admission, limits: ClientLimits | None, opened: memoryview[float]
    ) -> None:
        self.admission = admission
        self.limits = limits
        self.opened = opened
        rates = admission.slots.rates
        if limits is not None and limits.rate > 0 and rates is not None:
            limits.new_bucket = rates.bucket  # one budget per client over every worker
        assert [door.name.lower() for door in Door] == list(DOORS)
        # Without per-client limits a pass holds nothing: one per door, shared (no allocation).
        self._free = tuple(Pass(door, None, True) for door in Door)
        self.sessions_total = 0
        """Sessions this worker admitted, every door (``/metadata``'s ``sessions_total``)."""
        self.tenants = admission.directory if isinstance(admission, FairAdmission) else None
        """The node's tenants (``--tenants``), or ``None``."""

    # -- the client: quota and rate ----------------------------------------------------

    def enter(
        self,
        door: Door,
        client: str | None,
        now: float,
        *,
        counted: bool = True,
        tenant: Tenant | None = None,
    ) -> Pass:
        """Charge a session coming through ``door`` to ``client`` and ``tenant`` (their
        quotas, when ``counted``); raises :class:`~stadium.CapacityError` over a quota
        (nothing charged). No slot."""
        charged = self._enter_client(door, client, now, counted)
        if tenant is not None and self.tenants is not None:
            return self._enter_tenant(charged, self.tenants, tenant, now)
        return charged

    def _enter_client(self, door: Door, client: str | None, now: float, counted: bool) -> Pass:
        limits = self.limits
        if limits is None:
            return self._free[door] if counted else Pass(door, None, counted)
        record = limits.open_session(client, now, counted=counted)
        if record is None:
            raise limits.quota_error()
        shared = self.admission.slots.clients
        if shared is None or not counted:
            return Pass(door, record, counted)
        keys = shared.keys(client)  # the quota over every worker, not only this one
        if not shared.try_acquire(keys):
            limits.close_session(record, now, counted=counted)
            raise limits.quota_error()
        return Pass(door, record, counted, keys)

    def _enter_tenant(
        self, charged: Pass, directory: TenantDirectory, tenant: Tenant, now: float
    ) -> Pass:
        if charged.record is None:  # a shared free pass: this one is the session's own
            charged = Pass(charged.door, None, charged.counted)
        row = tenant.row
        now_is = directory.rows[row]  # directory.current(tenant), inlined (per session)
        if now_is is not tenant and now_is is not None and now_is.name == tenant.name:
            tenant = now_is  # (the upgrade's is the table's own: the same object, mostly)
        shared = directory.shared
        if charged.counted:
            shared.mine[row][CHARGED] += 1
            if tenant.max_sessions:
                shared.fence()  # the increment is visible before the sum is read
                if shared.total(row, CHARGED) > tenant.max_sessions:
                    shared.add(row, CHARGED, -1)
                    shared.add(row, REFUSED)
                    self.leave(charged, now)
                    raise CapacityError(
                        f"tenant {tenant.name!r} holds its quota of {tenant.max_sessions} "
                        "sessions (open or waiting) on this server; close some first",
                        tenant=tenant.name,
                        max_sessions=tenant.max_sessions,
                        retry_after_s=1.0,
                    )
        charged.tenant = tenant
        if tenant.rate_limit > 0:
            bucket = TenantBucket(directory, tenant)
            charged.bucket = bucket if charged.bucket is None else _Both(charged.bucket, bucket)
        return charged

    def leave(self, charged: Pass, now: float) -> None:
        """Give back what ``charged`` holds of its client and tenant (idempotent)."""
        tenant = charged.tenant
        if tenant is not None:
            charged.tenant = None
            charged.bucket = None
            if charged.counted and self.tenants is not None:
                self.tenants.shared.mine[tenant.row][CHARGED] -= 1
        record = charged.record
        if record is None:
            return
        charged.record = None
        charged.bucket = None
        if charged.keys is not None:
            shared = self.admission.slots.clients
            assert shared is not None
            shared.release(charged.keys)
            charged.keys = None
        limits = self.limits
        assert limits is not None
        limits.close_session(record, now, counted=charged.counted)

    def request(
        self, client: str | None, now: float, tenant: Tenant | None = None
    ) -> RateLimitError | None:
        """Spend one of ``client``'s tokens, and one of ``tenant``'s, for a request
        outside a session (HTTP, an upgrade): the error to answer when a bucket is
        empty, else ``None``."""
        limits = self.limits
        if limits is not None and limits.rate:
            wait = limits.take(client, now)
            if wait:
                return limits.rate_error(wait)
        if tenant is not None and self.tenants is not None:
            wait = TenantBucket(self.tenants, tenant).take(now)
            if wait:
                return RateLimitError(
                    f"tenant {tenant.name!r} is over its rate limit of "
                    f"{self.tenants.current(tenant).rate_limit:g} requests per second on "
                    f"this server; retry in {wait:.2f}s",
                    retry_after_s=wait,
                )
        return None

    def steps(self, tenant: Tenant | None, n: int, charged: Pass | None = None) -> None:
        """Count ``n`` steps of ``tenant``'s (``stadium_tenant_steps_total``): an episode's
        ``n`` so far, less those ``charged``'s session inherited from the session it was
        forked from (once: the next episode is its own)."""
        if charged is not None and charged.inherited:
            n -= charged.inherited
            charged.inherited = 0
        if n > 0 and tenant is not None and self.tenants is not None:
            self.tenants.shared.mine[tenant.row][STEPS] += n

    def closed(self, charged: Pass | None, tenant: Tenant, steps: int, now: float) -> None:
        """A session of ``tenant`` ended: its running episode's ``steps`` counted
        (:meth:`steps`) and ``charged`` given back (:meth:`leave`), in one call."""
        directory = self.tenants
        if directory is None:
            if charged is not None:
                self.leave(charged, now)
            return
        mine = directory.shared.mine[tenant.row]
        if charged is None:
            if steps > 0:
                mine[STEPS] += steps
            return
        if charged.inherited:
            steps -= charged.inherited
            charged.inherited = 0
        if steps > 0:
            mine[STEPS] += steps
        held = charged.tenant
        if held is not None:
            charged.tenant = None
            charged.bucket = None
            if charged.counted:
                directory.shared.mine[held.row][CHARGED] -= 1
        if charged.record is not None:
            self.leave(charged, now)

    def episode(self, tenant: Tenant, cost: EpisodeCost) -> None:
        """Count an ended episode's ``cost`` to ``tenant`` (``stadium_tenant_episode_*``)."""
        if self.tenants is not None:  # once per episode, at its end
            mine = self.tenants.shared.mine[tenant.row]
            mine[EPISODES] += 1
            mine[EP_WALL_US] += int(cost.wall_s * 1e6)
            mine[EP_CPU_US] += int(cost.cpu_s * 1e6)
            mine[EP_STEPS] += cost.steps
            mine[EP_IN] += cost.bytes_in
            mine[EP_OUT] += cost.bytes_out

    # -- the slot --------------------------------------------------------------------

    def admit(
        self,
        door: Door,
        client: str | None,
        now: float,
        waiter: Waiter,
        group: object | None = None,
        tenant: Tenant | None = None,
    ) -> tuple[Pass, Verdict]:
        """A session that may wait for its slot (WebSocket, batch entry, restore): charge
        it, then take a slot now, queue ``waiter`` or refuse (no admission timeout, or
        its connection ``group`` or its client has its bound of waiting sessions:
        :meth:`~stadium._server.admission.slots.Admission.queue_error` says which).
        Raises :class:`~stadium.CapacityError` over the client's or tenant's quota
        (nothing taken)."""
        if self.limits is not None:
            charged = self.enter(door, client, now, tenant=tenant)
        elif tenant is None:
            charged = self._free[door]
        elif self.tenants is not None:  # enter() without a client to charge, inlined
            charged = self._enter_tenant(self._free[door], self.tenants, tenant, now)
        else:
            charged = self._free[door]
        return charged, self.admission.admit(waiter, group, client, tenant)

    def admit_now(
        self, door: Door, client: str | None, now: float, tenant: Tenant | None = None
    ) -> Pass:
        """A session that takes its slot now or not at all (a fork): raises
        :class:`~stadium.CapacityError` (nothing taken) over a quota or with no free slot.
        The caller counts it (:meth:`open`) once it exists (its env restored)."""
        charged = self.enter(door, client, now, tenant=tenant)
        if not self.admission.try_seat(tenant):
            self.leave(charged, now)
            slots = self.admission.slots
            raise CapacityError(
                f"server at capacity for a fork ({slots.active()}/{slots.limit} sessions, or "
                "the free slot is owed to a session waiting for it): a fork takes a slot at "
                "once or not at all; retry later",
                active_sessions=slots.active(),
                max_sessions=slots.limit,
                retry_after_s=1.0,
            )
        return charged

    async def admit_waiting(
        self, door: Door, client: str | None, now: float, tenant: Tenant | None = None
    ) -> Pass:
        """A session that awaits its slot in the admission queue (HTTP, MCP create);
        raises :class:`~stadium.CapacityError` over a quota or when none frees in time.
        Cancelling the caller takes nothing."""
        charged = self.enter(door, client, now, tenant=tenant)
        try:
            seated = await self.admission.acquire(tenant)
        except BaseException:
            self.leave(charged, now)
            raise
        if not seated:
            self.leave(charged, now)
            raise self.capacity_error()
        self.open(door)
        return charged

    def open(self, door: Door) -> None:
        """Count a session admitted through ``door``."""
        self.sessions_total += 1
        self.opened[door] += 1

    def release(self, charged: Pass, now: float) -> None:
        """The session of ``charged``, which held a slot, ended: the slot and the charge back."""
        self.admission.release(charged.tenant)
        self.leave(charged, now)

    def capacity_error(self) -> CapacityError:
        slots = self.admission.slots
        return CapacityError(
            f"server at capacity ({slots.active()}/{slots.limit} sessions) and no slot freed "
            f"within {self.admission.timeout:g}s; retry later",
            active_sessions=slots.active(),
            max_sessions=slots.limit,
            retry_after_s=1.0,
        )

    # -- ids and tokens ----------------------------------------------------------------

    def mint(self) -> tuple[str, str]:
        """A new resumable session's id (naming this worker) and resume token."""
        return new_session_id(os.getpid()), new_token()

    def new_id(self) -> str:
        """A new session id naming this worker (a restored session keeps its token)."""
        return new_session_id(os.getpid())

    @staticmethod
    def new_token() -> str:
        """A new resume token (a resume rotates it)."""
        return new_token()

    @staticmethod
    def mcp_id() -> str:
        """A new MCP session id (``openenv/session/create``, as OpenEnv makes them)."""
        return uuid.uuid4().hex


__all__ = ["CALLER", "Door", "Doorway", "Pass", "TenantBucket"]

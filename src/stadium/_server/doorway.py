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
  quota holds over all of them (:mod:`~stadium._server.client_counts`);
* gives it its client's token bucket (``--rate-limit``): every request on it, whatever
  door it came through, spends one token; with several workers the bucket is the
  client's view of windowed counters all workers share
  (:class:`~stadium._server.client_counts.SharedClientRates`): one budget per client;
  a WebSocket attached to an MCP session holds its client's record without a session
  of the quota (it rides on the MCP session's slot and env) and its requests are
  rate-limited like any other;
* takes its slot (``--max-sessions``, :class:`~stadium._server.admission.Admission`):
  queued (a WebSocket, batch or restored session), awaited (HTTP, MCP create) or now
  or never (a fork);
* counts it in ``stadium_sessions_opened_total{door}`` (``/metrics``) and in the
  worker's ``sessions_total`` (``/metadata``) once admitted;
* mints session ids, resume tokens and MCP session ids (:mod:`stadium._core.resume`).

What a session is charged is its :class:`Pass`; :meth:`Doorway.leave` gives it back
(once, however often it is called). Nothing here runs per step.
"""

from __future__ import annotations

import enum
import os
import uuid

from stadium._core.limits import Bucket, ClientLimits, ClientRecord
from stadium._core.resume import new_session_id, new_token
from stadium._errors import CapacityError, RateLimitError
from stadium._server.admission import Admission, Verdict, Waiter
from stadium._server.client_counts import Keys
from stadium._server.metrics import DOORS


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
    per-client limits) and that client's bucket (``None``: no rate limit)."""

    __slots__ = ("bucket", "counted", "door", "keys", "record")

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


class Doorway:
    """The one admission of a worker's sessions (see the module docstring).

    Args:
        admission: the session slots and their queue (``--max-sessions``).
        limits: the per-client quota and rate (``None``: both off).
        opened: the worker's ``stadium_sessions_opened_total`` counts, one per door in
            :data:`~stadium._server.metrics.DOORS`' order (its row of the metrics board).
    """

    __slots__ = ("_free", "admission", "limits", "opened", "sessions_total")

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

    # -- the client: quota and rate ----------------------------------------------------

    def enter(self, door: Door, client: str | None, now: float, *, counted: bool = True) -> Pass:
        """Charge a session coming through ``door`` to ``client`` (its quota, when
        ``counted``); raises :class:`~stadium.CapacityError` over the quota. No slot."""
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

    def leave(self, charged: Pass, now: float) -> None:
        """Give back what ``charged`` holds of its client (idempotent)."""
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

    def request(self, client: str | None, now: float) -> RateLimitError | None:
        """Spend one of ``client``'s tokens for a request outside a session (HTTP, an
        upgrade): the error to answer when its bucket is empty, else ``None``."""
        limits = self.limits
        if limits is None or not limits.rate:
            return None
        wait = limits.take(client, now)
        return limits.rate_error(wait) if wait else None

    # -- the slot --------------------------------------------------------------------

    def admit(
        self,
        door: Door,
        client: str | None,
        now: float,
        waiter: Waiter,
        group: object | None = None,
    ) -> tuple[Pass, Verdict]:
        """A session that may wait for its slot (WebSocket, batch entry, restore): charge
        it, then take a slot now, queue ``waiter`` or refuse (no admission timeout, or
        its connection ``group`` or its client has its bound of waiting sessions:
        :meth:`~stadium._server.admission.Admission.queue_error` says which).
        Raises :class:`~stadium.CapacityError` over the client's quota (nothing taken)."""
        charged = self._free[door] if self.limits is None else self.enter(door, client, now)
        return charged, self.admission.admit(waiter, group, client)

    def admit_now(self, door: Door, client: str | None, now: float) -> Pass:
        """A session that takes its slot now or not at all (a fork): raises
        :class:`~stadium.CapacityError` (nothing taken) over the quota or with no free slot.
        The caller counts it (:meth:`open`) once it exists (its env restored)."""
        charged = self.enter(door, client, now)
        if not self.admission.slots.try_acquire():
            self.leave(charged, now)
            raise self.capacity_error()
        return charged

    async def admit_waiting(self, door: Door, client: str | None, now: float) -> Pass:
        """A session that awaits its slot in the admission queue (HTTP, MCP create);
        raises :class:`~stadium.CapacityError` over the quota or when none frees in time.
        Cancelling the caller takes nothing."""
        charged = self.enter(door, client, now)
        try:
            seated = await self.admission.acquire()
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
        self.admission.release()
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


__all__ = ["Door", "Doorway", "Pass"]

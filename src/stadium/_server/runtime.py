"""What all sessions of one worker share: the :class:`Runtime`, the session lifecycle
(:class:`Phase`), the channel a transport offers, and the server's close codes and bounds.

:mod:`stadium._server.sessions.runner` runs one session on it; transports build a :class:`Runtime`
through :class:`~stadium._server.processes.worker.Worker`.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import enum
import inspect
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from stadium._core.limits import ClientLimits
from stadium._env.spec import EnvSpec
from stadium._errors import CapacityError, describe_exception
from stadium._server.admission.doorway import Doorway
from stadium._server.admission.slots import Admission
from stadium._server.durability.records import Durable
from stadium._server.invoke import Invoker
from stadium._server.ledger import Ledger, RecordConfig
from stadium._server.metrics import FLUSH_INTERVAL_S, MetricsBoard, WorkerCounts
from stadium._util.throttle import DistinctErrorLog

log = logging.getLogger("stadium.session")

SESSION_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "stadium_session", default=None
)
"""The short id of the session a log record is about, while the server logs for it
(``--log-format json`` puts it in the ``session`` field)."""

NODE_NAME = socket.gethostname()
"""This node's name, as ``/health`` reports it and resumable sessions name their node."""

# WebSocket close codes used by the server.
CLOSE_NORMAL = 1000
CLOSE_GOING_AWAY = 1001
CLOSE_SERVICE_RESTART = 1012
"""A draining server's close of a durable session: resume it (another node restores it)."""
CLOSE_INTERNAL_ERROR = 1011
CLOSE_TRY_AGAIN_LATER = 1013
CLOSE_POLICY = 1008

#: Requests queued behind a running one before the session refuses more (count, bytes).
MAX_PENDING = 1024
MAX_PENDING_BYTES = 32 * 1024 * 1024
#: Replies a transport holds unsent for a client that does not read, before closing it (1008).
MAX_UNSENT_BYTES = 16 * 1024 * 1024
#: Fragments one WebSocket message may arrive in.
MAX_FRAGMENTS = 1024


class Channel(Protocol):
    """What a transport offers a session: send a frame, close the connection."""

    def send(self, data: bytes) -> None: ...

    def close(self, code: int, reason: str) -> None: ...


class Phase(enum.IntEnum):
    """Lifecycle of a session on the server."""

    ADMITTING = 0
    """Waiting for a free slot; messages are queued."""
    STARTING = 1
    """Slot taken; the environment is being created."""
    OPEN = 2
    """Serving requests."""
    DETACHED = 3
    """A resumable session whose connection was lost: the env, its slot and the
    in-flight call are kept (replies held) for ``--resume-grace`` seconds, until the
    client resumes it on a new connection (see :mod:`stadium._core.resume`)."""
    CLOSING = 4
    """Finishing the in-flight request, then closing (close frame, drain, idle)."""
    CLOSED = 5
    """Slot and environment released."""


class SessionLike(Protocol):
    """What the runtime sees of a session (:class:`stadium._server.sessions.runner.Session`)."""

    phase: Phase
    last_active: float
    outcome: str

    @property
    def sid(self) -> str: ...

    @property
    def busy(self) -> bool: ...

    @property
    def channel(self) -> Channel: ...

    def close(self, code: int = ..., reason: str = ...) -> None: ...

    def connection_lost(self, channel: Any = None) -> None: ...


class Runtime:
    """What all sessions of one worker share: spec, admission, env calls, counters.

    Args:
        spec: the compiled environment class.
        admission: the session slots and their queue.
        executor_threads: size of the thread pool for blocking sync env calls.
        step_timeout: seconds an env call that waits may run (0: no limit); past
            it the request is answered ``TIMEOUT`` and the session closed (1011).
        env_kwargs: keyword arguments for every env instance.
        limits: the per-client session quota and request rate (``None``: off).
        debug_errors: error replies carry exceptions' full text, and every env
            exception is logged with its traceback (else: paths cut from replies,
            one traceback per distinct env error, repeats counted, see :meth:`env_raised`).
        board: where the worker publishes its metrics (``metrics``; shared across
            forked workers); default: a board of its own.
        resume_grace: seconds a resumable session's env and slot are kept after its
            connection is lost, for the client to resume it (0: no resume).
        durable: the store resumable sessions are written to after each reply, to be
            restored by any worker after theirs died (``--durable``).
        record: ``--record``'s configuration (episodes written as Parquet shards), or
            ``None``.
    """

    def __init__(
        self,
        spec: EnvSpec,
        admission: Admission,
        *,
        executor_threads: int = 8,
        step_timeout: float = 0.0,
        env_kwargs: dict[str, Any] | None = None,
        limits: ClientLimits | None = None,
        debug_errors: bool = False,
        board: MetricsBoard | None = None,
        resume_grace: float = 0.0,
        durable: Durable | None = None,
        record: RecordConfig | None = None,
    ) -> None:
        self.limits = limits
        self.debug_errors = debug_errors
        self._env_errors = DistinctErrorLog(log, logging.WARNING)
        self.spec = spec
        self.admission = admission
        self.invoke = Invoker(executor_threads, step_timeout)
        self.step_takes_timeout_s = _takes_timeout_s(spec)
        """Whether the env's ``step`` takes ``timeout_s`` (OpenEnv's), passed when sent."""
        self.watchdog: Any = None
        self.isolation: Any = None
        """The worker's :class:`~stadium._server.isolation.Isolation` (isolated sessions)."""
        """The worker's :class:`~stadium._server.processes.watchdog.Watchdog` when one runs
        (its counters)."""
        self.env_kwargs = env_kwargs or {}
        self.attachable: dict[str, Any] = {}
        """Envs a WebSocket may attach to by id (``/ws?session_id=``): OpenEnv's HTTP MCP
        sessions (``mcp_sessions.McpSessions``), which hold their slot and close their env."""
        self.attached: dict[str, SessionLike] = {}
        self.attachable_tenant: dict[str, str | None] = {}
        """The tenant (``--tenants``; ``None``: none) of each of :attr:`attachable`: only a
        token of that tenant uses, attaches to or closes it."""
        self.sweepers: list[Callable[[], None]] = []
        self.close_mcp_session: Callable[[str, str | None], Awaitable[bool]] | None = None
        """Closes an HTTP MCP session by id, of a tenant (set by the HTTP endpoints), for the
        ``openenv/session/close`` a WebSocket session may send."""
        self.detached_idle_timeout = 300.0
        """Seconds a session without a live connection (HTTP MCP) is kept unused (0: forever;
        set by :meth:`start_reaper`)."""
        """Called with each round of the idle reaper (e.g. ``endpoints``'s idle MCP sessions)."""
        """The session attached to each of :attr:`attachable` (one at a time)."""
        self.sessions: set[SessionLike] = set()
        self.resume_grace = resume_grace
        """Seconds a resumable session outlives its connection (0: sessions are not resumable)."""
        self.resumable: dict[str, SessionLike] = {}
        """Resumable sessions by resume id (``resume``), attached or detached."""
        self.durable = durable
        """Where durable sessions are written (``--durable``), else ``None``."""
        self.draining = False
        # Metrics (``metrics``): counted straight into this worker's row of the board.
        self.board = board or MetricsBoard(1)
        self.counts = counts = WorkerCounts(self.board)
        self.doors = Doorway(admission, limits, counts.opened)
        """The one admission every session goes through (``doorway``): slots, the
        per-client quota and rate, ids and tokens, the count by door."""
        self.errors_total: collections.Counter[str] = counts.errors
        """Error replies by code."""
        self.outcomes: collections.Counter[str] = counts.outcomes
        """Sessions ended, by ``stadium_sessions_total`` outcome."""
        self.step_seconds = counts.step_seconds
        self.reset_seconds = counts.reset_seconds
        self.admission_wait = counts.admission_wait
        self.ledger = Ledger(spec, counts.episodes, record, counts.recording)
        """Episodes' cost, summed into the metrics; the recorder (``ledger``)."""
        self.open_connections: Callable[[], int] = lambda: len(self.sessions)
        self.handoff_refused: Callable[[], int] = lambda: 0
        """Connection hand-offs refused so far (set by the transport that takes them)."""
        """The worker's open connections (the transport sets it: it knows its HTTP ones)."""
        self._flusher: asyncio.TimerHandle | None = None
        self._reaper: asyncio.TimerHandle | None = None

    def new_env(self) -> Any:
        return self.spec.factory(**self.env_kwargs) if self.env_kwargs else self.spec.factory()

    def capacity_error(self) -> CapacityError:
        return self.doors.capacity_error()

    @property
    def sessions_total(self) -> int:
        """Sessions this worker admitted, through every door."""
        return self.doors.sessions_total

    def describe(self, exc: BaseException) -> str:
        """``"TypeName: message"`` for an error reply (paths cut unless ``debug_errors``)."""
        return describe_exception(exc, debug=self.debug_errors)

    def env_raised(self, what: str, exc: BaseException, session: SessionLike | None = None) -> None:
        """Log an exception the environment raised (the env author's bug, not the client's).

        A client can make an env raise at will, so the reports are bounded: each
        distinct error (type and innermost frame) is logged at WARNING with its
        traceback once, then at most once per 10 s with how often it recurred (see
        :class:`~stadium._util.throttle.DistinctErrorLog`). With ``debug_errors`` every
        one is logged at ERROR with its traceback. The record carries ``session``'s
        short id (:data:`SESSION_ID`).
        """
        token = SESSION_ID.set(session.sid) if session is not None else None
        try:
            if self.debug_errors:
                log.error("%s: %r", what, exc, exc_info=exc)
            else:
                self._env_errors("%s: %r", what, exc, exc=exc)
        finally:
            if token is not None:
                SESSION_ID.reset(token)

    def reap_idle(self, idle_timeout: float) -> int:
        """Close connected sessions with no request for ``idle_timeout`` seconds; return
        how many (each closed with 1001, its reason logged, counted as ``reaped``)."""
        now = asyncio.get_running_loop().time()
        reaped = 0
        for session in list(self.sessions):
            if (
                session.phase is Phase.OPEN
                and not session.busy
                and now - session.last_active > idle_timeout
            ):
                session.outcome = "reaped"
                session.close(CLOSE_GOING_AWAY, f"idle for more than {idle_timeout:g}s")
                reaped += 1
        return reaped

    def start_reaper(self, connected: float, detached: float = 0.0) -> None:
        """Reap idle sessions on the running loop, every quarter of the shorter timeout
        (at most 5 s). Idempotent; :meth:`shutdown` stops it.

        Args:
            connected: seconds a quiet session with a live connection is kept (0: forever;
                ``--idle-timeout`` given explicitly). Its peer's liveness is the pings' job.
            detached: seconds a session without a live connection (an HTTP MCP session,
                :attr:`sweepers`) is kept unused (0: forever).
        """
        self.detached_idle_timeout = detached
        timeouts = [t for t in (connected, detached) if t > 0]
        if self._reaper is not None or not timeouts:
            return
        loop = asyncio.get_running_loop()
        interval = max(0.05, min(min(timeouts) / 4, 5.0))

        def reap() -> None:
            if connected > 0:
                self.reap_idle(connected)
            for sweep in self.sweepers:
                sweep()
            self._reaper = loop.call_later(interval, reap)

        self._reaper = loop.call_later(interval, reap)

    def stop_reaper(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            self._reaper = None

    @property
    def steps_total(self) -> int:
        """Steps answered with an observation by this worker."""
        return self.counts.steps

    def publish_metrics(self) -> None:
        """Copy this worker's gauges into its row of :attr:`board` (see ``metrics``)."""
        waiting = self.admission.waiting
        invoke = self.invoke
        pool = invoke.executor
        self.counts.publish(
            active=len(self.sessions) - waiting,
            queue=waiting,
            connections=self.open_connections(),
            isolated=self.isolation.counts() if self.isolation is not None else (0,) * 8,
            pool=(pool.live, pool.busy, pool.queued, invoke.stuck, pool.saturated),
            handoff_refused=self.handoff_refused(),
            images=(iso.pools.counts(iso.policy) if (iso := self.isolation) else ((), ())),
        )

    def start_metrics(self) -> None:
        """Publish the metrics every :data:`~.metrics.FLUSH_INTERVAL_S` (idempotent)."""
        if self._flusher is not None:
            return
        loop = asyncio.get_running_loop()

        def flush() -> None:
            self.publish_metrics()
            self._flusher = loop.call_later(FLUSH_INTERVAL_S, flush)

        flush()

    def shutdown(self) -> None:
        """Stop the reaper and the thread pool (running calls are not waited for);
        publish the metrics a last time."""
        self.stop_reaper()
        if self.durable is not None:
            self.durable.close()
        if self._flusher is not None:
            self._flusher.cancel()
            self._flusher = None
            self.publish_metrics()
        self.invoke.shutdown()
        self.ledger.close()
        if self.isolation is not None:
            self.isolation.shutdown()


def _takes_timeout_s(spec: EnvSpec) -> bool:
    try:
        return "timeout_s" in inspect.signature(spec.env_cls.step).parameters
    except (TypeError, ValueError):  # no signature to read
        return False

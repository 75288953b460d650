"""Session runner: one environment instance driven by the protocol core, for any transport.

A transport (picows, ASGI) wraps each connection in a :class:`Session` and calls
:meth:`Session.feed` with every complete message, :meth:`Session.connection_lost`
when the peer is gone. The session admits itself, creates its environment,
runs calls one at a time in arrival order (later messages queue), and sends the
replies through the transport's :class:`Channel`.

No OS thread per session: async env methods run on the event loop (as eager
tasks where Python has them, so a call that does not suspend costs no task
switch); blocking sync methods run on the worker's one bounded thread pool;
non-blocking sync methods run inline.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import enum
import functools
import inspect
import itertools
import logging
import os
import urllib.parse
import uuid
from bisect import bisect_left
from collections.abc import Callable
from typing import Any, Protocol

from stadium import _mcp
from stadium._admission import Admission, Verdict
from stadium._errors import (
    CallTimeoutError,
    CapacityError,
    ExecutionError,
    SessionError,
    StadiumError,
    describe_exception,
)
from stadium._invoke import Invoker
from stadium._limits import Client, ClientLimits, TokenBucket
from stadium._metrics import FLUSH_INTERVAL_S, MetricsBoard, WorkerCounts
from stadium._protocol import Call, Encoding, Op, SessionProtocol
from stadium._spec import CallMode, EnvSpec
from stadium._throttle import DistinctErrorLog, ThrottledLog

log = logging.getLogger("stadium.session")

# Module constants: an enum member looked up on its class costs ~20 ns, per step.
_STATE = Op.STATE
_STEP = Op.STEP
_MCP = Op.MCP

SESSION_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "stadium_session", default=None
)
"""The short id of the session a log record is about, while the server logs for it
(``--log-format json`` puts it in the ``session`` field)."""
_SESSION_NUMBERS = itertools.count(1)

# WebSocket close codes used by the server.
CLOSE_NORMAL = 1000
CLOSE_GOING_AWAY = 1001
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
    CLOSING = 3
    """Finishing the in-flight request, then closing (close frame, drain, idle)."""
    CLOSED = 4
    """Slot and environment released."""


def attach_id(query: str) -> str | None:
    """The ``session_id`` of a ``/ws`` URL's query string (OpenEnv's attach to an HTTP MCP
    session), or ``None``."""
    if "session_id=" not in query:
        return None
    values = urllib.parse.parse_qs(query).get("session_id")
    return values[0] if values else None


def _new_episode_id() -> str:
    return uuid.uuid4().hex


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
        board: where the worker publishes its metrics (``_metrics``; shared across
            forked workers); default: a board of its own.
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
        """The worker's :class:`~stadium._watchdog.Watchdog` when one runs (its counters)."""
        self.env_kwargs = env_kwargs or {}
        self.attachable: dict[str, Any] = {}
        """Envs a WebSocket may attach to by id (``/ws?session_id=``): OpenEnv's HTTP MCP
        sessions (``_http.McpSessions``), which hold their slot and close their env."""
        self.attached: dict[str, Session] = {}
        """The session attached to each of :attr:`attachable` (one at a time)."""
        self.sessions: set[Session] = set()
        self.draining = False
        self.sessions_total = 0
        # Metrics (``_metrics``): counted straight into this worker's row of the board.
        self.board = board or MetricsBoard(1)
        self.counts = counts = WorkerCounts(self.board)
        self.errors_total: collections.Counter[str] = counts.errors
        """Error replies by code."""
        self.outcomes: collections.Counter[str] = counts.outcomes
        """Sessions ended, by ``stadium_sessions_total`` outcome."""
        self.step_seconds = counts.step_seconds
        self.reset_seconds = counts.reset_seconds
        self.admission_wait = counts.admission_wait
        self.open_connections: Callable[[], int] = lambda: len(self.sessions)
        """The worker's open connections (the transport sets it: it knows its HTTP ones)."""
        self._flusher: asyncio.TimerHandle | None = None
        self._reaper: asyncio.TimerHandle | None = None

    def new_env(self) -> Any:
        return self.spec.factory(**self.env_kwargs) if self.env_kwargs else self.spec.factory()

    def capacity_error(self) -> CapacityError:
        slots = self.admission.slots
        return CapacityError(
            f"server at capacity ({slots.active()}/{slots.limit} sessions) and no slot freed "
            f"within {self.admission.timeout:g}s; retry later",
            active_sessions=slots.active(),
            max_sessions=slots.limit,
            retry_after_s=1.0,
        )

    def describe(self, exc: BaseException) -> str:
        """``"TypeName: message"`` for an error reply (paths cut unless ``debug_errors``)."""
        return describe_exception(exc, debug=self.debug_errors)

    def env_raised(self, what: str, exc: BaseException, session: Session | None = None) -> None:
        """Log an exception the environment raised (the env author's bug, not the client's).

        A client can make an env raise at will, so the reports are bounded: each
        distinct error (type and innermost frame) is logged at WARNING with its
        traceback once, then at most once per 10 s with how often it recurred (see
        :class:`~stadium._throttle.DistinctErrorLog`). With ``debug_errors`` every
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
        """Close sessions with no request for ``idle_timeout`` seconds; return how many."""
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

    def start_reaper(self, idle_timeout: float) -> None:
        """Reap idle sessions every ``idle_timeout / 4`` s (at most 5 s) on the running loop.

        Idempotent; ``idle_timeout`` 0 disables it. :meth:`shutdown` stops it.
        """
        if self._reaper is not None or idle_timeout <= 0:
            return
        loop = asyncio.get_running_loop()
        interval = max(0.05, min(idle_timeout / 4, 5.0))

        def reap() -> None:
            self.reap_idle(idle_timeout)
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
        """Copy this worker's gauges into its row of :attr:`board` (see ``_metrics``)."""
        waiting = self.admission.waiting
        self.counts.publish(
            active=len(self.sessions) - waiting,
            queue=waiting,
            connections=self.open_connections(),
        )

    def start_metrics(self) -> None:
        """Publish the metrics every :data:`~stadium._metrics.FLUSH_INTERVAL_S` (idempotent)."""
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
        if self._flusher is not None:
            self._flusher.cancel()
            self._flusher = None
            self.publish_metrics()
        self.invoke.shutdown()


class Session:
    """One session: admission, environment, ordered request processing, replies."""

    __slots__ = (
        "_attach",
        "_bucket",
        "_call",
        "_client",
        "_close_after",
        "_pending",
        "_pending_bytes",
        "_queued_at",
        "_sid",
        "_task",
        "_waiter",
        "channel",
        "client",
        "env",
        "last_active",
        "loop",
        "outcome",
        "phase",
        "protocol",
        "runtime",
    )

    def __init__(
        self,
        runtime: Runtime,
        channel: Channel,
        encoding: Encoding = Encoding.JSON,
        loop: asyncio.AbstractEventLoop | None = None,
        client: str | None = None,
        attach: str | None = None,
    ) -> None:
        self.runtime = runtime
        self.client = client
        """The peer's address (its IP), for the per-client limits."""
        self._attach = attach
        """The id of an HTTP MCP session whose env this session drives (OpenEnv's
        ``/ws?session_id=``): no slot of its own, the env not created nor closed here."""
        self._client: Client | None = None
        self._bucket: TokenBucket | None = None
        self.channel = channel
        self.loop = loop or asyncio.get_running_loop()
        self.protocol = SessionProtocol(runtime.spec, encoding, _new_episode_id)
        self.phase = Phase.ADMITTING
        self.env: Any = None
        self.last_active = self.loop.time()
        self._pending: collections.deque[bytes | str] | None = None
        self._pending_bytes = 0
        self._call: Call | None = None
        self._task: asyncio.Task[Any] | asyncio.Future[Any] | None = None
        self._waiter: Callable[[bool], None] | None = None
        self._close_after = (CLOSE_GOING_AWAY, "server closing session")
        self._queued_at = 0.0
        self._sid: str | None = None
        self.outcome = "completed"
        """How it ends, for ``stadium_sessions_total`` (``errored``, ``reaped`` set on the way)."""

    # -- transport-facing ------------------------------------------------------

    def start(self) -> None:
        """Ask for a slot; the session opens when one is granted."""
        rt = self.runtime
        if rt.draining:
            self._refuse(rt.capacity_error(), "server is shutting down")
            return
        if self._attach is not None:
            self._start_attached(self._attach)
            return
        if rt.limits is not None:
            client = rt.limits.open_session(self.client, self.loop.time())
            if client is None:
                self._refuse(rt.limits.quota_error(), "too many sessions from this client")
                return
            self._client = client
            self._bucket = client.bucket
        rt.sessions.add(self)
        waiter = self._on_admission
        verdict = rt.admission.admit(waiter)
        if verdict is Verdict.QUEUED:
            self._waiter = waiter
            self._queued_at = self.loop.time()
        else:
            self._on_admission(verdict is Verdict.ADMITTED)

    def feed(self, message: bytes | str) -> None:
        """Handle (or queue) one complete message from the peer."""
        self.last_active = self.loop.time()
        if self._call is not None or self.phase is not Phase.OPEN:
            if self.phase >= Phase.CLOSING:
                return
            pending = self._pending
            if pending is None:
                pending = self._pending = collections.deque()
                self._pending_bytes = 0
            size = len(message)
            if len(pending) >= MAX_PENDING or self._pending_bytes + size > MAX_PENDING_BYTES:
                self._send_error(
                    None,
                    SessionError(
                        f"more than {MAX_PENDING} requests or {MAX_PENDING_BYTES} bytes queued "
                        "behind the running one; wait for replies before sending more"
                    ),
                )
                return
            pending.append(message)
            self._pending_bytes += size
            return
        self._handle(message)

    def connection_lost(self) -> None:
        """The peer is gone: cancel in-flight work, free the slot and the environment."""
        if self.phase is Phase.CLOSED:
            return
        if self._waiter is not None:
            self.runtime.admission.cancel(self._waiter)
            self._waiter = None
        self._teardown()

    def close(self, code: int = CLOSE_GOING_AWAY, reason: str = "server closing session") -> None:
        """End the session from the server side, after the in-flight request, if any."""
        if self.phase >= Phase.CLOSING:
            return
        if self.phase is Phase.ADMITTING:
            self._refuse(self.runtime.capacity_error(), reason)
            return
        self.phase = Phase.CLOSING
        self._pending = None
        if self._call is None:
            self._finish_close(code, reason)
        else:
            self._close_after = (code, reason)

    @property
    def sid(self) -> str:
        """A short id for the logs (``pid.n``, made on first use: nothing per session else)."""
        if self._sid is None:
            self._sid = f"{os.getpid()}.{next(_SESSION_NUMBERS)}"
        return self._sid

    @property
    def busy(self) -> bool:
        return self._call is not None

    # -- admission and start-up -------------------------------------------------

    def _on_admission(self, granted: bool) -> None:
        queued = self._waiter is not None
        self._waiter = None
        if self.phase is not Phase.ADMITTING:
            if granted:  # the peer left while we waited: give the slot back
                self.runtime.admission.release()
            return
        if not granted:
            self._refuse(self.runtime.capacity_error(), "no free session slot")
            return
        self.phase = Phase.STARTING
        rt = self.runtime
        rt.sessions_total += 1
        wait = rt.admission_wait
        if queued:
            waited = self.loop.time() - self._queued_at
            wait.counts[bisect_left(wait.bounds, waited)] += 1
            wait.counts[-1] += waited
        else:
            wait.counts[0] += 1
        self._task = rt.invoke.run(self.loop, rt.spec.create_mode, rt.new_env, (), self._created)

    def _start_attached(self, sid: str) -> None:
        """Open on the env of HTTP MCP session ``sid`` (OpenEnv's ``MCPToolClient`` attaches
        its WebSocket so): refused, and closed (1008), if there is none or it is attached."""
        rt = self.runtime
        env = rt.attachable.get(sid)
        if env is None or sid in rt.attached:
            why = "has a WebSocket attached already" if env is not None else "is not open"
            self.phase = Phase.CLOSED
            rt.outcomes["refused"] += 1
            self._send_error(
                None,
                SessionError(
                    f"session_id {sid!r} {why}: open one with POST /mcp "
                    "openenv/session/create, or connect to /ws without session_id",
                    session_id=sid,
                ),
            )
            self.channel.close(CLOSE_POLICY, "unknown session_id")
            return
        rt.attached[sid] = self
        rt.sessions.add(self)
        self.env = env
        self.phase = Phase.OPEN
        if self._pending:
            self._drain_pending()

    def _created(self, _token: Any, env: Any, error: BaseException | None) -> None:
        self._task = None
        if error is not None:
            if isinstance(error, CallTimeoutError):
                self._timed_out("create", None, error)
                self._finish_close(*self._close_after)
            elif not isinstance(error, asyncio.CancelledError):
                self._fail_start(error)
            return
        self.env = env
        if self.phase is not Phase.STARTING:  # the peer left meanwhile
            self._release_env()
            return
        self.phase = Phase.OPEN
        if self._pending:
            self._drain_pending()

    def _fail_start(self, exc: BaseException) -> None:
        self.outcome = "errored"
        self.runtime.env_raised("creating the environment failed", exc, self)
        err = ExecutionError(
            f"creating the environment failed: {self.runtime.describe(exc)}",
            exception=type(exc).__name__,
            operation="create",
        )
        self.channel.send(self.protocol.error_reply(None, err))
        self.phase = Phase.CLOSING
        self._finish_close(CLOSE_INTERNAL_ERROR, "environment could not be created")

    def _refuse(self, err: CapacityError, reason: str) -> None:
        if self._client is not None:
            self._release_client()
        self.runtime.errors_total[str(err.code)] += 1
        self.runtime.outcomes["refused"] += 1
        self.runtime.sessions.discard(self)
        self.phase = Phase.CLOSED
        self._pending = None
        self.channel.send(self.protocol.error_reply(None, err))
        self.channel.close(CLOSE_TRY_AGAIN_LATER, reason)

    # -- request processing -----------------------------------------------------

    def _drain_pending(self) -> None:
        pending = self._pending
        while pending and self._call is None and self.phase is Phase.OPEN:
            message = pending.popleft()
            self._pending_bytes -= len(message)
            self._handle(message)

    def _handle(self, message: bytes | str) -> None:
        bucket = self._bucket
        if bucket is not None and (wait := bucket.take(self.last_active)):  # --rate-limit
            self._rate_limited(message, wait)
            return
        out = self.protocol.receive(message)
        if type(out) is bytes:
            self.runtime.errors_total[self.protocol.last_error or "protocol"] += 1
            self.channel.send(out)
            return
        assert isinstance(out, Call)
        call = out
        op = call.op
        rt = self.runtime
        spec = rt.spec
        if op is _STEP:
            if call.timeout_s is None:
                pending = rt.invoke.run(self.loop, spec.step_mode, self.env.step, (call.action,),
                                        self._on_done, call)  # fmt: skip
            else:
                pending = self._step_limited(call)
        elif op is Op.RESET:
            reset = functools.partial(self.env.reset, **call.reset_kwargs)
            pending = rt.invoke.run(self.loop, spec.reset_mode, reset, (), self._on_done, call)
        elif op is _STATE:
            try:
                state = self.env.state
            except Exception as exc:
                self._fail(call, exc)
                return
            self._reply(call, state)
            return
        elif op is _MCP:  # after the common ops: nothing added to their path
            pending = self._mcp(call)
        else:  # CLOSE
            self.phase = Phase.CLOSING
            self._pending = None
            self._finish_close(CLOSE_NORMAL, "session closed by client")
            return
        if pending is not None:  # the call waits: later messages queue behind it
            self._call = call
            self._task = pending

    def _on_done(self, call: Call, result: Any, error: BaseException | None) -> None:
        # A call that waited was registered in-flight; one that finished at once is
        # being answered inside _handle, whose caller (feed, or _drain_pending's loop)
        # goes on with the queue: draining here too would recurse once per message.
        waited = self._call is not None
        self._call = None
        self._task = None
        if self.phase is Phase.CLOSED:
            return
        if error is None:
            try:
                self._reply(call, result)
            except Exception as exc:  # e.g. an observation that cannot be encoded
                self._fail(call, exc)
        elif isinstance(error, asyncio.CancelledError):
            self._send_error(call, SessionError(f"{call.op.name.lower()} was cancelled"))
        elif isinstance(error, CallTimeoutError):
            self._timed_out(call.op.name.lower(), call, error)
        else:
            self._fail(call, error)
        if not waited:
            return
        if self.phase is Phase.CLOSING:
            self._finish_close(*self._close_after)
        elif self._pending:
            self._drain_pending()

    def _mcp(self, call: Call) -> asyncio.Future[Any] | None:
        """An ``mcp`` request: JSON-RPC on this session's env (``_mcp``), an eager task;
        the reply is ``{"type": "mcp", ...}``, the JSON-RPC error object when it fails."""
        req = _mcp.request(call.action)
        if isinstance(req, dict):  # not a JSON-RPC request: the error response
            self.channel.send(self.protocol.mcp_reply(call, req))
            return None
        rt = self.runtime
        dispatch = functools.partial(
            _mcp.dispatch, server=(rt.spec.name, rt.spec.version), describe=rt.describe
        )
        return rt.invoke.run(
            self.loop, CallMode.TASK, dispatch, (self.env, req), self._on_done, call
        )

    def _step_limited(self, call: Call) -> asyncio.Future[Any] | None:
        """A step that brought its own ``timeout_s``: bounded by it (and ``--step-timeout``),
        and given to an env whose ``step`` takes it (OpenEnv's)."""
        rt = self.runtime
        step = self.env.step
        if rt.step_takes_timeout_s:
            step = functools.partial(step, timeout_s=call.timeout_s)
        return rt.invoke.run(
            self.loop, rt.spec.step_mode, step, (call.action,), self._on_done, call,
            rt.invoke.bound(call.timeout_s),
        )  # fmt: skip

    def _timed_out(self, op: str, call: Call | None, error: CallTimeoutError) -> None:
        """Answer TIMEOUT, then close the session (1011) once the reply is out: the
        abandoned call may still be running on the env (in a thread), so the env
        cannot be trusted with another request."""
        limit = error.context.get("timeout_s")
        self._send_error(
            call,
            CallTimeoutError(
                f"{op} ran longer than {limit:g} s (the server's --step-timeout or the "
                "request's timeout_s) and was abandoned; the session is closed because the "
                "environment may still be running it: open a new session",
                operation=op,
                timeout_s=limit,
            ),
        )
        self.phase = Phase.CLOSING
        self.outcome = "errored"
        self._pending = None
        self._close_after = (CLOSE_INTERNAL_ERROR, f"{op} timed out after {limit:g} s")

    def _reply(self, call: Call, result: Any) -> None:
        protocol = self.protocol
        op = call.op
        if op is _STATE:
            frame = protocol.state_reply(call, result)
        elif op is _MCP:  # a JSON-RPC response (or error object): an ``mcp`` frame
            frame = protocol.mcp_reply(call, result)
        else:
            frame = protocol.observation_reply(call, result)
            rt = self.runtime
            # Timed from the request's arrival (the session's last message) to its reply;
            # the step histogram's count is the step count (``Runtime.steps_total``).
            hist = rt.step_seconds if op is _STEP else rt.reset_seconds
            took = self.loop.time() - self.last_active
            counts = hist.counts
            counts[bisect_left(hist.bounds, took)] += 1
            counts[-1] += took
        self.channel.send(frame)

    def _fail(self, call: Call, exc: BaseException) -> None:
        if isinstance(exc, StadiumError):
            err = exc
        else:
            op = call.op.name.lower()
            rt = self.runtime
            err = ExecutionError(
                f"{op} raised {rt.describe(exc)}",
                exception=type(exc).__name__,
                operation=op,
            )
            rt.env_raised(f"the environment's {op} raised", exc, self)
        self._send_error(call, err)

    def _rate_limited(self, message: bytes | str, wait: float) -> None:
        """Refuse a request over the client's ``--rate-limit``: not run; the session stays open."""
        limits = self.runtime.limits
        assert limits is not None
        err = limits.rate_error(wait)
        self.runtime.errors_total[str(err.code)] += 1
        self.channel.send(self.protocol.error_reply(self.protocol.request_id(message), err))

    def _release_client(self) -> None:
        """Give the client's session back to the per-client quota (once)."""
        client, self._client = self._client, None
        self._bucket = None
        limits = self.runtime.limits
        if client is not None and limits is not None:
            limits.close_session(client, self.loop.time())

    def _send_error(self, call: Call | None, err: StadiumError) -> None:
        self.runtime.errors_total[str(err.code)] += 1
        self.channel.send(self.protocol.error_reply(call, err))

    # -- teardown ---------------------------------------------------------------

    def _finish_close(self, code: int, reason: str) -> None:
        self.channel.close(code, reason)
        self._teardown()

    def _teardown(self) -> None:
        phase = self.phase
        self.phase = Phase.CLOSED
        self.protocol.close()
        self._pending = None
        rt = self.runtime
        if phase is not Phase.CLOSED:
            rt.outcomes[self.outcome] += 1
        rt.sessions.discard(self)
        task = self._task
        if task is not None and not task.done():
            task.cancel()
        self._task = None
        if self._attach is not None:  # the env and slot belong to the HTTP MCP session
            if rt.attached.get(self._attach) is self:
                del rt.attached[self._attach]
            self.env = None
            return
        if phase is not Phase.ADMITTING and phase is not Phase.CLOSED:
            rt.admission.release()
        if self._client is not None:
            self._release_client()
        self._release_env()

    def _release_env(self) -> None:
        env, self.env = self.env, None
        rt = self.runtime
        if env is not None and rt.spec.has_close:
            rt.invoke.run(self.loop, rt.spec.close_mode, env.close, (), _log_close_error)


_CLOSE_ERRORS = ThrottledLog(log, logging.WARNING)


def _takes_timeout_s(spec: EnvSpec) -> bool:
    try:
        return "timeout_s" in inspect.signature(spec.env_cls.step).parameters
    except (TypeError, ValueError):  # no signature to read
        return False


def _log_close_error(_token: Any, _result: Any, error: BaseException | None) -> None:
    if error is not None and not isinstance(error, asyncio.CancelledError):
        _CLOSE_ERRORS("closing the environment raised: %r", error, exc=error)

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
import functools
import inspect
import itertools
import logging
import os
import uuid
from bisect import bisect_left
from collections.abc import Callable
from time import perf_counter as _clock
from typing import Any

from stadium._core import mcp as _mcp
from stadium._core.access import Tenant
from stadium._core.limits import Bucket
from stadium._core.protocol import BatchCall, Call, Encoding, Op, RawCall, SessionProtocol
from stadium._core.resume import ResumeAsk, ResumeChannel, Target
from stadium._env.snapshot import restore_env
from stadium._env.spec import CallMode
from stadium._errors import (
    CallTimeoutError,
    CapacityError,
    ExecutionError,
    SessionError,
    StadiumError,
)
from stadium._server.admission.doorway import Door, Pass
from stadium._server.admission.slots import Verdict
from stadium._server.durability.records import SessionRecord
from stadium._server.invoke import EAGER_TASKS, Pending, awaited
from stadium._server.ledger import ThreadTimed
from stadium._server.runtime import (
    CLOSE_GOING_AWAY,
    CLOSE_INTERNAL_ERROR,
    CLOSE_NORMAL,
    CLOSE_POLICY,
    CLOSE_SERVICE_RESTART,
    CLOSE_TRY_AGAIN_LATER,
    MAX_PENDING,
    MAX_PENDING_BYTES,
    SESSION_ID,
    Channel,
    Phase,
    Runtime,
)
from stadium._server.sessions.episodes import EpisodeAccounts, ended_by
from stadium._server.sessions.forking import ForkingSession
from stadium._server.sessions.mcp_methods import SESSION_METHODS, session_method
from stadium._server.sessions.resumable import Where
from stadium._util.throttle import ThrottledLog

log = logging.getLogger("stadium.session")

Message = bytes | str | RawCall
"""What a session is fed: a frame, or a call of a batch frame decoded already (``batch``)."""


# Module constants: an enum member looked up on its class costs ~20 ns, per step.
_STATE = Op.STATE
_STEP = Op.STEP
_MCP = Op.MCP
_OPEN = Phase.OPEN
_POOL = CallMode.POOL
_TASK = CallMode.TASK
_STARTED = CallMode.STARTED

_SESSION_NUMBERS = itertools.count(1)


def _new_episode_id() -> str:
    return uuid.uuid4().hex


class Session(ForkingSession, EpisodeAccounts):
    """One session: admission, environment, ordered request processing, replies."""

    __slots__ = (
        "_attach",
        "_bucket",
        "_call",
        "_close_after",
        "_pass",
        "_pending",
        "_pending_bytes",
        "_queued_at",
        "_sid",
        "_task",
        "_waiter",
        "channel",
        "client",
        "env",
        "loop",
        "protocol",
        "runtime",
        "tenant",
    )

    def __init__(
        self,
        runtime: Runtime,
        channel: Channel,
        encoding: Encoding = Encoding.JSON,
        loop: asyncio.AbstractEventLoop | None = None,
        client: str | None = None,
        attach: str | None = None,
        resume: tuple[str, str] | None = None,
        tenant: Tenant | None = None,
    ) -> None:
        self.runtime = runtime
        self.client = client
        """The peer's address (its IP), for the per-client limits."""
        self.tenant = tenant
        """The tenant its token named (``--tenants``), charged its slot and quota."""
        self._attach = attach
        """The id of an HTTP MCP session whose env this session drives (OpenEnv's
        ``/ws?session_id=``): no slot of its own, the env not created nor closed here."""
        self._pass: Pass | None = None
        """What it is charged (``doorway``): its door, its client's quota and bucket."""
        self._bucket: Bucket | None = None
        self.channel = channel
        self.loop = loop or asyncio.get_running_loop()
        self.protocol = SessionProtocol(runtime.spec, encoding, _new_episode_id)
        self.phase = Phase.ADMITTING
        self.env: Any = None
        self.last_active = self.loop.time()
        self._pending: collections.deque[Message] | None = None
        self._pending_bytes = 0
        self._call: Call | None = None
        self._task: Pending | None = None
        self._waiter: Callable[[bool], None] | None = None
        self._close_after = (CLOSE_GOING_AWAY, "server closing session")
        self._queued_at = 0.0
        self._sid: str | None = None
        self._no_episode()
        self.outcome = "completed"
        """How it ends, for ``stadium_sessions_total`` (``errored``, ``reaped`` set on the way)."""
        self.resume_id: str | None = None
        """The id a client resumes this session by (``resume``); ``None``: not resumable."""
        self._token = ""
        self._expiry: asyncio.TimerHandle | None = None
        self._restoring: tuple[SessionRecord, ResumeAsk, Where] | None = None
        """A durable session being restored from the store: its record, the resume."""
        if resume is not None:  # replies go through a ResumeChannel, which keeps the last few
            self.resume_id, self._token = resume
            self.channel = ResumeChannel(channel)
            runtime.resumable[self.resume_id] = self

    # -- transport-facing ------------------------------------------------------

    def start(self, door: Door = Door.WEBSOCKET, group: object | None = None) -> None:
        """Ask the worker's :class:`~stadium._server.admission.doorway.Doorway` for a slot
        (``door``: how this session came: a WebSocket, a batch entry, a restore); it opens when
        one is granted. ``group``: the batch connection it is one of, whose waiting
        sessions are bounded together."""
        rt = self.runtime
        if rt.draining:
            self._refuse(rt.capacity_error(), "server is shutting down")
            return
        if self._attach is not None:
            self._start_attached(self._attach)
            return
        waiter = self._on_admission
        try:
            charged, verdict = rt.doors.admit(
                door, self.client, self.loop.time(), waiter, group, self.tenant
            )
        except CapacityError as err:  # the client holds its --max-sessions-per-client
            self._refuse(err, "too many sessions from this client")
            return
        self._pass = charged
        self._bucket = charged.bucket
        rt.sessions.add(self)
        if verdict is Verdict.QUEUED:
            self._waiter = waiter
            self._queued_at = self.loop.time()
        elif verdict is Verdict.TOO_MANY_WAITING:
            refusal = rt.admission.queue_error(group, self.client, self.tenant)
            self._refuse(refusal, "too many sessions waiting")
        else:
            self._on_admission(verdict is Verdict.ADMITTED)

    def feed(self, message: Message) -> None:
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

    def step_now(self, message: RawCall, now: float) -> bytes | bool:
        """A batch's step on an open, idle session, without the queue's checks and the
        envelope's reading (``batch``); ``now``: the batch's arrival.

        Returns the reply itself when the step was answered at once and nothing stands
        between it and the batch (the usual case): the batch files it in place, and a
        resumable session's channel has already counted and kept it, as its ``send``
        would have. ``True`` when the reply went, or will go, to the channel as any
        other. ``False``, nothing done, when the session or the call is not that simple:
        :meth:`feed` it then."""
        if self.phase is not _OPEN or self._call is not None or self._pending:
            return False
        if self._bucket is not None:
            return False
        call = self.protocol.step_call(message)
        if call is None:
            return False
        self.last_active = now
        self._ep_in += len(message)
        if self._ep_log is not None:
            self._ep_req = self._batch_request(message)
        rt = self.runtime
        mode = rt.spec.step_mode
        if mode is _POOL or (mode is _TASK and not EAGER_TASKS):
            step = ThreadTimed(self.env.step, self) if mode is _POOL else self.env.step
            pending = rt.invoke.run(self.loop, mode, step, (call.action,), self._on_done, call)
            if pending is not None:
                self._call = call
                self._task = pending
            return True
        # Invoker.run's inline and eager-task cases, inlined: the batch's per-step path is
        # the session's (measured: Invoker.run + _settle + _on_done were half of it).
        try:
            t0 = _clock()
            if mode is _TASK:
                task: asyncio.Task[Any] = asyncio.Task(
                    self.env.step(call.action),
                    loop=self.loop,
                    eager_start=True,  # type: ignore[call-arg,unused-ignore]
                )
                if not task.done():  # it waits: as Invoker.run would go on
                    self._ep_cpu += _clock() - t0
                    self._call = call
                    self._task = rt.invoke.follow(self.loop, task, None, None, self._on_done, call)
                    return True
                result = task.result()
            elif mode is _STARTED:  # an isolated step: the invoker hands it _on_done
                pending = rt.invoke.run(self.loop, mode, self.env.step, (call.action,),
                                        self._on_done, call)  # fmt: skip
                self._ep_cpu += _clock() - t0
                if pending is not None:
                    self._call = call
                    self._task = pending
                return True
            else:
                result = self.env.step(call.action)
            self._ep_cpu += _clock() - t0
            # _reply for a step, inlined (one Python call less per batched step)
            frame = self.protocol.observation_reply(call, result)
            hist = rt.step_seconds
            end = self.loop.time()
            took = end - now
            counts = hist.counts
            counts[bisect_left(hist.bounds, took)] += 1
            counts[-1] += took
            self._ep_out += len(frame)
            if self.protocol.ended or self._ep_log is not None:
                frame = self._episode_step(call, frame, took, end, result)
        except Exception as exc:  # the env raised, or its observation cannot be encoded
            self._fail(call, exc)
            return True
        if self.resume_id is None:  # the channel is the batch's own: it files the reply
            return frame
        # ResumeChannel.send's usual case, inlined: counted and kept, then given back
        channel: ResumeChannel = self.channel  # type: ignore[assignment]
        if channel.persist is None and channel.target is not None and not channel.unsent:
            channel.count += 1
            channel.recent.append(frame)
            return frame
        channel.send(frame)  # a record to write first, or replies before it waiting
        return True

    def connection_lost(self, channel: Target | None = None) -> None:
        """The peer is gone: cancel in-flight work, free the slot and the environment.

        A resumable session that is open is *detached* instead (:meth:`_detach`);
        ``channel`` (the lost connection) is ignored when the session has since
        been resumed on another one.
        """
        if self.phase is Phase.CLOSED:
            return
        if self.resume_id is not None:
            current = self.channel
            assert isinstance(current, ResumeChannel)
            if channel is not None and current.target is not channel:
                return  # a connection this session was taken from by a resume
            if self.phase is Phase.OPEN and not self.runtime.draining:
                self._detach(current)
                return
        if self._waiter is not None:
            self.runtime.admission.cancel(self._waiter)
            self._waiter = None
        if self.phase is not Phase.CLOSING:
            _log_close(self, None, "the connection was closed by the peer or lost")
        self._teardown()

    def close(self, code: int = CLOSE_GOING_AWAY, reason: str = "server closing session") -> None:
        """End the session from the server side, after the in-flight request, if any."""
        if self.phase >= Phase.CLOSING:
            return
        if self.phase is Phase.ADMITTING:
            self._refuse(self.runtime.capacity_error(), reason)
            return
        rt = self.runtime
        if code == CLOSE_GOING_AWAY and rt.draining and rt.durable and self.resume_id:
            code = CLOSE_SERVICE_RESTART  # its record stays: the client resumes it elsewhere
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
                self.runtime.admission.release(self.tenant)
            return
        if not granted:
            self._refuse(self.runtime.capacity_error(), "no free session slot")
            return
        self.phase = Phase.STARTING
        rt = self.runtime
        assert self._pass is not None
        rt.doors.open(self._pass.door)
        wait = rt.admission_wait
        if queued:
            waited = self.loop.time() - self._queued_at
            wait.counts[bisect_left(wait.bounds, waited)] += 1
            wait.counts[-1] += waited
        else:
            wait.counts[0] += 1
        if self._restoring is None:
            self._task = rt.invoke.run(
                self.loop, rt.spec.create_mode, rt.new_env, (), self._created
            )
            return
        blob = self._restoring[0].env
        mode = CallMode.POOL if rt.spec.create_mode is CallMode.POOL else CallMode.INLINE
        restore = functools.partial(restore_env, rt.new_env, blob)
        self._task = rt.invoke.run(self.loop, mode, restore, (), self._created)

    def _start_attached(self, sid: str) -> None:
        """Open on the env of HTTP MCP session ``sid`` (OpenEnv's ``MCPToolClient`` attaches
        its WebSocket so): refused, and closed (1008), if there is none or it is attached."""
        rt = self.runtime
        env = rt.attachable.get(sid)
        if env is not None and rt.attachable_tenant.get(sid) != (
            None if self.tenant is None else self.tenant.name
        ):  # another tenant's (--tenants): as if there were none
            env = None
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
        # Held by the attaching client (its bucket: --rate-limit), not a session of its
        # quota: the slot and the env are the MCP session's, charged to its creator.
        charged = rt.doors.enter(
            Door.MCP_ATTACH, self.client, self.loop.time(), counted=False, tenant=self.tenant
        )
        self._pass = charged
        self._bucket = charged.bucket
        rt.doors.open(Door.MCP_ATTACH)
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
        bind = getattr(env, "bind_session", None)  # an isolated env: its output's log tag
        if bind is not None:
            bind(self.sid)
        if self.phase is not Phase.STARTING:  # the peer left meanwhile
            self._release_env()
            return
        self.phase = Phase.OPEN
        if self.resume_id is not None and self.runtime.durable is not None:
            channel = self.channel
            assert isinstance(channel, ResumeChannel)
            channel.persist = self._persist
            if self._restoring is not None:
                self._restored(channel, *self._restoring)
                return
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
        if self._pass is not None:
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

    def _handle(self, message: Message) -> None:
        bucket = self._bucket
        if (
            bucket is not None
            and (wait := bucket.take(self.last_active))  # --rate-limit
            and not self.protocol.is_close(message)  # a close always passes
        ):
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
            self._ep_in += len(message)
            if self._ep_log is not None:  # recorded: the request as it came (its action)
                self._ep_req = (
                    self._batch_request(message) if isinstance(message, BatchCall) else message
                )
            mode = spec.step_mode
            if mode is _POOL:  # the pool thread's own CPU clock
                pending = self._step_pooled(call)
            else:  # on the loop: timed from here to _reply (or to its first suspension)
                self._t0 = t0 = _clock()
                if call.timeout_s is None:
                    pending = rt.invoke.run(self.loop, mode, self.env.step, (call.action,),
                                            self._on_done, call)  # fmt: skip
                else:
                    pending = self._step_limited(call, self.env.step)
                if pending is not None and self._t0:  # it suspended: its part so far
                    self._ep_cpu += _clock() - t0
                    self._t0 = 0.0
        elif op is Op.RESET:
            pending = self._reset(call, len(message))
        elif op is _STATE:
            try:
                state = self.env.state
            except Exception as exc:
                self._fail(call, exc)
                return
            if not inspect.isawaitable(state):
                self._reply(call, state)
                return
            # An awaitable state (an isolated env's, read in its process): awaited as a task.
            pending = rt.invoke.run(self.loop, CallMode.TASK, awaited, (state,), self._on_done,
                                    call)  # fmt: skip
        elif op is _MCP:  # after the common ops: nothing added to their path
            pending = self._mcp(call)
        elif op is Op.FORK:
            pending = self._fork(call)
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

    def _mcp(self, call: Call) -> Pending | None:
        """An ``mcp`` request: JSON-RPC on this session's env (``mcp``), an eager task;
        the reply is ``{"type": "mcp", ...}``, the JSON-RPC error object when it fails."""
        req = _mcp.request(call.action)
        if isinstance(req, dict):  # not a JSON-RPC request: the error response
            self.channel.send(self.protocol.mcp_reply(call, req))
            return None
        rt = self.runtime
        if req.method in SESSION_METHODS:  # OpenEnv's session methods, on this session
            own = functools.partial(
                session_method, rt, self._attach or self.resume_id or self.sid,
                tenant=None if self.tenant is None else self.tenant.name,
            )  # fmt: skip
            return rt.invoke.run(self.loop, CallMode.TASK, own, (req,), self._on_done, call)
        dispatch = functools.partial(
            _mcp.dispatch, server=(rt.spec.name, rt.spec.version), describe=rt.describe
        )
        return rt.invoke.run(
            self.loop, CallMode.TASK, dispatch, (self.env, req), self._on_done, call
        )

    def _step_limited(self, call: Call, step: Callable[..., Any]) -> Pending | None:
        """A step that brought its own ``timeout_s``: bounded by it (and ``--step-timeout``),
        and given to an env whose ``step`` takes it (OpenEnv's)."""
        rt = self.runtime
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
            frame = self._state_cost(protocol.state_reply(call, result))
        elif op is _MCP:  # a JSON-RPC response (or error object): an ``mcp`` frame
            frame = protocol.mcp_reply(call, result)
        elif op is Op.FORK:  # an isolated env's, forked off the loop (_fork_later)
            frame = protocol.forked_reply(call, result)
        else:
            t0 = self._t0
            if t0:  # the env call ran on the loop: its time (docs/PROTOCOL.md, Episode cost)
                self._ep_cpu += _clock() - t0
                self._t0 = 0.0
            rt = self.runtime
            if op is not _STEP and self.tenant is not None and protocol.step_count:
                rt.doors.steps(self.tenant, protocol.step_count, self._pass)  # a reset ends them
            frame = protocol.observation_reply(call, result)
            # Timed from the request's arrival (the session's last message) to its reply;
            # the step histogram's count is the step count (``Runtime.steps_total``).
            hist = rt.step_seconds if op is _STEP else rt.reset_seconds
            end = self.loop.time()
            took = end - self.last_active
            counts = hist.counts
            counts[bisect_left(hist.bounds, took)] += 1
            counts[-1] += took
            self._ep_out += len(frame)
            if op is not _STEP:
                self._episode_reset(call, frame)
            elif self._ep_log is not None:  # recorded: _episode_step, inlined
                if self._ep_in + self._ep_out <= self._ep_bound:
                    self._ep_rec(self._ep_log, self._ep_req, frame, took)
                else:
                    self._ep_clipped = True
                if protocol.ended and self._ep_start:
                    frame = self._episode_over(ended_by(result), end, frame)
            elif protocol.ended:
                frame = self._episode_step(call, frame, took, end, result)
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

    def _rate_limited(self, message: Message, wait: float) -> None:
        """Refuse a request over the client's ``--rate-limit``: not run; the session stays open."""
        limits = self.runtime.limits
        assert limits is not None
        err = limits.rate_error(wait)
        self.runtime.errors_total[str(err.code)] += 1
        self.channel.send(self.protocol.error_reply(self.protocol.request_id(message), err))

    def _release_client(self) -> None:
        """Give what the session was charged back to its client (once)."""
        charged, self._pass = self._pass, None
        self._bucket = None
        if charged is not None:
            self.runtime.doors.leave(charged, self.loop.time())

    def _send_error(self, call: Call | None, err: StadiumError) -> None:
        self.runtime.errors_total[str(err.code)] += 1
        self._t0 = 0.0
        frame = self.protocol.error_reply(call, err)
        if call is not None and self._ep_start:  # an error in the running episode
            self._episode_error(call, frame, err)
        self.channel.send(frame)

    # -- teardown ---------------------------------------------------------------

    def _finish_close(self, code: int, reason: str) -> None:
        _log_close(self, code, reason)
        self.channel.close(code, reason)
        self._teardown()

    def _teardown(self) -> None:
        phase = self.phase
        self.phase = Phase.CLOSED
        self._episode_closed()
        self.protocol.close()
        self._pending = None
        rt = self.runtime
        if self.resume_id is not None:
            rt.resumable.pop(self.resume_id, None)
            if rt.durable is not None and not rt.draining:  # ended: not to be restored
                rt.durable.drop(self.resume_id)
            if self._expiry is not None:
                self._expiry.cancel()
                self._expiry = None
        if phase is not Phase.CLOSED:
            rt.outcomes[self.outcome] += 1
        rt.sessions.discard(self)
        task = self._task
        if task is not None and not task.done():
            task.cancel()
        self._task = None
        charged = self._pass
        tenant = self.tenant
        if tenant is not None and phase is not Phase.CLOSED:  # --tenants: steps, charge back
            self._pass = None
            self._bucket = None
            rt.doors.closed(charged, tenant, self.protocol.step_count, self.loop.time())
        elif charged is not None and (charged.record is not None or charged.tenant is not None):
            self._release_client()  # per-client limits or tenants on
        if self._attach is not None:  # the env and slot belong to the HTTP MCP session
            if rt.attached.get(self._attach) is self:
                del rt.attached[self._attach]
            self.env = None
            return
        if phase is not Phase.ADMITTING and phase is not Phase.CLOSED:
            rt.admission.release(self.tenant)
        self._release_env()

    def _release_env(self) -> None:
        env, self.env = self.env, None
        rt = self.runtime
        if env is not None and rt.spec.has_close:
            rt.invoke.run(self.loop, rt.spec.close_mode, env.close, (), _log_close_error)


_CLOSE_ERRORS = ThrottledLog(log, logging.WARNING)

_QUIET_OUTCOMES = frozenset({"completed"})


def _log_close(session: Session, code: int | None, reason: str) -> None:
    """Log why ``session`` ends: at INFO when the server ends it (reaped, expired, errors,
    drain), at DEBUG when its client does (a ``close`` request, a closed connection).
    ``stadium_sessions_total`` counts it by outcome."""
    server_side = code is not None and code != CLOSE_NORMAL
    level = logging.INFO if server_side or session.outcome not in _QUIET_OUTCOMES else logging.DEBUG
    if log.isEnabledFor(level):
        token = SESSION_ID.set(session.sid)
        try:
            log.log(
                level, "session closed (%s%s): %s", session.outcome,
                "" if code is None else f", code {code}", reason,
            )  # fmt: skip
        finally:
            SESSION_ID.reset(token)


def _log_close_error(_token: Any, _result: Any, error: BaseException | None) -> None:
    if error is not None and not isinstance(error, asyncio.CancelledError):
        _CLOSE_ERRORS("closing the environment raised: %r", error, exc=error)

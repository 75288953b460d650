"""Resuming, restoring and persisting a session: the resumable half of ``Session``.

:class:`ResumableSession` is a mixin of :class:`stadium._server.sessions.runner.Session` (its
``__slots__`` are the resume state; the rest it uses is the session's, named in
:class:`ResumeHost`). See :mod:`stadium._core.resume` for the wire extension and
:mod:`stadium._server.durability.records` for records.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Any, Protocol

import msgspec

from stadium._core.access import Tenant
from stadium._core.protocol import Call, SessionProtocol, SessionState
from stadium._core.resume import (
    REPLAY_FRAMES,
    ResumeAsk,
    ResumeChannel,
    ResumedData,
    Target,
    token_matches,
    unknown_session,
)
from stadium._env.snapshot import snapshot_env
from stadium._errors import ResumeError, StadiumError
from stadium._server.admission.doorway import Door
from stadium._server.durability.records import RECORD_VERSION, Durable, SessionRecord, token_digest
from stadium._server.runtime import CLOSE_GOING_AWAY, CLOSE_POLICY, Channel, Phase, Runtime
from stadium._util.throttle import ThrottledLog

log = logging.getLogger("stadium.session")

Where = tuple[str, str]
"""Where a session is served: the node's name and the ``host:port`` a connection reached."""


class ResumeHost(Protocol):
    """What the resumable half needs of the session it is part of: the one interface
    between the two halves, explicit (mypy checks :class:`~stadium._server.sessions.runner.Session`
    against it wherever a method below that calls back into the session is called).

    The session's state the resume uses, its own calls (:meth:`close`, :meth:`start`,
    :meth:`_send_error`, :meth:`_drain_pending`), and the resumable half's methods that
    these methods call in turn.
    """

    runtime: Runtime
    loop: asyncio.AbstractEventLoop
    channel: Channel
    protocol: SessionProtocol
    phase: Phase
    env: Any
    last_active: float
    outcome: str
    resume_id: str | None
    tenant: Tenant | None
    _token: str
    _expiry: asyncio.TimerHandle | None
    _call: Call | None
    _pending: Any
    _restoring: tuple[SessionRecord, ResumeAsk, Where] | None

    def close(self, code: int = ..., reason: str = ...) -> None: ...

    def start(self, door: Door = ...) -> None: ...

    def _send_error(self, call: Call | None, err: StadiumError) -> None: ...

    def _drain_pending(self) -> None: ...

    def resume(self, ask: ResumeAsk, target: Target, where: Where) -> StadiumError | None: ...

    def _take(self, channel: ResumeChannel, target: Target) -> None: ...

    def _persist(self, frame: bytes | None) -> bool: ...

    def _resume_later(self, ask: ResumeAsk, target: Target, where: Where) -> None: ...

    def _expire(self) -> None: ...


class ResumableSession:
    """The resume, restore and durable-record methods of a session (a mixin).

    What they need of the session is :class:`ResumeHost` (their ``self`` type where they
    call back into it): no call goes up to the session unnamed.
    """

    # The session's state this half writes (the rest is the session's own).
    __slots__ = ("_expiry", "_restoring", "_token", "last_active", "outcome", "phase", "resume_id")

    runtime: Runtime
    loop: asyncio.AbstractEventLoop
    channel: Channel
    protocol: SessionProtocol
    phase: Phase
    env: Any
    last_active: float
    resume_id: str | None
    tenant: Tenant | None
    _token: str
    _expiry: asyncio.TimerHandle | None
    _call: Call | None
    _pending: Any
    _restoring: tuple[SessionRecord, ResumeAsk, Where] | None

    def _detach(self: ResumeHost, channel: ResumeChannel) -> None:
        """The connection is lost: keep the env, slot and in-flight call for the grace
        period; replies made meanwhile are held for the resume."""
        channel.detach()
        self.phase = Phase.DETACHED
        self._expiry = self.loop.call_later(self.runtime.resume_grace, self._expire)

    def _expire(self: ResumeHost) -> None:
        self._expiry = None
        if self.phase is Phase.DETACHED:
            self.outcome = "expired"
            self.close(CLOSE_GOING_AWAY, "not resumed within the grace period")

    def resume(
        self: ResumeHost, ask: ResumeAsk, target: Target, where: Where
    ) -> StadiumError | None:
        """Bind the session to the connection ``target`` (a resume): the ``resumed``
        frame, the replies the client missed, then the requests that queued.

        A session still attached to another connection (whose loss this server has
        not seen yet) is taken from it. Returns the error to answer instead.

        ``ask.batched`` (a ``resume`` call of a batch, ``batch``): one ``resumed`` frame
        carrying the missed replies (``replies``), sent once the call in flight, if any,
        is done (its reply is among them); queued requests are dropped (not run: the
        client sends them again, as ``requests`` tells it).
        """
        channel = self.channel
        assert isinstance(channel, ResumeChannel)
        if not token_matches(self._token, ask.token):
            log.debug("resume of %s refused: wrong token", ask.sid)
            return unknown_session(ask.sid)
        if self.phase is not Phase.OPEN and self.phase is not Phase.DETACHED:
            log.debug("resume of %s refused: session is %s", ask.sid, self.phase.name)
            return unknown_session(ask.sid)
        batched = ask.batched
        if batched:
            self._pending = None
            if self._call is not None:  # answer once it is done
                self._take(channel, target)
                self.phase = Phase.DETACHED
                channel.after_held = functools.partial(self._resume_later, ask, target, where)
                return None
        frames = channel.replay(ask.received)
        if frames is None:
            return ResumeError(
                f"session {ask.sid} cannot be resumed: the client says it got "
                f"{ask.received} replies, the server sent {channel.count} and keeps only the "
                "last few; open a new session",
                session=ask.sid,
            )
        self._take(channel, target)
        self._token = self.runtime.doors.new_token()
        if channel.persist is not None:  # the store must know the new token
            self._persist(None)
        requests = channel.count + (self._call is not None) + len(self._pending or ())
        data = ResumedData[msgspec.Raw](
            self.resume_id or "", self._token, requests, len(frames), where[0], where[1]
        )
        if batched:
            data.replies = [msgspec.Raw(frame) for frame in frames]
            target.send(self.protocol.resumed_reply(data))
        else:
            target.send(self.protocol.resumed_reply(data))
            for frame in frames:
                target.send(frame)
        channel.attach(target)
        self.phase = Phase.OPEN
        self.last_active = self.loop.time()
        self.runtime.outcomes["resumed"] += 1
        if self._pending and self._call is None:
            self._drain_pending()
        return None

    def _take(self, channel: ResumeChannel, target: Target) -> None:
        """Take the session from a connection still attached (stale), stop its expiry."""
        old = channel.target
        if old is not None and old is not target:
            channel.detach()
            old.close(CLOSE_POLICY, "session resumed on another connection")
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None

    def _resume_later(self: ResumeHost, ask: ResumeAsk, target: Target, where: Where) -> None:
        """A batch's resume waited for the call in flight: it is done, answer now."""
        error = self.resume(ask, target, where)
        if error is not None:
            target.send(self.protocol.error_reply(None, error))
            target.close(CLOSE_POLICY, "session cannot be resumed")

    def start_restoring(
        self: ResumeHost, record: SessionRecord, ask: ResumeAsk, where: Where
    ) -> None:
        """:meth:`start` a session whose env comes from ``record`` (``reattach``), and
        resume it on its connection once it is back."""
        self._restoring = (record, ask, where)
        self.start(Door.RESTORE)

    def _restored(
        self: ResumeHost,
        channel: ResumeChannel,
        record: SessionRecord,
        ask: ResumeAsk,
        where: Where,
    ) -> None:
        """The env is back from its snapshot: the protocol's counters and the replies to
        replay too, then the resume handshake; the record moves to the new id."""
        self._restoring = None
        protocol = self.protocol
        protocol.episode_id = record.episode_id
        protocol.step_count = record.step_count
        protocol.state = SessionState.READY if record.ready else SessionState.NEW
        channel.count = record.replies
        channel.recent.extend(record.recent)
        ask.sid = self.resume_id
        target = channel.target
        assert target is not None
        error = self.resume(ask, target, where)
        durable = self.runtime.durable
        assert durable is not None
        if error is not None:
            self._send_error(None, error)
            self.close(CLOSE_POLICY, "session cannot be resumed")
            return
        durable.drop(record.sid)
        self.runtime.outcomes["restored"] += 1

    def _persist(self, frame: bytes | None) -> bool:
        """Write this durable session's record (``durable``): before ``frame`` is sent.
        ``True``: the record is being written off the event loop, and the channel is told
        when it is (``ResumeChannel.written``) to send ``frame`` then."""
        channel = self.channel
        durable = self.runtime.durable
        assert isinstance(channel, ResumeChannel)
        assert durable is not None
        assert self.resume_id is not None
        sid = self.resume_id
        count = channel.count
        try:
            # An isolated env's snapshot is taken in its own process, with its last reply.
            durable_snapshot = getattr(self.env, "durable_snapshot", None)
            blob = durable_snapshot() if durable_snapshot is not None else snapshot_env(self.env)
        except StadiumError as exc:  # this env cannot be durable: say so once, go on without
            _SNAPSHOT_ERRORS("session %s is no longer durable: %s", sid, exc)
            return self._no_longer_durable(channel, durable, sid, count)
        if len(blob) > durable.max_record_bytes:  # every reply would stall the worker on it
            _SNAPSHOT_ERRORS(
                "session %s is no longer durable: its env's snapshot is %d bytes, above the "
                "%d a record may hold (a smaller state, or serve it without --durable)",
                sid, len(blob), durable.max_record_bytes,
            )  # fmt: skip
            return self._no_longer_durable(channel, durable, sid, count)
        recent = [*channel.recent, *channel.held]
        if frame is not None:
            recent.append(frame)
        protocol = self.protocol
        record = SessionRecord(
            RECORD_VERSION,
            sid,
            token_digest(self._token),
            protocol.encoding.value,
            blob,
            protocol.episode_id,
            protocol.step_count,
            protocol.state is SessionState.READY,
            channel.count,
            recent[-REPLAY_FRAMES:],
            None if self.tenant is None else self.tenant.name,
        )
        if frame is None:
            return durable.save(record)
        return durable.save(record, functools.partial(channel.written, count))

    @staticmethod
    def _no_longer_durable(channel: ResumeChannel, durable: Durable, sid: str, count: int) -> bool:
        """Stop writing the session's records; its replies still wait for the writes in
        flight (so that none overtakes another)."""
        durable.drop(sid)

        def after(_frame: bytes | None) -> bool:
            return durable.after_writes(sid, functools.partial(channel.written, channel.count))

        channel.persist = after
        return durable.after_writes(sid, functools.partial(channel.written, count))


_SNAPSHOT_ERRORS = ThrottledLog(log, logging.WARNING)

__all__ = ["ResumableSession", "ResumeHost", "Where"]

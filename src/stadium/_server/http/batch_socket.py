"""Batch connections: many sessions on one connection, stepped by one frame each way.

A client that offers the subprotocol ``stadium.batch`` (or ``stadium.batch.msgpack``)
gets a :class:`BatchServerConnection` instead of one session: each batch frame carries one
call per session (docs/PROTOCOL.md, "Batches"). The frame is decoded once, its calls
(:class:`~stadium._core.protocol.BatchCall`) go to their sessions as decoded requests, and
the sessions are the ordinary :class:`~stadium._server.sessions.runner.Session` — their
own env, their own slot, admission, time limits, drain — whose channel (:class:`_Member`) files each
reply into its place in the batch. The reply frame goes out once every result is in
(or, with ``first``, whenever ``first`` are ready). Errors stay per entry.

A batch connection opened with ``?stadium_resume=1`` has resumable sessions: the reply
of the batch that opened them lists their ids and tokens (``opened``), a lost
connection detaches them (``resume``), and a ``resume`` call on a new batch
connection takes one back; its result (``resumed``) carries the replies the client
missed.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from typing import Any

import msgspec

from stadium._core.access import Tenant
from stadium._core.protocol import (
    JSON_BATCH_FRAME,
    MSGPACK_BATCH_FRAME,
    BatchCall,
    Encoding,
    RawCall,
    SessionProtocol,
)
from stadium._core.resume import ResumeAsk, ResumeCall
from stadium._errors import InvalidMessageError, SessionError, StadiumError
from stadium._errors import ValidationError as StadiumValidationError
from stadium._server.admission.doorway import Door
from stadium._server.runtime import CLOSE_GOING_AWAY, Channel, Runtime
from stadium._server.sessions.reattach import resume_session
from stadium._server.sessions.resumable import Where
from stadium._server.sessions.runner import Session

log = logging.getLogger("stadium.session")

#: Calls one batch frame may carry.
MAX_CALLS = 4096
_MAX_SESSION = 2**31

_JSON_RESUME = msgspec.json.Decoder(ResumeCall)
_MSGPACK_RESUME = msgspec.msgpack.Decoder(ResumeCall)


class _Batch:
    """One batch frame being answered: its results, filled as sessions reply."""

    __slots__ = ("conn", "first", "id", "left", "opened", "ready", "results")

    def __init__(self, conn: BatchServerConnection, rid: Any, size: int, first: int | None) -> None:
        self.conn = conn
        self.opened: list[tuple[int, str, str]] | None = None
        """Resumable sessions this batch opened: (position, id, token)."""
        self.id = rid
        self.results: list[bytes | None] = [None] * size
        self.left = size
        self.first = first
        self.ready: list[int] | None = None if first is None else []

    def fill(self, index: int, frame: bytes) -> None:
        self.results[index] = frame
        self.left -= 1
        ready = self.ready
        if ready is None:
            if not self.left:
                self.conn.reply(self)
            return
        ready.append(index)
        assert self.first is not None
        if len(ready) >= self.first or not self.left:
            self.conn.reply_ready(self)


class _Member:
    """One session's channel on a batch connection: its replies go to the batch slots
    of its calls, in order (one reply per call)."""

    __slots__ = ("conn", "number", "slots")

    def __init__(self, conn: BatchServerConnection, number: int) -> None:
        self.conn = conn
        self.number = number
        self.slots: collections.deque[tuple[_Batch, int]] = collections.deque()

    def send(self, data: bytes) -> None:
        slots = self.slots
        if slots:  # _Batch.fill, inline (once per step)
            batch, index = slots.popleft()
            batch.results[index] = data
            batch.left -= 1
            if batch.ready is not None:
                batch.ready.append(index)
                if len(batch.ready) >= batch.first or not batch.left:  # type: ignore[operator]
                    self.conn.reply_ready(batch)
            elif not batch.left:
                self.conn.reply(batch)

    def close(self, code: int, reason: str) -> None:
        """The session ended: its calls not answered get ``closed``; its number is free."""
        conn = self.conn
        if conn.sessions.get(self.number) is not None and conn.members.get(self.number) is self:
            del conn.sessions[self.number]
            del conn.members[self.number]
        slots = self.slots
        if slots:
            frame = conn.protocol.closed_reply(code, reason)
            while slots:
                batch, index = slots.popleft()
                batch.fill(index, frame)
        if not conn.sessions and conn.runtime.draining:
            conn.channel.close(CLOSE_GOING_AWAY, "server shutting down")


class BatchServerConnection:
    """The sessions of one batch connection (see the module docstring); the transport
    feeds it whole frames and reports the connection's loss, as it does a session's."""

    __slots__ = (
        "channel",
        "client",
        "decoder",
        "encoding",
        "loop",
        "members",
        "outcome",
        "protocol",
        "runtime",
        "sessions",
        "tenant",
        "where",
    )

    def __init__(
        self,
        runtime: Runtime,
        channel: Channel,
        encoding: Encoding = Encoding.JSON,
        client: str | None = None,
        where: Where | None = None,
        tenant: Tenant | None = None,
    ) -> None:
        self.tenant = tenant
        """The tenant its token named (``--tenants``): its sessions are charged to it."""
        self.where = where
        """Where this server is (node, address), when the sessions are resumable."""
        self.runtime = runtime
        self.channel = channel
        self.encoding = encoding
        self.client = client
        self.loop = asyncio.get_running_loop()
        self.sessions: dict[int, Session] = {}
        self.members: dict[int, _Member] = {}
        self.outcome = "completed"
        self.decoder: Any = JSON_BATCH_FRAME if encoding is Encoding.JSON else MSGPACK_BATCH_FRAME
        # Replies about the connection itself (a bad frame) and ``closed`` results.
        self.protocol = SessionProtocol(runtime.spec, encoding, str)

    def feed(self, message: bytes | str) -> None:
        """One batch frame: each call to its session (a ``reset`` on a free number opens one)."""
        try:
            frame = self.decoder.decode(message)
        except Exception as exc:
            self._error(None, InvalidMessageError(f"Invalid batch frame: {_describe(exc)}"))
            return
        calls = frame.calls
        if frame.type != "batch" or not calls:
            self._error(
                frame.id,
                InvalidMessageError(
                    'a batch connection takes only {"type": "batch", "calls": [...]} frames '
                    "with at least one call"
                ),
            )
            return
        if len(calls) > MAX_CALLS or (frame.first is not None and frame.first < 1):
            why = (
                f"a batch carries at most {MAX_CALLS} calls, got {len(calls)}"
                if len(calls) > MAX_CALLS
                else f"first must be at least 1, got {frame.first}"
            )
            self._error(frame.id, StadiumValidationError(why))
            return
        batch = _Batch(self, frame.id, len(calls), frame.first)
        now = self.loop.time()
        sessions, members = self.sessions, self.members
        seen: set[int] = set()
        for index, call in enumerate(calls):
            number = call.session
            if number in seen or not 0 <= number < _MAX_SESSION:
                why = (
                    f"session {number} has two calls in this batch: one call per session"
                    if number in seen
                    else f'"session" must be a number from 0 to 2^31-1, got {number}'
                )
                batch.fill(index, self.protocol.error_reply(None, SessionError(why)))
                continue
            seen.add(number)
            session = sessions.get(number)
            if call.type == "resume":
                self._resume(batch, index, number, call)
                continue
            if session is None:
                if call.type != "reset":
                    err = SessionError(
                        f"session {number} is not open on this connection: a reset opens it",
                        session=number,
                    )
                    batch.fill(index, self.protocol.error_reply(None, err))
                    continue
                member = members[number] = _Member(self, number)
                resume = None
                if self.where is not None:
                    resume = self.runtime.doors.mint()
                    if batch.opened is None:
                        batch.opened = []
                    batch.opened.append((index, *resume))
                session = sessions[number] = Session(
                    self.runtime, member, self.encoding, self.loop, client=self.client,
                    resume=resume, tenant=self.tenant,
                )  # fmt: skip
                member.slots.append((batch, index))
                session.start(Door.BATCH, self)
                session.feed(call)
                continue
            slots = members[number].slots
            slots.append((batch, index))  # before: the reply may come through the channel
            reply = session.step_now(call, now)
            if reply is False:  # anything but a plain step on an idle one
                session.feed(call)
            elif reply is not True:  # answered at once and given back: filed here
                slots.pop()
                if batch.ready is None:  # _Batch.fill, inline (once per step)
                    batch.results[index] = reply
                    batch.left -= 1
                    if not batch.left:
                        self.reply(batch)
                else:
                    batch.fill(index, reply)

    def reply(self, batch: _Batch) -> None:
        """Every result of ``batch`` is in: one frame, the results in call order."""
        results: list[bytes] = batch.results  # type: ignore[assignment]  # all filled
        self.channel.send(self.protocol.batch_reply(batch.id, results, batch.opened))

    def reply_ready(self, batch: _Batch) -> None:
        """``first`` results (or the last ones) of ``batch`` are ready: send those."""
        ready = batch.ready
        assert ready is not None
        batch.ready = []
        results: list[bytes] = [batch.results[i] for i in ready]  # type: ignore[misc]
        opened, batch.opened = batch.opened, None  # with the first frame
        self.channel.send(
            self.protocol.batch_reply(batch.id, results, opened, ready, not batch.left)
        )

    def _resume(self, batch: _Batch, index: int, number: int, call: RawCall) -> None:
        """A ``resume`` call: session ``data.id`` (lost with another connection) becomes
        number ``number`` of this one; its result carries the replies the client missed."""
        member = _Member(self, number)
        member.slots.append((batch, index))
        if number in self.sessions:
            err: StadiumError = SessionError(
                f"session {number} is open on this connection: resume into a free number",
                session=number,
            )
            member.send(self.protocol.error_reply(None, err))
            return
        if self.where is None:
            err = SessionError(
                "this batch connection has no resumable sessions: open it with "
                "?stadium_resume=1 to resume sessions on it"
            )
            member.send(self.protocol.error_reply(None, err))
            return
        try:
            decoder = _JSON_RESUME if self.encoding is Encoding.JSON else _MSGPACK_RESUME
            data = decoder.decode(call.data)
        except Exception as exc:
            err = StadiumValidationError(
                f'resume needs "data": {{"id": ..., "token": ..., "received": n}}: {exc}',
                field="$.data",
            )
            member.send(self.protocol.error_reply(None, err))
            return
        ask = ResumeAsk.from_call(data)
        result = resume_session(
            self.runtime, ask, member, self.encoding, self.where, self.client, self.tenant
        )
        if isinstance(result, StadiumError):
            self.runtime.errors_total[str(result.code)] += 1
            member.send(self.protocol.error_reply(None, result))
            return
        self.sessions[number] = result
        self.members[number] = member

    def connection_lost(self, channel: Any = None) -> None:
        """The connection is gone: its sessions end, or wait detached to be resumed."""
        members = self.members
        for number, session in list(self.sessions.items()):
            session.connection_lost(members.get(number))
        self.sessions.clear()
        members.clear()

    def _error(self, rid: Any, error: StadiumError) -> None:
        self.runtime.errors_total[str(error.code)] += 1
        self.channel.send(self.protocol.error_reply(rid, error))


def _describe(exc: Exception) -> str:
    if isinstance(exc, msgspec.DecodeError | msgspec.ValidationError):
        return str(exc)
    if isinstance(exc, RecursionError):
        return "values are nested more deeply than the decoder allows"
    return f"{type(exc).__name__}: {exc}"


__all__ = ["MAX_CALLS", "BatchCall", "BatchServerConnection"]

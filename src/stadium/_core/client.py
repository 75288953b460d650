"""The session protocol's client side: requests in, frames out; frames in, results or
errors out. No I/O, no clocks (the server's side is :mod:`stadium._core.protocol`).

:class:`~stadium.AsyncClient` drives a :class:`ClientProtocol` (one session), the batch
connection and :class:`~stadium.SessionPool`'s batched sessions a
:class:`BatchProtocol` (many sessions, batch frames). Both write and read the Structs of
:mod:`stadium._core.frames`, the ones the server reads and writes, so a frame has one
definition. Reading never raises for what the server sent: a frame that cannot be read,
or that is not the answer expected, comes back as the :class:`~stadium.StadiumError` to
raise (an ``error`` frame as the error it carries, rebuilt by ``error_from_wire``).

A resumable session's bookkeeping is the protocol's too: :attr:`ClientProtocol.book`
(a :class:`~stadium._core.resume.ResumeBook`) numbers the requests, keeps them until
answered and reads the server's ``resumed`` answer::

    proto = ClientProtocol()
    proto.granted(response_headers.get)              # the 101 granted resume
    payload, rid = proto.request("step", {"x": 1})   # b'{"type":"step","data":{"x":1},"id":1}'
    reply = proto.reply(raw, rid)                    # a Reply, or the error to raise
    result = proto.step_result(reply)                # a StepResult, or the error to raise
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from stadium._core.frames import (
    NO_DATA,
    BatchCall,
    BatchFrame,
    BatchReply,
    ClosedData,
    Reply,
    Request,
)
from stadium._core.resume import AfterResume, ForkedData, ResumeBook, ResumedData
from stadium._env.codecs import UNREADABLE
from stadium._env.contract import StepResult
from stadium._env.cost import cost_from
from stadium._errors import (
    ResumeError,
    SessionClosedError,
    SessionError,
    StadiumError,
    error_from_wire,
)
from stadium._errors import ValidationError as StadiumValidationError

_JSON_REPLY = msgspec.json.Decoder(Reply)
_MSGPACK_REPLY = msgspec.msgpack.Decoder(Reply)
_JSON_BATCH = msgspec.json.Decoder(BatchReply[Reply])
_MSGPACK_BATCH = msgspec.msgpack.Decoder(BatchReply[Reply])
_RAISED = (*UNREADABLE, msgspec.ValidationError)


def codec(msgpack: bool) -> tuple[Callable[[Any], bytes], Callable[[bytes], Any]]:
    """The frames' encoder and decoder: MessagePack or JSON."""
    if msgpack:
        return msgspec.msgpack.encode, msgspec.msgpack.decode
    return msgspec.json.encode, msgspec.json.decode


def reset_data(seed: int | None, episode_id: str | None, options: dict[str, Any]) -> Any:
    """The ``data`` of a ``reset``: its options, ``seed`` and ``episode_id`` when given."""
    data = dict(options)
    if seed is not None:
        data["seed"] = seed
    if episode_id is not None:
        data["episode_id"] = episode_id
    return data


def _unreadable(what: str, exc: BaseException) -> SessionClosedError:
    return SessionClosedError(f"the server sent {what} that cannot be read: {exc}")


def outcome(reply: Reply) -> Reply | StadiumError:
    """``reply``, or the error it stands for (``error``: the error it carries; ``closed``,
    a batch session's: :class:`SessionClosedError` with the close code)."""
    kind = reply.type
    if kind == "error":
        return error_from_wire(reply.data)
    if kind == "closed":
        try:
            closed = msgspec.convert(reply.data, ClosedData, strict=False)
        except msgspec.ValidationError:
            closed = ClosedData(0, repr(reply.data)[:200])
        return SessionClosedError(
            f"server closed the session ({closed.code}: {closed.reason})", close_code=closed.code
        )
    return reply


def _expected(reply: Reply, kind: str) -> SessionError:
    return SessionError(
        f"the server answered {reply.type!r} where {kind!r} was expected: {reply.data!r:.200}"
    )


def step_result(reply: Reply, observation_type: Any = None) -> StepResult[Any] | StadiumError:
    """An ``observation`` reply (or batch result) as a :class:`StepResult`, its observation
    converted to ``observation_type`` when given, with the episode's cost when the reply
    ended one (its top-level ``cost``); any other reply as the error it stands for."""
    if reply.type != "observation":
        answer = outcome(reply)
        return answer if isinstance(answer, StadiumError) else _expected(reply, "observation")
    data = reply.data
    if data.__class__ is not dict:
        if data:
            return _expected(reply, "an observation object")
        data = {}
    obs = data.get("observation", {})
    if observation_type is not None:
        try:
            obs = msgspec.convert(obs, observation_type, strict=False)
        except msgspec.ValidationError as exc:
            return StadiumValidationError(
                f"the observation does not fit {observation_type!r}: {exc}", field="$.observation"
            )
    reward, done, truncated = data.get("reward"), data.get("done"), data.get("truncated")
    info = data.get("info") or data.get("metadata")
    odd = _mistyped(reward, done, truncated, info)
    if odd is not None:
        return StadiumValidationError(
            f"the server's observation reply has {odd} (an old, foreign or broken server?)",
            field=f"$.data.{odd.split(' ', 1)[0]}",
        )
    cost = reply.cost
    return StepResult(
        obs,
        reward,
        done is True,
        truncated=truncated is True,
        info=info,
        cost=None if cost is None else cost_from(cost),
    )


def _mistyped(reward: Any, done: Any, truncated: Any, info: Any) -> str | None:
    """What in an observation reply is not of its type (``reward`` a number or null,
    ``done`` and ``truncated`` booleans or absent, ``info`` an object or absent), or None:
    a trainer gets a wrong type as an error here, not as a crash in its own code."""
    if reward is not None and (reward.__class__ is bool or not isinstance(reward, int | float)):
        return f"reward {reward!r:.80} (a number or null expected)"
    for name, flag in (("done", done), ("truncated", truncated)):
        if flag is not None and flag.__class__ is not bool:
            return f"{name} {flag!r:.80} (true or false expected)"
    if info and not isinstance(info, dict):
        return f"info {info!r:.80} (an object expected)"
    return None


def state_result(reply: Reply, state_type: Any = None) -> Any:
    """A ``state`` reply's data (converted to ``state_type`` when given), or the error the
    reply stands for (return value an instance of :class:`StadiumError`)."""
    if reply.type != "state":
        answer = outcome(reply)
        return answer if isinstance(answer, StadiumError) else _expected(reply, "state")
    data = reply.data if reply.data is not msgspec.UNSET else {}
    if state_type is None:
        return data
    try:
        return msgspec.convert(data, state_type, strict=False)
    except msgspec.ValidationError as exc:
        return StadiumValidationError(f"the state does not fit {state_type!r}: {exc}", field="$")


def resumed_data(reply: Reply) -> ResumedData[Reply] | StadiumError:
    """A ``resumed`` answer's data, or the error the answer stands for (the server's
    ``error``, else a :class:`ResumeError` saying what came instead)."""
    if reply.type == "resumed":
        try:
            return msgspec.convert(reply.data, ResumedData[Reply], strict=False)
        except msgspec.ValidationError as exc:
            return ResumeError(f"the server's resumed answer cannot be read: {exc}")
    answer = outcome(reply)
    if isinstance(answer, ResumeError):
        return answer
    return ResumeError(f"the server answered {reply.type!r} to a resume: {reply.data!r:.200}")


class ClientProtocol:
    """The client side of one session (one WebSocket): its encoding, and when resumable
    its :class:`ResumeBook` (requests numbered and kept until answered).

    Args:
        msgpack: MessagePack frames (the negotiated subprotocol) instead of JSON.
    """

    __slots__ = ("_decode", "_encode", "book", "in_sync", "msgpack")

    def __init__(self, msgpack: bool = False) -> None:
        self.msgpack = msgpack
        self._encode = codec(msgpack)[0]
        self._decode = _MSGPACK_REPLY.decode if msgpack else _JSON_REPLY.decode
        self.book: ResumeBook[bytes] | None = None
        """A resumable session's book (None: the server granted no resume)."""
        self.in_sync = True
        """False once a reply came for another request than the one waiting: the session
        is no longer usable (the client drops it)."""

    def granted(self, headers: Callable[[str], str | None]) -> ResumeBook[bytes] | None:
        """Read the ``101``'s headers (``headers``: their lookup): the session's book when
        the server granted resume (:meth:`ResumeBook.granted`), else None."""
        self.book = ResumeBook[bytes].granted(headers)
        self.in_sync = True
        return self.book

    # -- requests -------------------------------------------------------------

    def request(self, kind: str, data: Any = NO_DATA) -> tuple[bytes, int | None]:
        """The frame of a ``kind`` request (``reset``, ``step``, ``state``, ``close``,
        ``mcp``, ``fork``) and its number: on a resumable session it is numbered (its
        ``id``) and kept in the book until answered; else ``None``."""
        book = self.book
        if book is None:
            return self._encode(Request(kind, data)), None
        rid = book.sent = book.sent + 1
        payload = self._encode(Request(kind, data, rid))
        book.keep(rid, payload)
        return payload, rid

    # -- replies --------------------------------------------------------------

    def read(self, raw: bytes) -> Reply | StadiumError:
        """One reply frame, decoded (an unreadable one: the error to raise)."""
        try:
            return self._decode(raw)
        except _RAISED as exc:
            return _unreadable("a frame", exc)

    def reply(self, raw: bytes, rid: int | None) -> Reply | StadiumError:
        """The reply to request ``rid`` (None: not numbered), or the error to raise: the
        one an ``error`` frame carries, or a frame that cannot be read or answers another
        request (then :attr:`in_sync` turns false: drop the session)."""
        try:
            reply: Reply = self._decode(raw)  # read(), inline: once per request
        except _RAISED as exc:
            return _unreadable("a frame", exc)
        if rid is not None and reply.id is not None and reply.id != rid:
            self.in_sync = False  # never another request's reply
            return SessionClosedError(
                f"reply to request {reply.id!r} arrived for request {rid}; the session was dropped"
            )
        if reply.type == "error":
            return error_from_wire(reply.data)
        return reply

    def forked(self, reply: Reply) -> ForkedData | StadiumError:
        """A ``forked`` answer's data: the new session's id, token, node and grace."""
        if reply.type != "forked":
            answer = outcome(reply)
            return answer if isinstance(answer, StadiumError) else _expected(reply, "forked")
        try:
            return msgspec.convert(reply.data, ForkedData, strict=False)
        except msgspec.ValidationError as exc:
            return SessionError(f"the server's forked answer cannot be read: {exc}")

    def resumed(self, raw: bytes) -> AfterResume[bytes] | StadiumError:
        """The first frame on a resumed connection: the server took the session back
        (the book takes its new token; the requests it never got are to send again), or
        the error to fail the session with."""
        book = self.book
        reply = self.read(raw)
        if isinstance(reply, StadiumError):
            return ResumeError(f"session {book and book.session_id} could not be resumed: {reply}")
        data = resumed_data(reply)
        if isinstance(data, StadiumError):
            return data
        if book is None:
            return ResumeError("a resumed answer on a session that is not resumable")
        return book.resumed(data)


class BatchProtocol:
    """The client side of one batch connection (``batch``): batch frames out, their
    replies in. The calls are :class:`BatchCall` Structs (:func:`call`)."""

    __slots__ = ("_decode", "_encode", "msgpack")

    def __init__(self, msgpack: bool = False) -> None:
        self.msgpack = msgpack
        self._encode = codec(msgpack)[0]
        self._decode = _MSGPACK_BATCH.decode if msgpack else _JSON_BATCH.decode

    def frame(self, rid: int, calls: Sequence[BatchCall[Any]], first: int | None = None) -> bytes:
        """A batch frame of ``calls`` under id ``rid``; with ``first``, the server answers
        in frames of at least ``first`` ready results (bounded to 1..len(calls))."""
        if first is not None:
            first = max(1, min(first, len(calls)))
        return self._encode(BatchFrame("batch", rid, list(calls), first))

    def read(self, raw: bytes) -> BatchReply[Reply] | StadiumError:
        """One batch reply frame, decoded; an unreadable one: the error to raise."""
        try:
            return self._decode(raw)
        except _RAISED as exc:
            return _unreadable("a batch frame", exc)


def call(session: int, kind: str, data: Any = NO_DATA, **extra: Any) -> BatchCall[Any]:
    """One call of a batch frame: session ``session``'s ``kind`` request (``data``;
    ``timeout_s`` or ``id`` in ``extra``)."""
    return BatchCall(kind, data, session=session, **extra)


def resume_call(session: int, book: ResumeBook[Any]) -> BatchCall[Any]:
    """The ``resume`` call that takes ``book``'s session back as number ``session``."""
    return BatchCall("resume", book.ask().call(), session=session)


__all__ = [
    "NO_DATA",
    "BatchProtocol",
    "ClientProtocol",
    "call",
    "codec",
    "outcome",
    "reset_data",
    "resume_call",
    "resumed_data",
    "state_result",
    "step_result",
]

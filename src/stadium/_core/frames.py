"""The wire's frames as msgspec Structs: the one definition client and server share.

No I/O, no clocks. Every frame of the session protocol (docs/PROTOCOL.md) is one of
these, whoever writes it and whoever reads it:

=====================  ==========================================================
:class:`Request`       a request of one session (``reset``, ``step``, ``state``,
                       ``close``, ``mcp``, ``fork``): the client encodes it
                       (:mod:`stadium._core.client`), the server decodes it
                       (:class:`~stadium._core.protocol.SessionProtocol`)
:class:`BatchCall`     one call of a batch frame: a request with its ``session``
:class:`BatchFrame`    a batch frame (``{"type": "batch", "id", "calls", "first"?}``)
:class:`Reply`         a reply of one session (``observation``, ``state``, ``error``,
                       ``mcp``, ``forked``, ``resumed``, ``closed``): the server
                       encodes it, the client decodes it
:class:`BatchReply`    a batch's reply frame (``results``, with ``first``: ``index``
                       and ``done``; ``opened``: the resumable sessions it opened)
=====================  ==========================================================

OpenEnv's HTTP ``/reset`` and ``/step`` answer with an :class:`ObservationBody` (the server's
HTTP endpoints write it; not a frame, the same shape on another route).

The payloads of resume and fork (``resume`` calls, ``resumed`` and ``forked`` data)
are :mod:`stadium._core.resume`'s.

The request and batch Structs are generic in their ``data``: the server decodes
``Request[msgspec.Raw]`` (the action stays bytes until the env's typed decoder reads
it), the client encodes ``Request[Any]`` (the action as its builtins). A batch reply
is generic in its results: the server encodes ``BatchReply[msgspec.Raw]`` (each result
an encoded :class:`Reply` already), the client decodes ``BatchReply[Reply]``. Fields
left at their default are not encoded (``omit_defaults``), so ``Request("state")`` is
``{"type":"state"}``, byte for byte what an OpenEnv client sends.
"""

from __future__ import annotations

from typing import Annotated, Any, Generic, TypeVar

import msgspec

D = TypeVar("D")
"""The type of a request's ``data`` (``msgspec.Raw`` decoding, ``Any`` encoding)."""
R = TypeVar("R")
"""The type of a batch reply's results (``msgspec.Raw`` encoding, :class:`Reply` decoding)."""

RequestId = int | str | None

#: ``timeout_s`` of a step frame: seconds, over 0 (under a billion: a finite timer).
TimeoutS = Annotated[float, msgspec.Meta(gt=0, lt=1e9)]

NO_DATA: Any = msgspec.Raw(b"")
"""A request's ``data`` when it has none: never encoded. The very object (``omit_defaults``
omits a ``msgspec.Raw`` default by identity, not by value)."""


class Request(msgspec.Struct, Generic[D], omit_defaults=True):
    """A request frame: ``{"type": ..., "data"?: ..., "id"?: ..., "timeout_s"?: ...}``.

    ``id`` is Stadium's extension (the reply echoes it); ``timeout_s`` a step's own
    time limit (OpenEnv's HTTP field). No ``data``: the empty :class:`msgspec.Raw`
    (falsy, never encoded)."""

    type: str = ""
    data: D = NO_DATA
    id: RequestId = None
    timeout_s: TimeoutS | None = None


class BatchCall(Request[D]):
    """One call of a batch frame (``batch``): a session's request with its ``session``
    number; a session takes it as it takes a decoded frame (:meth:`SessionProtocol.receive`)."""

    session: int = -1

    def __len__(self) -> int:
        """Its weight in a session's queue (``Session.feed`` bounds queued bytes)."""
        data: Any = self.data  # msgspec.Raw, as the server decodes it
        return len(data) + 64


class BatchFrame(msgspec.Struct, Generic[D], omit_defaults=True):
    """A batch frame: calls on many sessions of one connection (docs/PROTOCOL.md)."""

    type: str = ""
    id: RequestId = None
    calls: list[BatchCall[D]] = msgspec.field(default_factory=list)
    first: int | None = None


class Reply(msgspec.Struct, omit_defaults=True):
    """A reply frame: ``{"type": ..., "data": ..., "id"?: ..., "cost"?: ...}``.

    ``data`` is always encoded (``null`` too); read, a frame without it has
    :data:`msgspec.UNSET` (falsy). ``cost``: the episode's cost, on the reply that
    ended it (docs/PROTOCOL.md, "Episode cost")."""

    type: str
    data: Any = msgspec.UNSET
    id: RequestId = None
    cost: Any = None


class ClosedData(msgspec.Struct):
    """The ``data`` of a ``closed`` result: a batch session ended (its close code and
    reason), answering its calls still waiting."""

    code: int
    reason: str = ""


class BatchReply(msgspec.Struct, Generic[R], omit_defaults=True):
    """A batch's reply frame: its ``results`` in call order, or with ``first`` the
    ``index`` of each result in this frame and whether the batch is ``done``; ``opened``:
    ``[position, session id, resume token]`` of each resumable session it opened. A
    batch frame the server refused is answered ``{"type": "error", "data", "id"}``."""

    type: str = "batch"
    id: RequestId = None
    data: Any = msgspec.UNSET
    """An ``error`` frame's (the batch frame itself was refused)."""
    results: list[R] | None = None
    index: list[int] | None = None
    opened: list[tuple[int, str, str]] | None = None
    done: bool | None = None


class ObservationBody(msgspec.Struct):
    """The body of OpenEnv's HTTP ``/reset`` and ``/step`` answers (its ``ResetResponse`` and
    ``StepResponse``, ``metadata`` not sent): ``{"observation", "reward", "done"}``, each
    always written."""

    observation: Any
    reward: Any = None
    done: bool = False


__all__ = [
    "NO_DATA",
    "BatchCall",
    "BatchFrame",
    "BatchReply",
    "ClosedData",
    "ObservationBody",
    "Reply",
    "Request",
    "RequestId",
    "TimeoutS",
]

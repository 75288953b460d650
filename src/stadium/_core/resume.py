"""Session resume: the wire extension's names, ids and tokens, and the replay channel.

No I/O, no clocks. A client opts in when it opens a session (plain OpenEnv clients
never do, so nothing changes for them)::

    GET /ws?stadium_resume=1                          (a new, resumable session)
    ← 101 + X-Stadium-Session: <id>
            X-Stadium-Resume-Token: <secret>
            X-Stadium-Node: <the node's name, as /health reports it>
            X-Stadium-Address: <host:port the connection reached>
            X-Stadium-Resume-Grace: <seconds>

After losing the connection, it resumes on a new one::

    GET /ws?stadium_resume=<id>&stadium_received=<replies it got>
           &stadium_node=<node>&stadium_addr=<host:port>
        X-Stadium-Resume-Token: <secret>
    ← 101, then {"type": "resumed", "data": {"session": <id>, "token": <new secret>,
                 "requests": <requests the server got>, "replayed": <k>}}
      then the k replies the client missed, in order, then the session goes on.

The client resends the requests numbered above ``requests`` (lost on the way in);
a request the server got is never run twice and its reply is delivered once, after
the resume. Routers send a resume to the node that holds the session by
``stadium_node`` (a Kubernetes route, by pod name) or ``stadium_addr`` (HAProxy,
by server address). Tokens rotate on every resume (an old one is refused), travel in a
header (never in a URL a proxy logs), and are compared in constant time.

The session id starts with the worker's pid in hex, so a worker that receives a
resume for another worker's session hands the connection to it
(:mod:`stadium._server.transports.handoff`).

One vocabulary, both sides (each concept once, here):

=====================  ===============================================================
:class:`ResumeAsk`     a resume request: the client writes it (:meth:`ResumeAsk.query`,
                       :meth:`~ResumeAsk.headers`, or a batch call's :class:`ResumeCall`),
                       the server reads it (:func:`resume_ask`, or the call)
:class:`ResumedData`   the ``resumed`` answer's data: the server encodes it, the client's
                       :meth:`ResumeBook.resumed` reads it
:class:`ForkedData`    the ``forked`` answer's data (a fork is a session to resume)
:class:`ResumeChannel` the server's replies of a resumable session, kept for replay
:class:`ResumeBook`    the client's requests of a resumable session, kept until answered
=====================  ===============================================================
"""

from __future__ import annotations

import collections
import hmac
import secrets
import urllib.parse
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

import msgspec

from stadium._core.frames import Reply
from stadium._errors import ResumeError

T = TypeVar("T")
R = TypeVar("R")

RESUME_PARAM = "stadium_resume"
"""Query parameter: ``1`` asks for a resumable session; a session id resumes it."""
RECEIVED_PARAM = "stadium_received"
"""Query parameter of a resume: how many replies the client got on the session."""
NODE_PARAM = "stadium_node"
"""Query parameter of a resume: the name of the node holding the session (routers route on it)."""
ADDR_PARAM = "stadium_addr"
"""Query parameter of a resume: the ``host:port`` of the node holding the session."""
TOKEN_HEADER = "X-Stadium-Resume-Token"
"""Header: the resume token (in the 101 of a new session, and in a resume request)."""
SESSION_HEADER = "X-Stadium-Session"
NODE_HEADER = "X-Stadium-Node"
ADDR_HEADER = "X-Stadium-Address"
GRACE_HEADER = "X-Stadium-Resume-Grace"

#: Replies a resumable session keeps after sending them, to replay to a client that
#: lost them with the connection (a client that pipelines more than this may not resume).
REPLAY_FRAMES = 8

_MAX_ID = 64
#: Digits a ``stadium_received`` count may have (a count of replies fits in 63 bits).
MAX_RECEIVED_DIGITS = 18
_DIGITS = frozenset("0123456789")
_HEX = frozenset("0123456789abcdefABCDEF")
_ALNUM = frozenset("0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")


class Target(Protocol):
    """The transport's side of a channel."""

    def send(self, data: bytes) -> None: ...

    def close(self, code: int, reason: str) -> None: ...


class _Nowhere:
    """The target of a session no connection holds yet (a fork before its client comes)."""

    def send(self, data: bytes) -> None:
        pass

    def close(self, code: int, reason: str) -> None:
        pass


NOWHERE: Target = _Nowhere()


class ResumeAsk:
    """A resume request, as both sides see it: a new resumable session (``sid`` None) or
    a resume of session ``sid`` with ``token``, the client having got ``received``
    replies; ``node`` and ``address``: where the session was (routers route on them);
    ``batched``: a ``resume`` call of a batch (``batch``). The client writes it
    (:meth:`query` and :meth:`headers`, or :meth:`call`), the server reads it
    (:func:`resume_ask`, :meth:`from_call`)."""

    __slots__ = ("address", "batched", "node", "received", "sid", "token")

    def __init__(
        self,
        sid: str | None,
        token: str = "",
        received: int = 0,
        *,
        batched: bool = False,
        node: str = "",
        address: str = "",
    ) -> None:
        self.sid = sid
        self.token = token
        self.received = received
        self.batched = batched
        self.node = node
        self.address = address

    def query(self) -> dict[str, str]:
        """The query parameters of the ``/ws`` request that makes this ask."""
        if self.sid is None:
            return {RESUME_PARAM: "1"}
        return {
            RESUME_PARAM: self.sid,
            RECEIVED_PARAM: str(self.received),
            NODE_PARAM: self.node,
            ADDR_PARAM: self.address,
        }

    def headers(self) -> dict[str, str]:
        """The headers that prove the client holds the session (its token)."""
        return {} if self.sid is None else {TOKEN_HEADER: self.token}

    def call(self) -> ResumeCall:
        """This ask as the data of a batch ``resume`` call."""
        return ResumeCall(self.sid or "", self.token, self.received)

    @classmethod
    def from_call(cls, data: ResumeCall) -> ResumeAsk:
        """The ask a batch ``resume`` call makes."""
        return cls(data.id, data.token, data.received, batched=True)


class ResumeCall(msgspec.Struct):
    """The ``data`` of a batch's ``resume`` call: ``{"id", "token", "received"}``."""

    id: str
    token: str
    received: int = 0


class ResumedData(msgspec.Struct, Generic[R]):
    """The ``data`` of a ``resumed`` answer: the session's id (a durable session restored
    elsewhere has a new one), its new token, how many requests the server got, how many
    replies it replays, where the session is now; a batch session's ``replies`` (the ones
    its client missed, carried in the answer: the server encodes them as
    ``msgspec.Raw``, the client reads them as :class:`~stadium._core.frames.Reply`; unset,
    not encoded, on a one-session connection, which gets them replayed after it). Read
    leniently: a field absent keeps the session's as it was."""

    session: str = ""
    token: str = ""
    requests: int = 0
    replayed: int = 0
    node: str = ""
    address: str = ""
    replies: list[R] | msgspec.UnsetType = msgspec.UNSET


class ForkedData(msgspec.Struct):
    """The ``data`` of a ``forked`` answer: the new session, to resume (its id, token,
    node and the server's grace period)."""

    session: str
    token: str
    node: str = ""
    grace: float = 0.0


def resume_ask(query: str, token: str | None) -> ResumeAsk | str | None:
    """Read a ``/ws`` query string: ``None`` when it asks nothing of resume, a
    :class:`ResumeAsk`, or a sentence saying what is wrong with the request."""
    if RESUME_PARAM not in query:
        return None
    params = urllib.parse.parse_qs(query)
    value = (params.get(RESUME_PARAM) or [""])[0]
    if value in ("1", "true", "new"):
        return ResumeAsk(None)
    if not value or len(value) > _MAX_ID or owner_pid(value) is None:
        return f"{RESUME_PARAM}={value!r} is not a session id (use 1 to open a resumable session)"
    if not token:
        return f"resuming session {value} needs its token in the {TOKEN_HEADER} header"
    received = (params.get(RECEIVED_PARAM) or ["0"])[0]
    if not received or len(received) > MAX_RECEIVED_DIGITS or not _DIGITS.issuperset(received):
        shown = received if len(received) <= 24 else f"{received[:20]}... ({len(received)} chars)"
        return (
            f"{RECEIVED_PARAM} must be a count of replies (how many replies the client got "
            f"on the session): 1 to {MAX_RECEIVED_DIGITS} ASCII digits, got {shown!r}"
        )
    return ResumeAsk(value, token, int(received))


def new_session_id(pid: int) -> str:
    """A session id: the worker's pid (hex), then 64 random bits."""
    return f"{pid:x}-{secrets.token_hex(8)}"


def owner_pid(sid: str) -> int | None:
    """The pid of the worker that opened session ``sid``; ``None`` if ``sid`` is malformed."""
    head, sep, tail = sid.partition("-")
    if not sep or not tail or not head or len(sid) > _MAX_ID:
        return None
    if not _HEX.issuperset(head) or not _ALNUM.issuperset(tail):  # ASCII only
        return None
    return int(head, 16)


def resume_target_sid(request_line: bytes) -> str | None:
    """The id of the session a raw request line (``GET /ws?... HTTP/1.1``) resumes, if any."""
    target = request_line.split(b" ", 2)[1] if request_line.count(b" ") >= 2 else b""
    query = target.partition(b"?")[2].decode("latin-1")
    value = (urllib.parse.parse_qs(query).get(RESUME_PARAM) or [""])[0]
    return value if owner_pid(value) is not None else None


def unknown_session(sid: str | None) -> ResumeError:
    """One answer for an unknown session and a wrong token (no oracle for guessing)."""
    return ResumeError(
        f"session {sid} cannot be resumed: no session with that id and token is held "
        "here (it was closed, its grace period passed, or its server restarted); open a "
        "new session",
        session=sid,
    )


def new_token() -> str:
    return secrets.token_urlsafe(24)


def token_matches(expected: str, given: str) -> bool:
    """Constant-time comparison of resume tokens."""
    return hmac.compare_digest(expected.encode(), given.encode())


class ResumeChannel:
    """The channel of a resumable session, between it and the transport.

    While attached it forwards every reply and keeps the last :data:`REPLAY_FRAMES`;
    while detached (the connection lost) it holds the replies. :meth:`attach` binds
    a new connection and says which replies the client missed.
    """

    __slots__ = (
        "_closing",
        "_written",
        "after_held",
        "count",
        "held",
        "persist",
        "recent",
        "target",
        "unsent",
    )

    def __init__(self, target: Target) -> None:
        self.target: Target | None = target
        self.persist: Callable[[bytes | None], bool] | None = None
        """A durable session's writer (``durable``), called with each reply before it is
        sent (``count`` already includes it): ``True`` when the reply's record is being
        written off the event loop, and :meth:`written` will be called with ``count``
        once it is (the reply is sent then); ``False`` when it may be sent now."""
        self.after_held: Callable[[], None] | None = None
        """Called once, after the next reply held (a batch's resume waiting for it)."""
        self.recent: collections.deque[bytes] = collections.deque(maxlen=REPLAY_FRAMES)
        self.held: list[bytes] = []
        self.count = 0
        """Replies made on the session, from its start."""
        self.unsent: collections.deque[tuple[int, Target, bytes, bool]] = collections.deque()
        """Replies waiting for their record (or an earlier one's), in order: number,
        connection, bytes, whether a record is written for it."""
        self._written = 0
        self._closing: tuple[int, str] | None = None

    def send(self, data: bytes) -> None:
        self.count += 1
        target = self.target
        if self.persist is None and target is not None and not self.unsent:  # the usual case
            self.recent.append(data)
            target.send(data)
            return
        deferred = self.persist is not None and self.persist(data)
        if target is None:
            self.held.append(data)
            if self.after_held is not None:
                after, self.after_held = self.after_held, None
                after()
            return
        self.recent.append(data)
        if deferred or self.unsent:  # after its record, and after the replies before it
            self.unsent.append((self.count, target, data, deferred))
            self._flush()
            return
        target.send(data)

    def written(self, count: int) -> None:
        """The record made for reply ``count`` is written: send the replies it held back."""
        self._written = max(self._written, count)
        self._flush()

    def _flush(self) -> None:
        unsent = self.unsent
        while unsent and (unsent[0][0] <= self._written or not unsent[0][3]):
            _n, target, data, _deferred = unsent.popleft()
            if target is self.target:
                target.send(data)
        if not unsent and self._closing is not None and self.target is not None:
            code, reason = self._closing
            self._closing = None
            self.target.close(code, reason)

    def close(self, code: int, reason: str) -> None:
        if self.target is not None:
            if self.unsent:  # after the replies waiting for their record
                self._closing = (code, reason)
                return
            self.target.close(code, reason)

    def detach(self) -> None:
        self.target = None
        self.unsent.clear()  # kept in ``recent``: replayed to the client that resumes
        self._closing = None

    def replay(self, received: int) -> list[bytes] | None:
        """The replies a client that got ``received`` of them missed, oldest first;
        ``None`` when it claims more than were sent or missed more than are kept."""
        missing = self.count - received
        kept = len(self.recent) + len(self.held)
        if missing < 0 or missing > kept:
            return None
        if not missing:
            return []
        return [*self.recent, *self.held][kept - missing :]

    def attach(self, target: Target) -> None:
        """Bind a new connection (after :meth:`replay`); held replies become recent."""
        self.recent.extend(self.held)
        self.held.clear()
        self.target = target


#: Close codes (None: no close frame) after which a resumable session is resumed: the
#: connection broke (1006) or the server restarts (1012); the session lives on there.
RESUMABLE_CLOSES: tuple[int | None, ...] = (None, 1006, 1012)

#: Seconds a client keeps trying past the server's grace period (the server's clock
#: started when it noticed the loss, which may be after the client did).
GRACE_SLACK_S = 1.0

#: The longest grace period a client believes (the server's ``--resume-grace`` limit):
#: a server that says more cannot keep a client resuming for ever.
MAX_GRACE_S = 86400.0


def grace_from(value: str | float | None) -> float:
    """A server's grace period (its ``X-Stadium-Resume-Grace`` header, or a ``forked``
    answer's ``grace``) as seconds from 0 to :data:`MAX_GRACE_S`; unreadable, NaN or
    negative: 0 (no resume)."""
    try:
        grace = float(value or 0)
    except (TypeError, ValueError):
        return 0.0
    return min(grace, MAX_GRACE_S) if grace > 0 else 0.0


def resumable_close(code: int | None) -> bool:
    """Whether a connection closed with ``code`` (None: no close frame) is resumed."""
    return code in RESUMABLE_CLOSES


@dataclass(slots=True)
class AfterResume(Generic[T]):
    """What a ``resumed`` answer means for the session's requests."""

    #: Requests answered by the replies the ``resumed`` result carried (a batch
    #: session's), with those replies, in order.
    answered: list[tuple[T, Any]] = field(default_factory=list)
    #: Requests the server never got: send them again, in order.
    resend: list[T] = field(default_factory=list)
    #: Requests the server got and still owes a reply: a one-session connection gets
    #: them replayed after ``resumed``; a batch session would have had them in
    #: ``replies`` (so they are lost).
    owed: list[tuple[int, T]] = field(default_factory=list)


class ResumeBook(Generic[T]):
    """One resumable session: its credentials, its numbered requests until answered,
    and the count of replies received. ``T`` is what the client keeps of a request
    (the encoded frame, or a batch call and its future)."""

    __slots__ = (
        "_unanswered",
        "address",
        "grace",
        "node",
        "received",
        "sent",
        "session_id",
        "token",
    )

    def __init__(
        self,
        session_id: str | None = None,
        token: str = "",
        *,
        node: str = "",
        address: str = "",
        grace: float = 0.0,
    ) -> None:
        self.session_id = session_id
        """The server's id of the session (None: a batch session not open yet)."""
        self.token = token
        self.node = node
        self.address = address
        self.grace = grace
        """Seconds the server keeps the session after losing its connection."""
        self.sent = 0
        """The number of the last request numbered."""
        self.received = 0
        """Replies received on the session (told to the server on a resume)."""
        self._unanswered: collections.deque[tuple[int, T]] = collections.deque()

    @classmethod
    def granted(cls, headers: Callable[[str], str | None]) -> ResumeBook[T] | None:
        """The book of a session whose ``101`` granted resume (``headers``: the 101's
        header lookup, e.g. ``response.headers.get``); None when it did not."""
        sid = headers(SESSION_HEADER)
        if sid is None:
            return None
        grace = grace_from(headers(GRACE_HEADER))
        return cls(
            sid,
            headers(TOKEN_HEADER) or "",
            node=headers(NODE_HEADER) or "",
            address=headers(ADDR_HEADER) or "",
            grace=grace,
        )

    # -- requests and replies -----------------------------------------------------------

    def number(self) -> int:
        """The next request's number (its ``id``); :meth:`keep` the request under it."""
        self.sent += 1
        return self.sent

    def keep(self, rid: int, request: T) -> None:
        """Keep request ``rid`` until its reply comes (to send it again after a resume)."""
        self._unanswered.append((rid, request))

    def keep_next(self, request: T) -> None:
        """:meth:`keep` ``request`` under the next number (:meth:`number`), in one call."""
        self.sent += 1
        self._unanswered.append((self.sent, request))

    @property
    def unanswered(self) -> Sequence[tuple[int, T]]:
        """The requests kept, oldest first, with their numbers."""
        return self._unanswered

    def replied(self, rid: int | None = None) -> T | None:
        """A reply came on the session: count it; it answers the oldest request kept
        (when ``rid`` is given, only if that request is number ``rid``). The request
        answered, or None."""
        self.received += 1
        unanswered = self._unanswered
        if unanswered and (rid is None or unanswered[0][0] == rid):
            return unanswered.popleft()[1]
        return None

    def replied_to(self, call: Any) -> bool:
        """A batch session's result for ``call`` came: when the oldest request kept is
        ``call`` (kept as ``(call, ...)``), count the reply and forget the request (the
        server answers a session's calls in order, so no id is needed); whether it was."""
        unanswered = self._unanswered
        if unanswered and unanswered[0][1][0] is call:  # type: ignore[index]
            self.received += 1
            unanswered.popleft()
            return True
        return False

    def drain(self) -> list[T]:
        """Every request kept, oldest first, forgotten (the session is over)."""
        requests = [request for _, request in self._unanswered]
        self._unanswered.clear()
        return requests

    # -- resuming -------------------------------------------------------------------------

    def deadline(self, now: float) -> float:
        """When a client that lost the connection at ``now`` stops trying to resume."""
        return now + self.grace + GRACE_SLACK_S

    def ask(self) -> ResumeAsk:
        """The resume request for this session (:class:`ResumeAsk`: its query and headers,
        or a batch's ``resume`` call)."""
        return ResumeAsk(
            self.session_id or "",
            self.token,
            self.received,
            node=self.node,
            address=self.address,
        )

    def resumed(self, data: ResumedData[Reply]) -> AfterResume[T]:
        """The server took the session back (``data``: its ``resumed`` answer): take its
        new token (and a restored session's new id, node and address); match the
        replies it carried to the oldest requests; say which requests to send again."""
        self.token = data.token
        self.session_id = data.session or self.session_id
        self.node = data.node or self.node
        self.address = data.address or self.address
        out: AfterResume[T] = AfterResume()
        unanswered = self._unanswered
        for reply in data.replies or ():  # oldest first; one without an id: in order
            if unanswered and reply.id in (None, unanswered[0][0]):
                out.answered.append((unanswered.popleft()[1], reply))
                self.received += 1
        requests = data.requests
        for rid, request in unanswered:
            if rid > requests:
                out.resend.append(request)
            else:
                out.owed.append((rid, request))
        return out


__all__ = [
    "ADDR_HEADER",
    "ADDR_PARAM",
    "GRACE_HEADER",
    "GRACE_SLACK_S",
    "MAX_GRACE_S",
    "NODE_HEADER",
    "NODE_PARAM",
    "NOWHERE",
    "RECEIVED_PARAM",
    "REPLAY_FRAMES",
    "RESUMABLE_CLOSES",
    "RESUME_PARAM",
    "SESSION_HEADER",
    "TOKEN_HEADER",
    "AfterResume",
    "ForkedData",
    "ResumeAsk",
    "ResumeBook",
    "ResumeCall",
    "ResumeChannel",
    "ResumedData",
    "new_session_id",
    "new_token",
    "owner_pid",
    "resumable_close",
    "resume_ask",
    "resume_target_sid",
    "token_matches",
    "unknown_session",
]

"""The client's side of batch connections: many sessions on one WebSocket.

A :class:`BatchConnection` offers the subprotocol ``stadium.batch`` (or
``stadium.batch.msgpack``) on ``/ws``; a Stadium server picks it in its ``101`` and
the connection then carries batch frames (docs/PROTOCOL.md, "Batches"): one call
per session each way, matched to its reply by the batch's ``id``, many batches in
flight. A server that does not pick it (OpenEnv's) leaves :attr:`accepted` false,
and the caller falls back to one connection per session. The frames are the core's
(:class:`~stadium._core.client.BatchProtocol`): calls are
:class:`~stadium._core.frames.BatchCall` Structs (:func:`call`), results
:class:`~stadium._core.frames.Reply` Structs (:func:`checked`, :func:`result_of`).

:class:`BatchGroup` is what :class:`~stadium.SessionPool` drives when batching: a
few connections, the pool's sessions numbered by their index, and one
:class:`BatchSession` per session with :class:`~stadium.AsyncClient`'s request
methods. Calls issued in the same event-loop iteration (``asyncio.gather`` over the
sessions) are coalesced into one batch frame per connection.

A connection opened with ``resume=`` has resumable sessions (docs/PROTOCOL.md,
"Resumable batch sessions"): the listener reports the sessions a batch opened
(``on_opened``) and, when the connection is lost, hands it to ``on_lost`` instead of
failing the batches in flight (:mod:`stadium._client.batch_pool` resumes them).
"""

from __future__ import annotations

import asyncio
import itertools
import ssl as ssl_module
from collections.abc import AsyncIterator, Callable, Sequence
from functools import partial
from typing import Any, Protocol, TypeVar, Unpack, cast

from picows import WSCloseCode, WSFrame, WSHandshakeError, WSListener, WSMsgType, WSTransport

from stadium._client.options import (
    ConnectOptions,
    HandshakeKeywords,
    backoff,
    refused,
    settle,
    unreachable,
    untrusted,
    with_query,
)
from stadium._core.client import NO_DATA, BatchProtocol, outcome, step_result
from stadium._core.frames import BatchCall, BatchReply, Reply
from stadium._core.protocol import BATCH_MSGPACK_SUBPROTOCOL, BATCH_SUBPROTOCOL
from stadium._core.resume import (
    GRACE_HEADER,
    RESUME_PARAM,
    TOKEN_HEADER,
    grace_from,
    resumable_close,
)
from stadium._core.urls import ws_url
from stadium._env.contract import StepResult
from stadium._errors import (
    ConnectError,
    SessionClosedError,
    StadiumError,
    error_from_wire,
)

ObsT = TypeVar("ObsT")

#: Calls one batch frame may carry (the server's limit).
MAX_CALLS = 4096
#: Why a lost batch connection's calls fail, when its sessions are not resumable.
NOT_RESUMABLE = (
    "its sessions were not resumable (the server runs with --resume-grace 0, or the pool "
    "was opened with resume=False): a lost connection ends them"
)

#: One streamed result: its position in the batch's calls and the decoded entry; a
#: failure of the whole batch comes as (-1, the exception).
Streamed = tuple[int, Any]


class ResultSink(Protocol):
    """Where a batch's results stream to as they arrive (an ``asyncio.Queue`` will do)."""

    def put_nowait(self, item: Streamed, /) -> None: ...


class _Pending:
    """One batch sent and not yet fully answered."""

    __slots__ = ("calls", "future", "left", "queue", "results", "timer")

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        calls: Sequence[BatchCall[Any]],
        queue: ResultSink | None,
    ) -> None:
        size = len(calls)
        self.calls = calls
        self.future: asyncio.Future[list[Any]] = loop.create_future()
        # A failure may have no reader (a stream reads its queue): never warn about it.
        self.future.add_done_callback(_retrieve)
        self.results: list[Any] = [None] * size
        self.left = size
        self.queue = queue
        self.timer: asyncio.TimerHandle | None = None

    def fail(self, exc: BaseException) -> None:
        if self.timer is not None:
            self.timer.cancel()
        if not self.future.done():
            self.future.set_exception(exc)
        if self.queue is not None:
            self.queue.put_nowait((-1, exc))


def _retrieve(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()


class _BatchListener(WSListener):
    """Routes batch replies to their :class:`_Pending` by ``id``."""

    def __init__(self, protocol: BatchProtocol, limit: int | None = None) -> None:
        self.protocol = protocol
        self.limit = limit
        """The largest frame read (``max_message_bytes``; see ``replies.Listener.limit``)."""
        self.pending: dict[int, _Pending] = {}
        self.closed: SessionClosedError | None = None
        self.closing = False  # the client closes it
        self.on_opened: Callable[[int, str, str], None] | None = None
        """Told ``(session number, id, token)`` of each resumable session a batch opened."""
        self.on_lost: Callable[[], None] | None = None
        """Called, instead of failing the batches in flight, when the connection is lost."""

    def on_ws_frame(self, transport: WSTransport, frame: WSFrame) -> None:
        mtype = frame.msg_type
        if mtype == WSMsgType.TEXT or mtype == WSMsgType.BINARY:
            if self.limit is not None and frame.payload_size > self.limit:
                self.closed = SessionClosedError(
                    f"the server sent a frame of {frame.payload_size} bytes, over "
                    f"max_message_bytes ({self.limit}); {NOT_RESUMABLE}",
                    close_code=WSCloseCode.MESSAGE_TOO_BIG.value,
                )
                transport.send_close(WSCloseCode.MESSAGE_TOO_BIG)
                transport.disconnect()
                return
            reply = self.protocol.read(frame.get_payload_as_bytes())
            if isinstance(reply, StadiumError):
                self.closed = SessionClosedError(f"{reply}; {NOT_RESUMABLE}")
                transport.disconnect()
                return
            self._route(reply)
        elif mtype == WSMsgType.CLOSE:
            if self.closed is not None:  # the answer to the client's own close
                transport.disconnect()
                return
            code = frame.get_close_code()
            reason = (frame.get_close_message() or b"").decode(errors="replace")
            self.closed = SessionClosedError(
                f"server closed the batch connection ({code.value}: {reason}); {NOT_RESUMABLE}",
                close_code=code.value,
            )
            transport.send_close(code)
            transport.disconnect()

    def _route(self, reply: BatchReply[Reply]) -> None:
        rid = reply.id
        if not isinstance(rid, int) or (pending := self.pending.get(rid)) is None:
            return  # a batch given up (no reply in time), or a stray frame
        if reply.type == "error":  # the frame itself was refused
            del self.pending[rid]
            pending.fail(error_from_wire(reply.data))
            return
        results = reply.results
        if results is None:
            return
        opened = reply.opened
        if opened and self.on_opened is not None:
            for at, sid, token in opened:
                if 0 <= at < len(pending.calls):
                    self.on_opened(pending.calls[at].session, sid, token)
        index = reply.index
        size = len(pending.results)
        if index is None and len(results) != size:
            return self._miscounted(rid, pending, f"{len(results)} results")
        positions: Sequence[Any] = index if index is not None else range(size)
        if len(positions) != len(results):
            return self._miscounted(rid, pending, f"{len(results)} results at {len(positions)}")
        queue = pending.queue
        for at, entry in zip(positions, results, strict=True):
            if not 0 <= at < size or pending.results[at] is not None:
                return self._miscounted(rid, pending, f"a result at {at!r}, unasked or twice")
            pending.results[at] = entry
            pending.left -= 1
            if queue is not None:
                queue.put_nowait((at, entry))
        if (index is None or reply.done is True) or pending.left <= 0:
            if pending.left > 0:
                return self._miscounted(rid, pending, f"done after {size - pending.left} results")
            del self.pending[rid]
            if pending.timer is not None:
                pending.timer.cancel()
            if not pending.future.done():
                pending.future.set_result(pending.results)
        return None

    def _miscounted(self, rid: int, pending: _Pending, what: str) -> None:
        """A batch reply that does not answer each call once: the batch's calls fail (the
        results cannot be told apart), the connection's other batches go on."""
        del self.pending[rid]
        size = len(pending.results)
        pending.fail(
            SessionClosedError(
                f"the server answered batch {rid} of {size} calls with {what}: its calls "
                "failed (their sessions' state is unknown: reset them)",
                batch=rid,
            )
        )

    def on_ws_disconnected(self, transport: WSTransport) -> None:
        settle(transport)
        code = None if self.closed is None else self.closed.context.get("close_code")
        if self.on_lost is not None and not self.closing and resumable_close(code):
            pending, self.pending = self.pending, {}
            for p in pending.values():  # their calls are answered by the resume
                if p.timer is not None:
                    p.timer.cancel()
            self.on_lost()
            return
        err = self.closed or SessionClosedError(f"the batch connection was lost; {NOT_RESUMABLE}")
        self.closed = err
        pending, self.pending = self.pending, {}
        for p in pending.values():
            p.fail(err)


class BatchConnection:
    """One WebSocket carrying batch frames for many sessions.

    Open it with :meth:`open`; :attr:`accepted` says whether the server picked the
    batch subprotocol (if not, the connection is an ordinary session: close it).
    """

    def __init__(
        self,
        transport: WSTransport,
        listener: _BatchListener,
        *,
        url: str,
        msgpack: bool,
        request_timeout: float | None,
    ) -> None:
        self.transport = transport
        self.listener = listener
        self.url = url
        self.msgpack = msgpack
        self.request_timeout = request_timeout
        self._ids = itertools.count(1)
        self._protocol = listener.protocol
        self._msg_type = WSMsgType.BINARY if msgpack else WSMsgType.TEXT
        offered = BATCH_MSGPACK_SUBPROTOCOL if msgpack else BATCH_SUBPROTOCOL
        picked = transport.response.headers.get("Sec-WebSocket-Protocol", "")
        #: Whether the server speaks batches (it picked the subprotocol offered).
        self.accepted = picked.strip() == offered
        grace = grace_from(transport.response.headers.get(GRACE_HEADER))
        #: Seconds the server keeps this connection's sessions after a loss (0: not resumable).
        self.grace = grace

    @classmethod
    async def open(
        cls,
        url: str,
        *,
        resume: str | None = None,
        resume_token: str | None = None,
        options: ConnectOptions | None = None,
        **keywords: Unpack[HandshakeKeywords],
    ) -> BatchConnection:
        """Connect to ``url`` offering the batch subprotocol (retrying with backoff while
        the server is unreachable, as :meth:`AsyncClient.connect` does).

        ``resume``: ``"1"`` asks for resumable sessions; a session id (with its
        ``resume_token``) opens the connection that resumes them (it reaches the worker
        holding that session). The connection keywords are
        :class:`~stadium.AsyncClient`'s (``msgpack``, ``token``, ``ssl``, ...), or
        ``options``: them as one :class:`ConnectOptions` (its ``resume`` aside: ``resume``
        here says what to ask).

        Raises:
            ConnectError: the server cannot be reached, or answered the upgrade with an
                HTTP error (401: pass ``token``).
        """
        opts = ConnectOptions.given(options, **keywords)
        url = ws_url(url)
        base = url
        if resume is not None:
            url = with_query(url, {RESUME_PARAM: resume})
        extra = dict(opts.headers)
        if resume_token:
            extra[TOKEN_HEADER] = resume_token
        extra["Sec-WebSocket-Protocol"] = (
            BATCH_MSGPACK_SUBPROTOCOL if opts.msgpack else BATCH_SUBPROTOCOL
        )
        protocol = BatchProtocol(opts.msgpack)
        last: Exception | None = None
        for attempt in range(opts.max_retries + 1):
            try:
                async with asyncio.timeout(opts.connect_timeout):
                    transport, listener = await opts.handshake(
                        partial(_BatchListener, protocol, opts.max_message_bytes), url, extra
                    )
                if transport.is_disconnected:
                    raise ConnectionResetError("the server closed the connection in the handshake")
            except ssl_module.SSLCertVerificationError as exc:
                raise untrusted(exc, url, "a batch connection") from exc
            except (TimeoutError, OSError) as exc:
                last = exc
                if attempt < opts.max_retries:
                    await asyncio.sleep(backoff(attempt))
                continue
            except WSHandshakeError as exc:
                raise refused(exc, url) from exc
            except Exception as exc:  # other picows handshake errors
                raise ConnectError(
                    f"cannot open a batch connection at {url}: {exc}", url=url
                ) from exc
            return cls(
                transport,
                cast(_BatchListener, listener),
                url=base,
                msgpack=opts.msgpack,
                request_timeout=opts.request_timeout,
            )
        raise unreachable(url, opts.max_retries + 1, last) from last

    @property
    def closed(self) -> bool:
        return self.transport.is_disconnected or self.listener.closed is not None

    def submit(
        self,
        calls: Sequence[BatchCall[Any]],
        first: int | None = None,
        queue: ResultSink | None = None,
    ) -> asyncio.Future[list[Any]]:
        """Send one batch frame; the future gets every call's result entry, in call order.

        With ``first`` the server answers in frames of at least ``first`` ready results;
        each arrives on ``queue`` (if given) as ``(index, entry)`` as soon as its frame does.

        Raises:
            SessionClosedError: the connection is gone.
            ValueError: no calls, or more than :data:`MAX_CALLS`.
        """
        listener = self.listener
        if listener.closed is not None or self.transport.is_disconnected:
            raise listener.closed or SessionClosedError(
                f"the batch connection is closed; {NOT_RESUMABLE}"
            )
        if not calls or len(calls) > MAX_CALLS:
            raise ValueError(f"a batch carries 1 to {MAX_CALLS} calls, got {len(calls)}")
        loop = asyncio.get_running_loop()
        rid = next(self._ids)
        pending = _Pending(loop, calls, queue)
        payload = self._protocol.frame(rid, calls, first)
        listener.pending[rid] = pending
        if self.request_timeout is not None:
            pending.timer = loop.call_later(self.request_timeout, self._expire, rid)
        self.transport.send(self._msg_type, payload)
        return pending.future

    def _expire(self, rid: int) -> None:
        pending = self.listener.pending.pop(rid, None)
        if pending is not None:
            pending.timer = None
            pending.fail(
                SessionClosedError(
                    f"no reply to batch {rid} within {self.request_timeout:g}s",
                    timeout_s=self.request_timeout,
                )
            )

    async def batch(self, calls: Sequence[BatchCall[Any]], first: int | None = None) -> list[Reply]:
        """Send one batch and wait for all its results (:class:`Reply` entries, in call
        order; an error entry is returned as it came: :func:`checked` raises it)."""
        return await self.submit(calls, first)

    async def stream(
        self, calls: Sequence[BatchCall[Any]], first: int
    ) -> AsyncIterator[tuple[int, Reply]]:
        """Send one batch with ``first``; yield ``(index, entry)`` as results arrive, the
        first ready first, until every call is answered."""
        queue: asyncio.Queue[Streamed] = asyncio.Queue()
        self.submit(calls, first, queue)
        for _ in range(len(calls)):
            at, entry = await queue.get()
            if at < 0:
                raise cast(BaseException, entry)
            yield at, entry

    async def close(self) -> None:
        """Close the connection (the server ends its sessions, 1000)."""
        transport = self.transport
        self.listener.closing = True
        if transport.is_disconnected:
            return
        try:
            transport.send_close(WSCloseCode.OK)
            await asyncio.wait_for(transport.wait_disconnected(), 5.0)
        except Exception:  # no answer, or one breaking the WebSocket's rules: it is over
            transport.disconnect(graceful=False)


def call(session: int, kind: str, data: Any = None, **extra: Any) -> BatchCall[Any]:
    """One call of a batch frame: session ``session``'s ``kind`` request (``data``;
    ``timeout_s`` in ``extra``), a :class:`~stadium._core.frames.BatchCall`."""
    return BatchCall(kind, NO_DATA if data is None else data, session=session, **extra)


def checked(entry: Reply) -> Reply:
    """A result entry, or the exception it stands for raised (``error``: the wire error;
    ``closed``: :class:`SessionClosedError` with the close code)."""
    answer = outcome(entry)
    if isinstance(answer, StadiumError):
        raise answer
    return answer


def result_of(entry: Reply, observation_type: Any = None) -> StepResult[Any]:
    """An ``observation`` result as a :class:`StepResult`, or the error it stands for
    raised (:func:`stadium._core.client.step_result`)."""
    result = step_result(entry, observation_type)
    if isinstance(result, StadiumError):
        raise result
    return result


__all__ = [
    "MAX_CALLS",
    "NOT_RESUMABLE",
    "BatchConnection",
    "ResultSink",
    "call",
    "checked",
    "result_of",
]

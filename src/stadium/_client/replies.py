"""The client's side of one connection: reply frames routed to the requests waiting
for them, in order, and what happens when the connection is lost (see
:class:`Listener`). :class:`~stadium._client.session.AsyncClient` owns one at a time.
The frames themselves are read by the session's protocol (:mod:`stadium._core.client`).
A frame no request waits for (a reply sent twice, one never asked for) ends the session:
the next request would read it as its own.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable

from picows import WSCloseCode, WSFrame, WSListener, WSMsgType, WSTransport

from stadium._client.balance import Lease
from stadium._client.options import settle
from stadium._core.resume import ResumeBook, resumable_close
from stadium._errors import SessionClosedError

#: Frames a connection keeps before its first request (a refusal the server sent as it
#: opened, e.g. ``CAPACITY_REACHED``, is one); more, or any frame no request waits for
#: once the session asked something, is a frame no request asked for.
MAX_EARLY_FRAMES = 4


class Listener(WSListener):
    """Routes reply frames to the waiting futures, in order.

    On a resumable session each reply is counted in the session's
    :class:`~stadium._core.resume.ResumeBook` (it answers the oldest request
    kept); when the connection is lost without the client closing it, ``on_lost`` is
    called instead of failing the waiting requests, and the listener of the resumed
    connection (``predecessor``) takes them over, and the book with them.
    """

    def __init__(
        self,
        lease: Lease | None = None,
        predecessor: Listener | None = None,
        limit: int | None = None,
    ) -> None:
        self.limit = limit
        """The largest frame read (``max_message_bytes``; picows' own check ends the
        connection but may still hand on a frame that arrived whole before it did)."""
        self.waiting: collections.deque[asyncio.Future[bytes]] = collections.deque()
        self.early: collections.deque[bytes] = collections.deque()
        self.closed: SessionClosedError | None = None
        self.lease = lease  # balanced sessions: the node's slot, released on disconnect
        self.closing = False  # the client ended the session
        self.asked = predecessor is not None
        """Whether a request was sent on the session (then every frame answers one)."""
        self.book: ResumeBook[bytes] | None = None
        """A resumable session's requests (numbered, kept until answered) and replies."""
        self.on_lost: Callable[[Listener], None] | None = None
        self.hello: asyncio.Future[bytes] | None = None
        if predecessor is not None:  # a resumed connection: the session's requests go on
            self.waiting = predecessor.waiting
            self.book = predecessor.book
            if lease is None:
                self.lease = predecessor.lease
            self.hello = asyncio.get_running_loop().create_future()
        self.greeting = self.hello
        self.adopted = predecessor is None
        """Whether the session's requests are this listener's (a resumed connection's are
        once the server said ``resumed``)."""

    def on_ws_frame(self, transport: WSTransport, frame: WSFrame) -> None:
        mtype = frame.msg_type
        if mtype == WSMsgType.TEXT or mtype == WSMsgType.BINARY:
            if self.limit is not None and frame.payload_size > self.limit:
                return self._too_large(transport, frame.payload_size)
            data = frame.get_payload_as_bytes()
            hello = self.hello
            if hello is not None:  # the first frame of a resumed connection
                self.hello = None
                if not hello.done():
                    hello.set_result(data)
                return
            book = self.book
            if book is not None:
                book.replied()
            if self.waiting:
                fut = self.waiting.popleft()
                if not fut.done():
                    fut.set_result(data)
            elif self.closing:
                return  # the session's end: nothing waits for it
            elif self.asked or len(self.early) >= MAX_EARLY_FRAMES:
                self._unasked(transport)
            else:
                self.early.append(data)  # e.g. a capacity refusal before any request
        elif mtype == WSMsgType.CLOSE:
            if self.closed is not None:  # the answer to the client's own close: why it closed
                transport.disconnect()
                return
            code = frame.get_close_code()
            reason = frame.get_close_message() or b""
            self.closed = SessionClosedError(
                f"server closed the session ({code.value}: {reason.decode(errors='replace')})",
                close_code=code.value,
            )
            transport.send_close(code)
            transport.disconnect()

    def _too_large(self, transport: WSTransport, size: int) -> None:
        """A frame over the limit: never read; the session ends (1009)."""
        self.closing = True
        self.closed = SessionClosedError(
            f"the server sent a frame of {size} bytes, over max_message_bytes ({self.limit})",
            close_code=WSCloseCode.MESSAGE_TOO_BIG.value,
        )
        transport.send_close(WSCloseCode.MESSAGE_TOO_BIG)
        transport.disconnect()

    def _unasked(self, transport: WSTransport) -> None:
        """A frame no request waits for (a reply sent twice, or never asked for): the
        next request would read it as its own, so the session is dropped, not resumed."""
        self.closing = True
        self.early.clear()
        self.closed = SessionClosedError(
            "the server sent a reply no request asked for (a duplicated or unsolicited "
            "frame); the session was dropped so that no request reads another's reply",
            close_code=WSCloseCode.PROTOCOL_ERROR.value,
        )
        if self.lease is not None:  # a misbehaving node
            self.lease.release(suspect=True)
            self.lease = None
        transport.send_close(WSCloseCode.PROTOCOL_ERROR)
        transport.disconnect()

    def on_ws_disconnected(self, transport: WSTransport) -> None:
        settle(transport)
        code = None if self.closed is None else self.closed.context.get("close_code")
        hello = self.hello
        if hello is not None and not hello.done():
            hello.set_exception(self.closed or ConnectionResetError("connection lost"))
            return
        if not self.adopted:  # a resume that failed: the session's requests are not ours
            return
        if self.on_lost is not None and not self.closing and resumable_close(code):
            self.on_lost(self)  # the session lives on on the server: resume it
            return
        if self.lease is not None:  # lost without a close frame, or the node going away
            self.lease.release(suspect=not self.closing and code in (None, 1001, 1011, 1012))
        err = self.closed or SessionClosedError("connection lost")
        self.closed = err
        while self.waiting:
            fut = self.waiting.popleft()
            if not fut.done():
                fut.set_exception(err)


def answered_before_closing(listener: WSListener | None) -> bool:
    """Whether a session closed at once still said why (e.g. a capacity refusal and 1013:
    the frames are kept for the first request to read)."""
    if not isinstance(listener, Listener):
        return False
    closed = listener.closed
    return bool(listener.early) or (closed is not None and "close_code" in closed.context)


__all__ = ["Listener", "answered_before_closing"]

"""Plain HTTP/1.1 connections of the picows transport (h11 does the parsing).

The transport's front protocol (:mod:`stadium._server.transports.picows`) gives a connection to
:class:`HttpProtocol` when it is not a WebSocket upgrade nor a GET picows answers:
``POST /reset``, ``POST /step``, HEAD, HTTP/1.0 (health checkers' default) and
errors, with keep-alive and the socket timeouts.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Protocol

import h11

from stadium._core.access import Tenant
from stadium._core.limits import client_address
from stadium._server.http.endpoints import HttpEndpoints
from stadium._server.http.responses import TOO_LARGE, HttpResponse, error_response
from stadium._server.runtime import Runtime


class HttpOwner(Protocol):
    """What an HTTP connection needs of its transport (``picows.PicowsTransport``)."""

    runtime: Runtime
    endpoints: HttpEndpoints
    header_timeout: float
    body_timeout: float
    keepalive_timeout: float
    max_message_bytes: int
    http_connections: set[HttpProtocol]

    def timed_out(self, what: str) -> None: ...

    def http_refusal(
        self, request: h11.Request, transport: asyncio.BaseTransport
    ) -> HttpResponse | None: ...

    def http_tenant(self, request: h11.Request) -> Tenant | None: ...


_AMBIGUOUS_LENGTH = error_response(
    400,
    "a request with both Content-Length and Transfer-Encoding is refused: send one of them",
    "BAD_REQUEST",
)


def timeout_response(what: str, seconds: float) -> HttpResponse:
    """``408 Request Timeout``, closing the connection."""
    resp = error_response(
        408,
        f"the request's {what} did not arrive within {seconds:g}s; send each request whole",
        "REQUEST_TIMEOUT",
    )
    return dataclasses.replace(resp, headers=(("Connection", "close"),))


def encode_response(conn: h11.Connection, resp: HttpResponse, *, body: bool = True) -> bytes:
    """``resp`` as bytes on ``conn``; raises ``h11.LocalProtocolError`` out of turn."""
    headers = [
        ("Content-Type", resp.content_type),
        ("Content-Length", str(len(resp.body))),
        *resp.headers,
    ]
    out = conn.send(h11.Response(status_code=resp.status, headers=headers)) or b""
    if body:
        out += conn.send(h11.Data(data=resp.body)) or b""
    return out + (conn.send(h11.EndOfMessage()) or b"")


# What an HTTP connection waits for (which timeout runs).
_HEADERS = "headers"
_BODY = "body"
_BUSY = "busy"  # answering: no socket timeout (the env call's own limits apply)
_IDLE = "keep-alive"
_LINGER = "linger"  # an error reply sent, the write side shut: input read and dropped
#: After an error reply that closes the connection, the client's input is read and dropped
#: for at most this long and this many bytes before the socket is closed (a socket closed
#: with unread input answers with a reset, which can discard the reply at the client
#: before it reads it: a client still sending would never see its 408 or 413).
LINGER_S = 2.0
LINGER_BYTES = 256 << 10


class HttpProtocol(asyncio.Protocol):
    """HTTP/1.1 with keep-alive for the non-GET endpoints (h11 does the parsing).

    One timer at a time, re-armed as the connection changes state: the request's
    headers by ``header_deadline`` (then ``header_timeout`` from a later request's
    first byte), its body within ``body_timeout`` of its headers (``408`` and close
    on either), and ``keepalive_timeout`` idle between requests (close).
    """

    def __init__(self, owner: HttpOwner, header_deadline: float) -> None:
        self._owner = owner
        self._conn = h11.Connection(h11.SERVER, max_incomplete_event_size=64 * 1024)
        self._transport: asyncio.Transport | None = None
        self._request: h11.Request | None = None
        self._tenant: Tenant | None = None
        self._body: list[bytes] = []
        self._size = 0
        self._task: asyncio.Task[None] | None = None
        self._deadline = header_deadline
        self._wait = _HEADERS
        self._timer: asyncio.TimerHandle | None = None
        self._linger_left = 0  # bytes still dropped while lingering

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        self._owner.http_connections.add(self)
        self._timer = asyncio.get_running_loop().call_at(self._deadline, self._timed_out)

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        self._owner.http_connections.discard(self)
        self._arm(_BUSY, 0.0)
        if self._task is not None:
            self._task.cancel()

    def _client(self) -> str | None:
        """The peer's address, for the per-client limits (``None`` when they are off)."""
        transport = self._transport
        if transport is None or self._owner.runtime.limits is None:
            return None
        return client_address(transport.get_extra_info("peername"))

    def _arm(self, wait: str, seconds: float) -> None:
        """Wait for ``wait`` for ``seconds`` (no timer for ``_BUSY``)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._wait = wait
        if wait is not _BUSY:
            self._timer = asyncio.get_running_loop().call_later(seconds, self._timed_out)

    def _timed_out(self) -> None:
        self._timer = None
        if self._transport is None or self._task is not None:
            return
        wait = self._wait
        if wait is _LINGER:
            self._close()
            return
        self._owner.timed_out(wait)
        if wait is _IDLE:
            self._close()
            return
        owner = self._owner
        limit = owner.header_timeout if wait is _HEADERS else owner.body_timeout
        self._send(timeout_response(wait, limit))
        self._linger()

    def _linger(self) -> None:
        """Close after an error reply: the write side shut at once (the reply, then FIN),
        the socket closed when the client closes its side, or after :data:`LINGER_S` or
        :data:`LINGER_BYTES` more of its input, dropped unread (see :data:`LINGER_S`)."""
        transport = self._transport
        if transport is None or not transport.can_write_eof():
            self._close()
            return
        transport.write_eof()
        self._linger_left = LINGER_BYTES
        self._arm(_LINGER, LINGER_S)

    def data_received(self, data: bytes) -> None:
        if self._wait is _LINGER:
            self._linger_left -= len(data)
            if self._linger_left <= 0:
                self._close()
            return
        if self._wait is _IDLE:  # the next request begins
            self._arm(_HEADERS, self._owner.header_timeout)
        self._conn.receive_data(data)
        self._process()

    def _process(self) -> None:
        while self._task is None and self._transport is not None:
            try:
                event = self._conn.next_event()
            except h11.RemoteProtocolError as exc:
                self._send(error_response(exc.error_status_hint, str(exc), "BAD_REQUEST"))
                self._linger()
                return
            if event is h11.NEED_DATA or event is h11.PAUSED:
                return
            if isinstance(event, h11.Request):
                names = {name for name, _ in event.headers}
                if b"content-length" in names and b"transfer-encoding" in names:
                    # Two framings: a proxy in front may read the other one (smuggling).
                    self._send(_AMBIGUOUS_LENGTH)
                    self._linger()
                    return
                refusal = self._owner.http_refusal(event, self._transport)
                if refusal is not None:
                    self._send(refusal, body=event.method != b"HEAD")
                    self._linger()
                    return
                self._request = event
                self._tenant = self._owner.http_tenant(event)
                self._body = []
                self._size = 0
                self._arm(_BODY, self._owner.body_timeout)
            elif isinstance(event, h11.Data):
                self._size += len(event.data)
                if self._size > self._owner.max_message_bytes:
                    self._send(TOO_LARGE)
                    self._linger()
                    return
                self._body.append(event.data)
            elif isinstance(event, h11.EndOfMessage):
                self._arm(_BUSY, 0.0)
                self._task = asyncio.get_running_loop().create_task(self._respond())
                return
            elif isinstance(event, h11.ConnectionClosed):
                self._close()
                return

    async def _respond(self) -> None:
        request = self._request
        assert request is not None
        method = request.method.decode("latin-1")
        head = method == "HEAD"  # a GET answered without its body
        resp = await self._owner.endpoints.handle(
            "GET" if head else method,
            request.target.decode("latin-1"),
            b"".join(self._body),
            self._client(),
            self._tenant,
        )
        self._task = None
        self._send(resp, body=not head)
        if self._conn.our_state is h11.MUST_CLOSE or self._owner.runtime.draining:
            self._close()
            return
        try:
            self._conn.start_next_cycle()
        except h11.LocalProtocolError:
            self._close()
            return
        if self._conn.trailing_data[0]:  # part of a pipelined request is already in
            self._arm(_HEADERS, self._owner.header_timeout)
        else:
            self._arm(_IDLE, self._owner.keepalive_timeout)
        self._process()

    def _send(self, resp: HttpResponse, *, body: bool = True) -> None:
        transport = self._transport
        if transport is None:
            return
        try:
            out = encode_response(self._conn, resp, body=body)
        except h11.LocalProtocolError:
            self._close()
            return
        transport.write(out)

    def _close(self) -> None:
        if self._transport is not None:
            self._transport.close()
            self._transport = None

    def shutdown(self) -> None:
        """Close if idle (server draining)."""
        if self._task is None:
            self._close()

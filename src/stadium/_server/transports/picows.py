"""The picows transport: WebSocket sessions and plain HTTP on one listening socket.

Each accepted connection starts in :class:`_FrontProtocol`, which looks at the
first bytes: a ``GET`` goes to picows (a WebSocket upgrade on ``/ws``, or one of
the GET endpoints answered in picows' handshake hook); anything else (``POST
/reset``, ``POST /step``) goes to a small h11-based HTTP/1.1 protocol. A
WebSocket session is a :class:`_SessionListener` that feeds complete messages to
a :class:`~stadium._server.sessions.runner.Session` and is that session's channel.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import socket
import sys
from http import HTTPStatus
from typing import Any

import h11
from picows import (
    WSCloseCode,
    WSFrame,
    WSListener,
    WSMsgType,
    WSTransport,
    WSUpgradeRequest,
    WSUpgradeResponse,
    WSUpgradeResponseWithListener,
)
from picows import picows as _picows_impl
from picows.picows import WSAutoPingStrategy

from stadium._core.access import AccessPolicy, Refusal, Tenant, header_values
from stadium._core.handshake import PLAIN, Terms, Upgrade, host_port, negotiate
from stadium._core.limits import client_address
from stadium._core.protocol import Encoding
from stadium._server.http.batch_socket import BatchServerConnection
from stadium._server.http.endpoints import HttpEndpoints
from stadium._server.http.mcp_socket import McpSocket
from stadium._server.http.responses import HttpResponse
from stadium._server.http.upgrade import open_upgrade
from stadium._server.runtime import MAX_FRAGMENTS, MAX_UNSENT_BYTES, NODE_NAME, Runtime
from stadium._server.sessions.runner import Session
from stadium._server.transports.h11 import HttpProtocol, encode_response, timeout_response
from stadium._server.transports.handoff import Handoff
from stadium._util.throttle import ThrottledLog

log = logging.getLogger("stadium.transport")


class _PicowsLog(logging.LoggerAdapter):  # type: ignore[type-arg]
    """picows' log, quiet about clients (a client must not be able to fill the disk).

    picows logs every connection and disconnection at INFO, and a client's broken
    frames ("WS parser error"), slow readers and handshake timeouts at
    WARNING/ERROR, some with a traceback: all of that goes to DEBUG, without the
    traceback. What it logs about exceptions from our listener (a Stadium bug) or
    its own ping loop stays at ERROR, throttled: one line per 10 s with its
    traceback, naming how many were held back.
    """

    _BUG_MARKERS = ("WSListener", "Auto-ping loop failed")

    def __init__(self, logger: logging.Logger) -> None:
        super().__init__(logger, {})
        self._bugs = ThrottledLog(logger, logging.ERROR)

    def log(self, level: int, msg: object, *args: Any, **kwargs: Any) -> None:
        if level < logging.WARNING:  # every connection logs at INFO: keep it cheap
            if self.logger.isEnabledFor(logging.DEBUG):
                kwargs.pop("exc_info", None)
                self.logger.log(logging.DEBUG, msg, *args, **kwargs)
            return
        text = str(msg)
        if any(marker in text for marker in self._BUG_MARKERS):
            exc = kwargs.get("exc_info")
            if exc is True:
                exc = sys.exc_info()[1]
            self._bugs(text, *args, exc=exc if isinstance(exc, BaseException) else None)
            return
        kwargs.pop("exc_info", None)
        super().log(logging.DEBUG, msg, *args, **kwargs)


# picows makes a child logging.Logger per connection when given a Logger; an
# adapter avoids that allocation (memory per session).
_PICOWS_LOG = _PicowsLog(logging.getLogger("stadium.picows"))
_READ_BUFFER = 2048

# -- the one private seam ---------------------------------------------------------
# picows' public server API (ws_create_server) owns the listening socket, but
# Stadium serves plain HTTP (h11) and WebSockets on one socket and hands picows
# only the connections that start with GET. picows has no public factory for its
# per-connection protocol, so it is built here exactly as ws_create_server builds
# it: positionally, in this order. tests/test_picows.py reads picows' own
# ws_create_server and fails loudly if the order changes; pyproject.toml bounds
# picows to the minor version that test passed on.
_WSProtocol: Any = getattr(_picows_impl, "WSProtocol")  # noqa: B009

WS_PROTOCOL_ARGS = (
    "host_port",
    "ws_path",
    "is_client_side",
    "ws_listener_factory",
    "logger",
    "disconnect_on_exception",
    "websocket_handshake_timeout",
    "enable_auto_ping",
    "auto_ping_idle_timeout",
    "auto_ping_reply_timeout",
    "auto_ping_strategy",
    "enable_auto_pong",
    "max_frame_size",
    "extra_headers",
    "read_buffer_init_size",
)
"""The positional parameters of picows' ``WSProtocol``, as ``ws_create_server`` passes them."""


def picows_server_protocol(**kwargs: Any) -> asyncio.BufferedProtocol:
    """picows' server-side protocol for one connection; ``kwargs`` named as in
    :data:`WS_PROTOCOL_ARGS` (every one is required)."""
    missing = set(WS_PROTOCOL_ARGS) - set(kwargs)
    extra = set(kwargs) - set(WS_PROTOCOL_ARGS)
    if missing or extra:
        raise TypeError(f"picows protocol arguments: missing {missing}, unknown {extra}")
    proto: asyncio.BufferedProtocol = _WSProtocol(*(kwargs[name] for name in WS_PROTOCOL_ARGS))
    return proto


_TEXT = WSMsgType.TEXT
_BINARY = WSMsgType.BINARY
_CONTINUATION = WSMsgType.CONTINUATION
_CLOSE = WSMsgType.CLOSE


class _SessionListener(WSListener):
    """One WebSocket session: frames in (reassembled, bounded), the session's channel out.

    Backpressure: when the socket's write buffer passes its high-water mark
    (uvloop calls ``pause_writing``), the session stops reading requests, so a
    client that does not read its replies cannot make the server buffer more of
    them; if more than ``max_unsent_bytes`` are still unsent when another reply
    is due, it is closed (1008) and its buffers are dropped.
    """

    __slots__ = (
        "_frag_size",
        "_frags",
        "_msg_type",
        "_owner",
        "_paused",
        "_upgrade",
        "encoding",
        "session",
        "transport",
    )

    def __init__(self, owner: PicowsTransport, upgrade: Upgrade) -> None:
        self._owner = owner
        self._upgrade = upgrade
        """What the handshake decided this connection carries (``stadium._core.handshake``)."""
        self.encoding = encoding = upgrade.encoding
        self._msg_type = _TEXT if encoding is Encoding.JSON else _BINARY
        self._frags: list[bytes] | None = None
        self._frag_size = 0
        self._paused = False
        self.transport: WSTransport | None = None
        self.session: Session | BatchServerConnection | McpSocket | None = None

    # picows callbacks ----------------------------------------------------------

    def on_ws_connected(self, transport: WSTransport) -> None:
        self.transport = transport
        runtime = self._owner.runtime
        upgrade, self._upgrade = self._upgrade, PLAIN  # decided: not kept per session
        client = None
        if runtime.limits is not None:  # per-client limits (a restore is charged too)
            client = client_address(transport.underlying_transport.get_extra_info("peername"))
        self.session = open_upgrade(
            runtime,
            upgrade,
            self,
            client=client,
            address=functools.partial(_address, transport.underlying_transport),
        )

    def on_ws_frame(self, transport: WSTransport, frame: WSFrame) -> None:
        mtype = frame.msg_type
        if mtype in (_TEXT, _BINARY):
            if frame.fin:
                if self._frags is not None:
                    self._protocol_violation("a new message started inside a fragmented one")
                    return
                self.session.feed(frame.get_payload_as_bytes())  # type: ignore[union-attr]
            else:
                payload = frame.get_payload_as_bytes()
                self._frags = [payload]
                self._frag_size = len(payload)
        elif mtype == _CONTINUATION:
            self._continuation(transport, frame)
        elif mtype == _CLOSE:
            transport.send_close(frame.get_close_code(), frame.get_close_message())
            transport.disconnect()

    def _continuation(self, transport: WSTransport, frame: WSFrame) -> None:
        """Add a fragment: linear in the message (a running size), bounded in bytes and count."""
        frags = self._frags
        if frags is None:
            self._protocol_violation("continuation frame without a message to continue")
            return
        payload = frame.get_payload_as_bytes()
        frags.append(payload)
        self._frag_size += len(payload)
        limit = self._owner.max_message_bytes
        if self._frag_size > limit or len(frags) > MAX_FRAGMENTS:
            self._frags = None
            why = (
                f"message exceeds {limit} bytes"
                if self._frag_size > limit
                else f"message split into more than {MAX_FRAGMENTS} fragments"
            )
            transport.send_close(WSCloseCode.MESSAGE_TOO_BIG, why.encode())
            transport.disconnect()
            return
        if frame.fin:
            self._frags = None
            self.session.feed(b"".join(frags))  # type: ignore[union-attr]

    def on_ws_disconnected(self, transport: WSTransport) -> None:
        self._frags = None
        session, self.session = self.session, None
        if session is not None:
            session.connection_lost(self)
        # Break the reference cycles (listener <-> WSTransport, listener <-> Session) now:
        # `stadium serve` runs the cyclic collector rarely (_server.GC_THRESHOLDS), so a
        # connection's objects left in a cycle would pile up for many thousand sessions.
        self.transport = None

    def pause_writing(self) -> None:
        """The peer is not reading fast enough: stop reading its requests until it does."""
        self._paused = True
        transport = self.transport
        if transport is not None and not transport.is_disconnected:
            transport.underlying_transport.pause_reading()

    def resume_writing(self) -> None:
        self._paused = False
        transport = self.transport
        if transport is not None and not transport.is_disconnected:
            transport.underlying_transport.resume_reading()

    def _protocol_violation(self, reason: str) -> None:
        assert self.transport is not None
        if self.session is not None:
            self.session.outcome = "errored"
        self._frags = None
        self.transport.send_close(WSCloseCode.PROTOCOL_ERROR, reason.encode())
        self.transport.disconnect()

    # Channel (what the session sees) ------------------------------------------

    def send(self, data: bytes) -> None:
        transport = self.transport
        if transport is not None and not transport.is_close_frame_sent:
            if self._paused and self._not_reading(transport):
                return
            transport.send(self._msg_type, data)

    def _not_reading(self, transport: WSTransport) -> bool:
        """Close the session if more than the bound is still unsent when a reply is due.

        Checked before the reply is queued, so one reply larger than the bound is
        still delivered to a client that reads it.
        """
        unsent = transport.underlying_transport.get_write_buffer_size()
        limit = self._owner.max_unsent_bytes
        if unsent <= limit:
            return False
        log.debug("closing a session whose client is not reading (%d bytes unsent)", unsent)
        transport.send_close(
            WSCloseCode.POLICY_VIOLATION,
            f"client is not reading its replies ({unsent} bytes unsent > {limit})".encode(),
        )
        transport.disconnect(graceful=False)
        return True

    def close(self, code: int, reason: str) -> None:
        transport = self.transport
        if transport is not None:
            if not transport.is_close_frame_sent:
                transport.send_close(WSCloseCode(code), reason.encode()[:120])
            transport.disconnect()


def _response(resp: HttpResponse) -> WSUpgradeResponseWithListener:
    headers = {"Content-Type": resp.content_type, **dict(resp.headers)}
    if resp.status < 400:
        r = WSUpgradeResponse.create_ok_response(resp.body, headers)
        r.status = HTTPStatus(resp.status)
    else:
        r = WSUpgradeResponse.create_error_response(resp.status, resp.body, headers)
    return WSUpgradeResponseWithListener(r, None)


class PicowsTransport:
    """Builds the per-connection protocols for one worker.

    Socket timeouts (each a timer per connection state change, none per message):
    ``header_timeout`` from accept until the request line and headers are in
    (picows' own handshake timeout for connections it takes), ``body_timeout``
    for an HTTP request's body, ``keepalive_timeout`` for an HTTP keep-alive
    connection idle between requests. ``timeouts`` counts the connections each
    closed (``headers``, ``body``, ``keep-alive``; picows' handshake timeouts
    are not counted here).
    """

    def __init__(
        self,
        runtime: Runtime,
        endpoints: HttpEndpoints,
        *,
        max_message_bytes: int,
        ping_interval: float,
        ping_timeout: float,
        max_unsent_bytes: int = MAX_UNSENT_BYTES,
        header_timeout: float = 10.0,
        body_timeout: float = 30.0,
        keepalive_timeout: float = 15.0,
        access: AccessPolicy | None = None,
    ) -> None:
        self.access = access or AccessPolicy()
        self.runtime = runtime
        self.terms = Terms(
            self.access, NODE_NAME, runtime.resume_grace, runtime.doors.mint, endpoints.harness
        )
        """What the handshake offers every connection (``stadium._core.handshake``)."""
        self.endpoints = endpoints
        self.max_message_bytes = max_message_bytes
        self.max_unsent_bytes = max_unsent_bytes
        self.ping_interval = ping_interval
        self.ping_timeout = ping_timeout
        self.header_timeout = header_timeout
        self.body_timeout = body_timeout
        self.keepalive_timeout = keepalive_timeout
        self.timeouts: collections.Counter[str] = collections.Counter()
        self.http_connections: set[HttpProtocol] = set()
        self.handoff: Handoff | None = None
        """Passes a resume for another worker's session to it (``handoff``); set by the
        server when it listens."""
        # stadium_worker_open_connections: WebSocket sessions and HTTP connections.
        runtime.open_connections = lambda: len(runtime.sessions) + len(self.http_connections)
        runtime.handoff_refused = lambda: self.handoff.refused if self.handoff is not None else 0

    def timed_out(self, what: str) -> None:
        """Count (and log at debug) a connection closed by a socket timeout."""
        self.timeouts[what] += 1
        log.debug("closing a connection: %s timeout", what)

    def _route(
        self, request: WSUpgradeRequest, transport: asyncio.BaseTransport | None = None
    ) -> Any:
        """picows' listener factory: the handshake's answer (``stadium._core.handshake``)."""
        path = request.path.decode("latin-1")
        decided = negotiate(
            self.terms,
            path,
            request.headers,
            local_addr=None if transport is None else functools.partial(_local_addr, transport),
            address=functools.partial(_address, transport),
        )
        if decided is None:  # not a session: one of the GET endpoints
            return _response(self.endpoints.get(path))
        if isinstance(decided, Refusal):  # before any env or slot
            return _response(_refused(decided))
        listener = _SessionListener(self, decided)
        headers = decided.headers
        if decided.subprotocol is None and not headers:
            return listener
        extra = dict(headers)
        if decided.subprotocol is not None:
            extra["Sec-WebSocket-Protocol"] = decided.subprotocol
        return WSUpgradeResponseWithListener(WSUpgradeResponse.create_101_response(extra), listener)

    def http_refusal(
        self, request: h11.Request, transport: asyncio.BaseTransport
    ) -> HttpResponse | None:
        """The access refusal of a plain-HTTP request, or ``None`` (:mod:`stadium._core.access`)."""
        auth, origin, host = header_values(request.headers)
        refusal = self.access.check(
            request.target.decode("latin-1"),
            authorization=auth,
            origin=origin,
            host=host,
            local_addr=functools.partial(_local_addr, transport),
        )
        return None if refusal is None else _refused(refusal)

    def http_tenant(self, request: h11.Request) -> Tenant | None:
        """The tenant a plain-HTTP request's token names (``None``: no tenants)."""
        if self.access.tenants is None:
            return None
        return self.access.tenant_of(header_values(request.headers)[0])

    def over_rate(self, transport: asyncio.Transport) -> bool:
        """Answer ``429`` and close if the peer is over its ``--rate-limit`` (one request each)."""
        if self.runtime.limits is None:
            return False
        resp = self.endpoints.over_rate(client_address(transport.get_extra_info("peername")))
        if resp is None:
            return False
        transport.write(encode_response(h11.Connection(h11.SERVER), resp))
        transport.close()
        return True

    def ws_protocol(
        self, handshake_timeout: float, transport: asyncio.BaseTransport | None = None
    ) -> asyncio.BufferedProtocol:
        """picows' protocol for a connection that has ``handshake_timeout`` seconds left
        to complete its request headers; ``transport`` tells the address it arrived on."""
        return picows_server_protocol(
            host_port=None,
            ws_path=None,
            is_client_side=False,
            ws_listener_factory=self._route
            if transport is None
            else functools.partial(self._route, transport=transport),
            logger=_PICOWS_LOG,
            disconnect_on_exception=True,
            websocket_handshake_timeout=handshake_timeout,
            enable_auto_ping=self.ping_interval > 0,
            auto_ping_idle_timeout=self.ping_interval or 20.0,
            auto_ping_reply_timeout=self.ping_timeout or 20.0,
            auto_ping_strategy=WSAutoPingStrategy.PING_WHEN_IDLE,
            enable_auto_pong=True,
            max_frame_size=self.max_message_bytes,
            extra_headers=None,
            read_buffer_init_size=_READ_BUFFER,
        )

    def __call__(self) -> asyncio.Protocol:
        """The protocol factory for ``loop.create_server``."""
        return _FrontProtocol(self)

    def adopt(self, sock: socket.socket, head: bytes) -> None:
        """Serve a connection another worker accepted and read ``head`` of (``handoff``)."""
        loop = asyncio.get_running_loop()

        async def connect() -> None:
            try:
                await loop.connect_accepted_socket(lambda: _FrontProtocol(self, head), sock)
            except OSError as exc:  # the peer left meanwhile
                log.debug("connection hand-off: adopting failed: %s", exc)
                sock.close()

        task = loop.create_task(connect())
        _ADOPTING.add(task)
        task.add_done_callback(_ADOPTING.discard)


_ADOPTING: set[asyncio.Task[None]] = set()


_MAX_REQUEST_LINE = 8192


def _refused(refusal: Refusal) -> HttpResponse:
    return HttpResponse(refusal.status, refusal.body, headers=refusal.headers)


def _address(transport: asyncio.BaseTransport | None) -> str:
    """This server as a router addresses it: the ``host:port`` the connection arrived on."""
    sockname = None if transport is None else transport.get_extra_info("sockname")
    return host_port(sockname) or NODE_NAME


def _local_addr(transport: asyncio.BaseTransport) -> str | None:
    """The local address a connection arrived on (``None`` if not an IP socket)."""
    sockname = transport.get_extra_info("sockname")
    return sockname[0] if isinstance(sockname, tuple) and sockname else None


class _FrontProtocol(asyncio.Protocol):
    """Decides from the request line whether a connection is picows' or plain HTTP.

    From accept, the connection has ``header_timeout`` seconds to send its request
    line and headers: a timer here until the request line is in (then ``408`` if
    part of it came, else a plain close), then what is left of it goes with the
    connection (picows' handshake timeout, or :class:`HttpProtocol`'s timer).
    ``GET /state`` goes to h11: it builds an environment, which picows' synchronous
    handshake hook cannot wait for.
    """

    __slots__ = ("_buf", "_owner", "_timer", "_transport")

    def __init__(self, owner: PicowsTransport, head: bytes = b"") -> None:
        self._owner = owner
        self._transport: asyncio.Transport | None = None
        self._buf = head
        """Bytes read so far (a connection handed over by another worker comes with some)."""
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        self._timer = asyncio.get_running_loop().call_later(
            self._owner.header_timeout, self._timed_out
        )
        if self._buf:  # handed over (``handoff``): its request line is in already
            self.data_received(b"")

    def _timed_out(self) -> None:
        self._timer = None
        transport = self._transport
        if transport is None:
            return
        self._owner.timed_out("headers")
        if self._buf:
            conn = h11.Connection(h11.SERVER)
            transport.write(
                encode_response(conn, timeout_response("headers", self._owner.header_timeout))
            )
        transport.close()
        self._transport = None

    def data_received(self, data: bytes) -> None:
        buf = self._buf + data if self._buf else data
        end = buf.find(b"\r\n")
        if end < 0 and len(buf) < _MAX_REQUEST_LINE:
            self._buf = buf
            return
        transport = self._transport
        if transport is None:  # timed out
            return
        timer = self._timer
        assert timer is not None
        timer.cancel()
        self._timer = None
        deadline = timer.when()
        line = buf[:end] if end >= 0 else b""
        if (
            line.startswith(b"GET ")
            and line.endswith(b" HTTP/1.1")
            and not self._owner.endpoints.builds_env(line[4:-9].decode("latin-1"))
        ):
            # picows: WebSocket upgrades and the GET endpoints (HTTP/1.1 only).
            if self._owner.over_rate(transport):
                return
            handoff = self._owner.handoff
            if handoff is not None and b"stadium_resume=" in line:
                self._buf = b""
                if handoff.pass_on(transport, buf, line):  # another worker's session
                    self._transport = None
                    return
            left = deadline - asyncio.get_running_loop().time()
            ws = self._owner.ws_protocol(max(left, 0.001), transport)
            transport.set_protocol(ws)
            ws.connection_made(transport)
            view = memoryview(buf)
            while view:
                target = memoryview(ws.get_buffer(len(view)))
                n = min(len(target), len(view))
                target[:n] = view[:n]
                ws.buffer_updated(n)
                view = view[n:]
        else:  # h11: POST, HEAD, HTTP/1.0 (HAProxy's and nginx's defaults), and errors
            http = HttpProtocol(self._owner, deadline)
            transport.set_protocol(http)
            http.connection_made(transport)
            http.data_received(buf)

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

"""The ASGI transport: the same sessions and endpoints inside any ASGI server.

Mount it in your own deployment::

    app = stadium.asgi_app("my_pkg.envs:MyEnv", max_sessions=1024)
    # uvicorn my_module:app        or   fastapi_app.mount("/env", app)

It speaks the same protocol as ``stadium serve`` (both pass one conformance
suite, and the same resume, batch and fork tests): each ``/ws`` upgrade is decided
by :func:`stadium._core.handshake.negotiate` and opened by
:func:`stadium._server.http.upgrade.open_upgrade`, as picows does. ``stadium serve`` is
faster (picows), this path is for fitting into an existing ASGI stack. One thing it
cannot do: hand a resume to the process holding the session (``stadium serve``'s
workers pass the socket to each other; an ASGI app is one process and cannot), so
under an ASGI server with several worker processes on one address a resume that
lands on another process is refused: run one process per address.

Graceful drain on SIGTERM is the hosting server's job here, and so are socket
timeouts (``header_timeout``, ``body_timeout`` and ``keepalive_timeout`` apply to
``stadium serve`` only; use e.g. uvicorn's ``--timeout-keep-alive`` or a proxy's
client header and body timeouts). HTTP requests that build an environment hold a
session slot here too (``endpoints``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from stadium._core.access import AccessPolicy, Refusal, header_values
from stadium._core.handshake import WS_PATH, Terms, header_map, host_port, negotiate
from stadium._core.limits import client_address
from stadium._core.protocol import Encoding
from stadium._env.contract import Environment
from stadium._server.config import ServerConfig
from stadium._server.http.responses import TOO_LARGE, HttpResponse
from stadium._server.http.upgrade import open_upgrade
from stadium._server.processes.worker import Worker
from stadium._server.runtime import MAX_UNSENT_BYTES, NODE_NAME

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

log = logging.getLogger("stadium.asgi")

_CLOSE = object()


class _AsgiChannel:
    """A session's channel: frames go through a queue to one writer task per connection.

    The queue is bounded in bytes: a client that does not read its replies (the
    ASGI server's ``send`` does not return) is closed with 1008 when more than
    ``MAX_UNSENT_BYTES`` still wait as another reply is due, and its frames are
    dropped.
    """

    __slots__ = ("_binary", "_queue", "_unsent", "closed")

    def __init__(self, binary: bool) -> None:
        self._binary = binary
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._unsent = 0
        self.closed = False

    def send(self, data: bytes) -> None:
        if self.closed:
            return
        if self._unsent > MAX_UNSENT_BYTES:  # checked first: one large reply still goes out
            while not self._queue.empty():
                self._queue.get_nowait()
            self.close(1008, f"client is not reading its replies (> {MAX_UNSENT_BYTES} bytes)")
            return
        self._unsent += len(data)
        self._queue.put_nowait(data)

    def close(self, code: int, reason: str) -> None:
        if not self.closed:
            self.closed = True
            self._queue.put_nowait((_CLOSE, code, reason))

    async def writer(self, send: Send) -> None:
        """Sends the queued frames until the close; ends quietly when the client has gone
        (ASGI's ``send`` then raises an ``OSError``: uvicorn's ``ClientDisconnected``)."""
        try:
            while True:
                item = await self._queue.get()
                if isinstance(item, tuple):
                    await send({"type": "websocket.close", "code": item[1], "reason": item[2]})
                    return
                if self._binary:
                    await send({"type": "websocket.send", "bytes": item})
                else:
                    await send({"type": "websocket.send", "text": item.decode()})
                self._unsent -= len(item)
        except OSError:  # the connection is gone: nothing is left to send it
            self.closed = True


class AsgiApp:
    """An ASGI 3 application serving one environment class."""

    def __init__(
        self, config: ServerConfig, env_cls: type[Environment[Any, Any, Any]] | None = None
    ) -> None:
        self.worker = Worker.build(config, env_cls)
        self.config = self.worker.config
        self.spec = self.worker.spec
        self.runtime = self.worker.runtime
        self.endpoints = self.worker.endpoints
        tenants = self.runtime.doors.tenants
        self.access = AccessPolicy.from_config(config, None if tenants is None else tenants.book)
        self.terms = Terms(
            self.access, NODE_NAME, self.runtime.resume_grace, self.runtime.doors.mint,
            self.endpoints.harness,
        )  # fmt: skip
        """What the handshake offers every connection (``stadium._core.handshake``)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "websocket":
            self.worker.start()  # idempotent: servers without lifespan events start here
            await self._websocket(scope, receive, send)
        elif kind == "http":
            await self._http(scope, receive, send)
        elif kind == "lifespan":
            await self._lifespan(receive, send)

    # -- WebSocket sessions -------------------------------------------------------

    async def _websocket(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = await receive()
        if message["type"] != "websocket.connect":
            return
        headers = header_map(scope.get("headers") or ())
        server = scope.get("server")  # the local address the connection arrived on
        decided = negotiate(
            self.terms,
            _ws_target(scope),
            headers,
            local_addr=server[0] if server and server[1] is not None else None,
            address=functools.partial(_address, server),
            offered=scope.get("subprotocols") or (),
            websocket=True,
        )
        if decided is None:
            await send({"type": "websocket.close", "code": 1008, "reason": "sessions live at /ws"})
            return
        if isinstance(decided, Refusal):  # before any env or slot: see stadium._core.access
            await _refuse_websocket(scope, send, decided)
            return
        client = None
        if self.runtime.limits is not None:  # per-client limits: the upgrade is a request too
            client = client_address(scope.get("client"))
            over = self.endpoints.over_rate(client)
            if over is not None:
                await _refuse_websocket(scope, send, _over_rate(over))
                return
        await send(
            {
                "type": "websocket.accept",
                "subprotocol": decided.subprotocol,
                "headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in decided.headers],
            }
        )
        channel = _AsgiChannel(binary=decided.encoding is Encoding.MSGPACK)
        writer = asyncio.get_running_loop().create_task(channel.writer(send))
        session = open_upgrade(
            self.runtime,
            decided,
            channel,
            client=client,  # a restore is charged to the peer that resumes it
            address=functools.partial(_address, server),
        )
        limit = self.config.max_message_bytes
        try:
            while not writer.done():
                receiving = asyncio.ensure_future(receive())
                await asyncio.wait({receiving, writer}, return_when=asyncio.FIRST_COMPLETED)
                if not receiving.done():
                    receiving.cancel()
                    break
                message = receiving.result()
                if message["type"] == "websocket.disconnect":
                    break
                data = message.get("bytes")
                if data is None:
                    data = (message.get("text") or "").encode()
                if len(data) > limit:
                    channel.close(1009, f"message exceeds {limit} bytes")
                    continue
                if session is not None:
                    session.feed(data)
        finally:
            if session is not None:  # a resumed session stays if another connection took it
                session.connection_lost(channel)
            channel.closed = True
            if not writer.done():
                writer.cancel()

    # -- HTTP -------------------------------------------------------------------------

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "/")
        root = scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root) :] or "/"
        method = scope.get("method", "GET")
        refusal = self._refusal(scope, path)
        tenant = None  # named now, as checked (a reload while the body comes keeps it)
        if refusal is None and self.access.tenants is not None:
            tenant = self.access.tenant_of(header_values(scope.get("headers") or ())[0])
        body = b""
        more = method == "POST" and refusal is None
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.config.max_message_bytes:
                break
        if refusal is not None:
            resp = HttpResponse(refusal.status, refusal.body, headers=refusal.headers)
        elif len(body) > self.config.max_message_bytes:
            resp = TOO_LARGE
        else:
            client = None if self.runtime.limits is None else client_address(scope.get("client"))
            resp = await self.endpoints.handle(method, path, body, client, tenant)
        await send(
            {
                "type": "http.response.start",
                "status": resp.status,
                "headers": [
                    (b"content-type", resp.content_type.encode()),
                    (b"content-length", str(len(resp.body)).encode()),
                    *((k.encode("latin-1"), v.encode("latin-1")) for k, v in resp.headers),
                ],
            }
        )
        await send({"type": "http.response.body", "body": resp.body})

    def _refusal(self, scope: Scope, path: str) -> Refusal | None:
        """The access refusal of a request (see :mod:`stadium._core.access`), or ``None``."""
        auth, origin, host = header_values(scope.get("headers") or ())
        server = scope.get("server")  # the local address the connection arrived on
        local = server[0] if server and server[1] is not None else None
        return self.access.check(
            path, authorization=auth, origin=origin, host=host, local_addr=local
        )

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self.worker.start()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                self.runtime.draining = True
                self.runtime.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return


def _ws_target(scope: Scope) -> str:
    """A WebSocket scope's target for the handshake: its path without the mount point
    (``root_path``; any path ending in ``/ws``, for servers that do not set it), and its
    query string."""
    path = scope.get("path", "/")
    root = scope.get("root_path", "")
    if root and path.startswith(root):
        path = path[len(root) :] or "/"
    if path.rstrip("/").rsplit("/", 1)[-1] == "ws":
        path = WS_PATH
    query = scope.get("query_string", b"").decode("latin-1")
    return f"{path}?{query}" if query else path


def _address(server: Any) -> str:
    """This server as a router addresses it: the ``host:port`` the connection arrived on."""
    return host_port(server) or NODE_NAME


def _over_rate(resp: HttpResponse) -> Refusal:
    """A WebSocket upgrade over its client's ``--rate-limit``, as a refusal."""
    message = "too many requests from this client (--rate-limit); retry later"
    return Refusal(resp.status, "RATE_LIMITED", message, resp.headers)


async def _refuse_websocket(scope: Scope, send: Send, refusal: Refusal) -> None:
    """Answer a refused upgrade with the refusal's status and body when the server supports
    the ASGI ``websocket.http.response`` extension (uvicorn, hypercorn); else close it
    before accepting (the server answers 403)."""
    if "websocket.http.response" in (scope.get("extensions") or {}):
        headers = [(b"content-type", b"application/json")]
        headers += [(k.encode("latin-1"), v.encode("latin-1")) for k, v in refusal.headers]
        await send(
            {"type": "websocket.http.response.start", "status": refusal.status, "headers": headers}
        )
        await send({"type": "websocket.http.response.body", "body": refusal.body})
    else:
        await send({"type": "websocket.close", "code": 1008, "reason": refusal.code})


def asgi_app(target: str | type[Environment[Any, Any, Any]], **options: Any) -> AsgiApp:
    """Build an ASGI app for TARGET (a target string or an Environment class).

    ``options`` are :class:`~stadium.ServerConfig` fields (``max_sessions``,
    ``admission_timeout``, ``idle_timeout``, ``max_message_bytes``, ...).
    """
    if isinstance(target, str):
        return AsgiApp(ServerConfig(target=target, **options))
    return AsgiApp(ServerConfig(target=target.__qualname__, **options), target)

"""One ``GET /health`` probe for every caller: the deployment tools waiting for their
servers (local processes, Podman containers, a SLURM job), the benchmark harness, and
the client's balancer reading each node's free capacity.

One exchange with no I/O (:class:`HealthExchange`: the request's bytes out, the
answer's bytes in, parsed by h11) and two thin shells around it: :func:`probe`
blocks on a socket, :func:`probe_async` uses asyncio streams. Both answer a
:class:`Health` (the status and the JSON body) or raise ``OSError`` (unreachable,
reset, timed out: ``TimeoutError`` is one) or ``ValueError`` (not an HTTP answer, or
one too large); :func:`healthy` is the yes/no of a deployment's wait::

    probe("http://127.0.0.1:8000")            # Health(status=200, body={"status": ...})
    healthy("http://127.0.0.1:8000", 1.0)     # True once it answers 200

The URL is a server's base URL (``http``/``https``) or its session URL
(``ws``/``wss``, ``…/ws``): the probe asks for ``/health`` under the same base path.
"""

from __future__ import annotations

import asyncio
import json
import socket
import ssl as ssl_module
import urllib.parse
from dataclasses import dataclass
from typing import Any

import h11

#: The largest ``/health`` answer read (a Stadium server's is a few hundred bytes).
MAX_HEALTH_BYTES = 64 * 1024


@dataclass(frozen=True, slots=True)
class Health:
    """A ``/health`` answer."""

    status: int
    """The HTTP status: 200 healthy, 503 draining (shutting down)."""
    body: Any = None
    """The JSON body decoded (None when it was not JSON)."""

    @property
    def ok(self) -> bool:
        return self.status == 200

    @property
    def draining(self) -> bool:
        return self.status == 503

    @property
    def data(self) -> dict[str, Any]:
        """The body when it is a JSON object (a Stadium server's counts), else empty."""
        return self.body if isinstance(self.body, dict) else {}


@dataclass(frozen=True, slots=True)
class HealthTarget:
    """Where a probe goes: the address, TLS or not, the Host header and the path."""

    host: str
    port: int
    tls: bool
    authority: str
    path: str

    @classmethod
    def of(cls, url: str, name: str | None = None) -> HealthTarget:
        """The target of ``url``. ``name``: the DNS name ``url``'s address stands for
        (sent as ``Host`` and used for TLS's SNI)."""
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https", "ws", "wss") or not parts.hostname:
            raise ValueError(f"not a server URL: {url!r} (want http://host:port)")
        tls = parts.scheme in ("https", "wss")
        port = parts.port or (443 if tls else 80)
        authority = f"{name}:{port}" if name else parts.netloc
        base = parts.path.rstrip("/").removesuffix("/ws")
        return cls(parts.hostname, port, tls, authority, base + "/health")


class HealthExchange:
    """One ``GET /health`` as bytes: :attr:`request` to send, then :meth:`feed` what
    comes back until it returns the :class:`Health` (``b""``: the peer closed)."""

    def __init__(self, target: HealthTarget) -> None:
        self._conn = h11.Connection(h11.CLIENT)
        self._status = 0
        self._body = bytearray()
        request = h11.Request(
            method="GET",
            target=target.path,
            headers=[("Host", target.authority), ("Connection", "close")],
        )
        self.request: bytes = self._conn.send(request) + (
            self._conn.send(h11.EndOfMessage()) or b""
        )

    def feed(self, data: bytes) -> Health | None:
        """The answer once complete; None while more bytes are needed.

        Raises:
            ConnectionResetError: the peer closed without answering.
            ValueError: not an HTTP answer, or one over :data:`MAX_HEALTH_BYTES`.
        """
        conn = self._conn
        try:
            conn.receive_data(data)
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    return None
                if isinstance(event, h11.Response):
                    self._status = event.status_code
                elif isinstance(event, h11.Data):
                    self._body += event.data
                    if len(self._body) > MAX_HEALTH_BYTES:
                        raise ValueError(f"health answer over {MAX_HEALTH_BYTES} bytes")
                elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                    break
        except h11.ProtocolError as exc:
            if not self._status:
                raise ConnectionResetError(f"no HTTP answer to GET /health: {exc}") from None
            raise ValueError(f"a broken /health answer: {exc}") from None
        if not self._status:
            raise ConnectionResetError("closed without an answer")
        try:
            body = json.loads(bytes(self._body) or b"null")
        except ValueError:
            body = None
        return Health(self._status, body)


def probe(
    url: str,
    timeout: float = 2.0,
    *,
    ssl: ssl_module.SSLContext | None = None,
    name: str | None = None,
) -> Health:
    """``GET /health`` of the server at ``url``, blocking (each step bounded by
    ``timeout`` seconds). ``ssl``: the TLS context for ``https`` (default: the system's
    trusted roots); ``name``: the DNS name ``url``'s address stands for.

    Raises:
        OSError: unreachable, reset, or timed out (``TimeoutError``).
        ValueError: not a server URL, or not an HTTP answer.
    """
    target = HealthTarget.of(url, name)
    exchange = HealthExchange(target)
    with socket.create_connection((target.host, target.port), timeout=timeout) as raw:
        sock: socket.socket = raw
        if target.tls:
            context = ssl or ssl_module.create_default_context()
            # The handshake after wrapping, inside the try: a refused certificate closes it.
            sock = context.wrap_socket(
                raw, server_hostname=name or target.host, do_handshake_on_connect=False
            )
        try:
            if isinstance(sock, ssl_module.SSLSocket):
                sock.do_handshake()
            sock.sendall(exchange.request)
            while (health := exchange.feed(sock.recv(65536))) is None:
                pass
            return health
        finally:
            if sock is not raw:
                sock.close()


async def probe_async(
    url: str, *, ssl: ssl_module.SSLContext | None = None, name: str | None = None
) -> Health:
    """:func:`probe` on asyncio streams (the caller bounds it, e.g. ``asyncio.timeout``)."""
    target = HealthTarget.of(url, name)
    exchange = HealthExchange(target)
    reader, writer = await asyncio.open_connection(
        target.host,
        target.port,
        ssl=(ssl or ssl_module.create_default_context()) if target.tls else None,
        server_hostname=(name or target.host) if target.tls else None,
    )
    try:
        writer.write(exchange.request)
        while (health := exchange.feed(await reader.read(65536))) is None:
            pass
        return health
    finally:
        writer.close()


def healthy(url: str, timeout: float = 2.0, *, ssl: ssl_module.SSLContext | None = None) -> bool:
    """Whether the server at ``url`` answers ``/health`` with 200 (never raises)."""
    try:
        return probe(url, timeout, ssl=ssl).ok
    except (OSError, ValueError):
        return False


__all__ = [
    "MAX_HEALTH_BYTES",
    "Health",
    "HealthExchange",
    "HealthTarget",
    "healthy",
    "probe",
    "probe_async",
]

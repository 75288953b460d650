"""How every client connects: one :class:`ConnectOptions`, and the pieces of a connect
that :class:`~stadium.AsyncClient`, the batch connections
(:mod:`stadium._client.batch`) and the batched pool share: the WebSocket handshake
call, the backoff between attempts, and the errors that say what to do.

Every client takes the same connection keywords (``msgpack``, ``connect_timeout``,
``request_timeout``, ``max_retries``, ``max_message_bytes``, ``headers``, ``token``,
``ssl``, ``resume``); they become one frozen :class:`ConnectOptions`, which a client
hands on as it is (a ``fork``, a pool's batch connections, a resume)::

    options = stadium.ConnectOptions.create(token="secret", request_timeout=30.0)
    async with stadium.AsyncClient(url, options=options) as env: ...
    async with stadium.SessionPool(url, 64, options=options) as pool: ...
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import random
import ssl as ssl_module
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypedDict

import msgspec
from picows import WSHandshakeError, WSListener, WSTransport, ws_connect

from stadium._core.client import codec
from stadium._core.protocol import MSGPACK_SUBPROTOCOL
from stadium._env.codecs import UNREADABLE
from stadium._errors import CapacityError, ConfigError, ConnectError

#: The environment variable a client reads its bearer token from when given none
#: (the same one ``stadium serve`` reads).
TOKEN_ENV = "STADIUM_AUTH_TOKEN"


class HandshakeKeywords(TypedDict, total=False):
    """The connection keywords but ``resume`` (a batch connection's ``resume`` says
    which sessions it resumes)."""

    msgpack: bool
    connect_timeout: float
    request_timeout: float | None
    max_retries: int
    max_message_bytes: int
    headers: Mapping[str, str] | None
    token: str | None
    ssl: ssl_module.SSLContext | None


class ConnectKeywords(HandshakeKeywords, total=False):
    """The connection keywords every client takes (:meth:`ConnectOptions.create`'s)."""

    resume: bool


@dataclass(frozen=True, slots=True)
class ConnectOptions:
    """A client's connection options (the keywords of :class:`~stadium.AsyncClient`).

    Build it with :meth:`create` (which turns ``token`` into the ``Authorization``
    header); the fields are the resolved values.
    """

    msgpack: bool = False
    """Negotiate MessagePack frames."""
    connect_timeout: float = 10.0
    """Seconds for the TCP + WebSocket handshake."""
    request_timeout: float | None = 600.0
    """Seconds to wait for each reply (None: no limit)."""
    max_retries: int = 8
    """Attempts when the server is unreachable or at capacity."""
    max_message_bytes: int = 64 * 1024 * 1024
    """Largest reply accepted."""
    headers: Mapping[str, str] = field(default_factory=dict)
    """Extra headers of the WebSocket handshake (with ``Authorization`` when a token is set)."""
    ssl: ssl_module.SSLContext | None = None
    """TLS context for ``wss://`` (``https://``) URLs; None: the system's trusted roots."""
    resume: bool = True
    """Ask the server for resumable sessions."""

    @classmethod
    def create(
        cls,
        *,
        msgpack: bool = False,
        connect_timeout: float = 10.0,
        request_timeout: float | None = 600.0,
        max_retries: int = 8,
        max_message_bytes: int = 64 * 1024 * 1024,
        headers: Mapping[str, str] | None = None,
        token: str | None = None,
        ssl: ssl_module.SSLContext | None = None,
        resume: bool = True,
    ) -> ConnectOptions:
        """The options of these keywords. ``token``: the bearer token, sent as
        ``Authorization: Bearer <token>`` unless ``headers`` has an ``Authorization``;
        None reads ``$STADIUM_AUTH_TOKEN``; ``""``: none."""
        extra = dict(headers or {})
        if token is None:
            token = os.environ.get(TOKEN_ENV)
        if token and not any(k.lower() == "authorization" for k in extra):
            extra["Authorization"] = f"Bearer {token}"
        return cls(
            msgpack=msgpack,
            connect_timeout=connect_timeout,
            request_timeout=request_timeout,
            max_retries=max_retries,
            max_message_bytes=max_message_bytes,
            headers=extra,
            ssl=ssl,
            resume=resume,
        )

    @classmethod
    def given(cls, options: ConnectOptions | None, **keywords: Any) -> ConnectOptions:
        """``options`` if given (then every keyword must be left at its default: one way
        of saying it), else the options of the keywords (:meth:`create`'s)."""
        if options is None:
            return cls.create(**keywords)
        defaults = _CREATE_DEFAULTS
        changed = sorted(k for k, v in keywords.items() if defaults.get(k, v) != v)
        if changed:
            raise ConfigError(
                f"connection options given twice: options= and "
                f"{', '.join(k + '=' for k in changed)}; pass "
                "them in one place (e.g. options=dataclasses.replace(options, ...))",
                keywords=changed,
            )
        return options

    @classmethod
    def split(cls, keywords: Mapping[str, Any]) -> tuple[ConnectOptions, dict[str, Any]]:
        """The options among a client's ``keywords`` (``options=`` or the connection
        keywords), and the other keywords (``observation_type``, ...)."""
        rest = dict(keywords)
        options = rest.pop("options", None)
        given = {name: rest.pop(name) for name in list(rest) if name in _CREATE_DEFAULTS}
        return cls.given(options, **given), rest

    def codec(self) -> tuple[Callable[[Any], bytes], Callable[[bytes], Any]]:
        """The frames' encoder and decoder (MessagePack or JSON); the clients' frames are
        the core protocol's (:mod:`stadium._core.client`), which uses the same."""
        return codec(self.msgpack)

    async def handshake(
        self,
        listener: Callable[[], WSListener],
        url: str,
        headers: Mapping[str, str] | None,
        **kwargs: Any,
    ) -> tuple[WSTransport, WSListener]:
        """One WebSocket handshake to ``url`` with these options (no retry; the caller
        bounds the TCP connect, which picows' handshake timeout does not cover)."""
        return await ws_connect(
            listener,
            url,
            ssl_context=self.ssl,
            websocket_handshake_timeout=self.connect_timeout,
            max_frame_size=self.max_message_bytes,
            extra_headers=dict(headers) if headers else None,
            enable_auto_ping=False,
            # a redirect is not followed: picows would carry the headers (the bearer and
            # resume tokens) to wherever it points, another host included
            max_redirects=0,
            # uvloop's own connect: ~15 % less client CPU per session than picows'
            # default aiofastnet path (measured in bursts; BENCHMARKS.md)
            use_aiofastnet=False,
            **kwargs,
        )


#: The keywords' defaults (a keyword left at its default is not "given").
_CREATE_DEFAULTS: dict[str, Any] = {
    name: p.default
    for name, p in inspect.signature(ConnectOptions.create).parameters.items()
    if p.kind is inspect.Parameter.KEYWORD_ONLY
}


_SETTLING: set[asyncio.Task[None]] = set()


def settle(transport: WSTransport) -> None:
    """Call from ``on_ws_disconnected``: picows puts the error that ended a connection (a
    frame over ``max_frame_size``, a malformed close frame) on a future no one awaits,
    which asyncio then logs as "never retrieved" with a traceback; read it once."""
    task = asyncio.get_running_loop().create_task(_settled(transport))
    _SETTLING.add(task)
    task.add_done_callback(_SETTLING.discard)


async def _settled(transport: WSTransport) -> None:
    with contextlib.suppress(Exception):
        await transport.wait_disconnected()


def backoff(attempt: int) -> float:
    """Exponential backoff with full jitter: up to 0.05 · 2^attempt s, capped at 2 s."""
    return float(random.uniform(0, min(2.0, 0.05 * 2**attempt)))


def unnegotiated(transport: WSTransport, offered: str | None, url: str) -> ConnectError | None:
    """The error when a ``101`` did not open the WebSocket the client asked for: a
    subprotocol it did not offer (``offered``: its ``Sec-WebSocket-Protocol``, None when
    none), none when it offered MessagePack's (it would send frames the server cannot
    read), or an extension it never offered (RFC 6455 §4.1: the client fails the
    connection); None when it did. The connection is closed."""
    headers = transport.response.headers
    extensions = headers.get("Sec-WebSocket-Extensions")
    picked = (headers.get("Sec-WebSocket-Protocol") or "").strip()
    choices = {p.strip() for p in (offered or "").split(",")} - {""}
    if extensions:
        why = f"turned on the WebSocket extensions {extensions[:100]!r}, which it did not offer"
    elif picked in choices or (not picked and MSGPACK_SUBPROTOCOL not in choices):
        return None
    elif not picked:
        why = (
            f"did not accept the {MSGPACK_SUBPROTOCOL} subprotocol (MessagePack frames): it "
            "is not a Stadium server, or a proxy dropped the header; connect with msgpack=False"
        )
    else:
        why = f"picked the subprotocol {picked[:100]!r}, which it offered {offered or 'none'}"
    transport.disconnect(graceful=False)
    return ConnectError(f"cannot open a session at {url}: the server's 101 {why}", url=url)


def refusal_wait(exc: CapacityError, cap: float) -> float:
    """Seconds to wait before retrying a session refused with ``CAPACITY_REACHED``: its
    ``retry_after_s`` with jitter (0.5 to 1.5 times), at most ``cap`` (the client's
    ``connect_timeout``: a server cannot park a client longer than its own timeout)."""
    return min(cap, exc.retry_after_s) * (0.5 + random.random())


def with_query(url: str, params: Mapping[str, str]) -> str:
    """``url`` with ``params`` set in its query (replacing any of the same names)."""
    parts = urllib.parse.urlsplit(url)
    query = [(k, v) for k, v in urllib.parse.parse_qsl(parts.query) if k not in params]
    query.extend(params.items())
    return urllib.parse.urlunsplit(parts._replace(query=urllib.parse.urlencode(query)))


def unreachable(url: str, attempts: int, last: BaseException | None) -> ConnectError:
    """A :class:`ConnectError` for a server not reached in ``attempts``, with the likely
    cause: nothing listening (refused), or a TLS server spoken to in clear (reset)."""
    hint = ""
    if isinstance(last, ConnectionRefusedError):
        hint = " (nothing listens there: is the server running, on this port?)"
    elif isinstance(last, ConnectionResetError) and url.startswith("ws://"):
        hint = " (a TLS server? use https:// or wss://)"
    return ConnectError(f"cannot reach {url} after {attempts} attempts: {last}{hint}", url=url)


def untrusted(exc: ssl_module.SSLCertVerificationError, url: str, what: str) -> ConnectError:
    """A :class:`ConnectError` for a certificate the client does not trust (not transient)."""
    return ConnectError(
        f"cannot open {what} at {url}: {exc.verify_message or exc}; for a private or "
        "self-signed certificate pass ssl=ssl.create_default_context(cafile='cert.pem')",
        url=url,
    )


def refused(exc: WSHandshakeError, url: str) -> ConnectError:
    """A :class:`ConnectError` for an upgrade answered with an HTTP error, saying what to do."""
    response = exc.response
    status = int(response.status) if response is not None else 0
    detail = ""
    try:
        body = msgspec.json.decode(exc.raw_body or b"{}")
        if isinstance(body, dict):
            detail = str(body.get("message") or body.get("detail") or "")
    except UNREADABLE:
        detail = (exc.raw_body or b"").decode(errors="replace")[:200]
    if status == 401:
        hint = (
            "the server requires a bearer token: pass token=... (or set "
            f"{TOKEN_ENV}) with the server's token"
        )
    elif status == 403:
        hint = "the server refused this client's Origin or Host header"
    elif 300 <= status < 400 and response is not None:
        where = str(response.headers.get("Location") or "?")[:200]
        hint = (
            f"the server answered HTTP {status}, a redirect to {where}, not followed (it "
            "would carry the token there): connect to that URL if you trust it"
        )
    else:
        hint = f"the server answered HTTP {status or '?'} instead of opening a WebSocket"
    message = f"cannot open a session at {url}: {hint}"
    return ConnectError(f"{message} ({detail})" if detail else message, url=url, status=status)


__all__ = [
    "TOKEN_ENV",
    "ConnectKeywords",
    "ConnectOptions",
    "HandshakeKeywords",
    "backoff",
    "refusal_wait",
    "refused",
    "settle",
    "unnegotiated",
    "untrusted",
    "with_query",
]

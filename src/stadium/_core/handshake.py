"""The ``/ws`` handshake, decided once: a request in, an upgrade or a refusal out. No I/O.

Every transport (picows for ``stadium serve``, the ASGI app) asks :func:`negotiate`
about each WebSocket upgrade and does what the answer says; none decides anything of
its own. In this order:

1. **Access** (:class:`~stadium._core.access.AccessPolicy`): Host, Origin, bearer
   token. A refusal builds no environment and takes no slot. Every request is asked,
   not only upgrades (a ``GET /metrics`` needs the token too).
2. **Is it a session upgrade?** ``GET /ws`` (or OpenEnv's ``GET /mcp``: JSON-RPC
   frames) with ``Upgrade: websocket``; anything
   else is ``None`` (an ordinary GET, which the HTTP endpoints answer: ``/ws``
   without the upgrade gets their ``426``).
3. **What the connection carries**, from the query string and the offered subprotocols:

   =====================================  ===============================================
   request                                upgrade
   =====================================  ===============================================
   ``/ws``                                one session, JSON frames (OpenEnv's)
   ``stadium.msgpack`` offered            one session, MessagePack frames
   ``?session_id=<id>``                   one session driving an HTTP MCP session's env
                                          (OpenEnv's attach; never batched nor resumable)
   ``stadium.batch[.msgpack]`` offered    many sessions (``batch``); JSON preferred
   ... and ``?stadium_resume=...``        their sessions resumable (ids and tokens come
                                          in batch replies), when the server keeps
                                          sessions (``--resume-grace`` > 0)
   ``?stadium_resume=1``                  a new resumable session: its id and token in
                                          the 101 (plain session when grace is 0)
   ``?stadium_resume=<id>`` + token       a resume of session ``<id>``
   =====================================  ===============================================

   A malformed resume (a bad id, no token, a bad ``stadium_received``) is refused
   with ``400 RESUME_FAILED`` saying what is wrong.
4. **The 101's headers**: the chosen subprotocol, and for resumable connections
   ``X-Stadium-Session`` / ``X-Stadium-Resume-Token`` (a new session's),
   ``X-Stadium-Node``, ``X-Stadium-Address`` and ``X-Stadium-Resume-Grace``
   (:mod:`stadium._core.resume`).

What stays with the transport: reading the socket (the peer and local addresses),
the per-client rate limit (a clock), passing a resume for another worker's session
to that worker (picows' ``handoff``; the ASGI app has one process per app and no
such hand-off), and opening what the upgrade names (``stadium._server.http.upgrade``).
"""

from __future__ import annotations

import dataclasses
import urllib.parse
from collections.abc import Callable, Iterable
from typing import NamedTuple, Protocol

from stadium._core.access import AccessPolicy, LocalAddr, Refusal, Tenant
from stadium._core.protocol import (
    BATCH_MSGPACK_SUBPROTOCOL,
    BATCH_SUBPROTOCOL,
    MSGPACK_SUBPROTOCOL,
    Encoding,
)
from stadium._core.resume import (
    ADDR_HEADER,
    GRACE_HEADER,
    NODE_HEADER,
    RESUME_PARAM,
    SESSION_HEADER,
    TOKEN_HEADER,
    ResumeAsk,
    resume_ask,
)

WS_PATH = "/ws"
"""Where sessions live (OpenEnv's path)."""
MCP_PATH = "/mcp"
"""Where OpenEnv 0.10 serves JSON-RPC over a WebSocket (``WS /mcp``): one session per
connection, each frame a bare JSON-RPC request (``stadium._server.http.mcp_socket``)."""
HARNESS_PATH = "/harness"
"""Where OpenEnv 0.10 serves an agentic harness env (RFC 005), in production mode: one
harness session per connection, each frame a turn (``stadium._server.http.harness_socket``)."""
ATTACH_PARAM = "session_id"
"""Query parameter of OpenEnv's attach to an HTTP MCP session (``/ws?session_id=``)."""

Mint = Callable[[], tuple[str, str]]
"""Makes a new resumable session's id and token (the server's: its pid, its randomness)."""
Address = str | Callable[[], str]
"""The ``host:port`` a connection reached, or a function reading it (called only for a
resumable connection: reading a socket's address costs a system call)."""


class Headers(Protocol):
    """A request's headers, looked up by lower-case name (``multidict.CIMultiDict``,
    picows', is one; :func:`header_map` makes one from raw ASGI/h11 headers). The first
    value of a repeated header counts, except ``Sec-WebSocket-Protocol``'s: all of them
    (from ``getall`` when the mapping has it)."""

    def get(self, key: str, /) -> str | None: ...


@dataclasses.dataclass(frozen=True, slots=True)
class Terms:
    """What this server offers every connection: who may come in, where it is, how
    long it keeps a lost session, how it names new ones."""

    access: AccessPolicy
    node: str
    """This node's name (``X-Stadium-Node``; ``/health`` reports it too)."""
    resume_grace: float
    """Seconds a lost session is kept for its client (``0``: no resume, no fork)."""
    mint: Mint
    """A new resumable session's id and token."""
    harness: bool = False
    """Whether ``WS /harness`` is served (an OpenEnv harness env in production mode)."""


class Upgrade(NamedTuple):
    """Accept the upgrade: what the connection carries and the 101's extra headers.

    Immutable (the common ones are built once: :data:`PLAIN`, :data:`MSGPACK`,
    :data:`BATCH`, :data:`BATCH_MSGPACK`); a named tuple, which is built in a fraction of
    a frozen dataclass's time (once per connection)."""

    encoding: Encoding = Encoding.JSON
    subprotocol: str | None = None
    """The subprotocol chosen (``Sec-WebSocket-Protocol`` of the 101), or none."""
    headers: tuple[tuple[str, str], ...] = ()
    """The 101's extra headers besides the subprotocol (resume: id, token, node, address,
    grace)."""
    attach: str | None = None
    """The HTTP MCP session whose env this connection's session drives (OpenEnv)."""
    batch: bool = False
    """Many sessions on this connection (``batch``)."""
    resumable: bool = False
    """The session (or the batch's sessions) can be resumed on another connection."""
    session: tuple[str, str] | None = None
    """A new resumable session's id and token (sent in the 101)."""
    resume: ResumeAsk | None = None
    """The existing session this connection resumes."""
    mcp: bool = False
    """JSON-RPC frames (``WS /mcp``), not the session protocol's."""
    harness: bool = False
    """Harness turns (``WS /harness``), not the session protocol's."""
    tenant: Tenant | None = None
    """The tenant the request's token names (``--tenants``), its sessions charged to it."""


assert Upgrade._fields[-1] == "tenant"  # negotiate() replaces the last field

# The upgrades most connections get, built once (an Upgrade is immutable).
PLAIN = Upgrade()
"""An OpenEnv client's session: JSON frames, no extension."""
MSGPACK = Upgrade(Encoding.MSGPACK, MSGPACK_SUBPROTOCOL)
"""A session in MessagePack frames."""
BATCH = Upgrade(Encoding.JSON, BATCH_SUBPROTOCOL, batch=True)
"""A batch connection in JSON frames (its sessions not resumable)."""
BATCH_MSGPACK = Upgrade(Encoding.MSGPACK, BATCH_MSGPACK_SUBPROTOCOL, batch=True)
"""A batch connection in MessagePack frames (its sessions not resumable)."""
MCP = Upgrade(mcp=True)
"""OpenEnv's ``WS /mcp``: a session whose frames are JSON-RPC requests and responses."""
HARNESS = Upgrade(harness=True)
"""OpenEnv's ``WS /harness``: a session whose frames are harness turns and their events."""


def negotiate(
    terms: Terms,
    target: str,
    headers: Headers,
    *,
    local_addr: LocalAddr = None,
    address: Address = "",
    offered: Iterable[str] | None = None,
    websocket: bool | None = None,
) -> Upgrade | Refusal | None:
    """:func:`_negotiate`, and with tenants (``--tenants``) the upgrade names the tenant
    whose token the request carries."""
    decided = _negotiate(
        terms, target, headers, local_addr=local_addr, address=address, offered=offered,
        websocket=websocket,
    )  # fmt: skip
    if terms.access.tenants is not None and isinstance(decided, Upgrade):
        tenant = terms.access.tenant_of(headers.get("authorization"))  # known: check()'s
        # decided._replace(tenant=tenant) without its Python frames (once per upgrade):
        # ``tenant`` is the last field.
        return tuple.__new__(Upgrade, (*decided[:-1], tenant))
    return decided


def _negotiate(
    terms: Terms,
    target: str,
    headers: Headers,
    *,
    local_addr: LocalAddr = None,
    address: Address = "",
    offered: Iterable[str] | None = None,
    websocket: bool | None = None,
) -> Upgrade | Refusal | None:
    """Decide a request (see the module docstring); never raises.

    Args:
        terms: the server's (:class:`Terms`).
        target: the request target, query string included (``/ws?stadium_resume=1``).
        headers: the request's headers (:class:`Headers`).
        local_addr: the address the connection arrived on, for the Host check
            (:meth:`AccessPolicy.check`).
        address: the ``host:port`` a router reaches this server by (``X-Stadium-Address``).
        offered: the subprotocols the client offered; ``None``: read from the
            ``Sec-WebSocket-Protocol`` header.
        websocket: whether the request is a WebSocket upgrade (an ASGI ``websocket``
            scope is); ``None``: read from the ``Upgrade`` header.

    Returns:
        a :class:`Refusal` (access, or a malformed resume), ``None`` when the request is
        no session upgrade (answer it as a GET), else the :class:`Upgrade`.
    """
    refusal = terms.access.check(
        target,
        authorization=headers.get("authorization"),
        origin=headers.get("origin"),
        host=headers.get("host"),
        local_addr=local_addr,
    )
    if refusal is not None:
        return refusal
    path, _, query = target.partition("?")
    if path != WS_PATH and path != MCP_PATH and (path != HARNESS_PATH or not terms.harness):
        return None
    if websocket is None:
        websocket = (headers.get("upgrade") or "").strip().lower() == "websocket"
    if not websocket:
        return None
    if path == MCP_PATH:
        return MCP
    if path == HARNESS_PATH:
        return HARNESS
    protocols = _offered(headers) if offered is None else list(offered)
    if not query and not protocols:
        return PLAIN  # OpenEnv's clients: nothing more to read
    attach = attach_id(query)
    json = BATCH_SUBPROTOCOL in protocols  # a batch in JSON frames, preferred
    if attach is None and (json or BATCH_MSGPACK_SUBPROTOCOL in protocols):
        if RESUME_PARAM in query and terms.resume_grace > 0:
            # A batch's sessions get their ids and tokens in batch replies; a resume's id
            # in the query only routes the connection to the worker holding them (``handoff``).
            base = BATCH if json else BATCH_MSGPACK
            return Upgrade(
                base.encoding, base.subprotocol, _where(terms, address), batch=True, resumable=True
            )
        return BATCH if json else BATCH_MSGPACK
    msgpack = MSGPACK_SUBPROTOCOL in protocols
    if RESUME_PARAM in query:
        ask = resume_ask(query, headers.get(TOKEN_HEADER.lower()))
        if isinstance(ask, str):
            return Refusal(400, "RESUME_FAILED", ask)
        encoding = Encoding.MSGPACK if msgpack else Encoding.JSON
        subprotocol = MSGPACK_SUBPROTOCOL if msgpack else None
        if ask is not None and ask.sid is not None:
            return Upgrade(encoding, subprotocol, attach=attach, resumable=True, resume=ask)
        if ask is not None and terms.resume_grace > 0 and attach is None:
            sid, token = terms.mint()
            return Upgrade(
                encoding,
                subprotocol,
                ((SESSION_HEADER, sid), (TOKEN_HEADER, token), *_where(terms, address)),
                resumable=True,
                session=(sid, token),
            )
    base = MSGPACK if msgpack else PLAIN
    return base if attach is None else Upgrade(base.encoding, base.subprotocol, attach=attach)


def attach_id(query: str) -> str | None:
    """The ``session_id`` of a ``/ws`` URL's query string (OpenEnv's attach to an HTTP MCP
    session), or ``None``."""
    if ATTACH_PARAM + "=" not in query:
        return None
    values = urllib.parse.parse_qs(query).get(ATTACH_PARAM)
    return values[0] if values else None


def header_map(raw: Iterable[tuple[bytes, bytes]]) -> dict[str, str]:
    """Raw headers (ASGI, h11) as :class:`Headers`: lower-case names, the first value of
    each, except ``Sec-WebSocket-Protocol``, whose values are joined (a list header)."""
    out: dict[str, str] = {}
    for raw_name, raw_value in raw:
        name = raw_name.decode("latin-1").lower()
        value = raw_value.decode("latin-1")
        if name not in out:
            out[name] = value
        elif name == "sec-websocket-protocol":
            out[name] += ", " + value
    return out


def host_port(sockname: object) -> str | None:
    """A socket's address as routers name it (``host:port``, ``[v6]:port``); ``None``
    when it is not an IP address (a Unix socket, unknown)."""
    if not isinstance(sockname, tuple | list) or len(sockname) < 2:
        return None
    host, port = sockname[0], sockname[1]
    if not isinstance(host, str) or not isinstance(port, int):
        return None
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _offered(headers: Headers) -> list[str]:
    """The subprotocols of ``Sec-WebSocket-Protocol``, a list header a client may repeat."""
    value = headers.get("sec-websocket-protocol")
    if value is None:
        return []
    getall = getattr(headers, "getall", None)  # picows' CIMultiDict: each repetition
    if getall is not None:
        value = ",".join(getall("sec-websocket-protocol"))
    return [p.strip() for p in value.split(",")]


def _where(terms: Terms, address: Address) -> tuple[tuple[str, str], ...]:
    """The 101's headers naming where a resumable connection's sessions live."""
    here = address() if callable(address) else address
    return (
        (NODE_HEADER, terms.node),
        (ADDR_HEADER, here or terms.node),
        (GRACE_HEADER, f"{terms.resume_grace:g}"),
    )


__all__ = [
    "ATTACH_PARAM",
    "BATCH",
    "BATCH_MSGPACK",
    "MSGPACK",
    "PLAIN",
    "WS_PATH",
    "Address",
    "Headers",
    "Mint",
    "Terms",
    "Upgrade",
    "attach_id",
    "header_map",
    "host_port",
    "negotiate",
]

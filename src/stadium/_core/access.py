"""Access control: who may open a session or call an endpoint. Pure decisions, no I/O.

Both transports ask one :class:`AccessPolicy` about every request, with the
request's ``Authorization``, ``Origin`` and ``Host`` headers and the local
address the connection arrived on, before anything else happens: a refused
request builds no environment and takes no session slot. Three checks, in this
order:

1. **Host (DNS rebinding).** A connection that arrived on a loopback address
   must name a loopback host: ``localhost``, an IP literal (``127.0.0.1``,
   ``[::1]``), or the host of an ``--allow-origin``. A DNS-rebinding page is
   same-origin with itself (its ``Origin`` and ``Host`` are both the attacker's
   domain, rebound to 127.0.0.1), so an Origin check alone cannot see it; its
   ``Host`` is a DNS name, which a loopback server has no reason to accept. IP
   literals are safe: no page can have an IP literal as origin without being
   served from that address. Requests without ``Host`` (HTTP/1.0 probes) pass:
   browsers always send one. Connections arriving on other addresses are not
   host-checked: a server reachable from the network must set a token (a
   warning at start says so).
2. **Origin.** A request without ``Origin`` is a non-browser client and passes.
   A browser's ``Origin`` passes when its ``host[:port]`` equals the request's
   ``Host`` (same origin), when it is listed with ``--allow-origin``, or when
   ``*`` is. Everything else is a cross-site page driving the server from a
   local browser: 403. (Browsers send ``Origin`` on every WebSocket upgrade
   and every POST, so cross-site sessions and stateless resets are covered.)
3. **Bearer token**, when the server has one: ``Authorization: Bearer <token>``,
   compared in constant time (:func:`hmac.compare_digest`); else 401 with
   ``WWW-Authenticate: Bearer``. The token is accepted only in that header:
   not in the query string (it would land in access logs) and not in
   ``Sec-WebSocket-Protocol`` (no client of OpenEnv's ecosystem sends it there,
   and proxies log it). A browser cannot set ``Authorization`` on a WebSocket,
   so browser clients reach a token-protected server through a proxy that adds
   the header.

   With tenants (``--tenants FILE``: :class:`TenantTable`), a token names its
   tenant: the presented token is hashed with SHA-256 and the digest looked up
   among the tenants' (the file holds digests, never tokens), then compared with
   :func:`hmac.compare_digest`; an unknown token is the same 401. A header that
   named a tenant once is remembered (the table's :attr:`TenantTable.seen`, bounded,
   dropped with the table on a reload): a client's next connections with the same
   header cost a dict lookup, not a hash (the lookup's string compare runs only on
   a full match of the salted string hash: no timing to learn a token from).
   :meth:`AccessPolicy.tenant_of` tells the transports whose request it is.
   The table sits in a :class:`TenantBook` the server swaps on a reload.

``GET /health`` is always open (no token, no Origin or Host check): load
balancers and orchestrators probe it without credentials, and it reveals
nothing but liveness.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import hmac
import ipaddress
from collections.abc import Callable, Iterable
from typing import Protocol

import msgspec

LocalAddr = str | Callable[[], str | None] | None
"""The address a connection arrived on, or a function reading it (:meth:`AccessPolicy.check`)."""

#: Paths every client may call without a token (liveness probes).
OPEN_PATHS = frozenset({"/health"})
#: Host names accepted on a loopback connection besides IP literals.
LOOPBACK_NAMES = frozenset({"localhost"})
_DEFAULT_PORTS = {"http": "80", "ws": "80", "https": "443", "wss": "443"}
_WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::"})


@dataclasses.dataclass(frozen=True, slots=True)
class Refusal:
    """An HTTP answer refusing a request: status, JSON body, extra headers."""

    status: int
    code: str
    message: str
    headers: tuple[tuple[str, str], ...] = ()

    @property
    def body(self) -> bytes:
        """``{"detail": message, "message": message, "code": code}`` (as other HTTP errors)."""
        return msgspec.json.encode(
            {"detail": self.message, "message": self.message, "code": self.code}
        )


UNAUTHORIZED = Refusal(
    401,
    "UNAUTHORIZED",
    "missing or wrong bearer token: pass Authorization: Bearer <token> "
    "(stadium: AsyncClient(url, token=...) or env STADIUM_AUTH_TOKEN; "
    "OpenEnv: headers={'Authorization': 'Bearer <token>'})",
    (("WWW-Authenticate", "Bearer"),),
)


@dataclasses.dataclass(frozen=True, slots=True)
class Tenant:
    """One tenant of a server (``--tenants``): who a request is, by its token.

    ``row`` is its place in the node's shared per-tenant counters
    (:mod:`stadium._server.admission.tenants`); it stays the same across reloads while the
    tenant is in the file."""

    name: str
    row: int
    weight: float = 1.0
    max_sessions: int = 0
    """Sessions it may hold or wait for over the node; 0: no quota."""
    rate_limit: float = 0.0
    """Requests per second over the node; 0: none."""
    operator: bool = False
    """Whether its token reads every tenant's series in ``/metrics`` (else its own only)."""


MAX_SEEN = 1024
"""Headers a :class:`TenantTable` remembers (those of valid tokens only)."""
MAX_SEEN_CHARS = 512
"""The longest header remembered: a valid token padded with whitespace (which the check
strips) names its tenant each time, but is not kept (1,024 of them could be megabytes)."""


class TenantTable:
    """The tenants of a server and the SHA-256 digests of their tokens (pure data)."""

    __slots__ = ("_by_digest", "seen", "tenants")

    def __init__(self, tenants: Iterable[tuple[Tenant, Iterable[bytes]]]) -> None:
        by_digest: dict[bytes, tuple[bytes, Tenant]] = {}
        listed: list[Tenant] = []
        for tenant, digests in tenants:
            listed.append(tenant)
            for digest in digests:
                by_digest[bytes(digest)] = (bytes(digest), tenant)
        self._by_digest = by_digest
        self.tenants: tuple[Tenant, ...] = tuple(listed)
        self.seen: dict[str, Tenant] = {}
        """``Authorization`` headers that named a tenant, as sent (at most
        :data:`MAX_SEEN`; cleared when full)."""

    def identify(self, token: bytes) -> Tenant | None:
        """The tenant whose token is ``token``, or ``None``: hashed, looked up, and the
        digest compared in constant time (the lookup sees only a hash of the token)."""
        digest = hashlib.sha256(token).digest()
        found = self._by_digest.get(digest)
        if found is None or not hmac.compare_digest(found[0], digest):
            return None
        return found[1]


class TenantBook:
    """Where a server's current :class:`TenantTable` is: one object every
    :class:`AccessPolicy` of a worker reads, its ``table`` swapped on a reload."""

    __slots__ = ("table",)

    def __init__(self, table: TenantTable) -> None:
        self.table = table


class _AccessConfig(Protocol):
    @property
    def auth_token(self) -> str | None: ...
    @property
    def allowed_origins(self) -> tuple[str, ...]: ...


class AccessPolicy:
    """The access decisions of one server (see the module docstring).

    Args:
        token: the bearer token requests must carry; ``None``: no authentication.
        allowed_origins: browser origins allowed besides the same host
            (``scheme://host[:port]``), or ``*`` for any.
        tenants: the tenants whose tokens are accepted (``--tenants``; then ``token``
            is ``None``).
    """

    __slots__ = ("_any_origin", "_hosts", "_origins", "_token", "tenants")

    def __init__(
        self,
        *,
        token: str | None = None,
        allowed_origins: Iterable[str] = (),
        tenants: TenantBook | None = None,
    ) -> None:
        self._token = token.encode() if token else None
        self.tenants = tenants
        origins = {o.lower() for o in allowed_origins}
        self._any_origin = "*" in origins
        origins.discard("*")
        self._origins = frozenset(origins)
        self._hosts = frozenset(_split_host(o.split("://", 1)[1])[0] for o in origins)

    @classmethod
    def from_config(cls, config: _AccessConfig, tenants: TenantBook | None = None) -> AccessPolicy:
        return cls(token=config.auth_token, allowed_origins=config.allowed_origins, tenants=tenants)

    @property
    def requires_token(self) -> bool:
        return self._token is not None or self.tenants is not None

    def tenant_of(self, authorization: str | None) -> Tenant | None:
        """The tenant whose bearer token ``authorization`` carries (``None``: no tenants,
        or not a tenant's token)."""
        book = self.tenants
        if book is None or authorization is None:
            return None
        table = book.table
        tenant = table.seen.get(authorization)  # the header as a tenant sent it before
        if tenant is not None:
            return tenant
        scheme, _, given = authorization.strip().partition(" ")
        if scheme.lower() != "bearer":
            return None
        tenant = table.identify(given.strip().encode())
        if tenant is not None and len(authorization) <= MAX_SEEN_CHARS:
            seen = table.seen
            if len(seen) >= MAX_SEEN:
                seen.clear()
            seen[authorization] = tenant
        return tenant

    def check(
        self,
        path: str,
        *,
        authorization: str | None,
        origin: str | None,
        host: str | None,
        local_addr: LocalAddr,
    ) -> Refusal | None:
        """The refusal of a request, or ``None`` when it may go on.

        Args:
            path: the request target (query string allowed).
            authorization, origin, host: the request's headers (``None``: absent).
            local_addr: the address the connection arrived on (``None``: unknown,
                e.g. a Unix socket), which decides the Host check; or a function
                returning it, called only when the Host is a DNS name (reading a
                socket's address costs a system call and objects per connection).
        """
        if (path.split("?", 1)[0].rstrip("/") or "/") in OPEN_PATHS:
            return None
        return (
            self.check_host(host, local_addr)
            or self.check_origin(origin, host)
            or self.check_auth(authorization)
        )

    def check_auth(self, authorization: str | None) -> Refusal | None:
        """401 unless ``authorization`` is ``Bearer <the token>`` (or no token is set)."""
        token = self._token
        if token is None:
            if self.tenants is None or self.tenant_of(authorization) is not None:
                return None
            return UNAUTHORIZED
        if authorization is not None:
            scheme, _, given = authorization.strip().partition(" ")
            if scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token):
                return None
        return UNAUTHORIZED

    def check_origin(self, origin: str | None, host: str | None) -> Refusal | None:
        """403 for a browser Origin that is neither the request's host nor allowed."""
        if origin is None or self._any_origin:
            return None
        origin = origin.strip().lower()
        if origin in self._origins:
            return None
        scheme, sep, netloc = origin.partition("://")
        if sep and host is not None and "/" not in netloc:
            default = _DEFAULT_PORTS.get(scheme, "")
            if _split_host(netloc, default) == _split_host(host.strip().lower(), default):
                return None
        return Refusal(
            403,
            "FORBIDDEN_ORIGIN",
            f"a browser page from origin {origin!r} may not use this server (a cross-site "
            f"page would drive it from the local browser): allow that origin with "
            f"--allow-origin {origin} (or --allow-origin '*' for any)",
        )

    def check_host(self, host: str | None, local_addr: LocalAddr) -> Refusal | None:
        """403 for a DNS name in ``Host`` on a loopback connection (DNS rebinding)."""
        if host is None or self._any_origin:
            return None
        name = _split_host(host.strip().lower())[0]
        if name in LOOPBACK_NAMES or name in self._hosts or _is_ip(name):
            return None
        local = local_addr() if callable(local_addr) else local_addr
        if local is None or not is_loopback_host(local):
            return None
        return Refusal(
            403,
            "FORBIDDEN_HOST",
            f"Host {host!r} is not a loopback name: a server on a loopback address only "
            f"answers requests for localhost or an IP address (protection against DNS "
            f"rebinding). Connect to 127.0.0.1 or localhost, or, behind a proxy that "
            f"passes this Host, allow it with --allow-origin https://{name}",
        )


def header_values(
    headers: Iterable[tuple[bytes, bytes]],
) -> tuple[str | None, str | None, str | None]:
    """``(authorization, origin, host)`` from raw headers (h11, ASGI); the first of each."""
    auth = origin = host = None
    for raw_name, raw_value in headers:
        name = raw_name.lower()
        if name == b"authorization":
            if auth is None:
                auth = raw_value.decode("latin-1")
        elif name == b"origin":
            if origin is None:
                origin = raw_value.decode("latin-1")
        elif name == b"host" and host is None:
            host = raw_value.decode("latin-1")
    return auth, origin, host


@functools.lru_cache(maxsize=4096)  # asked on every connection, of a few distinct strings
def is_loopback_host(host: str) -> bool:
    """Whether ``host`` (an address, maybe ``[v6]`` or with a port; or ``localhost``) is
    a loopback address."""
    name = _split_host(host.lower())[0] if not _is_ip(host) else host
    if name in LOOPBACK_NAMES:
        return True
    try:
        addr = ipaddress.ip_address(name.strip("[]"))
    except ValueError:
        return False
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped.is_loopback
    return addr.is_loopback


def exposure_warnings(host: str, *, token: bool, tls: bool) -> list[str]:
    """What to warn about when listening on ``host`` with or without a token and TLS."""
    if is_loopback_host(host):
        return []
    where = "all interfaces" if host in _WILDCARD_HOSTS else host
    if not token:
        return [
            f"listening on {where} without authentication: anyone who can reach this "
            f"port can create environments and run code paths of the env. Set a token "
            f"(--auth-token-file FILE or STADIUM_AUTH_TOKEN), or bind "
            f"--host 127.0.0.1"
        ]
    if not tls:
        return [
            f"listening on {where} with a bearer token but without TLS: the token travels "
            f"in clear text. Serve TLS with --tls-cert/--tls-key, or put a TLS proxy in front"
        ]
    return []


def _split_host(netloc: str, default_port: str = "") -> tuple[str, str]:
    """``host[:port]`` → ``(host, port)``; IPv6 in brackets; ``default_port`` when absent."""
    if netloc.startswith("["):
        end = netloc.find("]")
        if end >= 0:
            rest = netloc[end + 1 :]
            return netloc[: end + 1], rest[1:] if rest.startswith(":") else default_port
    name, sep, port = netloc.rpartition(":")
    if sep and port.isdigit() and ":" not in name:
        return name, port
    return netloc, default_port


@functools.lru_cache(maxsize=4096)
def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name.strip("[]"))
    except ValueError:
        return False
    return True

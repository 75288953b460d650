"""``stadium serve benchmark`` on every node of the emulated cluster, a router in front:
HAProxy or Envoy (``stadium router --kind``), both as ``stadium router`` renders them."""

from __future__ import annotations

import contextlib
import functools
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

from stadium.deploy import envoy, haproxy
from stadium.deploy.deployment import Deployment
from tests.cluster.harness import Cluster, free_port, haproxy_servers, stop_process, wait_for
from tests.conftest import UNIT

ROUTER_KINDS = ("haproxy", "envoy")

States = Callable[[], dict[str, str]]
"""``{node1: "UP" | "DOWN", ...}`` as the router sees its nodes now."""


def healthy(url: str) -> bool:
    """Whether ``url``'s ``/health`` answers 200."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2 * UNIT) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


def _envoy_states(admin_port: int, names: dict[str, str]) -> dict[str, str]:
    try:
        health = envoy.host_health(admin_port)
    except OSError:
        return {}
    return {names[addr]: "UP" if ok else "DOWN" for addr, ok in health.items()}


@contextlib.contextmanager
def behind_router(
    cluster: Cluster, port: int, *serve_args: str, kind: str = "haproxy"
) -> Iterator[tuple[list[Any], str, States]]:
    """``stadium serve benchmark --port PORT SERVE_ARGS`` on each node and a router of
    ``kind`` (``stadium router``'s config) on the host; yields (server processes, router
    URL, the router's view of its nodes); stops them all afterwards."""
    cmd = [sys.executable, "-m", "stadium", "serve", "benchmark", "--host", "0.0.0.0",
           "--port", str(port), *serve_args]  # fmt: skip
    procs = [n.popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for n in cluster.nodes]  # fmt: skip
    router_port = free_port()
    try:
        for node in cluster.nodes:
            wait_for(functools.partial(healthy, node.url(port)), 20 * UNIT, f"{node} healthy")
        deployment = Deployment.of([n.url(port) for n in cluster.nodes])
        states: States
        if kind == "envoy":
            admin = free_port()
            options = haproxy.RouterOptions(bind="127.0.0.1", port=router_port)
            proxy = cluster.envoy(envoy.render(deployment, options, admin_port=admin))
            names = {f"{n.addr}:{port}": f"node{i}" for i, n in enumerate(cluster.nodes, 1)}
            states = functools.partial(_envoy_states, admin, names)
        else:
            stats = cluster.workdir / f"router-{os.getpid()}-{time.monotonic_ns()}.sock"
            options = haproxy.RouterOptions(
                bind="127.0.0.1", port=router_port, stats_socket=str(stats)
            )
            proxy = cluster.haproxy(haproxy.render(deployment, options))
            states = functools.partial(haproxy_servers, stats, "stadium")
        try:
            up = {f"node{i}": "UP" for i in (1, 2, 3)}
            wait_for(lambda: states() == up, 15 * UNIT, f"3 nodes UP in {kind}")
            yield procs, f"http://127.0.0.1:{router_port}", states
        finally:
            stop_process(proxy)
    finally:
        for proc in procs:
            stop_process(proc)

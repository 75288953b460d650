"""``stadium serve benchmark`` on every node of the emulated cluster, HAProxy in front."""

from __future__ import annotations

import contextlib
import functools
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

from stadium.deploy.deployment import Deployment
from stadium.deploy.haproxy import RouterOptions, render
from tests.cluster.harness import Cluster, free_port, haproxy_servers, stop_process, wait_for
from tests.conftest import UNIT


def healthy(url: str) -> bool:
    """Whether ``url``'s ``/health`` answers 200."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2 * UNIT) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


@contextlib.contextmanager
def behind_router(
    cluster: Cluster, port: int, *serve_args: str
) -> Iterator[tuple[list[Any], str, Any]]:
    """``stadium serve benchmark --port PORT SERVE_ARGS`` on each node and HAProxy
    (``stadium router``'s config) on the host; yields (server processes, router URL,
    stats socket); stops them all afterwards."""
    cmd = [sys.executable, "-m", "stadium", "serve", "benchmark", "--host", "0.0.0.0",
           "--port", str(port), *serve_args]  # fmt: skip
    procs = [n.popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for n in cluster.nodes]  # fmt: skip
    stats = cluster.workdir / f"router-{os.getpid()}-{time.monotonic_ns()}.sock"
    router_port = free_port()
    options = RouterOptions(bind="127.0.0.1", port=router_port, stats_socket=str(stats))
    try:
        for node in cluster.nodes:
            wait_for(functools.partial(healthy, node.url(port)), 20 * UNIT, f"{node} healthy")
        cfg = render(Deployment.of([n.url(port) for n in cluster.nodes]), options)
        proxy = cluster.haproxy(cfg)
        try:
            up = {f"node{i}": "UP" for i in (1, 2, 3)}
            wait_for(lambda: haproxy_servers(stats, "stadium") == up, 15 * UNIT, "3 nodes UP")
            yield procs, f"http://127.0.0.1:{router_port}", stats
        finally:
            stop_process(proxy)
    finally:
        for proc in procs:
            stop_process(proc)

"""``stadium router`` (HAProxy) in front of three nodes: a draining node leaves the
rotation before its sessions end; ``kill -9`` of one node fails only its sessions."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from stadium import AsyncClient, SessionClosedError
from stadium.deploy.deployment import Deployment
from stadium.deploy.haproxy import RouterOptions, render
from tests.cluster.harness import Cluster, free_port, haproxy_servers, stop_process, wait_for
from tests.conftest import UNIT

pytestmark = pytest.mark.cluster

PORT = 8800


def _health(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2 * UNIT) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


@contextlib.contextmanager
def _nodes_and_router(cluster: Cluster, drain_s: float) -> Iterator[tuple[list[Any], str, Any]]:
    """``stadium serve benchmark`` on each node and HAProxy (``stadium router``'s config)
    on the host; yields (server processes, router URL, stats socket)."""
    cmd = [sys.executable, "-m", "stadium", "serve", "benchmark", "--host", "0.0.0.0",
           "--port", str(PORT), "--drain-timeout", str(drain_s)]  # fmt: skip
    procs = [n.popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for n in cluster.nodes]  # fmt: skip
    stats = cluster.workdir / f"router-{os.getpid()}-{time.monotonic_ns()}.sock"
    port = free_port()
    options = RouterOptions(bind="127.0.0.1", port=port, stats_socket=str(stats))
    try:
        for node in cluster.nodes:
            wait_for(functools.partial(_health, node.url(PORT)), 20 * UNIT, f"{node} healthy")
        cfg = render(Deployment.of([n.url(PORT) for n in cluster.nodes]), options)
        proxy = cluster.haproxy(cfg)
        try:
            up = {f"node{i}": "UP" for i in (1, 2, 3)}
            wait_for(lambda: haproxy_servers(stats, "stadium") == up, 15 * UNIT, "3 nodes UP")
            yield procs, f"http://127.0.0.1:{port}", stats
        finally:
            stop_process(proxy)
    finally:
        for proc in procs:
            stop_process(proc)


async def _open(url: str) -> tuple[AsyncClient[Any], str]:
    client: AsyncClient[Any] = AsyncClient(url, connect_timeout=5 * UNIT, max_retries=2)
    await client.connect()
    return client, str((await client.reset()).observation["host"])


def test_a_draining_node_leaves_the_router_before_its_sessions_end(cluster: Cluster) -> None:
    with _nodes_and_router(cluster, drain_s=8 * UNIT) as (procs, router, stats):

        async def scenario() -> None:
            held, host = await _open(f"{router}?stadium_node=node2")
            assert host == "node2"
            procs[1].send_signal(signal.SIGTERM)  # node2 drains
            down = {"node1": "UP", "node2": "DOWN", "node3": "UP"}
            deadline = time.monotonic() + 6 * UNIT
            while haproxy_servers(stats, "stadium") != down:
                assert time.monotonic() < deadline, "node2 still in rotation while draining"
                await held.step({"wait_seconds": 0.05})  # its session is served meanwhile
            # Out of rotation, and its session still runs: new sessions go elsewhere.
            assert (await held.step({"wait_seconds": 0})).observation["host"] == "node2"
            fresh = [await _open(router) for _ in range(4)]
            assert {h for _, h in fresh} <= {"node1", "node3"}
            ended = "still open"
            for _ in range(400):  # bounded: the drain ends it with 1001
                try:
                    await held.step({"wait_seconds": 0.05})
                except SessionClosedError as exc:
                    ended = str(exc)
                    break
            assert "1001" in ended, ended
            for c, _ in fresh:
                await c.close()

        asyncio.run(scenario())


def test_kill_9_of_one_node_fails_only_its_sessions(cluster: Cluster) -> None:
    with _nodes_and_router(cluster, drain_s=0) as (procs, router, _stats):

        async def scenario() -> None:
            sessions = [await _open(f"{router}?stadium_node=node{i}") for i in (1, 2, 3, 1, 2, 3)]
            procs[2].send_signal(signal.SIGKILL)  # node3's server dies at once
            procs[2].wait(timeout=10 * UNIT)
            for client, host in sessions:
                if host == "node3":
                    with pytest.raises(SessionClosedError):
                        await client.step({"wait_seconds": 0})
                else:
                    assert (await client.step({"wait_seconds": 0})).observation["host"] == host
                await client.close()

        asyncio.run(scenario())

"""Client-side balancing on the emulated cluster: a client given the nodes' URLs spreads its
sessions over them, and a node's network failure or dead server costs only that node's
sessions. Every wait is bounded by a multiple of ``UNIT``."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from stadium import AsyncClient, SessionClosedError
from stadium._client.balance import balancer_for, forget_all
from tests.cluster.harness import Cluster, stop_process
from tests.conftest import UNIT

pytestmark = pytest.mark.cluster

#: This file's ports on the nodes (one per test: a killed server's port may linger).
PORTS = iter(range(8790, 8800))


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=1 * UNIT) as resp:
            return resp.status == 200
    except OSError:
        return False


def _wait(pred: Any, limit_s: float, what: str) -> None:
    deadline = time.monotonic() + limit_s
    while not pred():
        if time.monotonic() > deadline:
            pytest.fail(f"not true after {limit_s:.1f} s: {what}")
        time.sleep(0.05)


@pytest.fixture
def serving(cluster: Cluster) -> Iterator[tuple[list[str], list[subprocess.Popen[Any]]]]:
    """``stadium serve benchmark`` on every node, on a port of this file's; their URLs."""
    forget_all()
    port = next(PORTS)
    cmd = [sys.executable, "-m", "stadium", "serve", "benchmark", "--host", "0.0.0.0",
           "--port", str(port), "--drain-timeout", "0"]  # fmt: skip
    procs = [
        n.popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for n in cluster.nodes
    ]
    urls = [n.url(port) for n in cluster.nodes]
    try:
        for url in urls:
            _wait(functools.partial(_healthy, url), 20 * UNIT, f"health of {url}")
        yield urls, procs
    finally:
        for node in cluster.nodes:
            node.reconnect()
        for proc in procs:
            stop_process(proc)
        forget_all()


@contextlib.asynccontextmanager
async def sessions(urls: list[str], n: int) -> AsyncIterator[list[AsyncClient[Any]]]:
    """``n`` sessions opened at once over ``urls``, each reset; closed afterwards."""
    clients = [
        AsyncClient[Any](urls, connect_timeout=2 * UNIT, request_timeout=5 * UNIT) for _ in range(n)
    ]
    try:
        await asyncio.gather(*(c.reset() for c in clients))
        yield clients
    finally:
        await asyncio.gather(*(c.close() for c in clients), return_exceptions=True)


async def hosts(clients: list[AsyncClient[Any]]) -> collections.Counter[str]:
    """The nodes the sessions step on (the benchmark env's observation names its host)."""
    results = await asyncio.gather(*(c.step({"wait_seconds": 0.0}) for c in clients))
    return collections.Counter(r.observation["host"] for r in results)


async def test_sessions_fill_the_nodes_evenly(serving: Any) -> None:
    urls, _ = serving
    async with sessions(urls, 30) as clients:
        assert await hosts(clients) == {"node1": 10, "node2": 10, "node3": 10}


async def test_a_disconnected_node_gets_no_new_session_and_others_are_unaffected(
    cluster: Cluster, serving: Any
) -> None:
    urls, _ = serving
    async with sessions(urls, 6) as before:
        assert await hosts(before) == {"node1": 2, "node2": 2, "node3": 2}
        on_live = [c for c in before if c.endpoint != urls[2]]
        cluster.nodes[2].disconnect()  # a network failure: node3 unreachable
        async with sessions(urls, 8) as after:  # no error: node3's connects fail over
            spread = await hosts(after)
            assert spread.keys() == {"node1", "node2"}
            assert spread.total() == 8
            assert min(spread.values()) >= 3, spread
            assert await hosts(on_live) == {"node1": 2, "node2": 2}
            b = balancer_for(urls)
            assert not b.endpoints[2].available(time.monotonic()) or b.endpoints[2].failures
        cluster.nodes[2].reconnect()


async def test_a_killed_server_fails_only_its_sessions_and_new_ones_go_elsewhere(
    serving: Any,
) -> None:
    urls, procs = serving
    async with sessions(urls, 9) as before:
        assert await hosts(before) == {"node1": 3, "node2": 3, "node3": 3}
        os.kill(procs[1].pid, signal.SIGKILL)  # node2's server dies; the node stays up
        procs[1].wait(5 * UNIT)
        on_dead = [c for c in before if c.endpoint == urls[1]]
        on_live = [c for c in before if c.endpoint != urls[1]]
        for c in on_dead:
            with pytest.raises(SessionClosedError):
                await c.step({"wait_seconds": 0.0})
        assert await hosts(on_live) == {"node1": 3, "node3": 3}
        async with sessions(urls, 6) as after:  # refused connects move them, no error
            spread = await hosts(after)
            assert spread.keys() == {"node1", "node3"}
            assert spread.total() == 6
            assert min(spread.values()) >= 2, spread
        assert await hosts(on_live) == {"node1": 3, "node3": 3}

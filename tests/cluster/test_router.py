"""``stadium router`` (HAProxy, and Envoy) in front of three nodes: a draining node leaves the
rotation before its sessions end; ``kill -9`` of one node fails only its sessions."""

from __future__ import annotations

import asyncio
import signal
import time
from typing import Any

import pytest

from stadium import AsyncClient, SessionClosedError
from tests.cluster.harness import Cluster
from tests.cluster.serving import behind_router
from tests.conftest import UNIT

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

PORT = 8800


async def _open(url: str) -> tuple[AsyncClient[Any], str]:
    client: AsyncClient[Any] = AsyncClient(url, connect_timeout=5 * UNIT, max_retries=2)
    await client.connect()
    return client, str((await client.reset()).observation["host"])


def test_a_draining_node_leaves_the_router_before_its_sessions_end(
    cluster: Cluster, router_kind: str
) -> None:
    args = ("--drain-timeout", str(8 * UNIT))
    with behind_router(cluster, PORT, *args, kind=router_kind) as (procs, router, states):

        async def scenario() -> None:
            held, host = await _open(f"{router}?stadium_node=node2")
            assert host == "node2"
            procs[1].send_signal(signal.SIGTERM)  # node2 drains
            down = {"node1": "UP", "node2": "DOWN", "node3": "UP"}
            deadline = time.monotonic() + 6 * UNIT
            while states() != down:
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


def test_kill_9_of_one_node_fails_only_its_sessions(cluster: Cluster, router_kind: str) -> None:
    with behind_router(cluster, PORT, "--drain-timeout", "0", kind=router_kind) as (
        procs,
        router,
        _states,
    ):

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

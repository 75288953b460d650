"""Resume across the emulated cluster: through ``stadium router`` (HAProxy, and Envoy) a resumed
session reaches the node that holds it; with ``--durable`` and a store the nodes share,
sessions of a node killed with ``kill -9`` continue on the others."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest

from stadium import AsyncClient
from tests.cluster.harness import Cluster
from tests.cluster.serving import behind_router
from tests.relay import relay_to

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

PORT = 8810


def test_a_resume_through_the_router_reaches_the_sessions_node(
    cluster: Cluster, router_kind: str
) -> None:
    with behind_router(cluster, PORT, "--drain-timeout", "1", kind=router_kind) as (
        _procs,
        router,
        _states,
    ):

        async def scenario() -> None:
            async with relay_to(router) as relay:
                clients = [AsyncClient(relay.url, max_retries=20) for _ in range(9)]
                try:
                    for c in clients:  # one at a time: HAProxy's leastconn spreads them
                        await c.connect()
                    firsts = [await c.reset() for c in clients]
                    hosts = [r.observation["host"] for r in firsts]
                    assert len(set(hosts)) == 3
                    for round_ in range(2):
                        relay.cut()  # every client loses its connection to the router
                        results = await asyncio.gather(
                            *(c.step({"wait_seconds": 0.0}) for c in clients)
                        )
                        assert [r.observation["host"] for r in results] == hosts
                        assert [r.observation["step_count"] for r in results] == [round_ + 1] * 9
                    assert all(c.resumes == 2 for c in clients)
                finally:
                    await asyncio.gather(*(c.close() for c in clients))

        asyncio.run(scenario())


def test_durable_sessions_of_a_killed_node_continue_on_the_others(
    cluster: Cluster, router_kind: str
) -> None:
    store: Path = cluster.workdir / f"sessions-{os.getpid()}-{time.monotonic_ns()}"
    key = store.with_suffix(".key")  # the nodes sign and check the records with one key
    key.write_bytes(os.urandom(64))
    key.chmod(0o600)
    args = ("--drain-timeout", "1", "--durable", "--session-store", str(store),
            "--session-store-key", str(key))  # fmt: skip
    with behind_router(cluster, PORT, *args, kind=router_kind) as (procs, router, _states):

        async def scenario() -> None:
            clients = [AsyncClient(router, max_retries=20) for _ in range(9)]
            try:
                for c in clients:
                    await c.connect()
                await asyncio.gather(*(c.reset(seed=i) for i, c in enumerate(clients)))
                before = await asyncio.gather(*(c.step({"wait_seconds": 0.0}) for c in clients))
                hosts = [r.observation["host"] for r in before]
                assert "node2" in hosts
                os.kill(procs[1].pid, signal.SIGKILL)  # node2's server (one worker) dies
                after = await asyncio.gather(*(c.step({"wait_seconds": 0.0}) for c in clients))
                assert [r.observation["step_count"] for r in after] == [2] * 9
                assert [r.observation["session_hash"] for r in after] == [
                    r.observation["session_hash"] for r in before
                ]
                moved = [i for i, h in enumerate(hosts) if h == "node2"]
                assert all(after[i].observation["host"] != "node2" for i in moved)
                assert all(clients[i].resumes == 1 for i in moved)
            finally:
                await asyncio.gather(*(c.close() for c in clients))

        asyncio.run(scenario())

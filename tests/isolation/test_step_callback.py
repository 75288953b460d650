"""An isolated step completed from the reply's reader callback (``StepCall``): its ways out
that no other test takes (a request's own ``timeout_s``, a session gone mid-step, a request
too large for the socket at once, a large reply), each as the coroutine path answers."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import websockets

import stadium
from tests.conftest import UNIT, serve, wait_until

TARGET = f"{Path(__file__).with_name('hostile.py')}:Hostile"

pytestmark = pytest.mark.slow


def _ws(url: str) -> str:
    return url.replace("http", "ws") + "/ws"


async def _closed(ws: Any) -> Any:
    try:
        while True:
            await asyncio.wait_for(ws.recv(), 10 * UNIT)
    except websockets.ConnectionClosed as exc:
        return exc.rcvd


async def test_a_step_past_its_own_timeout_s_is_answered_timeout_and_its_process_killed() -> None:
    async with serve(TARGET, isolation="process") as server:
        iso = server.runtime.isolation
        async with websockets.connect(_ws(server.url)) as ws:
            await ws.send('{"type":"reset"}')
            await ws.recv()
            (pid,) = iso.live
            limit = 0.3 * UNIT
            step = {"type": "step", "data": {"do": "spin", "arg": ""}, "timeout_s": limit}
            await ws.send(json.dumps(step))
            reply = json.loads(await asyncio.wait_for(ws.recv(), 10 * UNIT))
            assert reply["data"]["code"] == "TIMEOUT"
            assert reply["data"]["timeout_s"] == limit
            assert (await _closed(ws)).code == 1011
        assert server.runtime.invoke.timeouts == 1
        await wait_until(lambda: pid not in iso.live, 10 * UNIT)


async def test_a_session_gone_mid_step_has_its_process_killed() -> None:
    async with serve(TARGET, isolation="process") as server:
        iso = server.runtime.isolation
        async with websockets.connect(_ws(server.url)) as ws:
            await ws.send('{"type":"reset"}')
            await ws.recv()
            (pid,) = iso.live
            await ws.send(json.dumps({"type": "step", "data": {"do": "spin", "arg": ""}}))
            await asyncio.sleep(0.2 * UNIT)  # the step is in flight
        await wait_until(lambda: pid not in iso.live, 10 * UNIT)
        assert server.runtime.sessions == set()
        async with stadium.AsyncClient(server.url) as env:  # the worker goes on
            await env.reset()
            assert (await env.step({"do": "echo", "arg": "ok"})).observation["text"] == "ok"


async def test_a_request_too_large_for_the_socket_at_once_and_its_large_reply_arrive_whole() -> (
    None
):
    big = "x" * (3 << 20)  # over a Unix socket's buffer: its rest sent by the loop
    async with serve(TARGET, isolation="process") as server:
        async with stadium.AsyncClient(server.url) as env:
            await env.reset()
            for _ in range(3):
                assert (await env.step({"do": "echo", "arg": big})).observation["text"] == big
                assert (await env.step({"do": "echo", "arg": "s"})).observation["text"] == "s"
        assert server.runtime.isolation.crashes == 0


async def test_a_batch_connections_steps_are_isolated_steps_too() -> None:
    """``Session.step_now`` (a batch frame's plain step) hands an isolated step to the
    invoker as any session does: each answered in its own process, a crash its own."""
    async with serve(TARGET, isolation="process") as server:
        async with stadium.SessionPool(server.url, 3, batch=True) as pool:
            assert pool.batching
            await pool.reset()
            for arg in ("a", "b"):
                results = await pool.step([{"do": "echo", "arg": f"{arg}{i}"} for i in range(3)])
                assert [r.observation["text"] for r in results] == [f"{arg}{i}" for i in range(3)]
            pids = {r.observation["pid"] for r in results}
            assert len(pids) == 3
            assert pids <= set(server.runtime.isolation.live)

"""A review of the isolated step's callback path (``StepCall``, ``Clock``): after many steps
and every way a step ends (a reply, the env's error, a crash, its own ``timeout_s``, the
per-call limit, its session gone mid-step, a request the socket takes in parts), the
worker's one timer holds no call, and nothing reached the event loop's exception handler
(an exception there fails no test by itself: each test here collects them)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import websockets

import stadium
from stadium._server.isolation.worker.proxy import Clock
from tests.conftest import UNIT, serve, wait_until

TARGET = f"{Path(__file__).with_name('hostile.py')}:Hostile"

pytestmark = pytest.mark.slow


@contextmanager
def _loop_errors() -> Iterator[list[dict[str, Any]]]:
    """What reaches the running loop's exception handler meanwhile."""
    loop = asyncio.get_running_loop()
    seen: list[dict[str, Any]] = []
    before = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: seen.append(context))
    try:
        yield seen
    finally:
        loop.set_exception_handler(before)


def _ws(url: str) -> str:
    return url.replace("http", "ws") + "/ws"


def _clock(server: Any) -> Clock:
    (session,) = server.runtime.sessions
    clock = session.env.clock
    assert isinstance(clock, Clock)
    return clock


async def _recv(ws: Any) -> dict[str, Any]:
    return json.loads(await asyncio.wait_for(ws.recv(), 10 * UNIT))  # type: ignore[no-any-return]


async def test_the_clock_holds_no_call_after_many_steps_and_every_way_out() -> None:
    with _loop_errors() as errors:
        async with serve(TARGET, isolation="process", step_timeout=0.5 * UNIT) as server:
            async with websockets.connect(_ws(server.url), max_size=None) as ws:
                await ws.send('{"type":"reset"}')
                await _recv(ws)
                clock = _clock(server)
                for i in range(200):  # replies
                    step = {"type": "step", "data": {"do": "echo", "arg": str(i)}}
                    await ws.send(json.dumps(step))
                    assert (await _recv(ws))["type"] == "observation"
                assert clock.calls == {}
                big = "x" * (3 << 20)  # sent in parts (SENDING)
                await ws.send(json.dumps({"type": "step", "data": {"do": "echo", "arg": big}}))
                assert (await _recv(ws))["data"]["observation"]["text"] == big
                await ws.send(json.dumps({"type": "step", "data": {"do": "nosuch"}}))
                assert (await _recv(ws))["type"] == "error"  # the env's error
                await ws.send(json.dumps({"type": "step", "data": {"do": "exit"}}))
                assert (await _recv(ws))["type"] == "error"  # a crash (DYING)
                assert clock.calls == {}
            async with websockets.connect(_ws(server.url)) as ws:  # past the per-call limit
                await ws.send('{"type":"reset"}')
                await _recv(ws)
                await ws.send(json.dumps({"type": "step", "data": {"do": "spin"}}))
                reply = await _recv(ws)
                assert (reply["data"]["code"], reply["data"]["limit"]) == (
                    "LIMIT_EXCEEDED",
                    "wall_time",
                )
            for own, code in (  # its own timeout_s: shorter, the clock's, longer
                (0.2 * UNIT, "TIMEOUT"),
                (0.5 * UNIT, "TIMEOUT"),
                (5 * UNIT, "LIMIT_EXCEEDED"),
            ):
                async with websockets.connect(_ws(server.url)) as ws:
                    await ws.send('{"type":"reset"}')
                    await _recv(ws)
                    spin = {"type": "step", "data": {"do": "spin"}, "timeout_s": own}
                    await ws.send(json.dumps(spin))
                    assert (await _recv(ws))["data"]["code"] == code
            async with websockets.connect(_ws(server.url)) as ws:  # gone mid-step
                await ws.send('{"type":"reset"}')
                await _recv(ws)
                clock = _clock(server)
                await ws.send(json.dumps({"type": "step", "data": {"do": "spin"}}))
                await wait_until(lambda: len(clock.calls) == 1, 5 * UNIT, "the step in flight")
            await wait_until(lambda: not server.runtime.sessions, 5 * UNIT, "the session gone")
            assert clock.calls == {}
            async with stadium.AsyncClient(server.url) as env:  # the worker goes on
                await env.reset()
                assert (await env.step({"do": "echo", "arg": "ok"})).observation["text"] == "ok"
            assert clock.calls == {}
            await asyncio.sleep(0.7 * UNIT)  # past every deadline: nothing fires late
            assert clock.timer is None or clock.calls
    assert errors == []

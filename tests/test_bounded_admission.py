"""Bounded admission: sessions waiting for a slot are bounded per connection and per client
(refused per entry past the bound, saying which), and a closing connection forgets its
own waiters without scanning anyone else's (issue 22, item 3)."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

import pytest
import websockets
from websockets.typing import Subprotocol

import stadium._server.admission.slots as admission_module
from stadium._server.admission.slots import Admission, LocalSlots, Verdict
from tests.conftest import UNIT, serve, wait_until

pytestmark = pytest.mark.asyncio

_BATCH = Subprotocol("stadium.batch")


def _ws(url: str) -> str:
    return url.replace("http", "ws") + "/ws"


def _waiter(log: list[bool]) -> Callable[[bool], None]:
    return log.append


def _lines_in_admission(body: Callable[[], None]) -> int:
    """How many lines of ``stadium._server.admission.slots`` ``body`` executes (its work, counted
    without a clock)."""
    count = 0
    source = admission_module.__file__

    def tracer(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal count
        if frame.f_code.co_filename != source:
            return None
        if event == "line":
            count += 1
        return tracer

    sys.settrace(tracer)
    try:
        body()
    finally:
        sys.settrace(None)
    return count


async def test_cancelling_a_connections_waiters_never_scans_the_queue() -> None:
    """Cancelling k waiters costs O(k) whatever waits ahead of them (before: each cancel
    scanned the queue from its head, so closing a connection was O(k * queue))."""
    admission = Admission(LocalSlots(0), timeout=60 * UNIT, per_connection=0, per_client=0)
    others = [_waiter([]) for _ in range(5000)]
    for w in others:
        assert admission.admit(w, group="other") is Verdict.QUEUED
    mine = [_waiter([]) for _ in range(200)]
    for w in mine:
        assert admission.admit(w, group="mine") is Verdict.QUEUED

    def cancel_mine() -> None:
        for w in reversed(mine):
            admission.cancel(w)

    lines = _lines_in_admission(cancel_mine)
    assert lines <= 20 * len(mine), f"{lines} lines run to cancel {len(mine)} waiters"
    assert admission.waiting == len(others)
    assert admission.waiting_for("mine") == 0
    assert admission.waiting_for("other") == len(others)
    admission.refuse_all()


async def test_waiting_sessions_are_bounded_per_connection_and_per_client() -> None:
    admission = Admission(LocalSlots(0), timeout=60 * UNIT, per_connection=3, per_client=5)
    a, b = object(), object()
    got = [admission.admit(_waiter([]), group=a, client="10.0.0.1") for _ in range(4)]
    assert got == [Verdict.QUEUED] * 3 + [Verdict.TOO_MANY_WAITING]
    assert "this connection already has 3 sessions waiting" in admission.queue_error(a).message
    got = [admission.admit(_waiter([]), group=b, client="10.0.0.1") for _ in range(3)]
    assert got == [Verdict.QUEUED] * 2 + [Verdict.TOO_MANY_WAITING]  # the client's 5
    err = admission.queue_error(b, "10.0.0.1")
    assert "this client (10.0.0.1) already has 5 sessions waiting" in err.message
    assert err.code.value == "CAPACITY_REACHED"
    # Another client, and sessions of no connection group, are not held back.
    assert admission.admit(_waiter([]), group=object(), client="10.0.0.2") is Verdict.QUEUED
    assert admission.admit(_waiter([])) is Verdict.QUEUED
    # A waiter that leaves (or is served) makes room again; the counts never leak.
    log: list[bool] = []
    waiter = _waiter(log)
    admission.cancel(waiter)  # not queued: nothing happens
    admission.slots.limit = 1
    admission.release()  # hands the freed slot to the head waiter (one of a's)
    assert admission.waiting_for(a) == 2
    assert admission.admit(waiter, group=a, client="10.0.0.3") is Verdict.QUEUED
    admission.refuse_all()
    assert admission.waiting == 0
    assert admission._by_group == {}
    assert admission._by_client == {}


async def test_a_batch_past_its_connections_bound_is_refused_per_entry() -> None:
    async with serve(
        "benchmark", max_sessions=1, admission_timeout=0.3 * UNIT, max_waiting_per_connection=5
    ) as server:
        async with websockets.connect(_ws(server.url)) as holder:
            await holder.send(json.dumps({"type": "reset", "data": {}}))
            assert json.loads(await holder.recv())["type"] == "observation"
            async with websockets.connect(_ws(server.url), subprotocols=[_BATCH]) as ws:
                calls = [{"session": i, "type": "reset"} for i in range(8)]
                await ws.send(json.dumps({"type": "batch", "id": 1, "calls": calls}))
                reply = json.loads(await asyncio.wait_for(ws.recv(), 10 * UNIT))
        results = reply["results"]
        assert [r["data"]["code"] for r in results] == ["CAPACITY_REACHED"] * 8
        messages = [r["data"]["message"] for r in results]
        bounded = [m for m in messages if "this connection already has 5 sessions waiting" in m]
        timed_out = [m for m in messages if "no slot freed within" in m]
        assert len(bounded) == 3, messages
        assert len(timed_out) == 5, messages
        await wait_until(lambda: server.runtime.admission.waiting == 0, 5 * UNIT, "queue empty")


async def test_a_connection_with_thousands_of_waiters_closes_without_freezing_the_loop() -> None:
    """Issue 22: two batch connections fill the queue; one closes. Its waiters go, the
    other's stay queued, the queue's bound holds, and the loop's longest stall while the
    closing connection's waiters are forgotten is printed (measured, not asserted)."""
    async with serve("benchmark", max_sessions=1, admission_timeout=60 * UNIT) as server:
        admission = server.runtime.admission
        per = admission.per_connection
        async with websockets.connect(_ws(server.url)) as holder:
            await holder.send(json.dumps({"type": "reset", "data": {}}))
            assert json.loads(await holder.recv())["type"] == "observation"
            calls = [{"session": i, "type": "reset"} for i in range(per)]
            over = [{"session": per + i, "type": "reset"} for i in range(100)]
            kw: dict[str, Any] = {"subprotocols": [_BATCH], "max_size": None}
            staying = await websockets.connect(_ws(server.url), **kw)
            leaving = await websockets.connect(_ws(server.url), **kw)
            try:
                for ws in (staying, leaving):
                    await ws.send(json.dumps({"type": "batch", "id": 1, "calls": calls}))
                    await ws.send(json.dumps({"type": "batch", "id": 2, "calls": over}))
                    reply = json.loads(await asyncio.wait_for(ws.recv(), 30 * UNIT))
                    assert reply["id"] == 2  # refused at once, the first frame still waiting
                    messages = {r["data"]["message"] for r in reply["results"]}
                    assert all(f"already has {per} sessions waiting" in m for m in messages)
                await wait_until(lambda: admission.waiting == 2 * per, 30 * UNIT, "all queued")

                stall = 0.0
                beating = True

                async def heartbeat() -> None:
                    nonlocal stall
                    last = time.perf_counter()
                    while beating:
                        await asyncio.sleep(0.001)
                        now = time.perf_counter()
                        stall = max(stall, now - last)
                        last = now

                beat = asyncio.ensure_future(heartbeat())
                await asyncio.sleep(0.05 * UNIT)
                stall = 0.0
                leaving.transport.abort()
                await wait_until(lambda: admission.waiting == per, 30 * UNIT, "waiters forgotten")
                await asyncio.sleep(0.05 * UNIT)
                beating = False
                await beat
                ms = stall * 1e3
                print(f"\nlongest loop stall while {per} waiters were forgotten: {ms:.1f} ms")
                assert admission.waiting_for(server.runtime) == 0
                assert len(admission._by_group) == 1  # only the staying connection's count
            finally:
                await staying.close()
                await leaving.close()
        await wait_until(lambda: admission.waiting == 0, 30 * UNIT, "queue empty")
        await wait_until(lambda: not server.runtime.sessions, 30 * UNIT, "sessions ended")

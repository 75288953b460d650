"""Batch connections, server side (docs/PROTOCOL.md, "Batches"): one frame carries a call
per session and is answered by one frame with the results in order; errors stay per
entry; each session has its own env and slot; ``first: K`` streams the ready results;
drain answers what is left with ``closed``; plain clients never see any of it."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import msgspec
import pytest
import websockets

from tests.conftest import TRANSPORTS, UNIT, serve, wait_until

pytestmark = pytest.mark.asyncio


def _ws(url: str) -> str:
    return url.replace("http", "ws") + "/ws"


async def _batch(ws: Any, rid: Any, calls: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    await ws.send(json.dumps({"type": "batch", "id": rid, "calls": calls, **extra}))
    reply: dict[str, Any] = json.loads(await ws.recv())
    return reply


def _codes(reply: dict[str, Any]) -> list[str]:
    return [r["type"] if r["type"] != "error" else r["data"]["code"] for r in reply["results"]]


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_mixed_batch_keeps_errors_per_session(transport: str) -> None:
    async with serve("benchmark", transport=transport) as server:
        async with websockets.connect(_ws(server.url), subprotocols=["stadium.batch"]) as ws:
            assert ws.subprotocol == "stadium.batch"
            opened = await _batch(
                ws, 1, [{"session": i, "type": "reset", "data": {"seed": i}} for i in range(5)]
            )
            assert opened["id"] == 1
            assert _codes(opened) == ["observation"] * 5
            assert server.runtime.admission.slots.active() == 5  # a slot each
            reply = await _batch(ws, "two", [
                {"session": 0, "type": "step", "data": {"wait_seconds": 0}},
                {"session": 1, "type": "step", "data": {"wait_seconds": "soon"}},
                {"session": 7, "type": "step", "data": {"wait_seconds": 0}},
                {"session": 2, "type": "state"},
                {"session": 3, "type": "close"},
                {"session": 4, "type": "step", "data": {"wait_seconds": 0}},
            ])  # fmt: skip
            assert reply["id"] == "two"
            assert _codes(reply) == [
                "observation", "VALIDATION_ERROR", "SESSION_ERROR", "state", "closed", "observation"
            ]  # fmt: skip
            assert reply["results"][0]["data"]["observation"]["step_count"] == 1
            assert "wait_seconds" in reply["results"][1]["data"]["message"]
            assert "a reset opens it" in reply["results"][2]["data"]["message"]
            assert reply["results"][4]["data"]["code"] == 1000
            # Envs are apart: session 4's episode went on, session 1's did not.
            again = await _batch(ws, 3, [
                {"session": 1, "type": "step", "data": {"wait_seconds": 0}},
                {"session": 4, "type": "step", "data": {"wait_seconds": 0}},
                {"session": 3, "type": "step", "data": {"wait_seconds": 0}},
                {"session": 3, "type": "reset"},
            ])  # fmt: skip
            assert _codes(again) == ["observation", "observation", "SESSION_ERROR", "SESSION_ERROR"]
            assert [r["data"]["observation"]["step_count"] for r in again["results"][:2]] == [1, 2]
            hashes = {r["data"]["observation"]["session_hash"] for r in again["results"][:2]}
            assert len(hashes) == 2
        await wait_until(lambda: not server.runtime.sessions, 5 * UNIT, "all sessions ended")
        assert server.runtime.admission.slots.active() == 0


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_msgpack_batches(transport: str) -> None:
    async with serve("wordguess", transport=transport) as server:
        url = _ws(server.url)
        async with websockets.connect(url, subprotocols=["stadium.batch.msgpack"]) as ws:
            assert ws.subprotocol == "stadium.batch.msgpack"
            calls = [{"session": i, "type": "reset", "data": {"seed": 3}} for i in range(3)]
            await ws.send(msgspec.msgpack.encode({"type": "batch", "id": 1, "calls": calls}))
            reply = msgspec.msgpack.decode(await ws.recv())
            assert [r["type"] for r in reply["results"]] == ["observation"] * 3
            calls = [{"session": i, "type": "step", "data": {"word": "crane"}} for i in range(3)]
            await ws.send(msgspec.msgpack.encode({"type": "batch", "id": 2, "calls": calls}))
            reply = msgspec.msgpack.decode(await ws.recv())
            assert {r["data"]["observation"]["feedback"] for r in reply["results"]} != set()
            assert len({r["data"]["observation"]["feedback"] for r in reply["results"]}) == 1


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_first_k_streams_ready_results(transport: str) -> None:
    async with serve("benchmark", transport=transport) as server:
        async with websockets.connect(_ws(server.url), subprotocols=["stadium.batch"]) as ws:
            await _batch(ws, 1, [{"session": i, "type": "reset"} for i in range(4)])
            waits = [0.3, 0.0, 0.2, 0.0]
            calls = [
                {"session": i, "type": "step", "data": {"wait_seconds": w * UNIT}}
                for i, w in enumerate(waits)
            ]
            await ws.send(json.dumps({"type": "batch", "id": 2, "calls": calls, "first": 2}))
            frames = [json.loads(await ws.recv())]
            while not frames[-1]["done"]:
                frames.append(json.loads(await ws.recv()))
            assert sorted(frames[0]["index"]) == [1, 3]  # the quick ones first
            # Then at least K (2) at a time, or what is left: both slow ones together.
            assert [f["index"] for f in frames[1:]] == [[2, 0]]
            assert all(len(f["results"]) == len(f["index"]) for f in frames)


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_session_waits_for_a_slot_and_is_refused_when_none_frees(transport: str) -> None:
    async with serve(
        "benchmark", transport=transport, max_sessions=2, admission_timeout=0.2 * UNIT
    ) as server:
        async with websockets.connect(_ws(server.url), subprotocols=["stadium.batch"]) as ws:
            reply = await _batch(ws, 1, [{"session": i, "type": "reset"} for i in range(3)])
            codes = _codes(reply)
            assert codes.count("observation") == 2
            assert codes.count("CAPACITY_REACHED") == 1
            refused = codes.index("CAPACITY_REACHED")
            # The refused number is free again: it opens once a slot frees.
            close = next(i for i in range(3) if i != refused)
            reply = await _batch(ws, 2, [
                {"session": close, "type": "close"},
                {"session": refused, "type": "reset"},
            ])  # fmt: skip
            assert _codes(reply) == ["closed", "observation"]
        await wait_until(lambda: not server.runtime.sessions, 5 * UNIT, "all sessions ended")


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_bad_frames_get_one_error_and_the_connection_goes_on(transport: str) -> None:
    async with serve("benchmark", transport=transport) as server:
        async with websockets.connect(_ws(server.url), subprotocols=["stadium.batch"]) as ws:
            for frame, code in [
                ("{not json", "INVALID_JSON"),
                (json.dumps({"type": "step", "data": {}}), "INVALID_JSON"),
                (json.dumps({"type": "batch", "id": 5, "calls": []}), "INVALID_JSON"),
                (json.dumps({"type": "batch", "id": 6, "calls": [{"session": 1}] * 5000}),
                 "VALIDATION_ERROR"),
            ]:  # fmt: skip
                await ws.send(frame)
                reply = json.loads(await ws.recv())
                assert reply["type"] == "error"
                assert reply["data"]["code"] == code
            reply = await _batch(ws, 7, [
                {"session": 1, "type": "reset"},
                {"session": 1, "type": "step", "data": {"wait_seconds": 0}},
                {"session": -3, "type": "reset"},
            ])  # fmt: skip
            assert _codes(reply) == ["observation", "SESSION_ERROR", "SESSION_ERROR"]
            assert "one call per session" in reply["results"][1]["data"]["message"]


async def test_drain_answers_in_flight_calls_and_closes_the_rest() -> None:
    """``stadium serve`` only: under ASGI the hosting server drains (uvicorn closes its
    WebSockets with 1012 before the app's lifespan shutdown)."""
    async with serve("benchmark", drain_timeout=1.0 * UNIT) as server:
        async with websockets.connect(_ws(server.url), subprotocols=["stadium.batch"]) as ws:
            await _batch(ws, 1, [{"session": i, "type": "reset"} for i in range(2)])
            await ws.send(json.dumps({"type": "batch", "id": 2, "calls": [
                {"session": 0, "type": "step", "data": {"wait_seconds": 0.3 * UNIT}},
                {"session": 1, "type": "step", "data": {"wait_seconds": 0.3 * UNIT}},
            ]}))  # fmt: skip
            await asyncio.sleep(0.05 * UNIT)
            stopping = asyncio.ensure_future(server.stop())
            reply = json.loads(await ws.recv())
            assert _codes(reply) == ["observation", "observation"]  # in flight: answered
            with pytest.raises(websockets.ConnectionClosed) as closed:
                await ws.recv()
            assert closed.value.rcvd is not None
            assert closed.value.rcvd.code == 1001
            await stopping


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_plain_sessions_and_openenv_clients_are_unchanged(transport: str) -> None:
    async with serve("benchmark", transport=transport) as server:
        async with websockets.connect(_ws(server.url)) as ws:  # no subprotocol: one session
            assert ws.subprotocol is None
            await ws.send(json.dumps({"type": "reset"}))
            assert json.loads(await ws.recv())["type"] == "observation"
        async with websockets.connect(_ws(server.url), subprotocols=["other"]) as ws:
            assert ws.subprotocol is None


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_resumable_batch_sessions_survive_a_lost_connection(transport: str) -> None:
    async with serve("benchmark", transport=transport) as server:
        url = _ws(server.url) + "?stadium_resume=1"
        ws = await websockets.connect(url, subprotocols=["stadium.batch"])
        assert ws.response.headers["X-Stadium-Resume-Grace"] == "60"
        opened = await _batch(ws, 1, [{"session": i, "type": "reset", "id": 1} for i in range(3)])
        assert _codes(opened) == ["observation"] * 3
        ids = {i: (sid, token) for i, sid, token in opened["opened"]}
        assert sorted(ids) == [0, 1, 2]
        await ws.send(json.dumps({"type": "batch", "id": 2, "calls": [
            {"session": 0, "type": "step", "data": {"wait_seconds": 0.3 * UNIT}, "id": 2},
            {"session": 1, "type": "step", "data": {"wait_seconds": 0}, "id": 2},
        ]}))  # fmt: skip
        await asyncio.sleep(0.05 * UNIT)
        ws.transport.abort()  # the connection is lost: session 0's step is in flight
        await wait_until(
            lambda: all(s.phase.name == "DETACHED" for s in server.runtime.sessions),
            5 * UNIT,
            "sessions detached",
        )
        sid0, token0 = ids[0]
        query = f"?stadium_resume={sid0}"
        async with websockets.connect(
            _ws(server.url) + query,
            subprotocols=["stadium.batch"],
            additional_headers={"X-Stadium-Resume-Token": token0},
        ) as again:
            reply = await _batch(again, 3, [
                {"session": i, "type": "resume",
                 "data": {"id": ids[i][0], "token": ids[i][1], "received": 1}}
                for i in range(3)
            ])  # fmt: skip
            assert _codes(reply) == ["resumed"] * 3
            resumed = [r["data"] for r in reply["results"]]
            # Session 0's step ran once, its reply came with the resume; so did session 1's.
            assert [d["requests"] for d in resumed] == [2, 2, 1]
            assert [len(d["replies"]) for d in resumed] == [1, 1, 0]
            assert resumed[0]["replies"][0]["data"]["observation"]["step_count"] == 1
            assert resumed[0]["replies"][0]["id"] == 2
            # The sessions go on, on the new connection.
            more = await _batch(again, 4, [
                {"session": i, "type": "step", "data": {"wait_seconds": 0}} for i in range(3)
            ])  # fmt: skip
            assert [r["data"]["observation"]["step_count"] for r in more["results"]] == [2, 2, 1]
            # A stale token is refused, per entry.
            stale = await _batch(again, 5, [
                {"session": 9, "type": "resume",
                 "data": {"id": sid0, "token": token0, "received": 0}},
            ])  # fmt: skip
            assert _codes(stale) == ["RESUME_FAILED"]
        assert server.runtime.outcomes["resumed"] == 3


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_time_limits_and_env_errors_stay_per_entry(transport: str) -> None:
    async with serve("benchmark", transport=transport, step_timeout=0.2 * UNIT) as server:
        async with websockets.connect(_ws(server.url), subprotocols=["stadium.batch"]) as ws:
            await _batch(ws, 1, [{"session": i, "type": "reset"} for i in range(2)])
            reply = await _batch(ws, 2, [
                {"session": 0, "type": "step", "data": {"wait_seconds": 5}},
                {"session": 1, "type": "step", "data": {"wait_seconds": 0}},
            ])  # fmt: skip
            assert _codes(reply) == ["TIMEOUT", "observation"]
            after = await _batch(ws, 3, [
                {"session": 0, "type": "step", "data": {"wait_seconds": 0}},
                {"session": 1, "type": "step", "data": {"wait_seconds": 0}},
            ])  # fmt: skip
            # The timed-out session was closed (1011); its number is free; the other goes on.
            assert _codes(after) == ["SESSION_ERROR", "observation"]
            assert server.runtime.errors_total["TIMEOUT"] == 1


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_vanished_batch_client_gives_its_slots_back(transport: str) -> None:
    """Without resume (no ``?stadium_resume=1``) a lost batch connection ends its sessions:
    envs closed, slots freed, even with a step still running."""
    async with serve("benchmark", transport=transport) as server:
        ws = await websockets.connect(_ws(server.url), subprotocols=["stadium.batch"])
        await _batch(ws, 1, [{"session": i, "type": "reset"} for i in range(3)])
        await ws.send(json.dumps({"type": "batch", "id": 2, "calls": [
            {"session": 0, "type": "step", "data": {"wait_seconds": 5}},
        ]}))  # fmt: skip
        await asyncio.sleep(0.05 * UNIT)
        assert server.runtime.admission.slots.active() == 3
        ws.transport.abort()
        await wait_until(lambda: not server.runtime.sessions, 5 * UNIT, "sessions ended")
        assert server.runtime.admission.slots.active() == 0
        assert server.runtime.resumable == {}

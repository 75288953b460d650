"""A real server on port 0, driven by Stadium's client and raw WebSockets."""

from __future__ import annotations

import asyncio
import json
import socket
import urllib.error
import urllib.request
from typing import Any

import msgspec
import pytest
import websockets

import stadium
from stadium import AsyncClient, Environment, State, StepResult
from stadium.envs.benchmark import BenchmarkObservation
from tests.conftest import TRANSPORTS, UNIT, serve

# One conformance suite for both transports: picows (stadium serve) and the ASGI app.
pytestmark = pytest.mark.parametrize("transport", TRANSPORTS)


class Act(msgspec.Struct):
    value: int


class Obs(msgspec.Struct):
    value: int


class Flaky(Environment[Act, Obs, State]):
    """Raises on value 13, sleeps on value 99."""

    blocking = False

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Obs:
        return Obs(0)

    async def step(self, action: Act) -> StepResult[Obs]:  # type: ignore[override]
        if action.value == 13:
            raise RuntimeError("unlucky number")
        if action.value == 99:
            await asyncio.sleep(0.2 * UNIT)
        return StepResult(Obs(action.value), reward=float(action.value))


class SyncBlocking(Environment[Act, Obs, State]):
    """A sync env that blocks (runs on the thread pool)."""

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Obs:
        return Obs(seed or 0)

    def step(self, action: Act) -> StepResult[Obs]:
        import time

        time.sleep(0.01)
        return StepResult(Obs(action.value * 2), reward=1.0, done=action.value > 2)


class OptionsObs(msgspec.Struct):
    seed: int | None
    options: dict[str, Any] | None
    episode_id: str | None


class ShowsReset(Environment[Act, OptionsObs, State]):
    """Returns its reset arguments as the observation."""

    blocking = False

    def reset(
        self,
        *,
        seed: int | None = None,
        options: dict[str, Any] | None = None,
        episode_id: str | None = None,
    ) -> OptionsObs:
        return OptionsObs(seed, options, episode_id)

    def step(self, action: Act) -> OptionsObs:
        return OptionsObs(None, None, None)


def http(url: str, path: str, body: bytes | None = None) -> tuple[int, Any]:
    req = urllib.request.Request(
        url + path, data=body, method="POST" if body is not None else "GET"
    )
    try:
        with urllib.request.urlopen(req, timeout=10 * UNIT) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


async def test_client_reset_step_state_close(transport: str) -> None:
    async with serve("benchmark", transport=transport) as server:
        async with AsyncClient(server.url, observation_type=BenchmarkObservation) as env:
            first = await env.reset(seed=1)
            assert first.observation.step_count == 0
            assert first.reward is None
            result = await env.step({"wait_seconds": 0.01})
            assert result.observation.waited_seconds == 0.01
            assert result.observation.step_count == 1
            assert result.reward == 1.0
            assert result.done is False
            state = await env.state()
            assert state["step_count"] == 1
            assert len(state["episode_id"]) == 32
        assert not env.connected


async def test_every_error_code_and_the_session_survives(transport: str) -> None:
    async with serve("benchmark", transport=transport) as server:
        async with websockets.connect(server.url.replace("http", "ws") + "/ws") as ws:

            async def ask(frame: str | bytes) -> dict[str, Any]:
                await ws.send(frame)
                reply: dict[str, Any] = json.loads(await ws.recv())
                return reply

            assert (await ask("{nope"))["data"]["code"] == "INVALID_JSON"
            assert (await ask(b"\x89PNG\r\n\x1a\n\x00\x00"))["data"]["code"] == "INVALID_JSON"
            assert (await ask('{"type":"fly"}'))["data"]["code"] == "UNKNOWN_TYPE"
            reply = await ask('{"type":"step","data":{"wait_seconds":0}}')
            assert reply["data"]["code"] == "SESSION_ERROR"
            assert (await ask('{"type":"reset","data":{"state_kb":-1}}'))["data"]["code"] == (
                "EXECUTION_ERROR"
            )
            assert (await ask('{"type":"reset"}'))["type"] == "observation"
            bad = await ask('{"type":"step","data":{"wait_seconds":"soon"}}')
            assert bad["data"]["code"] == "VALIDATION_ERROR"
            assert bad["data"]["field"] == "$.wait_seconds"
            ok = await ask('{"type":"step","data":{"wait_seconds":0}}')
            assert ok["type"] == "observation"
            assert ok["data"]["observation"]["step_count"] == 1


async def test_env_raising_in_step_leaves_other_sessions_running(transport: str) -> None:
    async with serve(Flaky, transport=transport) as server:
        async with AsyncClient(server.url) as a, AsyncClient(server.url) as b:
            await a.reset()
            await b.reset()
            slow = asyncio.ensure_future(b.step({"value": 99}))
            with pytest.raises(stadium.ExecutionError) as info:
                await a.step({"value": 13})
            assert info.value.context["exception"] == "RuntimeError"
            assert "unlucky number" in info.value.message
            assert (await slow).observation == {"value": 99}
            assert (await a.step({"value": 2})).reward == 2.0  # a is still usable


async def test_sync_blocking_env_runs_on_the_pool(transport: str) -> None:
    async with (
        serve(SyncBlocking, transport=transport) as server,
        stadium.SessionPool(server.url, size=20) as pool,
    ):
        firsts = await pool.reset(seeds=range(20))
        assert [r.observation["value"] for r in firsts] == list(range(20))
        results = await pool.step([{"value": 3}] * 20)
        assert all(r.observation == {"value": 6} and r.done for r in results)


async def test_session_pool_bounds_connects_in_flight(
    transport: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import stadium._client.options as client_mod  # every client connects through it

    real = client_mod.ws_connect
    now, most = 0, 0

    async def counting(*args: Any, **kwargs: Any) -> Any:
        nonlocal now, most
        now += 1
        most = max(most, now)
        try:
            await asyncio.sleep(0.01)  # let the other sessions reach their connect
            return await real(*args, **kwargs)
        finally:
            now -= 1

    monkeypatch.setattr(client_mod, "ws_connect", counting)
    async with serve(SyncBlocking, transport=transport) as server:
        async with stadium.SessionPool(
            server.url, size=12, connect_concurrency=3, batch=False
        ) as pool:
            firsts = await pool.reset(seeds=range(12))
        assert [r.observation["value"] for r in firsts] == list(range(12))
        assert (now, most) == (0, 3)
    with pytest.raises(ValueError, match="connect_concurrency"):
        stadium.SessionPool("ws://127.0.0.1:1/ws", size=2, connect_concurrency=0)


async def test_pipelined_requests_are_answered_in_order_with_ids(transport: str) -> None:
    async with serve(Flaky, transport=transport) as server:
        async with websockets.connect(server.url.replace("http", "ws") + "/ws") as ws:
            await ws.send('{"type":"reset","id":0}')
            for i in range(1, 6):
                await ws.send(json.dumps({"type": "step", "data": {"value": i}, "id": i}))
            replies = [json.loads(await ws.recv()) for _ in range(6)]
            assert [r["id"] for r in replies] == list(range(6))
            assert [r["data"]["reward"] for r in replies[1:]] == [1.0, 2.0, 3.0, 4.0, 5.0]


async def test_msgpack_subprotocol(transport: str) -> None:
    async with (
        serve("echo", transport=transport) as server,
        AsyncClient(server.url, msgpack=True) as env,
    ):
        await env.reset()
        result = await env.step({"message": "packed"})
        assert result.observation == {"echoed_message": "packed", "message_length": 6}


async def test_oversize_message_closes_with_1009_and_server_keeps_serving(transport: str) -> None:
    async with serve("echo", max_message_bytes=4096, transport=transport) as server:
        url = server.url.replace("http", "ws") + "/ws"
        async with websockets.connect(url, max_size=None) as ws:
            await ws.send(json.dumps({"type": "step", "data": {"message": "x" * 10_000}}))
            with pytest.raises(websockets.ConnectionClosed) as info:
                await ws.recv()
            assert info.value.rcvd is not None
            assert info.value.rcvd.code == 1009
        async with AsyncClient(server.url) as env:
            await env.reset()
            assert (await env.step({"message": "still here"})).reward == pytest.approx(1.0)


async def test_fragmented_message_is_reassembled(transport: str) -> None:
    async with serve("echo", transport=transport) as server:
        async with websockets.connect(server.url.replace("http", "ws") + "/ws") as ws:
            await ws.send(['{"type":', '"reset"}'])
            assert json.loads(await ws.recv())["type"] == "observation"


async def test_capacity_queue_then_refusal_with_hint(transport: str) -> None:
    async with serve(
        "benchmark", max_sessions=2, admission_timeout=0.3 * UNIT, transport=transport
    ) as server:
        a, b = AsyncClient(server.url), AsyncClient(server.url)
        await a.reset()
        await b.reset()
        c = AsyncClient(server.url, max_retries=0)
        with pytest.raises(stadium.CapacityError) as info:
            await c.reset()
        ctx = info.value.context
        assert (ctx["active_sessions"], ctx["max_sessions"]) == (2, 2)
        assert ctx["retry_after_s"] > 0
        # a queued session is admitted when a slot frees within the timeout
        d = AsyncClient(server.url, max_retries=0)
        pending = asyncio.ensure_future(d.reset())
        await asyncio.sleep(0.05 * UNIT)
        _, meta = await asyncio.to_thread(http, server.url, "/metadata")
        assert meta["capacity"]["waiting_sessions"] == 1  # d waits for a slot
        await a.close()
        assert (await pending).observation["step_count"] == 0
        _, meta = await asyncio.to_thread(http, server.url, "/metadata")
        assert meta["capacity"]["waiting_sessions"] == 0
        await b.close()
        await d.close()


async def test_idle_sessions_are_reaped(transport: str) -> None:
    async with serve("echo", idle_timeout=0.2 * UNIT, transport=transport) as server:
        async with websockets.connect(server.url.replace("http", "ws") + "/ws") as ws:
            await ws.send('{"type":"reset"}')
            await ws.recv()
            with pytest.raises(websockets.ConnectionClosed) as info:
                await asyncio.wait_for(ws.recv(), 5 * UNIT)
            assert info.value.rcvd is not None
            assert info.value.rcvd.code == 1001
            assert "idle" in info.value.rcvd.reason
        assert server.runtime.sessions == set()


async def test_http_endpoints(transport: str) -> None:
    async with serve("echo", transport=transport) as server:
        url = server.url
        status, health = await asyncio.to_thread(http, url, "/health")
        assert status == 200
        assert health["status"] == "healthy"
        assert health["max_sessions"] == server.config.max_sessions
        assert health["active_sessions"] == 0
        assert health["node"] == socket.gethostname()
        async with AsyncClient(server.url) as env:  # the load counts the open session
            await env.reset()
            _, health = await asyncio.to_thread(http, url, "/health")
            assert health["active_sessions"] == 1
        status, schema = await asyncio.to_thread(http, url, "/schema")
        assert status == 200
        assert set(schema) == {"action", "observation", "state"}
        async with AsyncClient(server.url) as env:
            await env.reset()
            await env.step({"message": "a"})
            with pytest.raises(stadium.ValidationError):
                await env.step({"message": 1})
        status, meta = await asyncio.to_thread(http, url, "/metadata")
        assert meta["name"] == "echo"
        assert meta["capacity"]["max_sessions"] == server.config.max_sessions
        assert meta["worker"]["sessions_total"] == 2  # the one above, and this one
        assert meta["worker"]["steps_total"] == 1
        assert meta["worker"]["errors_total"] == {"VALIDATION_ERROR": 1}
        status, state = await asyncio.to_thread(http, url, "/state")
        assert (status, state["step_count"]) == (200, 0)
        status, reset = await asyncio.to_thread(http, url, "/reset", b"{}")
        assert (status, reset["done"]) == (200, False)
        status, step = await asyncio.to_thread(http, url, "/step", b'{"action":{"message":"hey"}}')
        assert status == 200
        assert step["observation"]["echoed_message"] == "hey"
        assert step["reward"] == pytest.approx(0.3)
        status, bad = await asyncio.to_thread(http, url, "/step", b'{"action":{"message":1}}')
        assert (status, bad["code"], bad["field"]) == (422, "VALIDATION_ERROR", "$.message")
        status, missing = await asyncio.to_thread(http, url, "/nowhere")
        assert status == 404
        assert "/health" in missing["detail"]
        status, plain = await asyncio.to_thread(http, url, "/ws")  # no Upgrade header
        assert (status, plain["code"]) == (426, "UPGRADE")
        assert "Upgrade: websocket" in plain["detail"]


RESET_BODIES = [
    ({}, {"seed": None, "options": None, "episode_id": None}),
    ({"seed": 3}, {"seed": 3, "options": None, "episode_id": None}),
    ({"options": {"level": 2}}, {"seed": None, "options": {"level": 2}, "episode_id": None}),
    ({"level": 2}, {"seed": None, "options": {"level": 2}, "episode_id": None}),
    (
        {"seed": 1, "level": 2, "options": {"level": 5, "mode": "x"}, "episode_id": "e1"},
        {"seed": 1, "options": {"level": 5, "mode": "x"}, "episode_id": "e1"},
    ),
]


async def test_reset_arguments_mean_the_same_over_websocket_and_post(transport: str) -> None:
    async with serve(ShowsReset, transport=transport) as server:
        for body, expected in RESET_BODIES:
            async with AsyncClient(server.url) as env:
                ws = await env.reset(**body)
            status, post = await asyncio.to_thread(
                http, server.url, "/reset", json.dumps(body).encode()
            )
            assert status == 200
            assert msgspec.to_builtins(ws.observation) == expected, body
            assert post["observation"] == expected, body
        for bad, field in (({"seed": "x"}, "$.seed"), ({"options": [1]}, "$.options")):
            status, err = await asyncio.to_thread(
                http, server.url, "/reset", json.dumps(bad).encode()
            )
            assert (status, err["code"], err["field"]) == (422, "VALIDATION_ERROR", field)
            async with AsyncClient(server.url) as env:
                with pytest.raises(stadium.ValidationError) as info:
                    await env.reset(**bad)
            assert info.value.context["field"] == "$.data" + field[1:]


async def test_client_connect_error_is_clear(transport: str) -> None:
    with pytest.raises(stadium.ConnectError) as info:
        await AsyncClient("http://127.0.0.1:9", max_retries=1).connect()
    assert "127.0.0.1:9" in info.value.message

"""Session resume: a lost connection, cut mid-step by a relay the test controls, is
resumed on a new one; the step in flight is answered once; no step is lost or run
twice; tokens rotate; a forged or stale token and a resume past the grace period
are refused with a clear error; plain (OpenEnv) clients see nothing of it."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from typing import Any

import pytest
import websockets

import stadium
from stadium._core.resume import GRACE_HEADER, SESSION_HEADER, TOKEN_HEADER
from stadium._errors import ResumeError
from tests.conftest import TRANSPORTS, UNIT, serve, wait_until
from tests.relay import relay_to

pytestmark = pytest.mark.asyncio


def _token(env: stadium.AsyncClient[Any]) -> str:
    """The session's current resume token (it rotates on every resume)."""
    assert env._protocol.book is not None, "the server did not grant a resumable session"
    return env._protocol.book.token


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_in_flight_step_is_answered_once_after_the_resume(transport: str) -> None:
    async with serve("benchmark", transport=transport) as server, relay_to(server.url) as relay:
        async with stadium.AsyncClient(relay.url) as env:
            assert env.session_id is not None
            await env.reset(seed=1)
            first = await env.step({"wait_seconds": 0.0})
            step = asyncio.create_task(env.step({"wait_seconds": 0.3 * UNIT}))
            await asyncio.sleep(0.1 * UNIT)
            assert relay.cut() == 1  # mid-step: the server is still running it
            result = await step
            assert result.observation["step_count"] == 2  # run once, on the same env
            assert result.observation["session_hash"] == first.observation["session_hash"]
            after = await env.step({"wait_seconds": 0.0})
            assert after.observation["step_count"] == 3
            assert env.resumes == 1
        assert server.runtime.outcomes["resumed"] == 1
        await wait_until(lambda: not server.runtime.sessions, 5 * UNIT, "session closed")
        assert server.runtime.admission.slots.active() == 0


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_request_lost_on_the_way_in_is_sent_again(transport: str) -> None:
    async with serve("benchmark", transport=transport) as server, relay_to(server.url) as relay:
        async with stadium.AsyncClient(relay.url) as env:
            await env.reset(seed=1)
            relay.drop_up = True  # the step never reaches the server
            step = asyncio.create_task(env.step({"wait_seconds": 0.0}))
            await asyncio.sleep(0.1 * UNIT)
            relay.drop_up = False
            relay.cut()
            result = await step
            assert result.observation["step_count"] == 1
            assert (await env.step({"wait_seconds": 0.0})).observation["step_count"] == 2
        assert server.runtime.steps_total == 2  # sent twice, run once


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_reply_lost_on_the_way_out_is_replayed(transport: str) -> None:
    async with serve("benchmark", transport=transport) as server, relay_to(server.url) as relay:
        async with stadium.AsyncClient(relay.url) as env:
            await env.reset(seed=1)
            relay.drop_down = True  # the step runs; its reply is lost
            step = asyncio.create_task(env.step({"wait_seconds": 0.0}))
            await wait_until(lambda: server.runtime.steps_total == 1, 5 * UNIT, "step ran")
            relay.drop_down = False
            relay.cut()
            result = await step
            assert result.observation["step_count"] == 1
            assert (await env.step({"wait_seconds": 0.0})).observation["step_count"] == 2
        assert server.runtime.steps_total == 2


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_pipelined_requests_survive_a_cut(transport: str) -> None:
    async with serve("benchmark", transport=transport) as server, relay_to(server.url) as relay:
        async with stadium.AsyncClient(relay.url, msgpack=True) as env:
            await env.reset(seed=1)
            steps = [asyncio.create_task(env.step({"wait_seconds": 0.05 * UNIT})) for _ in range(5)]
            await asyncio.sleep(0.08 * UNIT)
            relay.cut()
            results = await asyncio.gather(*steps)
            assert [r.observation["step_count"] for r in results] == [1, 2, 3, 4, 5]
        assert server.runtime.steps_total == 5


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("batch", [True, False], ids=["batched", "one-connection-each"])
async def test_pool_sessions_resume_transparently(transport: str, batch: bool) -> None:
    async with serve("benchmark", transport=transport) as server, relay_to(server.url) as relay:
        async with stadium.SessionPool(relay.url, size=4, batch=batch) as pool:
            assert pool.batching is batch
            await pool.reset(seeds=range(4))
            stepping = asyncio.create_task(pool.step([{"wait_seconds": 0.2 * UNIT}] * 4))
            await asyncio.sleep(0.05 * UNIT)
            assert relay.cut() == (1 if batch else 4)
            results = await stepping
            assert [r.observation["step_count"] for r in results] == [1] * 4
            assert all(c.resumes == 1 for c in pool.clients)
        assert server.runtime.outcomes["resumed"] == 4


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_resume_after_the_grace_period_fails_clearly(transport: str) -> None:
    async with (
        serve("benchmark", transport=transport, resume_grace=0.3 * UNIT) as server,
        relay_to(server.url) as relay,
    ):
        env = stadium.AsyncClient(relay.url)
        await env.connect()
        await env.reset(seed=1)
        relay.refusing = True  # the client cannot get back in time
        relay.cut()
        with pytest.raises(ResumeError, match="grace period"):
            await env.step({"wait_seconds": 0.0})
        await wait_until(lambda: not server.runtime.sessions, 5 * UNIT, "session expired")
        assert server.runtime.outcomes["expired"] == 1
        assert server.runtime.admission.slots.active() == 0  # its slot is free again
        with pytest.raises(stadium.SessionClosedError):  # the session stays failed
            await env.step({"wait_seconds": 0.0})
        await env.close()


async def _raw_resume(
    url: str, sid: str, token: str, received: int = 0
) -> tuple[dict[str, Any], Any]:
    ws_url = url.replace("http", "ws") + f"/ws?stadium_resume={sid}&stadium_received={received}"
    async with websockets.connect(ws_url, additional_headers={TOKEN_HEADER: token}) as ws:
        frame = json.loads(await ws.recv())
        try:
            await asyncio.wait_for(ws.recv(), 2 * UNIT)
        except websockets.ConnectionClosed as closed:
            return frame, closed.rcvd.code if closed.rcvd else None
        return frame, None


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_forged_and_stale_tokens_are_refused(transport: str) -> None:
    async with serve("benchmark", transport=transport) as server, relay_to(server.url) as relay:
        async with stadium.AsyncClient(relay.url) as env:
            await env.reset(seed=1)
            sid, first_token = env.session_id, _token(env)
            assert sid is not None
            frame, code = await _raw_resume(server.url, sid, "forged-" + first_token[7:])
            assert frame["type"] == "error"
            assert frame["data"]["code"] == "RESUME_FAILED"
            assert "no session with that id and token" in frame["data"]["message"]
            assert code == 1008
            relay.cut()  # the client resumes: the token rotates
            assert (await env.step({"wait_seconds": 0.0})).observation["step_count"] == 1
            assert _token(env) != first_token
            frame, code = await _raw_resume(server.url, sid, first_token)  # stolen, stale
            assert frame["data"]["code"] == "RESUME_FAILED"
            assert code == 1008
            # The client's session was not disturbed by the refused attempts.
            assert (await env.step({"wait_seconds": 0.0})).observation["step_count"] == 2
        assert server.runtime.errors_total["RESUME_FAILED"] == 2


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_resume_takes_the_session_from_a_stale_connection(transport: str) -> None:
    async with serve("benchmark", transport=transport) as server:
        async with stadium.AsyncClient(server.url) as env:
            await env.reset(seed=1)
            await env.step({"wait_seconds": 0.0})
            sid, token = env.session_id, _token(env)
            assert sid is not None
            # Another connection resumes it while the first is still attached (as after a
            # network blip the server has not noticed): it takes the session over.
            ws_url = (
                server.url.replace("http", "ws") + f"/ws?stadium_resume={sid}&stadium_received=2"
            )
            async with websockets.connect(ws_url, additional_headers={TOKEN_HEADER: token}) as ws:
                hello = json.loads(await ws.recv())
                assert hello["type"] == "resumed"
                assert hello["data"]["requests"] == 2
                assert hello["data"]["replayed"] == 0
                await ws.send(json.dumps({"type": "step", "data": {"wait_seconds": 0}, "id": 3}))
                reply = json.loads(await ws.recv())
                assert reply["id"] == 3
                assert reply["data"]["observation"]["step_count"] == 2
                await ws.send(json.dumps({"type": "close"}))
            with pytest.raises(stadium.SessionClosedError):  # the old connection was closed
                await env.step({"wait_seconds": 0.0})


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_plain_clients_are_not_resumable(transport: str) -> None:
    async with serve("benchmark", transport=transport) as server:
        ws_url = server.url.replace("http", "ws") + "/ws"
        async with websockets.connect(ws_url) as ws:
            assert SESSION_HEADER not in ws.response.headers
            await ws.send(json.dumps({"type": "reset", "data": {}}))
            await ws.recv()
            assert server.runtime.resumable == {}
        # Gone with its connection, as before: no slot held for a client that never resumes.
        await wait_until(lambda: not server.runtime.sessions, 5 * UNIT, "session released")
        env = stadium.AsyncClient(server.url, resume=False)
        await env.connect()
        assert env.session_id is None
        await env.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_resume_off_on_the_server(transport: str) -> None:
    async with serve("benchmark", transport=transport, resume_grace=0) as server:
        ws_url = server.url.replace("http", "ws") + "/ws?stadium_resume=1"
        async with websockets.connect(ws_url) as ws:
            assert GRACE_HEADER not in ws.response.headers
        async with stadium.AsyncClient(server.url) as env:
            assert env.session_id is None  # the client falls back to a plain session
            await env.reset()


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_malformed_resume_requests_get_a_400(transport: str) -> None:
    async with serve("benchmark", transport=transport) as server:
        for query, token, why in [
            ("stadium_resume=../../etc", {}, "is not a session id"),
            ("stadium_resume=1f-abc", {}, "needs its token"),
            ("stadium_resume=1f-abc&stadium_received=%C2%B2", {TOKEN_HEADER: "t"}, "ASCII digits"),
        ]:
            ws_url = server.url.replace("http", "ws") + "/ws?" + query
            with pytest.raises(websockets.InvalidStatus) as info:
                async with websockets.connect(ws_url, additional_headers=token):
                    pass
            assert info.value.response.status_code == 400
            assert why in info.value.response.body.decode()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
async def test_resume_reaches_the_worker_that_holds_the_session() -> None:
    """With several workers a resume lands on any of them; it is handed to the owner
    (``stadium serve`` only: the hand-off is picows'; an ASGI app is one process)."""
    port = _free_port()
    proc = subprocess.Popen(  # noqa: ASYNC220  (started once, not awaited)
        [sys.executable, "-m", "stadium", "serve", "benchmark", "--port", str(port),
         "--host", "127.0.0.1", "--workers", "2", "--log-level", "warning",
         "--drain-timeout", "1"],
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        async with relay_to(url) as relay:
            # One connection per session (batch=False), so that they spread over both workers.
            pool = stadium.SessionPool(relay.url, size=16, max_retries=40, batch=False)
            async with pool:
                firsts = await pool.reset(seeds=range(16))
                stepped = await pool.step([{"wait_seconds": 0.0}] * 16)
                pids = {r.observation["pid"] for r in stepped}
                for round_ in range(3):
                    stepping = asyncio.create_task(pool.step([{"wait_seconds": 0.1 * UNIT}] * 16))
                    await asyncio.sleep(0.03 * UNIT)
                    relay.cut()
                    results = await stepping
                    assert [r.observation["step_count"] for r in results] == [round_ + 2] * 16
                    # Each session stayed on its worker (its env, its pid).
                    assert [r.observation["pid"] for r in results] == [
                        s.observation["pid"] for s in stepped
                    ]
                assert all(c.resumes == 3 for c in pool.clients)
                del firsts
        assert len(pids) == 2, "the sessions should have spread over both workers"
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_fork_starts_a_session_from_this_ones_snapshot(transport: str) -> None:
    async with serve("wordguess", transport=transport) as server:
        async with stadium.AsyncClient(server.url) as parent:
            await parent.reset(seed=5)
            first = await parent.step({"word": "crane"})
            child = await parent.fork()
            try:
                assert child.session_id != parent.session_id
                # The same episode: the same secret word, the same turns so far.
                a = await child.step({"word": "plant"})
                b = await parent.step({"word": "plant"})
                assert a.observation == b.observation
                assert a.observation["guesses"] == ["crane", "plant"]
                assert first.observation["turns_left"] - 1 == a.observation["turns_left"]
                # ...and independent from then on.
                await child.step({"word": "storm"})
                assert (await parent.state())["step_count"] == 2
                assert (await child.state())["step_count"] == 3
            finally:
                await child.close()
        assert server.runtime.outcomes["forked"] == 1
        await wait_until(lambda: not server.runtime.sessions, 5 * UNIT, "both closed")
        assert server.runtime.admission.slots.active() == 0


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_fork_needs_a_slot_and_a_resumable_session(transport: str) -> None:
    async with serve("echo", transport=transport, max_sessions=1) as server:
        async with stadium.AsyncClient(server.url) as env:
            await env.reset()
            with pytest.raises(stadium.CapacityError):
                await env.fork()
            assert (await env.step({"message": "still here"})).observation is not None
    async with serve("echo", transport=transport, resume_grace=0) as server:
        async with stadium.AsyncClient(server.url) as env:
            await env.reset()
            with pytest.raises(stadium.SessionError, match="resumable"):
                await env.fork()

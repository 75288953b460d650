"""One door for sessions: every way a session comes into being keeps the per-client limits.

For each door (a WebSocket, an HTTP request that builds an env, a batch entry, a ``fork``,
an MCP ``openenv/session/create``, a WebSocket attached to an MCP session, a restore from
the durable store): with ``--max-sessions-per-client 1`` one client holds no more than
one session through it, and with ``--rate-limit 1`` the requests on a session it opened
are limited like any other. Real servers on 127.0.0.1 port 0; a second client is
127.0.0.2 (the loopback network answers every 127/8 address), and it is served
throughout. Every door is tested on both transports (picows and the ASGI app).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
from pathlib import Path
from typing import Any

import httpx
import pytest
import websockets
from websockets.typing import Subprotocol

from stadium._core.limits import ClientLimits
from stadium._core.resume import SESSION_HEADER, TOKEN_HEADER, owner_pid
from stadium._errors import CapacityError
from stadium._server.admission.doorway import Door
from stadium._server.metrics import DOORS
from stadium._server.runtime import CLOSE_TRY_AGAIN_LATER
from stadium.testing import memory_runtime
from tests.conftest import TRANSPORTS, UNIT, serve, wait_until

RATE = 1.0
"""``--rate-limit`` of the rate tests: one request a second."""
BURST = 4
"""``--rate-burst`` of the rate tests."""
SENT = 12
"""Requests sent at once on the session a door opened, in the rate tests."""
BATCH = Subprotocol("stadium.batch")
OTHER = ("127.0.0.2", 0)
"""Another client's address (its own quota and bucket)."""


def _ws(url: str, query: str = "") -> str:
    return url.replace("http://", "ws://") + "/ws" + (f"?{query}" if query else "")


def _rpc(method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "method": method, "params": params or {}, "id": 1}


async def _recv(ws: Any) -> dict[str, Any]:
    frame: dict[str, Any] = json.loads(await asyncio.wait_for(ws.recv(), 10 * UNIT))
    return frame


async def _ask(ws: Any, message: dict[str, Any]) -> dict[str, Any]:
    await ws.send(json.dumps(message))
    return await _recv(ws)


async def _refused_with_1013(ws: Any) -> dict[str, Any]:
    """The refusal frame of a session over its client's quota, then the close (1013)."""
    refusal = await _recv(ws)
    with pytest.raises(websockets.ConnectionClosed) as closed:
        await asyncio.wait_for(ws.recv(), 10 * UNIT)
    assert closed.value.rcvd is not None
    assert closed.value.rcvd.code == CLOSE_TRY_AGAIN_LATER
    return refusal


def _quota_refusal(reply: dict[str, Any]) -> None:
    assert reply["type"] == "error", reply
    assert reply["data"]["code"] == "CAPACITY_REACHED", reply
    assert "--max-sessions-per-client" in reply["data"]["message"]


async def _pipelined(ws: Any, messages: list[dict[str, Any]]) -> tuple[list[str], float]:
    """Send ``messages`` at once, read as many replies: their types (an error's code) and
    the seconds it took (tokens the bucket may have refilled meanwhile)."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    for message in messages:
        await ws.send(json.dumps(message))
    codes = []
    for _ in messages:
        reply = await _recv(ws)
        codes.append(reply["data"]["code"] if reply["type"] == "error" else reply["type"])
    return codes, loop.time() - start


def _rate_held(codes: list[str], elapsed: float) -> None:
    """At most the burst, plus what refilled while they were answered, went through."""
    served = sum(code != "RATE_LIMITED" for code in codes)
    assert "RATE_LIMITED" in codes, codes
    assert served <= BURST + math.ceil(elapsed * RATE), (codes, elapsed)
    assert set(codes) <= {"RATE_LIMITED", "state", "observation", "mcp"}, codes


def _requests(n: int = SENT) -> list[dict[str, Any]]:
    return [{"type": "state", "id": i} for i in range(n)]


def _opened(server: Any, door: Door) -> float:
    """``stadium_sessions_opened_total{door=...}`` of the server's board (its one worker)."""
    server.runtime.publish_metrics()
    return float(server.runtime.counts.opened[door])


async def _other_client_is_served(url: str) -> None:
    async with websockets.connect(_ws(url), local_addr=OTHER) as ws:
        assert (await _ask(ws, {"type": "reset"}))["type"] == "observation"


def test_the_doors_are_the_metrics_labels() -> None:
    assert [door.name.lower() for door in Door] == list(DOORS)


# -- WebSocket ------------------------------------------------------------------------------


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_websocket_door_quota(transport: str) -> None:
    async with serve("echo", transport, max_sessions_per_client=1) as server:
        async with websockets.connect(_ws(server.url)) as held:
            assert (await _ask(held, {"type": "reset"}))["type"] == "observation"
            async with websockets.connect(_ws(server.url)) as second:
                _quota_refusal(await _refused_with_1013(second))
            await _other_client_is_served(server.url)
            assert (await _ask(held, {"type": "state"}))["type"] == "state"
        assert _opened(server, Door.WEBSOCKET) == 2


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_websocket_door_rate(transport: str) -> None:
    async with serve("echo", transport, rate_limit=RATE, rate_burst=BURST) as server:
        async with websockets.connect(_ws(server.url)) as ws:
            _rate_held(*await _pipelined(ws, _requests()))
            await _other_client_is_served(server.url)


# -- HTTP: requests that build an env -----------------------------------------------------


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_http_door_quota(transport: str) -> None:
    async with serve("echo", transport, max_sessions_per_client=1) as server:
        async with websockets.connect(_ws(server.url)) as held, httpx.AsyncClient() as http:
            assert (await _ask(held, {"type": "reset"}))["type"] == "observation"
            for path in ("/reset", "/step"):
                body = {"action": {"message": "hi"}} if path == "/step" else {}
                refused = await http.post(server.url + path, json=body, timeout=10 * UNIT)
                assert refused.status_code == 429, refused.text
                assert refused.json()["code"] == "CAPACITY_REACHED"
                assert "--max-sessions-per-client" in refused.json()["detail"]
                assert int(refused.headers["Retry-After"]) >= 1
            state = await http.get(server.url + "/state", timeout=10 * UNIT)
            assert state.status_code == 429
        # The WebSocket gone, the same client's HTTP requests build their env again.
        limits = server.runtime.limits
        await wait_until(lambda: limits.sessions("127.0.0.1") == 0, 5 * UNIT, "ws closed")
        async with httpx.AsyncClient() as http:
            ok = await http.post(server.url + "/reset", json={}, timeout=10 * UNIT)
            assert ok.status_code == 200, ok.text
        assert _opened(server, Door.HTTP) == 1
        assert server.runtime.limits.sessions("127.0.0.1") == 0


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_http_door_rate(transport: str) -> None:
    async with (
        serve("echo", transport, rate_limit=RATE, rate_burst=BURST) as server,
        httpx.AsyncClient() as http,
    ):
        start = asyncio.get_running_loop().time()
        statuses = [
            (await http.post(server.url + "/reset", json={}, timeout=10 * UNIT)).status_code
            for _ in range(SENT)
        ]
        elapsed = asyncio.get_running_loop().time() - start
        assert 429 in statuses
        assert statuses.count(200) <= BURST + math.ceil(elapsed * RATE), statuses
        assert set(statuses) == {200, 429}


# -- batch entries --------------------------------------------------------------------------


def _batch(rid: int, calls: list[dict[str, Any]]) -> dict[str, Any]:
    return {"type": "batch", "id": rid, "calls": calls}


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_batch_door_quota(transport: str) -> None:
    async with serve("benchmark", transport=transport, max_sessions_per_client=1) as server:
        url = _ws(server.url)
        async with websockets.connect(url, subprotocols=[BATCH]) as ws:
            calls = [{"session": i, "type": "reset", "data": {"seed": i}} for i in range(3)]
            reply = await _ask(ws, _batch(1, calls))
            results = reply["results"]
            assert results[0]["type"] == "observation"
            for refused in results[1:]:
                _quota_refusal(refused)
            # A second batch connection of the same client: no more entries either.
            async with websockets.connect(url, subprotocols=[BATCH]) as other:
                again = await _ask(other, _batch(2, calls[1:2]))
                _quota_refusal(again["results"][0])
            step = await _ask(ws, _batch(3, [{"session": 0, "type": "step", "data": {}}]))
            assert step["results"][0]["type"] == "observation"
            await _other_client_is_served(server.url)
            assert server.runtime.limits.sessions("127.0.0.1") == 1
        assert _opened(server, Door.BATCH) == 1


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_batch_door_rate(transport: str) -> None:
    async with serve("benchmark", transport=transport, rate_limit=RATE, rate_burst=BURST) as server:
        url = _ws(server.url)
        async with websockets.connect(url, subprotocols=[BATCH]) as ws:
            loop = asyncio.get_running_loop()
            start = loop.time()
            frames = [_batch(0, [{"session": 0, "type": "reset"}])]
            frames += [_batch(i, [{"session": 0, "type": "state"}]) for i in range(1, SENT)]
            for frame in frames:
                await ws.send(json.dumps(frame))
            codes = []
            for _ in frames:
                result = (await _recv(ws))["results"][0]
                codes.append(result["data"]["code"] if result["type"] == "error" else "state")
            _rate_held(codes, loop.time() - start)
            await _other_client_is_served(server.url)


# -- fork -------------------------------------------------------------------------------------


async def _resumable(url: str) -> Any:
    """A resumable WebSocket session (its id and token in the ``101``)."""
    ws = await websockets.connect(_ws(url, "stadium_resume=1"))
    assert ws.response is not None
    assert ws.response.headers.get(SESSION_HEADER)
    return ws


async def _close(ws: Any) -> None:
    """End a resumable session (a lost connection would only detach it)."""
    await ws.send(json.dumps({"type": "close"}))
    await ws.close()


async def _resume(url: str, sid: str, token: str, **kwargs: Any) -> Any:
    return await websockets.connect(
        _ws(url, f"stadium_resume={sid}&stadium_received=0"),
        additional_headers={TOKEN_HEADER: token},
        **kwargs,
    )


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_fork_door_quota(transport: str) -> None:
    async with serve("wordguess", transport=transport, max_sessions_per_client=1) as server:
        parent = await _resumable(server.url)
        try:
            assert (await _ask(parent, {"type": "reset", "data": {"seed": 3}}))["type"] == (
                "observation"
            )
            for _ in range(3):  # never a second session of this client through fork
                _quota_refusal(await _ask(parent, {"type": "fork"}))
            assert server.runtime.admission.slots.active() == 1
            assert server.runtime.limits.sessions("127.0.0.1") == 1
            assert (await _ask(parent, {"type": "state"}))["type"] == "state"
            await _other_client_is_served(server.url)
        finally:
            await _close(parent)
        await wait_until(lambda: not server.runtime.sessions, 5 * UNIT, "closed")
        assert _opened(server, Door.FORK) == 0


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_fork_door_is_charged_to_its_client_and_rate_limited(transport: str) -> None:
    async with serve(
        "wordguess", max_sessions_per_client=2, rate_limit=RATE, rate_burst=BURST
    ) as server:
        parent = await _resumable(server.url)  # a token for the upgrade
        try:
            await _ask(parent, {"type": "reset", "data": {"seed": 3}})  # 2
            forked = await _ask(parent, {"type": "fork"})  # 3
            assert forked["type"] == "forked", forked
            assert server.runtime.limits.sessions("127.0.0.1") == 2  # the fork is its client's
            data = forked["data"]
            child = await _resume(server.url, data["session"], data["token"])  # 4
            try:
                assert (await _recv(child))["type"] == "resumed"
                _rate_held(*await _pipelined(child, _requests()))
            finally:
                await child.close()  # detached (its close would be over the rate too)
        finally:
            await parent.close()
        assert _opened(server, Door.FORK) == 1


# -- MCP create and attach ----------------------------------------------------------------


async def _create(http: httpx.AsyncClient, url: str) -> dict[str, Any]:
    reply: dict[str, Any] = (
        await http.post(url + "/mcp", json=_rpc("openenv/session/create"), timeout=10 * UNIT)
    ).json()
    return reply


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_mcp_create_door_quota(transport: str) -> None:
    async with serve("tools", transport, max_sessions_per_client=1) as server:
        async with httpx.AsyncClient() as http:
            created = await _create(http, server.url)
            sid = created["result"]["session_id"]
            for _ in range(5):  # no second session through MCP creates
                refused = await _create(http, server.url)
                assert refused["error"]["data"]["code"] == "CAPACITY_REACHED", refused
            assert server.runtime.limits.sessions("127.0.0.1") == 1
            async with websockets.connect(_ws(server.url)) as ws:  # nor through /ws
                _quota_refusal(await _refused_with_1013(ws))
            async with httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(
                local_address=OTHER[0])
            ) as other:  # fmt: skip
                assert "result" in await _create(other, server.url)
            close = _rpc("openenv/session/close", {"session_id": sid})
            assert (await http.post(server.url + "/mcp", json=close)).json()["result"]["closed"]
            assert server.runtime.limits.sessions("127.0.0.1") == 0
            assert "result" in await _create(http, server.url)  # its quota is back
        assert _opened(server, Door.MCP_CREATE) == 3


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_mcp_create_door_rate(transport: str) -> None:
    async with (
        serve("tools", transport, rate_limit=RATE, rate_burst=BURST) as server,
        httpx.AsyncClient() as http,
    ):
        start = asyncio.get_running_loop().time()
        replies = [
            await http.post(server.url + "/mcp", json=_rpc("openenv/session/create"))
            for _ in range(SENT)
        ]
        elapsed = asyncio.get_running_loop().time() - start
        created = [r for r in replies if r.status_code == 200]
        assert {r.status_code for r in replies} == {200, 429}
        assert all(r.json()["code"] == "RATE_LIMITED" for r in replies if r.status_code == 429)
        assert len(created) <= BURST + math.ceil(elapsed * RATE)


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_mcp_attach_door_quota(transport: str) -> None:
    """An attached WebSocket rides on its MCP session (one slot, one session of the quota):
    allowed, and no more sessions for the client beside it."""
    async with serve("tools", transport, max_sessions_per_client=1) as server:
        async with httpx.AsyncClient() as http:
            sid = (await _create(http, server.url))["result"]["session_id"]
            async with websockets.connect(_ws(server.url, f"session_id={sid}")) as attached:
                assert (await _ask(attached, {"type": "reset"}))["type"] == "observation"
                assert server.runtime.limits.sessions("127.0.0.1") == 1
                assert server.runtime.admission.slots.active() == 1
                async with websockets.connect(_ws(server.url)) as fresh:
                    _quota_refusal(await _refused_with_1013(fresh))
                refused = await _create(http, server.url)
                assert refused["error"]["data"]["code"] == "CAPACITY_REACHED"
                assert (await _ask(attached, {"type": "state"}))["type"] == "state"
            await wait_until(lambda: not server.runtime.attached, 5 * UNIT, "detached")
            assert server.runtime.limits.sessions("127.0.0.1") == 1  # the MCP session's
        assert _opened(server, Door.MCP_ATTACH) == 1


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_mcp_attach_door_rate(transport: str) -> None:
    async with serve("tools", transport, rate_limit=RATE, rate_burst=BURST) as server:
        async with httpx.AsyncClient() as http:
            sid = (await _create(http, server.url))["result"]["session_id"]  # a token
        async with websockets.connect(_ws(server.url, f"session_id={sid}")) as attached:
            _rate_held(*await _pipelined(attached, _requests()))
        await wait_until(lambda: not server.runtime.attached, 5 * UNIT, "detached")
        assert len(server.runtime.limits) <= 1  # the attach's record is given back


# -- restore from the durable store -------------------------------------------------------


async def _stored_session(url: str) -> tuple[str, str]:
    """A durable session on the server at ``url``, stepped once: its id and token."""
    async with websockets.connect(_ws(url, "stadium_resume=1")) as ws:
        assert ws.response is not None
        sid, token = ws.response.headers[SESSION_HEADER], ws.response.headers[TOKEN_HEADER]
        assert (await _ask(ws, {"type": "reset", "data": {"seed": 7}}))["type"] == "observation"
    return sid, token


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_restore_door_quota(tmp_path: Path, transport: str) -> None:
    store: dict[str, Any] = {"durable": True, "session_store": str(tmp_path / "store")}
    async with (
        serve("wordguess", transport=transport, **store) as first,
        serve("wordguess", transport=transport, max_sessions_per_client=1, **store) as second,
    ):
        sid, token = await _stored_session(first.url)
        async with websockets.connect(_ws(second.url)) as held:
            assert (await _ask(held, {"type": "reset"}))["type"] == "observation"
            restoring = await _resume(second.url, sid, token)
            try:
                _quota_refusal(await _refused_with_1013(restoring))
            finally:
                await restoring.close()
            assert second.runtime.limits.sessions("127.0.0.1") == 1
            assert second.runtime.admission.slots.active() == 1
            assert (await _ask(held, {"type": "state"}))["type"] == "state"
        assert _opened(second, Door.RESTORE) == 0
        # Its quota free again, the client restores the session (the record was kept).
        restored = await _resume(second.url, sid, token)
        try:
            assert (await _recv(restored))["type"] == "resumed"
            assert second.runtime.limits.sessions("127.0.0.1") == 1
        finally:
            await restored.close()
        assert _opened(second, Door.RESTORE) == 1


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_restore_door_rate(tmp_path: Path, transport: str) -> None:
    store: dict[str, Any] = {"durable": True, "session_store": str(tmp_path / "store")}
    async with (
        serve("wordguess", transport=transport, **store) as first,
        serve(
            "wordguess", transport=transport, rate_limit=RATE, rate_burst=BURST, **store
        ) as second,
    ):
        sid, token = await _stored_session(first.url)
        restored = await _resume(second.url, sid, token)  # a token for the upgrade
        try:
            assert (await _recv(restored))["type"] == "resumed"
            assert second.runtime.limits.sessions("127.0.0.1") == 1  # charged to its client
            _rate_held(*await _pipelined(restored, _requests()))
        finally:
            await restored.close()
        await _other_client_is_served(second.url)


# -- the doorway itself, in memory ----------------------------------------------------------


async def test_a_pass_is_given_back_once_and_a_refused_fork_takes_nothing() -> None:

    async with memory_runtime("echo", max_sessions=1, max_sessions_per_client=2) as rt:
        doors, limits = rt.doors, rt.limits
        assert limits is not None
        first = doors.admit_now(Door.FORK, "10.0.0.1", 0.0)
        assert limits.sessions("10.0.0.1") == 1
        with pytest.raises(CapacityError, match="at capacity"):  # no slot: no charge either
            doors.admit_now(Door.FORK, "10.0.0.1", 0.0)
        assert limits.sessions("10.0.0.1") == 1
        doors.release(first, 1.0)
        doors.leave(first, 1.0)  # again: nothing more given back
        assert limits.sessions("10.0.0.1") == 0
        assert rt.admission.slots.active() == 0
        a, b = doors.enter(Door.HTTP, "10.0.0.1", 2.0), doors.enter(Door.HTTP, "10.0.0.1", 2.0)
        with pytest.raises(CapacityError, match="--max-sessions-per-client"):
            doors.enter(Door.MCP_CREATE, "10.0.0.1", 2.0)
        attached = doors.enter(Door.MCP_ATTACH, "10.0.0.1", 2.0, counted=False)  # not charged
        assert limits.sessions("10.0.0.1") == 2
        for charged in (a, b, attached):
            doors.leave(charged, 3.0)
        assert limits.sessions("10.0.0.1") == 0
        assert len(limits) == 0


def test_an_uncounted_hold_keeps_the_bucket_of_its_client() -> None:

    limits = ClientLimits(max_sessions=1, rate=1.0, burst=2, max_idle=0)
    held = limits.open_session("a", 0.0, counted=False)
    assert held is not None
    assert held.bucket is not None
    assert held.bucket.take(0.0) == 0.0
    assert limits.take("a", 0.0) == 0.0
    assert limits.take("a", 0.0) > 0  # the same bucket, kept though no idle record is
    assert limits.open_session("a", 0.0) is not None  # the quota is untouched by the hold
    assert limits.sessions("a") == 1


async def test_ids_and_tokens_are_minted_by_the_doorway() -> None:

    async with memory_runtime("echo") as rt:
        sid, token = rt.doors.mint()
        assert owner_pid(sid) == os.getpid()
        assert len(token) >= 32
        assert rt.doors.new_token() != token
        assert owner_pid(rt.doors.new_id()) == os.getpid()
        assert rt.doors.mcp_id() != rt.doors.mcp_id()


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_every_door_counts_in_metrics_the_same_way(transport: str) -> None:
    async with serve("tools", transport) as server, httpx.AsyncClient() as http:
        async with websockets.connect(_ws(server.url)) as ws:
            assert (await _ask(ws, {"type": "reset"}))["type"] == "observation"
        assert (await http.post(server.url + "/reset", json={})).status_code == 200
        sid = (await _create(http, server.url))["result"]["session_id"]
        async with websockets.connect(_ws(server.url, f"session_id={sid}")) as attached:
            assert (await _ask(attached, {"type": "state"}))["type"] == "state"
        text = (await http.get(server.url + "/metrics")).text
        opened = {
            line.split('"')[1]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("stadium_sessions_opened_total{")
        }
        assert opened == {
            "websocket": 1.0, "batch": 0.0, "http": 1.0, "fork": 0.0,
            "mcp_create": 1.0, "mcp_attach": 1.0, "restore": 0.0,
        }  # fmt: skip
        metadata = (await http.get(server.url + "/metadata")).json()
        assert metadata["worker"]["sessions_total"] == 4

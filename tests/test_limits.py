"""Per-client limits: the token bucket and client table (pure), then sessions and HTTP."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from typing import Any

import msgspec
import pytest
import websockets

from stadium import Environment, State, StepResult
from stadium._core.limits import ClientLimits, TokenBucket, client_address
from stadium._errors import CapacityError, RateLimitError
from stadium._server.http.endpoints import HttpEndpoints
from stadium._server.runtime import CLOSE_TRY_AGAIN_LATER
from stadium._server.sessions.runner import Session
from stadium.testing import MemoryChannel, memory_runtime
from tests.conftest import TRANSPORTS, UNIT, serve

# -- the token bucket ---------------------------------------------------------------


def test_a_bucket_starts_full_and_refills_at_its_rate() -> None:
    bucket = TokenBucket(rate=2.0, burst=3, now=100.0)
    assert [bucket.take(100.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert bucket.take(100.0) == pytest.approx(0.5)  # one token every 1/rate s
    assert bucket.take(100.25) == pytest.approx(0.25)  # half a token saved up
    assert bucket.take(100.5) == 0.0
    assert bucket.take(100.5) == pytest.approx(0.5)
    assert not bucket.full(101.0)
    assert bucket.full(102.0)
    assert [bucket.take(1000.0) for _ in range(4)][-1] > 0  # never more than burst saved


def test_a_clock_going_backwards_refills_nothing() -> None:
    bucket = TokenBucket(rate=10.0, burst=1, now=50.0)
    assert bucket.take(50.0) == 0.0
    assert bucket.take(10.0) > 0
    assert bucket.take(50.0) > 0  # no refill from the backwards step
    assert bucket.take(50.1) == 0.0


# -- the client table ---------------------------------------------------------------


def test_limits_off_are_none() -> None:
    assert ClientLimits.of(0, 0.0, 100) is None
    assert ClientLimits.of(2, 0.0, 100) is not None
    assert ClientLimits.of(0, 5.0, 100) is not None


def test_the_session_quota_counts_per_address_and_returns_to_zero() -> None:
    limits = ClientLimits(max_sessions=2, rate=0.0, burst=1)
    a1 = limits.open_session("10.0.0.1", 0.0)
    a2 = limits.open_session("10.0.0.1", 0.0)
    assert a1 is not None
    assert a2 is not None
    assert limits.open_session("10.0.0.1", 0.0) is None  # over the quota: nothing counted
    assert limits.open_session("10.0.0.2", 0.0) is not None  # another client
    assert limits.sessions("10.0.0.1") == 2
    limits.close_session(a1, 1.0)
    assert limits.sessions("10.0.0.1") == 1
    again = limits.open_session("10.0.0.1", 1.0)
    assert again is not None
    limits.close_session(a2, 2.0)
    limits.close_session(again, 2.0)
    assert limits.sessions("10.0.0.1") == 0
    assert len(limits) == 1  # only 10.0.0.2 left: no bucket, nothing kept once it has none


def test_the_rate_is_per_address_and_shared_by_its_sessions_and_requests() -> None:
    limits = ClientLimits(max_sessions=0, rate=1.0, burst=2)
    client = limits.open_session("a", 0.0)
    assert client is not None
    assert client.bucket is not None
    assert client.bucket.take(0.0) == 0.0  # a session's request
    assert limits.take("a", 0.0) == 0.0  # an HTTP request of the same client
    assert limits.take("a", 0.0) == pytest.approx(1.0)
    assert limits.take("b", 0.0) == 0.0  # another client has its own bucket


def test_the_table_is_bounded_whatever_addresses_an_attacker_cycles() -> None:
    limits = ClientLimits(max_sessions=0, rate=1.0, burst=5, max_idle=100)
    for i in range(10_000):
        limits.take(f"10.{i // 65536}.{i // 256 % 256}.{i % 256}", 0.0)
    assert len(limits) == 100
    # A record whose bucket has refilled is as good as none: dropped as soon as seen.
    limits.take("fresh", 1000.0)
    assert len(limits) == 1


def test_clients_with_sessions_are_never_dropped() -> None:
    limits = ClientLimits(max_sessions=1, rate=1.0, burst=1, max_idle=2)
    held = limits.open_session("holder", 0.0)
    assert held is not None
    for i in range(50):
        limits.take(str(i), 0.0)
    assert limits.sessions("holder") == 1
    assert limits.open_session("holder", 0.0) is None
    limits.close_session(held, 0.0)
    assert limits.open_session("holder", 0.0) is not None


def test_client_address_of_peernames_and_asgi_scopes() -> None:
    assert client_address(("127.0.0.1", 5000)) == "127.0.0.1"
    assert client_address(("::1", 5000, 0, 0)) == "::1"
    assert client_address(["10.1.2.3", 80]) == "10.1.2.3"
    assert client_address(None) is None
    assert client_address("/run/stadium.sock") is None


def test_the_errors_say_what_and_when() -> None:
    limits = ClientLimits(max_sessions=3, rate=5.0, burst=10)
    rate = limits.rate_error(0.0123)
    assert isinstance(rate, RateLimitError)
    assert rate.to_wire()["code"] == "RATE_LIMITED"
    assert rate.retry_after_s == 0.013
    assert "--rate-limit" in rate.message
    quota = limits.quota_error()
    assert isinstance(quota, CapacityError)
    assert quota.to_wire()["code"] == "CAPACITY_REACHED"
    assert "already holds 3 sessions (--max-sessions-per-client)" in quota.message
    assert quota.retry_after_s == 1.0


# -- sessions, in memory ------------------------------------------------------------------


class Act(msgspec.Struct):
    value: int


class Obs(msgspec.Struct):
    value: int


class Gate(Environment[Act, Obs, State]):
    """Steps wait on ``Gate.gate``; ``Gate.broken`` makes the constructor raise."""

    blocking = False
    gate: asyncio.Event
    broken = False

    def __init__(self) -> None:
        if Gate.broken:
            raise RuntimeError("no GPU here")

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Obs:
        return Obs(0)

    async def step(self, action: Act) -> StepResult[Obs]:
        if action.value < 0:
            await Gate.gate.wait()
        return StepResult(Obs(action.value))


def _open(rt: Any, client: str | None = "10.0.0.1") -> tuple[Session, MemoryChannel]:
    channel = MemoryChannel()
    session = Session(rt, channel, client=client)
    session.start()
    return session, channel


def _reply(frame: bytes) -> dict[str, Any]:
    data: dict[str, Any] = msgspec.json.decode(frame)
    return data


async def test_a_session_over_the_client_quota_is_refused_at_once_with_1013() -> None:
    async with memory_runtime(Gate, max_sessions_per_client=2) as rt:
        _open(rt)
        _open(rt)
        _third, ch = _open(rt)
        err = _reply(await ch.next_frame(5 * UNIT))["data"]
        assert err["code"] == "CAPACITY_REACHED"
        assert "--max-sessions-per-client" in err["message"]
        assert err["retry_after_s"] == 1.0
        assert ch.closed is not None
        assert ch.closed[0] == CLOSE_TRY_AGAIN_LATER
        _other, ok = _open(rt, "10.0.0.2")  # another address is not affected
        assert ok.closed is None
        assert rt.limits is not None
        assert rt.limits.sessions("10.0.0.1") == 2
        assert rt.admission.slots.active() == 3


async def test_the_client_count_returns_to_zero_however_sessions_end() -> None:
    Gate.gate = asyncio.Event()
    async with memory_runtime(
        Gate, max_sessions=1, admission_timeout=0.2 * UNIT, max_sessions_per_client=8
    ) as rt:
        limits = rt.limits
        assert limits is not None
        closed, ch = _open(rt)  # 1. the client sends close
        await ch.request(closed, b'{"type":"reset"}')
        closed.feed(b'{"type":"close"}')
        lost, ch = _open(rt)  # 2. the connection drops with a call in flight
        await ch.request(lost, b'{"type":"reset"}')
        lost.feed(b'{"type":"step","data":{"value":-1}}')
        queued, _ = _open(rt)  # 3. it leaves while queued for a slot
        timed_out, late = _open(rt)  # 4. its admission times out
        assert limits.sessions("10.0.0.1") == 3
        queued.connection_lost()
        assert (await late.next_frame(5 * UNIT)).find(b"CAPACITY_REACHED") > 0
        assert timed_out.phase.name == "CLOSED"
        lost.connection_lost()
        server_closed, _ = _open(rt)  # 5. the server closes it (e.g. idle)
        assert limits.sessions("10.0.0.1") == 1
        server_closed.close()
        Gate.broken = True  # 6. its environment cannot be built
        try:
            _broken, ch = _open(rt)
            await ch.next_frame(5 * UNIT)
        finally:
            Gate.broken = False
        draining, _ = _open(rt)  # 7. server drains while it holds a slot
        rt.draining = True
        draining.close()
        _refused, _ = _open(rt)  # 8. refused: server shutting down
        assert limits.sessions("10.0.0.1") == 0
        assert len(limits) == 0
        assert rt.admission.slots.active() == 0


async def test_a_request_over_the_rate_is_refused_with_its_id_and_the_session_lives() -> None:
    async with memory_runtime(Gate, rate_limit=20.0, rate_burst=3) as rt:
        session, ch = _open(rt)
        replies = [_reply(await ch.request(session, b'{"type":"reset","id":1}'))]
        for rid in range(2, 6):
            replies.append(_reply(await ch.request(session, f'{{"type":"state","id":{rid}}}')))
        assert [r["type"] for r in replies] == ["observation", "state", "state", "error", "error"]
        refused = replies[3]
        assert refused["id"] == 4
        assert refused["data"]["code"] == "RATE_LIMITED"
        assert 0 < refused["data"]["retry_after_s"] <= 0.05
        assert rt.errors_total["RATE_LIMITED"] == 2
        await asyncio.sleep(refused["data"]["retry_after_s"] * 2)
        assert _reply(await ch.request(session, b'{"type":"state","id":6}'))["type"] == "state"
        assert ch.closed is None


async def test_a_client_over_the_rate_can_still_close_its_session() -> None:
    async with memory_runtime(Gate, rate_limit=0.001, rate_burst=1) as rt:
        session, ch = _open(rt)
        await ch.request(session, b'{"type":"reset","id":1}')  # the only token
        refused = _reply(await ch.request(session, b'{"type":"state","id":2}'))
        assert refused["data"]["code"] == "RATE_LIMITED"
        session.feed(b'{"type":"close","id":3}')
        await asyncio.sleep(0.05 * UNIT)
        assert session.phase.name == "CLOSED"
        assert rt.limits is not None
        assert rt.limits.sessions("10.0.0.1") == 0  # its slot given back at once
        assert rt.errors_total["RATE_LIMITED"] == 1


async def test_refusals_keep_the_order_of_pipelined_replies() -> None:
    Gate.gate = asyncio.Event()
    async with memory_runtime(Gate, rate_limit=0.001, rate_burst=2) as rt:
        session, ch = _open(rt)
        await ch.request(session, b'{"type":"reset","id":1}')
        session.feed(b'{"type":"step","data":{"value":-1},"id":2}')  # waits on the gate
        session.feed(b'{"type":"state","id":3}')  # queued behind it, then over the rate
        Gate.gate.set()
        first, second = _reply(await ch.next_frame(5 * UNIT)), _reply(await ch.next_frame())
        assert (first["id"], first["type"]) == (2, "observation")
        assert (second["id"], second["data"]["code"]) == (3, "RATE_LIMITED")


async def test_http_requests_that_build_an_env_count_against_the_client_quota() -> None:
    Gate.gate = asyncio.Event()
    async with memory_runtime(Gate, max_sessions_per_client=1) as rt:
        endpoints = HttpEndpoints(rt)
        step = b'{"action": {"value": -1}}'
        held = asyncio.ensure_future(endpoints.handle("POST", "/step", step, "10.0.0.9"))
        await asyncio.sleep(0.05 * UNIT)
        refused = await endpoints.handle("POST", "/reset", b"{}", "10.0.0.9")
        assert refused.status == 429
        assert json.loads(refused.body)["code"] == "CAPACITY_REACHED"
        assert ("Retry-After", "1") in refused.headers
        assert (await endpoints.handle("POST", "/reset", b"{}", "10.0.0.8")).status == 200
        assert (await endpoints.handle("GET", "/health", b"", "10.0.0.9")).status == 200
        Gate.gate.set()
        assert (await held).status == 200
        assert rt.limits is not None
        assert len(rt.limits) == 0


# -- over the wire, both transports --------------------------------------------------------


def _http(url: str, path: str, body: bytes | None = None) -> tuple[int, Any, Any]:
    req = urllib.request.Request(url + path, data=body, method="POST" if body else "GET")
    try:
        with urllib.request.urlopen(req, timeout=10 * UNIT) as resp:
            return resp.status, resp.headers, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers, json.loads(exc.read())


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_the_quota_and_the_rate_over_websockets_and_http(transport: str) -> None:
    async with serve(
        "echo", transport=transport, max_sessions_per_client=1, rate_limit=0.01, rate_burst=6
    ) as server:
        url = server.url.replace("http", "ws") + "/ws"
        async with websockets.connect(url) as ws:  # token 1 (the upgrade, under picows)
            async with websockets.connect(url) as second:  # token 2
                refusal = json.loads(await second.recv())
                assert refusal["data"]["code"] == "CAPACITY_REACHED"
                with pytest.raises(websockets.ConnectionClosed) as closed:
                    await second.recv()
                assert closed.value.rcvd is not None
                assert closed.value.rcvd.code == 1013
            replies = []
            for rid in range(5):
                await ws.send(json.dumps({"type": "reset", "id": rid}))
                replies.append(json.loads(await ws.recv()))
            codes = [r["data"].get("code") for r in replies]
            assert "RATE_LIMITED" in codes, codes
            assert replies[-1]["id"] == 4
            assert codes[-1] == "RATE_LIMITED"
            status, headers, body = await asyncio.to_thread(_http, server.url, "/health")
            assert status == 429, body
            assert body["code"] == "RATE_LIMITED"
            assert int(headers["Retry-After"]) >= 1
        await asyncio.sleep(0.05 * UNIT)
        limits = server.runtime.limits
        assert limits.sessions("127.0.0.1") == 0


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_an_upgrade_over_the_rate_is_refused_with_429(transport: str) -> None:
    async with serve("echo", transport=transport, rate_limit=0.01, rate_burst=1) as server:
        url = server.url.replace("http", "ws") + "/ws"
        async with websockets.connect(url):
            with pytest.raises(websockets.InvalidStatus) as refused:
                async with websockets.connect(url):
                    pass
        response = refused.value.response
        assert response.status_code == 429
        assert int(response.headers["Retry-After"]) >= 1
        assert b"RATE_LIMITED" in response.body

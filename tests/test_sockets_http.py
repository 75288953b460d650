"""Socket timeouts (picows transport) and HTTP requests counted against ``--max-sessions``.

Slow or silent clients (a half request line, headers or a body sent byte by byte,
an idle keep-alive connection) are closed after ``header_timeout``,
``body_timeout`` or ``keepalive_timeout``, with ``408`` where a request had begun;
healthy clients are served meanwhile. ``POST /reset``, ``POST /step`` and ``GET
/state`` each hold a session slot while their env lives, shared with WebSocket
sessions (both transports).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from stadium import AsyncClient, Environment, State, StepResult
from tests.conftest import TRANSPORTS, UNIT, serve, wait_until


class Act(msgspec.Struct):
    value: int = 0


class Obs(msgspec.Struct):
    value: int


class Gated(Environment[Act, Obs, State]):
    """Async env that counts its live instances and running steps; step 0 waits on ``gate``."""

    alive = 0
    peak_alive = 0
    running = 0
    peak_running = 0
    gate = asyncio.Event()

    def __init__(self) -> None:
        cls = Gated
        cls.alive += 1
        cls.peak_alive = max(cls.peak_alive, cls.alive)

    async def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Obs:
        return Obs(0)

    async def step(self, action: Act) -> StepResult[Obs]:  # type: ignore[override]
        cls = Gated
        cls.running += 1
        cls.peak_running = max(cls.peak_running, cls.running)
        try:
            if action.value:
                await asyncio.sleep(action.value * 0.01 * UNIT)
            else:
                await cls.gate.wait()
        finally:
            cls.running -= 1
        return StepResult(Obs(action.value), reward=1.0)

    async def close(self) -> None:
        Gated.alive -= 1


@pytest.fixture(autouse=True)
def _fresh_counters() -> None:
    Gated.alive = Gated.peak_alive = Gated.running = Gated.peak_running = 0
    Gated.gate = asyncio.Event()


class Blocking(Environment[Act, Obs, State]):
    """A blocking sync env that records the threads its constructor and ``state`` ran on."""

    threads: list[threading.Thread] = []

    def __init__(self) -> None:
        Blocking.threads.append(threading.current_thread())

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Obs:
        return Obs(0)

    def step(self, action: Act) -> StepResult[Obs]:
        return StepResult(Obs(action.value))

    @property
    def state(self) -> State:
        Blocking.threads.append(threading.current_thread())
        return State(episode_id="e", step_count=7)


# -- raw sockets ----------------------------------------------------------------------


@contextlib.asynccontextmanager
async def _raw(port: int) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        yield reader, writer
    finally:
        writer.close()


async def _read_to_eof(reader: asyncio.StreamReader, limit_s: float) -> bytes:
    """Everything the server sends until it closes; fails the test if it does not close."""
    data = b""
    try:
        while chunk := await asyncio.wait_for(reader.read(65536), limit_s):
            data += chunk
    except TimeoutError:
        pytest.fail(f"the server did not close the connection within {limit_s:g}s: {data!r}")
    except ConnectionResetError:
        pass
    return data


async def _trickle(writer: asyncio.StreamWriter, data: bytes, every_s: float) -> None:
    """Send ``data`` one byte at a time (until the server hangs up)."""
    with contextlib.suppress(ConnectionError):
        for i in range(len(data)):
            writer.write(data[i : i + 1])
            await writer.drain()
            await asyncio.sleep(every_s)
            if writer.is_closing():
                return


async def _healthy(url: str) -> None:
    """A well-behaved client: a WebSocket session and plain HTTP, all answered."""
    async with AsyncClient(url) as env:
        await env.reset()
        await env.step({"message": "hi"})
    async with httpx.AsyncClient(base_url=url, timeout=5 * UNIT) as http:
        assert (await http.get("/health")).status_code == 200
        assert (await http.post("/reset", content=b"{}")).status_code == 200


async def test_a_half_request_line_is_closed_after_the_header_timeout() -> None:
    """Part of a request line and then silence: 408 and close; a silent socket: close."""
    async with serve("echo", header_timeout=0.5 * UNIT) as server:
        async with _raw(server.port) as (half, writer), _raw(server.port) as (mute, _):
            writer.write(b"GET /hea")
            await _healthy(server.url)  # served while the slow ones wait
            data = await _read_to_eof(half, 5 * UNIT)
            assert data.startswith(b"HTTP/1.1 408"), data
            assert b"REQUEST_TIMEOUT" in data
            assert await _read_to_eof(mute, 5 * UNIT) == b""  # nothing sent: nothing answered
        assert server.transport.timeouts["headers"] == 2


@pytest.mark.parametrize(
    "request_line",
    [b"POST /reset HTTP/1.1\r\n", b"GET /ws HTTP/1.1\r\n"],
    ids=["h11", "picows-upgrade"],
)
async def test_headers_sent_byte_by_byte_are_cut_off(request_line: bytes) -> None:
    """A request line in time, then headers trickling in forever: closed at the deadline.

    The POST path answers 408 (h11); the WebSocket upgrade is cut by picows' own
    handshake timeout, given what is left of ``header_timeout``.
    """
    async with serve("echo", header_timeout=0.5 * UNIT) as server:
        async with _raw(server.port) as (reader, writer):
            writer.write(request_line)
            endless = b"Host: 127.0.0.1\r\n" + b"X-Slow: " + b"a" * 10_000
            trickle = asyncio.ensure_future(_trickle(writer, endless, 0.02 * UNIT))
            try:
                await _healthy(server.url)
                data = await _read_to_eof(reader, 5 * UNIT)
            finally:
                trickle.cancel()
        if request_line.startswith(b"POST"):
            assert data.startswith(b"HTTP/1.1 408"), data
            assert server.transport.timeouts["headers"] == 1
        else:
            assert data == b"", data  # picows closes without a reply
        assert server.runtime.sessions == set()


async def test_a_body_that_stops_short_gets_408_after_the_body_timeout() -> None:
    async with serve("echo", header_timeout=5 * UNIT, body_timeout=0.5 * UNIT) as server:
        async with _raw(server.port) as (reader, writer):
            writer.write(
                b"POST /step HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n\r\n" + b"x" * 10
            )
            await _healthy(server.url)
            data = await _read_to_eof(reader, 5 * UNIT)
        assert data.startswith(b"HTTP/1.1 408"), data
        assert b"body" in data
        assert b"REQUEST_TIMEOUT" in data
        assert server.transport.timeouts == {"body": 1}
        assert server.runtime.admission.slots.active() == 0


async def test_an_idle_keepalive_connection_is_closed_and_a_busy_one_kept() -> None:
    """Idle between requests past ``keepalive_timeout``: closed (no reply). Requests
    sent in time on the same connection are all served, and a slow answer is not a
    timeout (no socket timer runs while the server works)."""
    async with serve(
        Gated,
        header_timeout=0.3 * UNIT,
        body_timeout=0.3 * UNIT,
        keepalive_timeout=0.3 * UNIT,
    ) as server:
        async with _raw(server.port) as (reader, writer):
            for value in (1, 60, 2):  # 60: the step takes 0.6 s, past every socket timeout
                body = b'{"action":{"value":%d}}' % value
                writer.write(
                    b"POST /step HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: %d\r\n\r\n%s"
                    % (len(body), body)
                )
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5 * UNIT)
                assert head.startswith(b"HTTP/1.1 200"), head
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                await reader.readexactly(length)
                await asyncio.sleep(0.1 * UNIT)  # idle, but within keepalive_timeout
            assert await _read_to_eof(reader, 5 * UNIT) == b""
        assert server.transport.timeouts == {"keep-alive": 1}


# -- HTTP requests hold session slots (both transports) ----------------------------------


async def _post_step(http: httpx.AsyncClient, value: int = 0) -> httpx.Response:
    return await http.post("/step", json={"action": {"value": value}})


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_concurrent_http_steps_never_exceed_max_sessions(transport: str) -> None:
    """6 concurrent POST /step, 2 slots, a short admission timeout: 2 run, 4 get 503."""
    async with (
        serve(Gated, transport=transport, max_sessions=2, admission_timeout=0.1 * UNIT) as server,
        httpx.AsyncClient(base_url=server.url, timeout=10 * UNIT) as http,
    ):
        steps = [asyncio.ensure_future(_post_step(http)) for _ in range(6)]
        await wait_until(lambda: sum(s.done() for s in steps) == 4, 5 * UNIT, "4 refusals")
        assert Gated.running == 2
        meta = (await http.get("/metadata")).json()
        assert meta["capacity"]["active_sessions"] == 2
        refused = [s for s in steps if s.done()]
        for resp in (s.result() for s in refused):
            assert resp.status_code == 503
            assert int(resp.headers["retry-after"]) >= 1
            body = resp.json()
            assert body["code"] == "CAPACITY_REACHED"
            assert body["retry_after_s"] > 0
            assert (body["active_sessions"], body["max_sessions"]) == (2, 2)
        Gated.gate.set()
        served = [await s for s in steps if s not in refused]
        assert [r.status_code for r in served] == [200, 200]
        assert (Gated.peak_running, Gated.peak_alive) == (2, 2)
        assert Gated.alive == 0  # every request's env was closed
        assert server.runtime.admission.slots.active() == 0
        assert server.runtime.errors_total["CAPACITY_REACHED"] == 4


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_http_steps_wait_their_turn_for_a_slot(transport: str) -> None:
    async with (
        serve(Gated, transport=transport, max_sessions=2, admission_timeout=10 * UNIT) as server,
        httpx.AsyncClient(base_url=server.url, timeout=20 * UNIT) as http,
    ):
        replies = await asyncio.gather(*(_post_step(http, value=5) for _ in range(6)))
        assert [r.status_code for r in replies] == [200] * 6
        assert Gated.peak_alive == 2
        assert Gated.peak_running == 2
        assert server.runtime.admission.slots.active() == 0


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_websocket_sessions_and_http_requests_share_the_limit(transport: str) -> None:
    async with (
        serve(Gated, transport=transport, max_sessions=2, admission_timeout=0.1 * UNIT) as server,
        httpx.AsyncClient(base_url=server.url, timeout=10 * UNIT) as http,
        AsyncClient(server.url) as session,
    ):
        await session.reset()  # one slot held by a WebSocket session
        steps = [asyncio.ensure_future(_post_step(http)) for _ in range(3)]
        await wait_until(lambda: sum(s.done() for s in steps) == 2, 5 * UNIT, "2 refusals")
        assert all(s.result().status_code == 503 for s in steps if s.done())
        assert (await http.get("/metadata")).json()["capacity"]["active_sessions"] == 2
        state = await http.get("/state")  # builds an env too: no slot left
        assert state.status_code == 503
        assert state.json()["code"] == "CAPACITY_REACHED"
        (waiting,) = (s for s in steps if not s.done())
        Gated.gate.set()
        assert (await waiting).status_code == 200
        assert Gated.peak_alive == 2
        await session.close()
        await wait_until(lambda: server.runtime.admission.slots.active() == 0, 5 * UNIT)
        assert (await http.get("/state")).status_code == 200


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_get_state_builds_a_blocking_env_off_the_event_loop(transport: str) -> None:
    Blocking.threads = []
    async with (
        serve(Blocking, transport=transport) as server,
        httpx.AsyncClient(base_url=server.url, timeout=10 * UNIT) as http,
    ):
        resp = await http.get("/state")
        assert resp.status_code == 200
        assert resp.json()["step_count"] == 7
    loop_thread = threading.current_thread()
    assert len(Blocking.threads) == 2  # the constructor and the state property
    assert loop_thread not in Blocking.threads


async def test_a_client_that_leaves_while_queued_gives_up_its_place() -> None:
    """A POST waiting for a slot whose client hangs up takes no slot afterwards."""
    async with (
        serve(Gated, max_sessions=1, admission_timeout=10 * UNIT) as server,
        AsyncClient(server.url) as session,
    ):
        await session.reset()
        async with _raw(server.port) as (_, writer):
            body = b'{"action":{"value":1}}'
            writer.write(
                b"POST /step HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: %d\r\n\r\n%s"
                % (len(body), body)
            )
            await wait_until(lambda: server.runtime.admission.waiting == 1, 5 * UNIT, "queued")
        await wait_until(lambda: server.runtime.admission.waiting == 0, 5 * UNIT, "forgotten")
        await session.close()
        await wait_until(lambda: server.runtime.admission.slots.active() == 0, 5 * UNIT)
        assert Gated.peak_alive == 1


_GATE_ENV = '''
import asyncio, os, uuid

import msgspec

import stadium


class Act(msgspec.Struct):
    value: int = 0


class Obs(msgspec.Struct):
    running: int


class Gate(stadium.Environment[Act, Obs, stadium.State]):
    """Steps wait until ROOT/open exists; each counts the steps running, in any worker."""

    def __init__(self, root: str) -> None:
        self.root = root

    async def reset(self, *, seed=None, options=None) -> Obs:
        return Obs(0)

    async def step(self, action: Act) -> Obs:
        running = os.path.join(self.root, "running")
        mine = os.path.join(running, uuid.uuid4().hex)
        open(mine, "w").close()
        try:
            seen = len(os.listdir(running))
            while not os.path.exists(os.path.join(self.root, "open")):
                await asyncio.sleep(0.01)
        finally:
            os.remove(mine)
        return Obs(seen)
'''


@pytest.mark.slow
async def test_the_limit_holds_across_workers_for_sessions_and_http(tmp_path: Path) -> None:
    """Two workers, two slots: a WebSocket session holds one, so of 5 concurrent POST
    /step (on either worker) one runs and 4 get 503; no step ever saw another running."""
    from tests.test_supervisor import _serve

    (tmp_path / "running").mkdir()
    target = tmp_path / "gate_env.py"
    target.write_text(_GATE_ENV)
    with _serve(
        f"{target}:Gate", "--workers", "2", "--max-sessions", "2",
        "--admission-timeout", str(0.3 * UNIT), "--env-kwargs", json.dumps({"root": str(tmp_path)}),
    ) as srv:  # fmt: skip
        async with (
            AsyncClient(srv.url) as session,
            httpx.AsyncClient(base_url=srv.url, timeout=10 * UNIT) as http,
        ):
            await session.reset()
            steps = [asyncio.ensure_future(_post_step(http)) for _ in range(5)]
            await wait_until(lambda: sum(s.done() for s in steps) == 4, 10 * UNIT, "4 refusals")
            assert {s.result().status_code for s in steps if s.done()} == {503}
            (waiting,) = (s for s in steps if not s.done())
            (tmp_path / "open").touch()
            served = await waiting
            assert served.status_code == 200
            assert served.json()["observation"]["running"] == 1


async def test_a_client_still_sending_reads_its_413_whole() -> None:
    """A body over the bound, still being sent when the server refuses it: the 413 reaches
    the client, then a clean end. The server used to close the socket at once with the
    client's input unread: the kernel answered with a reset, which can discard the reply
    before the client reads it (test_headers_sent_byte_by_byte_are_cut_off lost its 408 so)."""
    async with serve("echo", max_message_bytes=64 * 1024) as server:
        async with _raw(server.port) as (reader, writer):
            size = 4 << 20
            writer.write(
                b"POST /step HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: %d\r\n\r\n" % size
            )
            sending = asyncio.ensure_future(_send_all(writer, b"x" * size))
            data = b""
            try:  # to a clean end: a reset (ConnectionResetError) fails the test
                while chunk := await asyncio.wait_for(reader.read(65536), 10 * UNIT):
                    data += chunk
            finally:
                sending.cancel()
        assert data.startswith(b"HTTP/1.1 413"), data[:200]


async def _send_all(writer: asyncio.StreamWriter, data: bytes) -> None:
    with contextlib.suppress(ConnectionError):
        for i in range(0, len(data), 16384):
            writer.write(data[i : i + 16384])
            await writer.drain()

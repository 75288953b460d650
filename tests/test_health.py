"""The one ``/health`` probe (stadium._util.health): the exchange with literal bytes,
then the blocking and the asyncio shells against real servers on 127.0.0.1 port 0
(a Stadium server, and raw ones that answer 503, garbage, too much or nothing)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from stadium._util.health import (
    MAX_HEALTH_BYTES,
    Health,
    HealthExchange,
    HealthTarget,
    healthy,
    probe,
    probe_async,
)
from tests.conftest import UNIT, serve


def _exchange(url: str = "http://127.0.0.1:8000", name: str | None = None) -> HealthExchange:
    return HealthExchange(HealthTarget.of(url, name))


def test_the_request_is_one_get_of_health_that_closes() -> None:
    assert _exchange().request == (
        b"GET /health HTTP/1.1\r\nHost: 127.0.0.1:8000\r\nConnection: close\r\n\r\n"
    )
    # A node's address standing for a DNS name: the name is the Host.
    assert (
        b"Host: node.example:8000\r\n" in _exchange("http://10.0.0.7:8000", "node.example").request
    )


@pytest.mark.parametrize(
    ("url", "target"),
    [
        ("http://h:1", HealthTarget("h", 1, False, "h:1", "/health")),
        ("ws://h:1/ws", HealthTarget("h", 1, False, "h:1", "/health")),
        ("wss://h/prefix/ws?stadium_node=a", HealthTarget("h", 443, True, "h", "/prefix/health")),
        ("https://[::1]:9/", HealthTarget("::1", 9, True, "[::1]:9", "/health")),
    ],
)
def test_the_target_of_a_base_or_session_url(url: str, target: HealthTarget) -> None:
    assert HealthTarget.of(url) == target


@pytest.mark.parametrize("url", ["127.0.0.1:8000", "ftp://h:1", "http://"])
def test_a_url_that_names_no_server_is_refused(url: str) -> None:
    with pytest.raises(ValueError, match="not a server URL"):
        HealthTarget.of(url)


def test_an_answer_in_pieces_is_parsed_once_complete() -> None:
    body = b'{"status":"healthy","active_sessions":3,"max_sessions":10}'
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body
    exchange = _exchange()
    cuts = [0, 5, 20, len(answer) - 3, len(answer)]
    results = [exchange.feed(answer[a:b]) for a, b in itertools.pairwise(cuts)]
    assert results[:-1] == [None, None, None]
    health = results[-1]
    assert health == Health(200, json.loads(body))
    assert (health.ok, health.draining, health.data["max_sessions"]) == (True, False, 10)


def test_a_chunked_503_without_json_is_draining_with_no_body() -> None:
    answer = b"HTTP/1.1 503 Unavailable\r\nTransfer-Encoding: chunked\r\n\r\n4\r\nbusy\r\n0\r\n\r\n"
    health = _exchange().feed(answer)
    assert health is not None
    assert (health.status, health.body, health.data) == (503, None, {})
    assert (health.ok, health.draining) == (False, True)


def test_an_answer_ended_by_the_close_is_complete() -> None:
    exchange = _exchange()
    assert exchange.feed(b'HTTP/1.0 200 OK\r\n\r\n{"status": "healthy"}') is None
    assert exchange.feed(b"") == Health(200, {"status": "healthy"})


def test_a_close_before_any_answer_or_garbage_is_a_failed_probe() -> None:
    with pytest.raises(ConnectionResetError):
        _exchange().feed(b"")
    with pytest.raises(ConnectionResetError, match="no HTTP answer"):
        _exchange().feed(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")
    exchange = _exchange()
    exchange.feed(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")
    with pytest.raises(ValueError, match="broken /health answer"):
        exchange.feed(b"")  # cut short


def test_an_answer_over_the_limit_is_refused() -> None:
    exchange = _exchange()
    size = MAX_HEALTH_BYTES + 1
    with pytest.raises(ValueError, match="health answer over"):
        exchange.feed(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size + b" " * size)


async def test_both_shells_probe_a_stadium_server_and_see_it_go() -> None:
    async with serve("benchmark", max_sessions=7) as server:
        url = server.url
        for health in (
            await probe_async(url),
            await probe_async(url.replace("http", "ws") + "/ws"),  # a session URL
            await asyncio.to_thread(probe, url, 5 * UNIT),
        ):
            assert (health.status, health.data["max_sessions"]) == (200, 7), health
        assert await asyncio.to_thread(healthy, url, 5 * UNIT)
    assert not await asyncio.to_thread(healthy, url, 5 * UNIT)  # stopped: nobody listens
    with pytest.raises(ConnectionRefusedError):
        await asyncio.to_thread(probe, url, 5 * UNIT)
    with pytest.raises(ConnectionRefusedError):
        await probe_async(url)


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@contextlib.asynccontextmanager
async def _raw(answer: bytes | None) -> AsyncIterator[str]:
    """A server that reads the request and sends ``answer`` then closes (None: never
    answers, holds the connection)."""
    hold = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        if answer is None:
            await hold.wait()
        else:
            writer.write(answer)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        hold.set()
        server.close()
        await server.wait_closed()


async def _both(url: str, limit_s: float) -> list[Any]:
    """What each shell makes of ``url``: a Health or the exception's type."""
    out: list[Any] = []
    for call in (
        lambda: asyncio.to_thread(probe, url, limit_s),
        lambda: asyncio.wait_for(probe_async(url), limit_s),
    ):
        try:
            out.append(await call())
        except Exception as exc:
            out.append(type(exc))
    return out


async def test_draining_garbage_silence_are_told_apart_by_both_shells() -> None:
    draining = (
        b'HTTP/1.1 503 Service Unavailable\r\nContent-Length: 21\r\n\r\n{"status":"draining"}'
    )
    async with _raw(draining) as url:
        assert await _both(url, 5 * UNIT) == [Health(503, {"status": "draining"})] * 2
        assert not await asyncio.to_thread(healthy, url, 5 * UNIT)
    async with _raw(b"not http at all\r\n\r\n") as url:
        assert await _both(url, 5 * UNIT) == [ConnectionResetError] * 2
    async with _raw(None) as url:
        assert await _both(url, 0.2 * UNIT) == [TimeoutError] * 2

"""Behaviour specific to the picows transport (``stadium serve``)."""

from __future__ import annotations

import asyncio

from picows import WSListener, ws_connect

from tests.conftest import UNIT, serve


async def test_half_open_peer_is_dropped_by_keepalive() -> None:
    """A peer that stops answering pings is disconnected and its slot freed."""
    async with serve("echo", ping_interval=0.1 * UNIT, ping_timeout=0.1 * UNIT) as server:
        transport, _ = await ws_connect(
            WSListener, server.url.replace("http", "ws") + "/ws", enable_auto_pong=False
        )
        await asyncio.sleep(0.05 * UNIT)
        assert len(server.runtime.sessions) == 1
        await asyncio.wait_for(transport.wait_disconnected(), 5 * UNIT)
        assert server.runtime.sessions == set()
        assert server.runtime.admission.slots.active() == 0


async def test_a_post_then_get_on_one_keepalive_connection() -> None:
    """Plain HTTP that does not start with GET goes to the h11 path, with keep-alive."""
    async with serve("echo") as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"POST /reset HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        await writer.drain()
        data = b""
        while data.count(b"HTTP/1.1 200") < 2:
            chunk = await asyncio.wait_for(reader.read(65536), 5 * UNIT)
            assert chunk, data
            data += chunk
        assert b'"echoed_message":"Echo environment ready!"' in data
        assert data.endswith(b'{"status":"healthy"}')
        writer.close()

"""The client against servers that answer and hang up in the same breath."""

from __future__ import annotations

import asyncio
import json

import pytest

from stadium import AsyncClient, CapacityError, ConnectError
from tests.wsfake import read_upgrade


def _frame(opcode: int, payload: bytes) -> bytes:
    assert len(payload) < 126
    return bytes([0x80 | opcode, len(payload)]) + payload


async def _one_shot_server(reply: bytes | None) -> tuple[asyncio.Server, str]:
    """Accepts the upgrade, then writes ``reply`` and closes, all in one write
    (``None``: hangs up before answering)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        _, accept = await read_upgrade(reader)
        if reply is not None:
            writer.write(
                b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
                b"Connection: Upgrade\r\nSec-WebSocket-Accept: " + accept + b"\r\n\r\n" + reply
            )
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"ws://127.0.0.1:{port}/ws"


async def test_a_refusal_sent_with_the_handshake_is_read_not_taken_for_a_failed_connect() -> None:
    data = {"code": "CAPACITY_REACHED", "message": "full", "retry_after_s": 1.0}
    refusal = json.dumps({"type": "error", "data": data}).encode()
    close = _frame(0x8, (1013).to_bytes(2, "big") + b"full")
    server, url = await _one_shot_server(_frame(0x1, refusal) + close)
    async with server:
        with pytest.raises(CapacityError):
            await AsyncClient(url, max_retries=0).reset()


async def test_a_hang_up_in_the_handshake_is_a_connect_error() -> None:
    server, url = await _one_shot_server(None)
    async with server:
        with pytest.raises(ConnectError):
            await AsyncClient(url, max_retries=0, connect_timeout=2.0).reset()

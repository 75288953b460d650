"""For fake WebSocket servers in tests: the upgrade read off a stream and its accept key."""

from __future__ import annotations

import asyncio
import base64
import hashlib

#: RFC 6455's GUID, appended to the client's key to make ``Sec-WebSocket-Accept``.
GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"


async def read_upgrade(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """The client's upgrade request head, and the ``Sec-WebSocket-Accept`` value it asks."""
    head = await reader.readuntil(b"\r\n\r\n")
    key = next(
        line.split(b":", 1)[1].strip()
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"sec-websocket-key:")
    )
    return head, base64.b64encode(hashlib.sha1(key + GUID).digest())

"""Behaviour specific to the ASGI transport."""

from __future__ import annotations

from stadium._asgi import _AsgiChannel
from stadium._session import MAX_UNSENT_BYTES


async def test_a_client_that_does_not_read_is_closed_past_the_unsent_bound() -> None:
    channel = _AsgiChannel(binary=True)
    chunk = b"x" * (1 << 20)
    for _ in range(MAX_UNSENT_BYTES // len(chunk)):
        channel.send(chunk)
    assert not channel.closed
    channel.send(chunk)  # one more than the bound: closed, queued frames dropped
    assert channel.closed
    sent: list[dict[str, object]] = []

    async def send(message: dict[str, object]) -> None:
        sent.append(message)

    await channel.writer(send)
    assert sent == [
        {
            "type": "websocket.close",
            "code": 1008,
            "reason": f"client is not reading its replies (> {MAX_UNSENT_BYTES} bytes)",
        }
    ]

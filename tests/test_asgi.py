"""Behaviour specific to the ASGI transport."""

from __future__ import annotations

from stadium._server.runtime import MAX_UNSENT_BYTES
from stadium._server.transports.asgi import _AsgiChannel


async def _written(channel: _AsgiChannel) -> list[dict[str, object]]:
    sent: list[dict[str, object]] = []

    async def send(message: dict[str, object]) -> None:
        sent.append(message)

    await channel.writer(send)
    return sent


async def test_a_client_that_does_not_read_is_closed_past_the_unsent_bound() -> None:
    channel = _AsgiChannel(binary=True)
    chunk = b"x" * (1 << 20)
    while channel._unsent <= MAX_UNSENT_BYTES:  # replies nobody reads, up to the bound
        channel.send(chunk)
    assert not channel.closed
    channel.send(chunk)  # a reply due past the bound: closed, queued frames dropped
    assert channel.closed
    assert await _written(channel) == [
        {
            "type": "websocket.close",
            "code": 1008,
            "reason": f"client is not reading its replies (> {MAX_UNSENT_BYTES} bytes)",
        }
    ]


async def test_one_reply_larger_than_the_bound_still_goes_out() -> None:
    channel = _AsgiChannel(binary=True)
    big = b"x" * (MAX_UNSENT_BYTES + 1)
    channel.send(big)
    channel.close(1000, "done")
    assert not channel._unsent > 2 * MAX_UNSENT_BYTES
    sent = await _written(channel)
    assert sent[0] == {"type": "websocket.send", "bytes": big}
    assert sent[1]["code"] == 1000
    assert channel._unsent == 0

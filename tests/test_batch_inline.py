"""A batch's plain steps are answered in place (``Session.step_now`` gives the reply back to
the batch instead of sending it through the session's channel): what the channel would
have done must still happen — a resumable session counts and keeps each reply for replay,
and a reply whose durable record is being written waits for it."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest

from stadium._core.resume import REPLAY_FRAMES, ResumeChannel
from stadium._server.http.batch_socket import BatchServerConnection
from stadium.testing import MemoryChannel, memory_runtime

pytestmark = pytest.mark.asyncio

N = 3


def _frame(rid: int, kind: str) -> bytes:
    calls: list[dict[str, Any]] = []
    for i in range(N):
        call: dict[str, Any] = {"session": i, "type": kind}
        if kind == "step":
            call["data"] = {"wait_seconds": 0}
        calls.append(call)
    return msgspec.json.encode({"type": "batch", "id": rid, "calls": calls})


async def _round(conn: BatchServerConnection, channel: MemoryChannel, frame: bytes) -> Any:
    conn.feed(frame)
    return msgspec.json.decode(await channel.next_frame())


async def test_resumable_batch_steps_are_counted_and_kept_for_replay() -> None:
    async with memory_runtime("benchmark", max_sessions=N + 1) as runtime:
        channel = MemoryChannel()
        conn = BatchServerConnection(runtime, channel, where=("node", "127.0.0.1:1"))
        opened = await _round(conn, channel, _frame(0, "reset"))
        assert [r["type"] for r in opened["results"]] == ["observation"] * N
        replies: list[list[bytes]] = [[] for _ in range(N)]
        for rid in range(1, REPLAY_FRAMES + 3):
            conn.feed(_frame(rid, "step"))
            raw = msgspec.json.decode(await channel.next_frame(), type=dict[str, Any])
            assert raw["id"] == rid
            for i, result in enumerate(raw["results"]):
                assert result["type"] == "observation"
                replies[i].append(msgspec.json.encode(result))
        for i in range(N):
            resumable = conn.sessions[i].channel
            assert isinstance(resumable, ResumeChannel)
            assert resumable.count == 1 + REPLAY_FRAMES + 2  # the reset, then every step
            kept = [msgspec.json.decode(f) for f in resumable.recent]
            sent = [msgspec.json.decode(f) for f in replies[i][-REPLAY_FRAMES:]]
            assert kept == sent  # what a resume would replay is what the batches carried
        conn.connection_lost()


async def test_a_step_whose_record_is_being_written_waits_for_it() -> None:
    async with memory_runtime("benchmark", max_sessions=N + 1) as runtime:
        channel = MemoryChannel()
        conn = BatchServerConnection(runtime, channel, where=("node", "127.0.0.1:1"))
        await _round(conn, channel, _frame(0, "reset"))
        written: list[int] = []
        slow = conn.sessions[1].channel
        assert isinstance(slow, ResumeChannel)

        def persist(data: bytes | None) -> bool:
            written.append(slow.count)
            return True  # written off the loop: the reply waits for ``written``

        slow.persist = persist
        conn.feed(_frame(1, "step"))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert not channel.frames  # session 1's reply is held, so the batch is not complete
        assert written == [2]
        slow.written(2)
        reply = msgspec.json.decode(await channel.next_frame())
        assert reply["id"] == 1
        assert [r["type"] for r in reply["results"]] == ["observation"] * N
        assert (slow.count, len(slow.recent)) == (2, 2)
        conn.connection_lost()


async def test_plain_batch_steps_are_filed_in_place() -> None:
    async with memory_runtime("benchmark", max_sessions=N + 1) as runtime:
        channel = MemoryChannel()
        conn = BatchServerConnection(runtime, channel)
        await _round(conn, channel, _frame(0, "reset"))
        for rid in range(1, 4):
            reply = await _round(conn, channel, _frame(rid, "step"))
            assert reply["id"] == rid
            assert [r["type"] for r in reply["results"]] == ["observation"] * N
            assert all(not m.slots for m in conn.members.values())  # no slot left behind
        first = msgspec.json.decode(_frame(9, "step"))
        first["first"] = 2
        conn.feed(msgspec.json.encode(first))
        streamed = msgspec.json.decode(await channel.next_frame())
        assert (streamed["index"], streamed["done"]) == ([0, 1], False)
        last = msgspec.json.decode(await channel.next_frame())
        assert (last["index"], last["done"]) == ([2], True)
        conn.connection_lost()

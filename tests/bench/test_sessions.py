"""The sessions' HTTP mode against scripted servers, and the workers' frames."""

from __future__ import annotations

import asyncio
import io
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import msgspec
import pytest

from stadium.bench.loadgen import FrameDecoder, frame, read_frame
from stadium.bench.loadspec import LoadSpec
from stadium.bench.sessions import run_sessions

Answer = Callable[[str, asyncio.StreamWriter], Awaitable[bool]]
"""Writes the response to a request for a path; False closes the connection."""

OBS = json.dumps({"observation": {"pid": 7, "host": "h", "session_hash": "x"}}).encode()


async def _serve(answer: Answer) -> tuple[asyncio.Server, int, list[str]]:
    """A keep-alive HTTP/1.1 server that hands each request's path to ``answer``."""
    paths: list[str] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                length = next(
                    int(v) for k, _, v in (x.partition(":") for x in lines[1:])
                    if k.lower() == "content-length"
                )  # fmt: skip
                await reader.readexactly(length)
                path = lines[0].split()[1]
                paths.append(path)
                if not await answer(path, writer):
                    break
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1], paths


async def _chunked(path: str, writer: asyncio.StreamWriter) -> bool:
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                 b"Transfer-Encoding: chunked\r\n\r\n")  # fmt: skip
    for i in range(0, len(OBS), 5):
        part = OBS[i : i + 5]
        writer.write(b"%x\r\n%s\r\n" % (len(part), part))
    writer.write(b"0\r\n\r\n")
    return True


@pytest.fixture
async def chunked_server() -> AsyncIterator[tuple[int, list[str]]]:
    server, port, paths = await _serve(_chunked)
    async with server:
        yield port, paths


async def test_http_mode_reads_chunked_bodies(chunked_server: tuple[int, list[str]]) -> None:
    port, paths = chunked_server
    spec = LoadSpec(url=f"ws://127.0.0.1:{port}/ws", sessions=3, wait_s=0.0, steps=2, mode="http")
    records = await run_sessions(spec, range(3), time.monotonic())
    assert all(r.ok for r in records), [r.detail for r in records]
    assert all(len(r.step_s) == 2 and r.reset_s is not None for r in records)
    assert {(r.pid, r.host, r.session_hash) for r in records} == {(7, "h", "x")}
    assert sorted(paths) == ["/reset"] * 3 + ["/step"] * 6


def _status(code: int) -> Answer:
    async def answer(path: str, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 %d No\r\nContent-Length: 2\r\n\r\n{}" % code)
        return True

    return answer


async def _truncated(path: str, writer: asyncio.StreamWriter) -> bool:
    writer.write(b'HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{"obs')
    return False


async def _garbage(path: str, writer: asyncio.StreamWriter) -> bool:
    writer.write(b"NOT HTTP AT ALL\r\n\r\n")
    return True


async def _close_after_reset(path: str, writer: asyncio.StreamWriter) -> bool:
    writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s"
                 % (len(OBS), OBS))  # fmt: skip
    return False


@pytest.mark.parametrize(
    ("answer", "kind", "phase_reached"),
    [
        (_status(503), "capacity", "connect"),
        (_status(429), "capacity", "connect"),
        (_status(404), "protocol", "connect"),
        (_truncated, "disconnected", "connect"),
        (_garbage, "protocol", "connect"),
        (_close_after_reset, "disconnected", "reset"),
    ],
)
async def test_http_mode_classifies_bad_responses(
    answer: Answer, kind: str, phase_reached: str
) -> None:
    server, port, _ = await _serve(answer)
    async with server:
        spec = LoadSpec(url=f"ws://127.0.0.1:{port}/ws", sessions=1, wait_s=0.0, mode="http")
        (rec,) = await run_sessions(spec, [0], time.monotonic())
    assert (rec.ok, rec.error) == (False, kind), rec.detail
    assert rec.connect_s is not None
    assert (rec.reset_s is not None) == (phase_reached == "reset")


def test_frames_split_and_joined_anyhow() -> None:
    messages = [["job", {"a": 1}, [1, 2, 3], 0], ["ready", None], ["start", 12.5], ["x" * 70_000]]
    stream = b"".join(frame(m) for m in messages)
    for size in (1, 3, 4, 7, len(stream)):  # byte by byte, across headers, all at once
        decoder = FrameDecoder()
        bodies: list[bytes] = []
        for i in range(0, len(stream), size):
            decoder.feed(stream[i : i + size])
            while (body := decoder.next()) is not None:
                bodies.append(body)
        assert [msgspec.msgpack.decode(b) for b in bodies] == messages
        assert decoder.missing() == 4  # nothing left over: the next header is awaited


def test_blocking_reader_reads_exactly_one_frame() -> None:
    class Trickle(io.RawIOBase):
        """A pipe that hands out at most 3 bytes per read and counts what it gave."""

        def __init__(self, data: bytes) -> None:
            self.data, self.given = data, 0

        def readable(self) -> bool:
            return True

        def read(self, n: int = -1) -> bytes:
            chunk = self.data[self.given : self.given + min(n, 3)]
            self.given += len(chunk)
            return chunk

    first, second = frame(["start", 1.0]), frame(["records", []])
    pipe = Trickle(first + second)
    assert msgspec.msgpack.decode(read_frame(pipe)) == ["start", 1.0]
    assert pipe.given == len(first)  # never reads into the next frame
    assert msgspec.msgpack.decode(read_frame(pipe)) == ["records", []]
    with pytest.raises(EOFError):
        read_frame(pipe)

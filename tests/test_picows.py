"""Behaviour specific to the picows transport (``stadium serve``)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import socket
from typing import Any

from picows import WSListener, ws_connect

import stadium
from stadium import AsyncClient
from stadium._server.transports.picows import _SessionListener
from tests.conftest import UNIT, serve, wait_until


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
        writer.write(b"POST /reset HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 2\r\n\r\n{}")
        writer.write(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        await writer.drain()
        data = b""
        while data.count(b"HTTP/1.1 200") < 2:
            chunk = await asyncio.wait_for(reader.read(65536), 5 * UNIT)
            assert chunk, data
            data += chunk
        assert b'"echoed_message":"Echo environment ready!"' in data
        assert b'{"status":"healthy",' in data
        writer.close()


def test_the_private_picows_seam_matches_picows_own_server() -> None:
    """Stadium builds picows' WSProtocol positionally, as ws_create_server does.

    This reads picows' own ``ws_create_server`` and checks that its ``WSProtocol(...)``
    call passes the same parameters in the same order as
    :data:`stadium._server.transports.picows.WS_PROTOCOL_ARGS`: a picows release that changes the
    private signature fails here, loudly, instead of silently mis-wiring pings.
    """
    import ast
    import inspect

    import picows.api

    from stadium._server.transports.picows import WS_PROTOCOL_ARGS

    tree = ast.parse(inspect.getsource(picows.api.ws_create_server))
    calls = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "WSProtocol"
    ]
    assert len(calls) == 1, "picows' ws_create_server no longer builds one WSProtocol"
    args = calls[0].args
    assert not calls[0].keywords
    assert len(args) == len(WS_PROTOCOL_ARGS), [ast.unparse(a) for a in args]
    constants = {"host_port": None, "ws_path": None, "is_client_side": False, "extra_headers": None}
    for name, arg in zip(WS_PROTOCOL_ARGS, args, strict=True):
        if name in constants:
            assert isinstance(arg, ast.Constant), (name, ast.unparse(arg))
            assert arg.value is constants[name], (name, ast.unparse(arg))
        elif name == "logger":
            assert isinstance(arg, ast.Call), ast.unparse(arg)
            assert "logger" in ast.unparse(arg), ast.unparse(arg)
        else:
            assert isinstance(arg, ast.Name), (name, ast.unparse(arg))
            assert arg.id == name, f"picows passes {arg.id} where Stadium passes {name}"


def test_the_seam_refuses_a_missing_or_unknown_argument() -> None:
    import pytest

    from stadium._server.transports.picows import picows_server_protocol

    with pytest.raises(TypeError, match="missing"):
        picows_server_protocol(host_port=None)


# -- hostile clients over raw sockets ------------------------------------------------------


async def _raw_upgrade(port: int, rcvbuf: int = 4096) -> socket.socket:
    """A WebSocket opened by hand (frames sent raw, replies read raw), on a socket with a
    receive buffer of ``rcvbuf`` bytes (tiny by default: a client that stops reading)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.setblocking(False)
    try:
        loop = asyncio.get_running_loop()
        await loop.sock_connect(sock, ("127.0.0.1", port))
        key = base64.b64encode(os.urandom(16)).decode()
        await loop.sock_sendall(
            sock,
            (
                "GET /ws HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\n"
                "Connection: Upgrade\r\n"
                f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
            ).encode(),
        )
        head = b""
        while b"\r\n\r\n" not in head:
            head += await asyncio.wait_for(loop.sock_recv(sock, 1), 5 * UNIT)
        assert head.startswith(b"HTTP/1.1 101"), head
    except BaseException:
        sock.close()  # not left for the collector to find (a ResourceWarning elsewhere)
        raise
    return sock


def _frame(payload: bytes, *, opcode: int = 0x1, fin: bool = True) -> bytes:
    """A masked client frame (RFC 6455) with a payload under 126 bytes."""
    mask = os.urandom(4)
    body = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
    return bytes([(0x80 if fin else 0) | opcode, 0x80 | len(payload)]) + mask + body


_RESET = _frame(b'{"type":"reset"}')
_STEP = _frame(b'{"type":"step","data":{"message":"' + b"x" * 60 + b'"}}')


async def _flood(sock: socket.socket, data: bytes, limit_s: float) -> None:
    """Send ``data`` until it is all out or the server stops reading (bounded in time)."""
    loop = asyncio.get_running_loop()
    with contextlib.suppress(TimeoutError, OSError):
        await asyncio.wait_for(loop.sock_sendall(sock, data), limit_s)


async def test_a_client_that_never_reads_is_paused_and_others_are_served() -> None:
    async with serve("echo") as server:
        sock = await _raw_upgrade(server.port)
        try:
            # ~60k steps pipelined: far more replies than the socket buffers hold.
            flood = asyncio.ensure_future(_flood(sock, _RESET + _STEP * 60_000, 10 * UNIT))
            await wait_until(lambda: len(server.runtime.sessions) == 1, 5 * UNIT)
            (session,) = server.runtime.sessions
            listener: Any = session.channel
            await wait_until(lambda: listener._paused, 10 * UNIT, "reading was never paused")
            unsent = listener.transport.underlying_transport.get_write_buffer_size()
            assert unsent <= server.transport.max_unsent_bytes
            async with AsyncClient(server.url) as env:  # the worker still serves others
                await env.reset()
                assert (await env.step({"message": "ok"})).observation["echoed_message"] == "ok"
            await flood
        finally:
            sock.close()
        await wait_until(lambda: not server.runtime.sessions, 5 * UNIT)


async def test_a_client_past_the_unsent_bound_is_closed_and_its_slot_freed() -> None:
    async with serve("echo") as server:
        server.transport.max_unsent_bytes = 1024
        sock = await _raw_upgrade(server.port)
        try:
            flood = asyncio.ensure_future(_flood(sock, _RESET + _STEP * 60_000, 10 * UNIT))
            await wait_until(lambda: server.runtime.sessions_total == 1, 5 * UNIT)
            await wait_until(lambda: not server.runtime.sessions, 10 * UNIT)
            assert server.runtime.admission.slots.active() == 0
            await flood
        finally:
            sock.close()


async def test_many_empty_fragments_are_cut_off_and_the_loop_stays_free() -> None:
    async with serve("echo") as server:
        sock = await _raw_upgrade(server.port, rcvbuf=65536)
        try:
            loop = asyncio.get_running_loop()
            first = _frame(b'{"type":', fin=False)
            empties = _frame(b"", opcode=0x0, fin=False) * 40_000
            await _flood(sock, first + empties, 5 * UNIT)
            reply = b""
            with contextlib.suppress(TimeoutError, OSError):
                while len(reply) < 4:
                    chunk = await asyncio.wait_for(loop.sock_recv(sock, 4096), 5 * UNIT)
                    if not chunk:
                        break
                    reply += chunk
            # A close frame (opcode 8) with 1009: too many fragments.
            assert reply[:1] == b"\x88", reply[:40]
            assert int.from_bytes(reply[2:4], "big") == 1009
            assert b"fragments" in reply
            async with AsyncClient(server.url) as env:
                await env.reset()
        finally:
            sock.close()


async def _exchange(port: int, request: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    await writer.drain()
    data = b""
    with contextlib.suppress(TimeoutError):
        while chunk := await asyncio.wait_for(reader.read(65536), 2 * UNIT):
            data += chunk
    writer.close()
    return data


async def test_http_1_0_and_head_are_answered() -> None:
    """HAProxy's and nginx's default health checks speak HTTP/1.0; HEAD must not hang up."""
    async with serve("echo") as server:
        old = await _exchange(server.port, b"GET /health HTTP/1.0\r\n\r\n")
        assert old.startswith(b"HTTP/1.1 200"), old
        assert b'{"status":"healthy",' in old
        head = await _exchange(server.port, b"HEAD /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), head
        body = old.split(b"\r\n\r\n", 1)[1]  # HEAD: the length GET's body would have
        assert f"content-length: {len(body)}".encode() in head.lower()
        assert head.endswith(b"\r\n\r\n")  # headers only
        ws10 = await _exchange(server.port, b"GET /ws HTTP/1.0\r\n\r\n")
        assert ws10.startswith(b"HTTP/1.1 426"), ws10  # a WebSocket needs HTTP/1.1


async def test_content_length_with_transfer_encoding_is_refused_not_smuggled() -> None:
    async with serve("echo") as server:
        data = await _exchange(
            server.port,
            b"POST /reset HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 2\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
            b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
        )
        assert data.startswith(b"HTTP/1.1 400"), data
        assert b"Transfer-Encoding" in data
        assert data.count(b"HTTP/1.1") == 1  # the smuggled second request is not answered


class _Big(stadium.Environment[dict[str, Any], dict[str, Any], stadium.State]):
    """Replies with an observation of ``size`` bytes."""

    blocking = False

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Any:
        return {"blob": ""}

    def step(self, action: dict[str, Any]) -> Any:
        return {"blob": "x" * int(action["size"])}


def test_a_reply_larger_than_the_unsent_bound_reaches_a_client_that_reads() -> None:
    """On uvloop, as `stadium serve` runs (CPython 3.12.1's own writelines, which picows
    uses for replies over 8 KiB, never signals backpressure)."""
    import uvloop

    async def run() -> None:
        async with serve(_Big, max_message_bytes=1024) as server:
            server.transport.max_unsent_bytes = 64 * 1024
            async with AsyncClient(server.url) as env:
                await env.reset()
                for _ in range(2):  # more than the kernel's socket buffers take at once
                    result = await env.step({"size": 32 * 1024 * 1024})
                    assert len(result.observation["blob"]) == 32 * 1024 * 1024
            await wait_until(lambda: not server.runtime.sessions, 5 * UNIT)
            assert server.runtime.sessions_total == 1

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(run())


async def test_ended_sessions_leave_no_reference_cycles() -> None:
    """`stadium serve` runs the cyclic collector rarely (GC_THRESHOLDS): a connection whose
    objects formed a cycle would stay in memory until a full collection, ~2 KB a session
    (a soak of churning sessions grew a worker by ~130 MB in 5 minutes)."""
    import gc

    from stadium._server.sessions.runner import Session

    def alive() -> int:
        return sum(isinstance(o, Session | _SessionListener) for o in gc.get_objects())

    async with serve("benchmark") as server:
        gc.collect()
        gc.disable()
        try:
            for _ in range(20):
                async with AsyncClient(server.url) as env:
                    await env.reset()
                    await env.step({"wait_seconds": 0})
            await wait_until(lambda: not server.runtime.sessions, 5 * UNIT, "sessions ended")
            await asyncio.sleep(0.05)
            assert alive() == 0  # freed by reference counting alone
        finally:
            gc.enable()

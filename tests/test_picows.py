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


def test_the_private_picows_seam_matches_picows_own_server() -> None:
    """Stadium builds picows' WSProtocol positionally, as ws_create_server does.

    This reads picows' own ``ws_create_server`` and checks that its ``WSProtocol(...)``
    call passes the same parameters in the same order as
    :data:`stadium._picows.WS_PROTOCOL_ARGS`: a picows release that changes the
    private signature fails here, loudly, instead of silently mis-wiring pings.
    """
    import ast
    import inspect

    import picows.api

    from stadium._picows import WS_PROTOCOL_ARGS

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

    from stadium._picows import picows_server_protocol

    with pytest.raises(TypeError, match="missing"):
        picows_server_protocol(host_port=None)

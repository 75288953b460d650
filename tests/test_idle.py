"""Quiet sessions: a connected session is never reaped by default; ``--idle-timeout``
given explicitly reaps connected ones too; sessions without a connection (HTTP MCP)
are reaped by default; every close is logged with its reason and counted."""

from __future__ import annotations

import asyncio
import json
import logging

import httpx
import pytest
import websockets

from stadium._server import config as config_module
from tests.conftest import UNIT, serve, wait_until


def _rpc(method: str) -> dict[str, object]:
    return {"jsonrpc": "2.0", "method": method, "params": {}, "id": 1}


async def test_a_connected_quiet_session_is_not_reaped_by_default(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """With the default settings (the detached timeout shortened to 0.2 UNIT), a quiet
    WebSocket session whose client answers pings outlives many reaper rounds, while an
    HTTP MCP session opened beside it (no connection) is reaped, logged and counted."""
    monkeypatch.setattr(config_module, "DEFAULT_DETACHED_IDLE_TIMEOUT", 0.2 * UNIT)
    caplog.set_level(logging.INFO, logger="stadium")
    async with (
        serve("tools", ping_interval=0.1 * UNIT, ping_timeout=0.1 * UNIT) as server,
        httpx.AsyncClient() as http,
    ):
        assert server.config.idle_timeout is None
        assert server.runtime.detached_idle_timeout == 0.2 * UNIT
        async with websockets.connect(server.url.replace("http", "ws") + "/ws") as ws:
            await ws.send('{"type":"reset"}')
            await ws.recv()
            created = await http.post(server.url + "/mcp", json=_rpc("openenv/session/create"))
            assert "session_id" in created.json()["result"]
            await wait_until(
                lambda: server.runtime.outcomes["reaped"] == 1, 10 * UNIT, "MCP session reaped"
            )
            await asyncio.sleep(10 * 0.2 * UNIT)  # ten detached timeouts, quiet
            await ws.send('{"type":"state"}')
            reply = json.loads(await asyncio.wait_for(ws.recv(), 5 * UNIT))
            assert reply["type"] == "state"
            assert server.runtime.outcomes["reaped"] == 1  # only the MCP session
        await wait_until(lambda: not server.runtime.sessions, 5 * UNIT, "session closed")
        assert server.runtime.outcomes["completed"] >= 1
        metrics = (await http.get(server.url + "/metrics")).text
    assert 'stadium_sessions_total{outcome="reaped"} 1.0' in metrics
    messages = [r.getMessage() for r in caplog.records]
    assert any("MCP session" in m and "reaped" in m and "unused for more than" in m
               for m in messages)  # fmt: skip


async def test_an_explicit_idle_timeout_reaps_connected_sessions_and_logs_why(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="stadium")
    async with serve("echo", idle_timeout=0.2 * UNIT) as server:
        async with websockets.connect(server.url.replace("http", "ws") + "/ws") as ws:
            await ws.send('{"type":"reset"}')
            await ws.recv()
            with pytest.raises(websockets.ConnectionClosed) as info:
                await asyncio.wait_for(ws.recv(), 5 * UNIT)
        assert info.value.rcvd is not None
        assert info.value.rcvd.code == 1001
        assert server.runtime.outcomes["reaped"] == 1
    closes = [r for r in caplog.records if "session closed (reaped, code 1001)" in r.getMessage()]
    assert closes
    assert closes[0].levelno == logging.INFO
    assert "idle for more than" in closes[0].getMessage()


def test_the_default_and_explicit_idle_settings() -> None:
    default = config_module.ServerConfig(target="echo")
    assert default.connected_idle_timeout == 0.0
    assert default.detached_idle_timeout == config_module.DEFAULT_DETACHED_IDLE_TIMEOUT == 300.0
    given = config_module.ServerConfig.from_options(target="echo", idle_timeout=30.0)
    assert (given.connected_idle_timeout, given.detached_idle_timeout) == (30.0, 30.0)
    off = config_module.ServerConfig(target="echo", idle_timeout=0.0)
    assert (off.connected_idle_timeout, off.detached_idle_timeout) == (0.0, 0.0)

"""OpenEnv 0.10's ``WS /harness`` (RFC 005) for a ``HarnessEnvironment`` in production mode.

The env is OpenEnv's own ``HarnessEnvironment`` with an in-process adapter whose turns
call an env tool through OpenEnv's MCP bridge (``tests/openenv_compat/harness_app.py``);
frames are read back with OpenEnv's own event models. The last test runs the same
conversation against OpenEnv's server (uvicorn) and ``stadium serve``, side by side.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import websockets
from websockets.exceptions import ConnectionClosed, InvalidStatus

from tests.conftest import TRANSPORTS, UNIT, serve

pytest.importorskip("fastmcp")
pytest.importorskip("openenv.core.harness.environment")

from openenv.core.harness.events import HarnessEvent, HarnessEventType, HarnessProtocolError

ROOT = Path(__file__).resolve().parents[1]
APP = "tests.openenv_compat.harness_app:app"


def _url(base: str) -> str:
    return base.replace("http", "ws", 1) + "/harness"


async def _recv(ws: Any) -> dict[str, Any]:
    frame: dict[str, Any] = json.loads(await asyncio.wait_for(ws.recv(), 20 * UNIT))
    return frame


async def _turn(ws: Any, content: str) -> list[dict[str, Any]]:
    """Send one message; the frames up to the turn's end (turn_complete, an error)."""
    await ws.send(json.dumps({"type": "message", "content": content}))
    frames = []
    while True:
        frame = await _recv(ws)
        frames.append(frame)
        if frame["type"] in ("turn_complete", "error", "protocol_error"):
            return frames


async def _closed(ws: Any) -> int | None:
    """The close code once the server closed the connection."""
    with contextlib.suppress(ConnectionClosed):
        while True:
            await asyncio.wait_for(ws.recv(), 20 * UNIT)
    code: int | None = ws.close_code
    return code


async def _until_free(server: Any) -> None:
    for _ in range(200):
        if server.runtime.admission.slots.active() == 0:
            return
        await asyncio.sleep(0.02 * UNIT)
    raise AssertionError("the harness session's slot was not released")


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_harness_session_streams_its_turns(transport: str) -> None:
    async with serve(APP, transport=transport) as server:
        async with websockets.connect(_url(server.url)) as ws:
            started = await _recv(ws)
            assert started["type"] == "session_started"
            assert started["data"]["harness"] == "scripted"
            assert isinstance(started["data"]["session_id"], str)
            first = [HarnessEvent(**f) for f in await _turn(ws, "hi")]
            assert [e.type for e in first] == [
                HarnessEventType.TOOL_CALL, HarnessEventType.TOOL_RESULT,
                HarnessEventType.TEXT_OUTPUT, HarnessEventType.TURN_COMPLETE,
            ]  # fmt: skip
            assert first[1].data["result"] == "hi#1"  # the env's tool, through the bridge
            assert first[-1].data == {"response": "turn 1: hi#1", "done": False}
            # Bad frames are answered, recoverably, and start no turn.
            await ws.send("{not json")
            bad = HarnessProtocolError(**await _recv(ws))
            assert bad.data["code"] == "INVALID_JSON"
            await ws.send(json.dumps({"type": "step", "content": "x"}))
            invalid = HarnessProtocolError(**await _recv(ws))
            assert invalid.data["code"] == "VALIDATION_ERROR"
            assert "HarnessClientMessage" in invalid.data["message"]
            # The same env and harness go on: its tool counted 1 call, its turns 1.
            second = await _turn(ws, "bye")
            assert second[-1]["data"] == {"response": "turn 2: bye#2", "done": True}
            assert server.runtime.admission.slots.active() == 1
        await _until_free(server)


@pytest.mark.parametrize(
    ("message", "error"),
    [
        ("crash", "harness turn failed"),
        ("no-end", "harness event stream ended without a TURN_COMPLETE event"),
        ("hang", "harness turn exceeded"),
    ],
)
async def test_a_failed_turn_ends_the_session_with_a_terminal_error(
    message: str, error: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HARNESS_TURN_TIMEOUT_S", str(0.3 * UNIT))
    async with serve(APP) as server:
        async with websockets.connect(_url(server.url)) as ws:
            assert (await _recv(ws))["type"] == "session_started"
            frames = await _turn(ws, message)
            last = HarnessEvent(**frames[-1])
            assert last.type is HarnessEventType.ERROR
            assert last.data["message"].startswith(error)
            assert last.data["recoverable"] is False
            assert "hunter2" not in json.dumps(frames)  # the adapter's exception stays here
            assert await _closed(ws) == 1000
        await _until_free(server)
        assert server.runtime.outcomes["errored"] == 1


async def test_a_harness_that_exited_ends_the_session_at_the_next_turn() -> None:
    async with serve(APP) as server, websockets.connect(_url(server.url)) as ws:
        assert (await _recv(ws))["type"] == "session_started"
        assert (await _turn(ws, "die"))[-1]["type"] == "turn_complete"
        last = (await _turn(ws, "hello"))[-1]
        assert last["type"] == "error"
        assert last["data"]["message"] == "harness process is not running"
        assert await _closed(ws) == 1000


async def test_harness_sessions_take_slots_and_are_not_reaped_while_connected() -> None:
    async with serve(APP, max_sessions=1, admission_timeout=0.1 * UNIT,
                     idle_timeout=0.1 * UNIT) as server:  # fmt: skip
        async with websockets.connect(_url(server.url)) as ws:
            assert (await _recv(ws))["type"] == "session_started"
            async with websockets.connect(_url(server.url)) as other:
                refused = await _recv(other)
                assert refused["type"] == "error"
                assert refused["data"]["code"] == "CAPACITY_REACHED"
            await asyncio.sleep(0.5 * UNIT)  # several idle timeouts: a harness is not idle
            assert (await _turn(ws, "still"))[-1]["type"] == "turn_complete"
        await _until_free(server)


async def test_no_harness_route_unless_a_harness_env_in_production_mode(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OPENENV_MODE", "simulation")
    async with serve("echo") as server:
        with pytest.raises(InvalidStatus) as refused:
            async with websockets.connect(_url(server.url)):
                pass
        assert refused.value.response.status_code == 404


# -- side by side with OpenEnv's own server ----------------------------------------------


@contextlib.asynccontextmanager
async def _server(argv: list[str], pattern: str) -> AsyncIterator[str]:
    """A server subprocess; yields its base URL once ``pattern`` (group 1) is logged."""
    proc = await asyncio.create_subprocess_exec(
        *argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    assert proc.stdout is not None
    try:
        async with asyncio.timeout(120 * UNIT):
            while True:
                line = (await proc.stdout.readline()).decode()
                assert line, f"{argv[:4]} exited before listening"
                found = re.search(pattern, line)
                if found:
                    break
        drain = asyncio.ensure_future(proc.stdout.read())
        yield found.group(1)
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            async with asyncio.timeout(30 * UNIT):
                await proc.wait()
        with contextlib.suppress(NameError):
            await drain


def _comparable(frames: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Frames without what differs by nature (timestamps, session ids)."""
    out = []
    for frame in frames:
        frame = {k: v for k, v in frame.items() if k != "timestamp"}
        if frame["type"] == "session_started":
            frame["data"] = {k: v for k, v in frame["data"].items() if k != "session_id"}
        out.append(frame)
    return out


async def _conversation(base: str) -> tuple[list[dict[str, Any]], int | None]:
    async with websockets.connect(_url(base)) as ws:
        frames = [await _recv(ws)]
        for message in ("hi", "again"):
            frames += await _turn(ws, message)
        await ws.send("[1")
        frames.append(await _recv(ws))
        await ws.send(json.dumps({"type": "message"}))
        frames.append(await _recv(ws))
        frames += await _turn(ws, "no-end")
        return frames, await _closed(ws)


@pytest.mark.slow
@pytest.mark.timeout(300 * UNIT)
async def test_the_same_conversation_on_openenv_and_stadium() -> None:
    py = sys.executable
    openenv = [py, "-m", "uvicorn", APP, "--host", "127.0.0.1", "--port", "0"]
    stadium = [py, "-m", "stadium", "serve", APP, "--host", "127.0.0.1", "--port", "0"]
    async with _server(openenv, r"Uvicorn running on (http://127\.0\.0\.1:\d+)") as url:
        theirs, their_close = await _conversation(url)
    async with _server(stadium, r"listening on (http://127\.0\.0\.1:\d+)") as url:
        ours, our_close = await _conversation(url)
    assert _comparable(ours) == _comparable(theirs)
    assert our_close == their_close == 1000
    assert [f["type"] for f in ours][-1] == "error"


def test_the_frames_stadium_writes_are_openenvs_bytes() -> None:
    """``error`` and ``protocol_error`` byte for byte as OpenEnv's models dump them;
    ``session_started`` (which OpenEnv writes with ``json.dumps``) as the same value."""
    from openenv.core.env_server.types import WSErrorResponse

    from stadium.integrations import openenv_harness as harness

    data = {"message": "harness session failed", "code": "SESSION_ERROR"}
    assert harness.error_frame(**data) == WSErrorResponse(data=data).model_dump_json().encode()
    data = {"message": "Invalid JSON: ü", "code": "INVALID_JSON"}
    expected = HarnessProtocolError(data=data).model_dump_json().encode()
    assert harness.protocol_error(**data) == expected
    started = {"type": "session_started", "data": {"session_id": "s1", "harness": "echo"}}
    assert json.loads(harness.session_frame("s1", "echo")) == started

"""Isolated sessions with the rest of the server: every env shape the in-process path
serves answers the same under ``--isolation process`` (sync and async calls, an async
``state``, a ``state`` that does work, tool envs and their MCP requests, OpenEnv envs
stepped before a reset); ``--durable`` isolated sessions outlive their worker (the env
snapshotted in its own process, restored into a fresh one)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import websockets

import stadium
from stadium._server.isolation import sandbox_unavailable
from stadium._server.sessions import resumable
from stadium._util.throttle import Throttle
from tests.conftest import UNIT, serve, wait_until
from tests.test_durable import _Server

HERE = Path(__file__).parent
SHAPES = f"{HERE / 'shapes.py'}"
WHY_NO_SANDBOX = sandbox_unavailable()
needs_sandbox = pytest.mark.skipif(
    WHY_NO_SANDBOX is not None, reason=f"--isolation sandbox: {WHY_NO_SANDBOX}"
)

pytestmark = pytest.mark.slow


def _rpc(method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"type": "mcp", "data": {"jsonrpc": "2.0", "method": method, "params": params or {},
                                    "id": 1}}  # fmt: skip


STADIUM_SCRIPT = [
    {"type": "state"},  # before any reset: a fresh env's state (its own State class)
    {"type": "reset", "data": {"seed": 3}},
    {"type": "step", "data": {"add": 2}},
    {"type": "state"},
    {"type": "step", "data": {"add": 5}},
    {"type": "state"},
]
TOOL_SCRIPT = [
    {"type": "state"},
    {"type": "reset", "data": {"seed": 3}},
    {"type": "step", "data": {"type": "call_tool", "tool_name": "add", "arguments": {"n": 2}}},
    _rpc("tools/list"),
    _rpc("tools/call", {"name": "add", "arguments": {"n": 4}}),
    _rpc("tools/call", {"name": "add", "arguments": {"n": "x"}}),  # bad arguments
    _rpc("tools/call", {"name": "nope"}),  # unknown tool
    {"type": "state"},
]
OPENENV_SCRIPT = [
    {"type": "step", "data": {"n": 4}},  # before any reset: OpenEnv allows it
    {"type": "state"},
    {"type": "reset", "data": {}},
    {"type": "step", "data": {"n": 2}},
    {"type": "state"},
]
SHAPES_CASES = {
    "sync": (f"{SHAPES}:SyncEnv", STADIUM_SCRIPT),
    "async": (f"{SHAPES}:AsyncEnv", STADIUM_SCRIPT),
    "busy-state": (f"{SHAPES}:BusyStateEnv", STADIUM_SCRIPT),
    "tools": (f"{SHAPES}:ToolShape", TOOL_SCRIPT),
    "openenv-sync": (f"{HERE / 'shapes_openenv.py'}:OpenSync", OPENENV_SCRIPT),
    "openenv-async": (f"{HERE / 'shapes_openenv.py'}:OpenAsync", OPENENV_SCRIPT),
}


def _strip(value: Any, pids: set[int]) -> Any:
    """``value`` without its ``pid`` fields (collected into ``pids``), episode ids made
    alike, an episode's cost reduced to what does not depend on the machine (its fields,
    steps and bytes received); JSON text inside
    (an MCP result's ``content``) is read and stripped too."""
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            if key == "pid" and isinstance(item, int):
                pids.add(item)
            elif key == "episode_id" and isinstance(item, str):  # a random one
                out[key] = "<episode id>"
            elif key == "cost" and isinstance(item, dict):  # measured: the same fields and counts
                out[key] = {"fields": sorted(item), "steps": item.get("steps"),
                            "bytes_in": item.get("bytes_in")}  # fmt: skip
            else:
                out[key] = _strip(item, pids)
        return out
    if isinstance(value, list):
        return [_strip(item, pids) for item in value]
    if isinstance(value, str) and value.startswith("{"):
        with contextlib.suppress(ValueError):
            return _strip(json.loads(value), pids)
    return value


async def _transcript(url: str, script: list[dict[str, Any]]) -> tuple[list[Any], set[int]]:
    pids: set[int] = set()
    replies = []
    async with websockets.connect(url.replace("http://", "ws://") + "/ws") as ws:
        for frame in script:
            await ws.send(json.dumps(frame))
            reply = json.loads(await asyncio.wait_for(ws.recv(), 10 * UNIT))
            replies.append(_strip(reply, pids))
    return replies, pids


@contextlib.asynccontextmanager
async def _isolated(target: str, **config: Any) -> AsyncIterator[Any]:
    async with serve(target, isolation="process", **config) as server:
        # The template imports the env's module (OpenEnv's imports take seconds here).
        await asyncio.wait_for(server.runtime.isolation.ready(), 60 * UNIT)
        yield server


@pytest.mark.parametrize("shape", list(SHAPES_CASES))
async def test_every_env_shape_answers_the_same_in_its_own_process(shape: str) -> None:
    target, script = SHAPES_CASES[shape]
    if "openenv" in shape:
        pytest.importorskip("openenv.core.env_server.interfaces")
    async with serve(target) as server:
        inline, inline_pids = await _transcript(server.url, script)
    async with _isolated(target) as server:
        isolated, isolated_pids = await _transcript(server.url, script)
        assert server.runtime.isolation.starts >= 1
    assert [r["type"] for r in inline] != ["error"] * len(script)
    assert all(r["type"] != "error" for r in inline), inline
    assert isolated == inline
    assert inline_pids == {os.getpid()}
    assert isolated_pids  # made in the session's own process, not this one
    assert os.getpid() not in isolated_pids
    assert len(isolated_pids) == 1


def _get_json(url: str) -> Any:
    import urllib.request

    with urllib.request.urlopen(url, timeout=30 * UNIT) as response:
        return json.loads(response.read())


@pytest.mark.parametrize("env", ["SyncEnv", "AsyncEnv"])
async def test_http_state_is_a_fresh_envs_own_state_read_in_a_process(env: str) -> None:
    """``GET /state`` (a fresh env's state, as OpenEnv's HTTP server answers it) has the
    env's own ``State`` fields — an async ``state`` awaited — in-process and when the env
    runs in a process, and that process is let go."""
    async with serve(f"{SHAPES}:{env}") as server:
        inline = await asyncio.to_thread(_get_json, server.url + "/state")
    assert inline == {"total": 0, "episode_id": None, "step_count": 0}
    async with _isolated(f"{SHAPES}:{env}") as server:
        isolation = server.runtime.isolation
        starts = isolation.starts
        assert await asyncio.to_thread(_get_json, server.url + "/state") == inline
        assert isolation.starts == starts + 1  # read in an env process of its own
        await wait_until(lambda: not isolation.live, 10 * UNIT, "the process let go")


async def test_a_state_that_never_comes_is_abandoned_at_the_step_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import urllib.error

    monkeypatch.setenv("ENABLE_WEB_INTERFACE", "true")  # for /web/state
    async with serve(f"{SHAPES}:SlowStateEnv", step_timeout=UNIT) as server:
        with pytest.raises(urllib.error.HTTPError) as info:
            await asyncio.to_thread(_get_json, server.url + "/state")
        assert info.value.code == 504
        body = json.loads(info.value.read())
        info.value.close()
        assert body["code"] == "TIMEOUT"
        assert body["operation"] == "state"
        assert server.runtime.admission.slots.active() == 0  # its slot is back
        # The web page's state of its env: the same bound.
        with pytest.raises(urllib.error.HTTPError) as info:
            await asyncio.to_thread(_get_json, server.url + "/web/state")
        assert info.value.code == 504
        assert json.loads(info.value.read())["code"] == "TIMEOUT"
        info.value.close()


async def test_an_async_state_does_not_hold_up_other_sessions() -> None:
    """``state`` is read in the env's process while the worker serves other sessions."""
    async with (
        _isolated(f"{SHAPES}:BusyStateEnv") as server,
        stadium.AsyncClient(server.url) as slow,
        stadium.AsyncClient(server.url) as other,
    ):
        await slow.reset(seed=400)
        await other.reset(seed=1)
        read = asyncio.ensure_future(slow.state())  # 400 ms of work in the env's process
        steps = 0
        while not read.done():  # the other session steps meanwhile
            await other.step({"add": 1})
            steps += 1
        assert (await read)["total"] == sum(range(401))
        assert steps >= 5  # a state read that blocked the worker would let none through


def _workers(server_pid: int) -> list[int]:
    """The worker processes of a ``stadium serve --workers N`` (its supervisor's children)."""
    with open(f"/proc/{server_pid}/task/{server_pid}/children") as f:
        return [int(pid) for pid in f.read().split()]


@pytest.mark.parametrize("mode", ["process", pytest.param("sandbox", marks=needs_sandbox)])
async def test_durable_isolated_sessions_outlive_their_worker(tmp_path: Path, mode: str) -> None:
    store = tmp_path / "sessions"
    server = _Server(store, "--workers", "2", "--isolation", mode)
    try:
        await asyncio.to_thread(server.wait_healthy)
        async with stadium.SessionPool(server.url, size=6, max_retries=40) as pool:
            await pool.reset(seeds=range(6))
            for _ in range(3):
                before = await pool.step([{"wait_seconds": 0.0}] * 6)
            assert [r.observation["step_count"] for r in before] == [3] * 6
            workers = _workers(server.proc.pid)
            assert len(workers) == 2
            assert not {r.observation["pid"] for r in before} & set(workers)  # own processes
            for pid in workers:  # every worker (and with it every env process) dies
                os.kill(pid, signal.SIGKILL)
            after = await pool.step([{"wait_seconds": 0.0}] * 6)
            assert [r.observation["step_count"] for r in after] == [4] * 6
            assert [r.observation["session_hash"] for r in after] == [
                r.observation["session_hash"] for r in before
            ]  # the same episodes, restored from snapshots taken in the env processes
            assert all(client.resumes == 1 for client in pool.clients)
            assert not set(_workers(server.proc.pid)) & set(workers)
            again = await pool.step([{"wait_seconds": 0.0}] * 6)
            assert [r.observation["step_count"] for r in again] == [5] * 6
        await wait_until(lambda: not list(store.iterdir()), 10 * UNIT, "store emptied")
    finally:
        server.stop()


async def test_an_isolated_env_that_cannot_pickle_ends_its_durability_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = tmp_path / "sessions"
    monkeypatch.setattr(resumable._SNAPSHOT_ERRORS, "_throttle", Throttle(10.0))  # said now
    caplog.set_level(logging.WARNING, logger="stadium")
    hostile = f"{HERE / 'hostile.py'}:Unpicklable"
    async with _isolated(hostile, durable=True, session_store=f"dir:{store}") as server:
        async with stadium.AsyncClient(server.url) as env:
            await env.reset()
            step = await env.step({"do": "echo", "arg": "still served"})
            assert step.observation["text"] == "still served"
            assert (await env.step({"do": "echo", "arg": "again"})).reward == 2.0
            # no record left: the session is not durable any more (it still is served)
            await wait_until(lambda: not list(store.iterdir()), 10 * UNIT, "record dropped")
        assert server.runtime.isolation.crashes == 0
    assert any("is no longer durable" in r.getMessage() and "pickle" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]  # fmt: skip

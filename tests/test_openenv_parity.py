"""Protocol parity with OpenEnv 0.10 where its clients and tests rely on it: a step before
any reset, ``openenv/session/create`` as an ``mcp`` message on ``/ws``, ``WS /mcp``,
``tools/call`` around ``step()`` for ``MCPEnvironment``s, a stateless ``tools/list`` at
capacity, the web interface's JSON endpoints, the Task API and ``info.version``."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import websockets

import stadium
from tests.conftest import TRANSPORTS, UNIT, serve

pytest.importorskip("fastmcp")
pytest.importorskip("openenv.core.env_server.mcp_environment")

from fastmcp import FastMCP
from openenv.core.env_server.interfaces import Environment as OpenEnvEnvironment
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.types import Action, Observation, State

from stadium.integrations.openenv import openenv_environment

ROOT = Path(__file__).resolve().parents[1]
NOTES = f"{ROOT / 'tests/openenv_compat/mcp_notes.py'}:OpenEnvNotes"


class CountingTools(MCPEnvironment):
    """As OpenEnv 0.10's echo_env: ``step`` counts every action, tools included."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        mcp = FastMCP("counting")

        @mcp.tool
        def echo(message: str) -> str:
            """Echo the message."""
            return message

        super().__init__(mcp)
        self._state = State(episode_id="e", step_count=0)

    def reset(self, **kwargs: Any) -> Observation:
        self._state = State(episode_id="e", step_count=0)
        return Observation(done=False, reward=0.0)

    def _step_impl(self, action: Action, timeout_s: Any = None, **kwargs: Any) -> Observation:
        return Observation(done=False, reward=0.0)

    def step(self, action: Action, timeout_s: Any = None, **kwargs: Any) -> Observation:
        self._state.step_count += 1
        return super().step(action, timeout_s=timeout_s, **kwargs)

    async def step_async(self, action: Action, timeout_s: Any = None, **kw: Any) -> Observation:
        self._state.step_count += 1
        return await super().step_async(action, timeout_s=timeout_s, **kw)

    @property
    def state(self) -> State:
        return self._state


class Greeting(Action):
    name: str


class Greeted(Observation):
    text: str = ""


class Greeter(OpenEnvEnvironment):  # type: ignore[type-arg]
    """Steps without a reset (OpenEnv's server allows it), and provides tasks."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = State(step_count=0)

    def reset(self, **kwargs: Any) -> Greeted:
        self._state = State(step_count=0)
        return Greeted(text="ready")

    def step(self, action: Greeting, **kwargs: Any) -> Greeted:  # type: ignore[override]
        self._state.step_count += 1
        return Greeted(text=f"hello {action.name}", reward=1.0)

    @property
    def state(self) -> State:
        return self._state

    def list_splits(self) -> list[Any]:
        return ["train", {"name": "hard", "type": "test"}]

    def num_tasks(self, split: str) -> int:
        return 3

    def get_task(self, split: str, index: int) -> dict[str, Any]:
        if not 0 <= index < 3:
            raise IndexError(index)
        return {"id": f"{split}-{index}"}

    def get_task_range(self, split: str, start: int | None, stop: int | None) -> list[Any]:
        return [self.get_task(split, i) for i in range(3)[start:stop]]


GREETER = openenv_environment(Greeter)
COUNTING = openenv_environment(CountingTools)


def _ws(url: str, path: str = "/ws") -> str:
    return url.replace("http", "ws", 1) + path


async def _ask(ws: Any, frame: dict[str, Any]) -> dict[str, Any]:
    await ws.send(json.dumps(frame))
    reply: dict[str, Any] = json.loads(await asyncio.wait_for(ws.recv(), 10 * UNIT))
    return reply


def _rpc(method: str, params: dict[str, Any] | None = None, rid: int = 1) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "method": method, "params": params or {}, "id": rid}


# -- a step before any reset ------------------------------------------------------------


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_an_openenv_env_steps_before_any_reset(transport: str) -> None:
    async with serve(GREETER, transport=transport) as server:
        async with websockets.connect(_ws(server.url)) as ws:
            reply = await _ask(ws, {"type": "step", "data": {"name": "ada"}})
            assert reply["type"] == "observation", reply
            assert reply["data"]["observation"]["text"] == "hello ada"
            state = await _ask(ws, {"type": "state"})
            assert state["data"]["step_count"] == 1


async def test_stadium_envs_keep_reset_first_unless_they_opt_in() -> None:
    async with serve("echo") as server, websockets.connect(_ws(server.url)) as ws:
        reply = await _ask(ws, {"type": "step", "data": {"message": "x"}})
        assert reply["type"] == "error"
        assert reply["data"]["code"] == "SESSION_ERROR"

    class Lenient(stadium.Environment[dict[str, Any], dict[str, Any], stadium.State]):
        step_before_reset = True
        blocking = False

        def reset(self, *, seed: int | None = None, options: Any = None) -> dict[str, Any]:
            return {}

        def step(self, action: dict[str, Any]) -> dict[str, Any]:
            return {"got": action}

    async with serve(Lenient) as server, websockets.connect(_ws(server.url)) as ws:
        reply = await _ask(ws, {"type": "step", "data": {"a": 1}})
        assert reply["data"]["observation"] == {"got": {"a": 1}}


# -- MCP on /ws, WS /mcp, tools/call around step() --------------------------------------


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_session_create_as_an_mcp_message_returns_this_sessions_id(transport: str) -> None:
    async with serve("tools", transport=transport) as server:
        async with websockets.connect(_ws(server.url)) as ws:
            created = await _ask(ws, {"type": "mcp", "data": _rpc("openenv/session/create")})
            assert created["type"] == "mcp"
            sid = created["data"]["result"]["session_id"]
            assert isinstance(sid, str)
            assert sid
            again = await _ask(ws, {"type": "mcp", "data": _rpc("openenv/session/create")})
            assert again["data"]["result"]["session_id"] == sid  # the same: no new session
            assert server.runtime.admission.slots.active() == 1
            close = _rpc("openenv/session/close", {"session_id": sid})
            refused = await _ask(ws, {"type": "mcp", "data": close})
            assert refused["data"]["error"]["code"] == -32600
            async with httpx.AsyncClient() as http:  # an HTTP MCP session closed from /ws
                other = (
                    await http.post(server.url + "/mcp", json=_rpc("openenv/session/create"))
                ).json()["result"]["session_id"]
            close = _rpc("openenv/session/close", {"session_id": other})
            closed = await _ask(ws, {"type": "mcp", "data": close})
            assert closed["data"]["result"] == {"session_id": other, "closed": True}


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_json_rpc_over_a_websocket_at_mcp(transport: str) -> None:
    async with serve(NOTES, transport=transport) as server:
        async with websockets.connect(_ws(server.url, "/mcp")) as ws:
            listed = await _ask(ws, _rpc("tools/list"))
            assert {t["name"] for t in listed["result"]["tools"]} >= {"add_note", "count"}
            add = {"name": "add_note", "arguments": {"text": "a"}}
            first = await _ask(ws, _rpc("tools/call", add, 2))
            assert first["id"] == 2
            assert first["result"]["data"] == 1
            second = await _ask(ws, _rpc("tools/call", {**add, "arguments": {"text": "b"}}, 3))
            assert second["result"]["data"] == 2  # the connection's own env keeps its notes
            bad = await _ask(ws, _rpc("tools/call", {"name": "nope"}, 4))
            assert bad["error"]["code"] == -32602
            await ws.send("{not json")
            parse = json.loads(await asyncio.wait_for(ws.recv(), 10 * UNIT))
            assert parse["error"]["code"] == -32700
            assert server.runtime.admission.slots.active() == 1


async def test_ws_mcp_at_capacity_answers_a_json_rpc_error() -> None:
    async with serve(NOTES, max_sessions=1, admission_timeout=0.1 * UNIT) as server:
        async with websockets.connect(_ws(server.url)) as holder:
            await _ask(holder, {"type": "reset"})
            async with websockets.connect(_ws(server.url, "/mcp")) as ws:
                reply = await _ask(ws, _rpc("tools/list"))
                assert reply["error"]["code"] == -32000
                assert reply["error"]["data"]["code"] == "CAPACITY_REACHED"


async def test_tools_call_of_an_mcp_environment_runs_around_step() -> None:
    """OpenEnv 0.10 answers tools/call through the env's MCP client: the env's step
    counter does not move; a ``call_tool`` *step* action still goes through ``step``."""
    async with serve(COUNTING) as server, websockets.connect(_ws(server.url)) as ws:
        await _ask(ws, {"type": "reset"})
        called = await _ask(ws, {"type": "mcp", "data": _rpc("tools/call", {
            "name": "echo", "arguments": {"message": "hi"}})})  # fmt: skip
        assert called["data"]["result"]["data"] == "hi"
        listed = await _ask(ws, {"type": "mcp", "data": _rpc("tools/list")})
        assert [t["name"] for t in listed["data"]["result"]["tools"]] == ["echo"]
        assert "inputSchema" in listed["data"]["result"]["tools"][0]
        assert (await _ask(ws, {"type": "state"}))["data"]["step_count"] == 0
        step = {"type": "call_tool", "tool_name": "echo", "arguments": {"message": "x"}}
        await _ask(ws, {"type": "step", "data": step})
        assert (await _ask(ws, {"type": "state"}))["data"]["step_count"] == 1


async def test_stateless_tools_list_is_answered_at_capacity() -> None:
    async with serve(NOTES, max_sessions=1, admission_timeout=0.1 * UNIT) as server:
        async with websockets.connect(_ws(server.url)) as holder, httpx.AsyncClient() as http:
            await _ask(holder, {"type": "reset"})
            listed = (await http.post(server.url + "/mcp", json=_rpc("tools/list"))).json()
            assert {t["name"] for t in listed["result"]["tools"]} >= {"add_note"}
            call = _rpc("tools/call", {"name": "count", "arguments": {}})
            refused = (await http.post(server.url + "/mcp", json=call)).json()
            assert refused["error"]["code"] == -32000  # a call runs the env: it needs a slot
            assert server.runtime.admission.slots.active() == 1


# -- the web interface's JSON endpoints ----------------------------------------------------


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_web_interface_json_endpoints(
    transport: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ENABLE_WEB_INTERFACE", "true")
    async with serve("echo", transport=transport) as server, httpx.AsyncClient() as http:
        root = await http.get(server.url + "/")
        assert root.status_code == 307
        assert root.headers["location"] == "/web/"
        reset = (await http.post(server.url + "/web/reset", json={})).json()
        assert reset["done"] is False
        step = await http.post(server.url + "/web/step", json={"action": {"message": "hey"}})
        assert step.status_code == 200, step.text
        assert step.json()["observation"]["echoed_message"] == "hey"
        chat = await http.post(server.url + "/web/step", json={"message": "yo"})
        assert chat.json()["observation"]["echoed_message"] == "yo"
        state = (await http.get(server.url + "/web/state")).json()
        assert state["step_count"] == 2  # one env, shared by the page's requests
        meta = (await http.get(server.url + "/web/metadata")).json()
        assert meta["name"] == "echo"
        bad = await http.post(server.url + "/web/step", json={"action": {"msg": 1}})
        assert bad.status_code == 422


async def test_web_json_endpoints_are_off_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ENABLE_WEB_INTERFACE", raising=False)
    async with serve("echo") as server, httpx.AsyncClient() as http:
        assert (await http.post(server.url + "/web/reset", json={})).status_code == 404
        assert (await http.get(server.url + "/")).status_code == 404


WEB_APP = f"{ROOT / 'tests/openenv_compat/web_app.py'}"


async def test_an_app_with_openenv_s_web_interface_serves_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """OpenEnv 0.10's tests/core/test_web_interface.py, against Stadium serving the app
    (without ENABLE_WEB_INTERFACE: the app has its web interface): the root's and /web's
    redirects, a reset with no body or keywords the env does not take, state before a
    reset answering 409."""
    pytest.importorskip("gradio")
    monkeypatch.delenv("ENABLE_WEB_INTERFACE", raising=False)
    async with serve(f"{WEB_APP}:app") as server, httpx.AsyncClient() as http:
        url = server.url
        for path in ("/", "/web"):
            moved = await http.get(url + path, follow_redirects=False)
            assert moved.status_code == 307, path
            assert moved.headers["location"] == "/web/"
        assert (await http.get(url + "/web/")).status_code == 200  # Stadium's page
        no_body = await http.post(url + "/web/reset")
        assert no_body.status_code == 200, no_body.text
        assert no_body.json()["observation"]["response"] == "reset"
        extra = await http.post(url + "/web/reset", json={"unused": "value"})
        assert extra.status_code == 200, extra.text
        assert extra.json()["observation"]["response"] == "reset"
        state = await http.get(url + "/web/state")
        assert state.status_code == 200
        assert state.json()["last_reset_marker"] == "default"
    async with serve(f"{WEB_APP}:not_ready_app") as server, httpx.AsyncClient() as http:
        early = await http.get(server.url + "/web/state")
        assert early.status_code == 409
        assert "Call reset() first" in early.json()["detail"]


# -- the Task API ------------------------------------------------------------------------------


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_task_api_where_the_env_provides_it(transport: str) -> None:
    async with serve(GREETER, transport=transport) as server, httpx.AsyncClient() as http:
        url = server.url
        assert (await http.get(url + "/list_environments")).json() == ["Greeter"]
        splits = (await http.get(url + "/greeter/splits")).json()
        assert splits == [{"name": "train", "type": "train"}, {"name": "hard", "type": "test"}]
        got = await http.post(url + "/Greeter/num_tasks", json={"split": "train"})
        assert got.json() == {"num_tasks": 3}
        task = await http.post(url + "/Greeter/task", json={"split": "train", "index": 1})
        assert task.json() == {"task": {"id": "train-1"}}
        ranged = await http.post(url + "/Greeter/task_range", json={"split": "t", "start": 1})
        assert ranged.json() == {"tasks": [{"id": "t-1"}, {"id": "t-2"}]}
        missing = await http.post(url + "/Greeter/tasks", json={"split": "train"})
        assert missing.status_code == 501  # list_tasks is not provided
        out = await http.post(url + "/Greeter/task", json={"split": "train", "index": 9})
        assert out.status_code == 400
        assert (await http.get(url + "/other/splits")).status_code == 404
        assert (await http.post(url + "/Greeter/task", json={"split": 1})).status_code == 422
        assert server.runtime.admission.slots.active() == 0


async def test_no_task_api_for_envs_without_tasks() -> None:
    async with serve("echo") as server, httpx.AsyncClient() as http:
        assert (await http.get(server.url + "/list_environments")).status_code == 404


# -- info.version ---------------------------------------------------------------------------


async def test_openapi_info_version_of_an_openenv_env_is_openenvs_api_version() -> None:
    async with serve(GREETER) as server, httpx.AsyncClient() as http:
        info = (await http.get(server.url + "/openapi.json")).json()["info"]
    assert info["version"] == "1.0.0"  # what OpenEnv's server reports: openenv-http/1.x
    assert info["x-env-version"] == GREETER.version
    assert msgspec.json.decode(msgspec.json.encode(info))["title"] == "Greeter"

"""MCP tool environments: OpenEnv's ``MCPEnvironment`` and Stadium's ``ToolEnvironment``.

Served by Stadium, reached by OpenEnv's own ``MCPToolClient`` (``POST /mcp`` with
its ``openenv/session/*`` sessions, step actions over ``/ws``), by raw ``"mcp"``
WebSocket messages (per-session tools) and by stateless ``POST /mcp``; JSON-RPC
errors come back as error objects and the session lives on.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
from pathlib import Path
from typing import Any

import httpx
import pytest
import websockets

import stadium
from stadium._core import mcp as _mcp
from stadium._env.tool_env import CallToolAction, ListToolsAction, compile_tools
from stadium.envs.tools import NotesEnv
from tests.conftest import TRANSPORTS, UNIT, serve, wait_until

mcp_client = pytest.importorskip("openenv.core.mcp_client")
mcp_types = pytest.importorskip("openenv.core.env_server.mcp_types")
MCPToolClient = mcp_client.MCPToolClient

ROOT = Path(__file__).resolve().parents[1]
OPENENV_NOTES = f"{ROOT / 'tests/openenv_compat/mcp_notes.py'}:OpenEnvNotes"
TARGETS = {"openenv": OPENENV_NOTES, "native": "tools"}
#: Envs in the worker, and in a process of each session's own (``--isolation process``,
#: one transport): the same answers.
WHERE = [
    *[(transport, "none") for transport in TRANSPORTS],
    pytest.param("picows", "process", marks=pytest.mark.slow),
]


@contextlib.asynccontextmanager
async def _serve(target: str, transport: str, isolation: str, **kwargs: Any) -> Any:
    if isolation != "none":
        kwargs["isolation"] = isolation
    async with serve(target, transport, **kwargs) as server:
        if isolation != "none":  # the template imports OpenEnv and FastMCP: seconds here
            await asyncio.wait_for(server.runtime.isolation.ready(), 60 * UNIT)
        yield server


def _rpc(method: str, params: dict[str, Any] | None = None, rid: int = 1) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "method": method, "params": params or {}, "id": rid}


def _ws_url(url: str) -> str:
    return url.replace("http://", "ws://") + "/ws"


async def _ask(ws: Any, message: dict[str, Any]) -> dict[str, Any]:
    await ws.send(json.dumps(message))
    reply: dict[str, Any] = json.loads(await asyncio.wait_for(ws.recv(), 10 * UNIT))
    return reply


async def _mcp_ws(ws: Any, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
    reply = await _ask(ws, {"type": "mcp", "data": _rpc(method, params, 5), "id": 9})
    assert reply["type"] == "mcp"
    assert reply["id"] == 9
    data: dict[str, Any] = reply["data"]
    assert data["jsonrpc"] == "2.0"
    assert data["id"] == 5
    return data


@pytest.mark.parametrize(("transport", "isolation"), WHERE)
@pytest.mark.parametrize("kind", ["openenv", "native"])
async def test_mcp_tool_client_sessions_keep_apart(
    kind: str, transport: str, isolation: str
) -> None:
    """OpenEnv's MCPToolClient lists and calls tools; two clients' notes stay apart."""
    async with (
        _serve(TARGETS[kind], transport, isolation) as server,
        MCPToolClient(base_url=server.url) as one,
        MCPToolClient(base_url=server.url) as two,
    ):
        names = {t.name for t in await one.list_tools()}
        assert "add_note" in names
        tool = await one.get_tool("add_note")
        assert tool is not None
        assert tool.input_schema["properties"]["text"]["type"] == "string"
        assert await one.call_tool("add_note", text="a") == 1
        assert await one.call_tool("add_note", text="b") == 2
        assert await two.call_tool("add_note", text="c") == 1  # its own session's notes
        with pytest.raises(RuntimeError, match="failed"):
            await one.call_tool("no_such_tool")
        # step actions over /ws give OpenEnv's observation shapes
        await one.reset()
        listed = await one.step(mcp_types.ListToolsAction())
        assert isinstance(listed.observation, mcp_types.ListToolsObservation)
        assert "add_note" in {t.name for t in listed.observation.tools}
        called = await one.step(
            mcp_types.CallToolAction(tool_name="add_note", arguments={"text": "x"})
        )
        assert isinstance(called.observation, mcp_types.CallToolObservation)
        assert called.observation.error is None
        assert called.observation.result["data"] == 1  # the WebSocket session's own env
        missing = await one.step(mcp_types.CallToolAction(tool_name="nope", arguments={}))
        assert missing.observation.error.error_type.value == "tool_not_found"
    endpoints = getattr(server, "endpoints", None) or server.app.endpoints
    assert len(endpoints.mcp_sessions) == 0  # closed by the clients
    assert server.runtime.admission.slots.active() == 0


@pytest.mark.parametrize(("transport", "isolation"), WHERE)
async def test_mcp_tool_client_websocket_attaches_to_its_session(
    transport: str, isolation: str
) -> None:
    """MCPToolClient's WebSocket (``/ws?session_id=``) drives its HTTP MCP session's env:
    one slot in all, and reset over the WebSocket is seen by the tools over POST /mcp."""
    async with _serve(OPENENV_NOTES, transport, isolation, max_sessions=1) as server:
        async with MCPToolClient(base_url=server.url) as env:
            assert await env.call_tool("add_note", text="a") == 1
            assert await env.call_tool("add_note", text="b") == 2
            assert server.runtime.admission.slots.active() == 1
            await env.reset()  # over the WebSocket: clears the same env's notes
            assert await env.call_tool("count") == 0
            step = await env.step(mcp_types.CallToolAction(tool_name="add_note", arguments={}))
            assert step.observation.error is not None  # bad arguments, reported in the step
            step = await env.step(
                mcp_types.CallToolAction(tool_name="add_note", arguments={"text": "c"})
            )
            assert step.observation.result["data"] == 1
            assert await env.call_tool("count") == 1
        await wait_until(lambda: not server.runtime.attached, 5 * UNIT, "detached")
        assert server.runtime.admission.slots.active() == 0
        assert not server.runtime.attachable
        # an unknown id: an error frame, then the connection is closed
        async with websockets.connect(_ws_url(server.url) + "?session_id=nope") as ws:
            reply = json.loads(await asyncio.wait_for(ws.recv(), 5 * UNIT))
            assert reply["type"] == "error"
            assert "session_id" in reply["data"]["message"]
            with pytest.raises(websockets.ConnectionClosed):
                await asyncio.wait_for(ws.recv(), 5 * UNIT)


@pytest.mark.parametrize(("transport", "isolation"), WHERE)
@pytest.mark.parametrize("kind", ["openenv", "native"])
async def test_ws_mcp_message_per_session_and_errors(
    kind: str, transport: str, isolation: str
) -> None:
    """The "mcp" message runs on the session's own env; errors are JSON-RPC errors."""
    async with (
        _serve(TARGETS[kind], transport, isolation) as server,
        websockets.connect(_ws_url(server.url)) as a,
        websockets.connect(_ws_url(server.url)) as b,
    ):
        listed = await _mcp_ws(a, "tools/list")
        tools = {t["name"]: t for t in listed["result"]["tools"]}
        assert tools["add_note"]["inputSchema"]["required"] == ["text"]
        call = {"name": "add_note", "arguments": {"text": "1"}}
        assert (await _mcp_ws(a, "tools/call", call))["result"]["data"] == 1
        assert (await _mcp_ws(a, "tools/call", call))["result"]["data"] == 2
        assert (await _mcp_ws(b, "tools/call", call))["result"]["data"] == 1
        unknown_method = await _mcp_ws(a, "tools/frobnicate")
        assert unknown_method["error"]["code"] == _mcp.METHOD_NOT_FOUND
        unknown_tool = await _mcp_ws(a, "tools/call", {"name": "nope"})
        assert unknown_tool["error"]["code"] == _mcp.INVALID_PARAMS
        bad_args = await _mcp_ws(a, "tools/call", {"name": "add_note", "arguments": {"text": 3}})
        assert bad_args["error"]["code"] == _mcp.INVALID_PARAMS
        no_name = await _mcp_ws(a, "tools/call", {"arguments": {}})
        assert no_name["error"]["code"] == _mcp.INVALID_PARAMS
        not_rpc = await _ask(a, {"type": "mcp", "data": {"method": "tools/list"}, "id": 3})
        assert not_rpc["type"] == "mcp"
        assert not_rpc["data"]["error"]["code"] == _mcp.INVALID_REQUEST
        # the session lives on: reset and step still work, notes kept by the tools
        assert (await _ask(a, {"type": "reset", "data": {}}))["type"] == "observation"
        action = {"type": "call_tool", "tool_name": "add_note", "arguments": {"text": "z"}}
        step = await _ask(a, {"type": "step", "data": action})
        assert step["type"] == "observation"
        assert step["data"]["observation"]["result"]["data"] == 1  # reset cleared the notes
        assert (await _mcp_ws(b, "tools/call", call))["result"]["data"] == 2


@pytest.mark.parametrize(("transport", "isolation"), WHERE)
async def test_post_mcp_stateless_and_errors(transport: str, isolation: str) -> None:
    """POST /mcp without a session: a fresh env per request (OpenEnv's); always 200 JSON-RPC."""
    async with _serve("tools", transport, isolation) as server, httpx.AsyncClient() as http:
        url = server.url + "/mcp"
        listed = (await http.post(url, json=_rpc("tools/list"))).json()
        assert {t["name"] for t in listed["result"]["tools"]} >= {"add_note", "calculate"}
        call = _rpc("tools/call", {"name": "add_note", "arguments": {"text": "a"}}, 2)
        for _ in range(2):  # stateless: each request has its own env
            reply = await http.post(url, json=call)
            assert reply.status_code == 200
            assert reply.json()["result"]["data"] == 1
        calc = _rpc("tools/call", {"name": "calculate", "arguments": {"a": 6, "op": "*", "b": 7}})
        assert (await http.post(url, json=calc)).json()["result"]["data"] == 42
        raised = _rpc("tools/call", {"name": "calculate", "arguments": {"a": 1, "op": "/", "b": 0}})
        err = (await http.post(url, json=raised)).json()["error"]
        assert err["code"] == _mcp.INTERNAL_ERROR
        assert "ZeroDivisionError" in err["message"]
        for body, code in [
            (b"{}", _mcp.INVALID_REQUEST),
            (b"not json", _mcp.PARSE_ERROR),
            (json.dumps(_rpc("nope")).encode(), _mcp.METHOD_NOT_FOUND),
            (json.dumps(_rpc("tools/list", {"session_id": "gone"})).encode(), _mcp.INVALID_PARAMS),
            (json.dumps(_rpc("tools/list", {"session_id": [1]})).encode(), _mcp.INVALID_PARAMS),
            (
                json.dumps(_rpc("tools/call", {"name": "add_note", "arguments": []})).encode(),
                _mcp.INVALID_PARAMS,
            ),
        ]:
            reply = await http.post(url, content=body)
            assert reply.status_code == 200
            assert reply.json()["jsonrpc"] == "2.0"
            assert reply.json()["error"]["code"] == code, body
        init = (await http.post(url, json=_rpc("initialize"))).json()["result"]
        assert init["serverInfo"]["name"] == "tools"
        assert "tools" in init["capabilities"]
        # an HTTP MCP session keeps its env (and a slot) until closed
        sid = (await http.post(url, json=_rpc("openenv/session/create"))).json()["result"]
        sid = sid["session_id"]
        assert server.runtime.admission.slots.active() == 1
        in_session = _rpc("tools/call", {"name": "add_note", "arguments": {"text": "a"},
                                          "session_id": sid})  # fmt: skip
        assert (await http.post(url, json=in_session)).json()["result"]["data"] == 1
        assert (await http.post(url, json=in_session)).json()["result"]["data"] == 2
        closed = await http.post(url, json=_rpc("openenv/session/close", {"session_id": sid}))
        assert closed.json()["result"]["closed"] is True
        assert server.runtime.admission.slots.active() == 0
        again = await http.post(url, json=_rpc("openenv/session/close", {"session_id": sid}))
        assert again.json()["error"]["code"] == _mcp.INVALID_PARAMS


async def test_non_tool_env_lists_no_tools() -> None:
    async with serve("echo") as server, httpx.AsyncClient() as http:
        url = server.url + "/mcp"
        assert (await http.post(url, json=_rpc("tools/list"))).json()["result"] == {"tools": []}
        err = (await http.post(url, json=_rpc("tools/call", {"name": "x"}))).json()["error"]
        assert err["code"] == _mcp.INVALID_PARAMS


def test_tool_decorator_schema_and_validation() -> None:
    class Calc(stadium.ToolEnvironment):
        @stadium.tool
        def add(self, a: int, b: int = 2) -> int:
            """Add two numbers.

            More text that is not the description."""
            return a + b

        @stadium.tool(name="shout", description="Upper-case")
        async def loud(self, text: str) -> str:
            return text.upper()

    tools = Calc.tools
    assert set(tools) == {"add", "shout"}
    assert tools["add"].description == "Add two numbers."
    schema = tools["add"].input_schema
    assert schema["required"] == ["a"]
    assert schema["properties"]["b"]["default"] == 2
    assert tools["shout"].is_async
    assert tools["shout"].description == "Upper-case"
    assert {t["name"] for t in stadium.ToolEnvironment.__subclasses__()[-1].tool_list()} >= {"add"}

    async def go() -> None:
        env = Calc()
        assert await env.call_tool("add", {"a": 1}) == 3
        assert await env.call_tool("shout", {"text": "hi"}) == "HI"
        with pytest.raises(stadium.ToolCallError, match=r"\$\.a"):
            await env.call_tool("add", {"a": "x"})
        with pytest.raises(stadium.ToolCallError, match="unknown"):
            await env.call_tool("add", {"a": 1, "c": 2})
        step = await env.step(CallToolAction(tool_name="add", arguments={"a": 5, "b": 5}))
        assert step.observation.result["data"] == 10
        listed = await env.step(ListToolsAction())
        assert {t.name for t in listed.observation.tools or []} == {"add", "shout"}

    asyncio.run(go())
    with pytest.raises(TypeError, match="reserved"):

        class Bad(stadium.ToolEnvironment):
            @stadium.tool
            def reset(self) -> None:  # type: ignore[override]
                pass

    assert compile_tools(NotesEnv)["calculate"].input_schema["properties"]["op"]["enum"]


def test_tools_env_submit_reward_and_check() -> None:
    async def go() -> None:
        env = NotesEnv()
        env.reset()
        for n in ("2", "3", "word"):
            await env.call_tool("add_note", {"text": n})
        result = await env.step(CallToolAction(tool_name="submit", arguments={"answer": 5}))
        assert result.reward == 1.0
        assert result.done
        assert result.observation.result["data"] == 5

    asyncio.run(go())
    actions = [
        ListToolsAction(),
        CallToolAction(tool_name="add_note", arguments={"text": "4"}),
        CallToolAction(tool_name="calculate", arguments={"a": 1, "op": "+", "b": 2}),
        CallToolAction(tool_name="list_notes"),
    ]
    assert stadium.check_env(NotesEnv, steps=4, seed=1, actions=actions)
    assert stadium.check_env(NotesEnv, steps=5, seed=1)  # sample_action
    action = NotesEnv().sample_action(random.Random(0))
    assert isinstance(action, ListToolsAction | CallToolAction)


async def test_mcp_message_in_memory_msgpack_and_order() -> None:
    """MessagePack sessions carry "mcp" too; pipelined requests keep their order; ids echo."""
    import msgspec

    from stadium._core.protocol import Encoding
    from stadium.testing import memory_runtime, open_session

    async with memory_runtime("tools") as rt:
        session, channel = open_session(rt, Encoding.MSGPACK)
        call = _rpc("tools/call", {"name": "add_note", "arguments": {"text": "n"}}, 4)
        for i in range(3):  # pipelined: queued behind each other, answered in order
            session.feed(msgspec.msgpack.encode({"type": "mcp", "data": call, "id": i}))
        for i in range(3):
            reply = msgspec.msgpack.decode(await channel.next_frame(5 * UNIT))
            assert reply["type"] == "mcp"
            assert reply["id"] == i
            assert reply["data"]["result"]["data"] == i + 1
        empty = msgspec.msgpack.decode(
            await channel.request(session, msgspec.msgpack.encode({"type": "mcp"}), 5 * UNIT)
        )
        assert empty["data"]["error"]["code"] == _mcp.INVALID_REQUEST
        unknown = msgspec.msgpack.decode(
            await channel.request(session, msgspec.msgpack.encode({"type": "mcpx"}), 5 * UNIT)
        )
        assert unknown["type"] == "error"
        assert "mcp" in unknown["data"]["message"]
        assert rt.steps_total == 0  # tool calls over MCP are not steps


def test_check_env_exercises_openenv_mcp_tools() -> None:
    """``check_env`` on a served MCPEnvironment: its sample actions call its FastMCP tools,
    and the tool observations fit the declared observation type."""
    from stadium._server.loader import load_target

    env_cls = load_target(OPENENV_NOTES)
    adapter = env_cls()
    try:
        actions = [adapter.sample_action(random.Random(i)) for i in range(12)]
    finally:
        adapter.env.close()
    kinds = {type(a).__name__ for a in actions}
    assert kinds == {"ListToolsAction", "CallToolAction"}
    assert {a.tool_name for a in actions if type(a).__name__ == "CallToolAction"} >= {"add_note"}
    assert stadium.check_env(env_cls, steps=6)


async def test_an_abandoned_http_mcp_session_gives_its_slot_back() -> None:
    """A client that created an HTTP MCP session and vanished does not hold its slot: the
    worker's idle reaper closes the session once it is unused for ``--idle-timeout``."""
    async with serve("tools", idle_timeout=0.2 * UNIT) as server, httpx.AsyncClient() as http:
        url = server.url + "/mcp"
        created = (await http.post(url, json=_rpc("openenv/session/create"))).json()
        sid = created["result"]["session_id"]
        assert server.runtime.admission.slots.active() == 1
        await wait_until(
            lambda: server.runtime.admission.slots.active() == 0, 10 * UNIT, "slot given back"
        )
        gone = await http.post(url, json=_rpc("tools/list", {"session_id": sid}))
        assert gone.json()["error"]["code"] == _mcp.INVALID_PARAMS

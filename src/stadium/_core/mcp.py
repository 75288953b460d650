"""MCP over JSON-RPC 2.0: the one handler of ``POST /mcp`` and the ``"mcp"`` WebSocket message.

A request ``{"jsonrpc": "2.0", "method": ..., "params": {...}, "id": ...}`` is
read by :func:`parse` (msgspec; never raises: a bad request becomes its JSON-RPC
error object) and carried out on one environment instance by :func:`dispatch`:

* ``tools/list`` → ``{"tools": [{"name", "description", "inputSchema"}, ...]}``
* ``tools/call`` (``params.name``, ``params.arguments``) → the call result as
  OpenEnv sends it (``content``, ``structured_content``, ``data``, ``is_error``);
* ``initialize`` and ``ping``, so MCP clients can open the conversation.

Errors are JSON-RPC error objects with the standard codes (the same numbers as
``mcp.types``): ``-32700`` unreadable JSON, ``-32600`` not a request, ``-32601``
unknown method, ``-32602`` unknown tool or bad arguments
(:class:`~stadium.ToolCallError`), ``-32603`` the tool raised.

An env has tools when it has the coroutine methods ``mcp_list_tools()`` and
``mcp_call_tool(name, arguments)``: :class:`~stadium.ToolEnvironment` and the
adapter of OpenEnv's ``MCPEnvironment`` (which runs them through FastMCP). An
env without them lists no tools. The JSON-RPC envelope is parsed here with
msgspec rather than ``mcp.types``' pydantic models, so that native tool envs
need no MCP package; OpenEnv's MCP envs run their tools with FastMCP itself.

The session layer (``session``: per-session env, the ``"mcp"`` message) and the
HTTP layer (``endpoints``: ``POST /mcp``, OpenEnv's ``openenv/session/*`` methods)
decide which instance a request runs on; this module only speaks JSON-RPC.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import msgspec

from stadium._errors import StadiumError, ToolCallError

PARSE_ERROR = -32700
INVALID_REQUEST = -32600
METHOD_NOT_FOUND = -32601
INVALID_PARAMS = -32602
INTERNAL_ERROR = -32603
SERVER_ERROR = -32000
"""Implementation-defined: e.g. no session slot free (OpenEnv's use)."""

#: The MCP revision ``initialize`` answers with.
MCP_PROTOCOL_VERSION = "2025-06-18"

RpcId = int | str | None


class Request(msgspec.Struct, forbid_unknown_fields=True):
    """A JSON-RPC 2.0 request (a notification when ``id`` is absent)."""

    jsonrpc: Literal["2.0"]
    method: str
    params: dict[str, Any] = {}
    id: int | str | None = None


_DECODER = msgspec.json.Decoder()


def error(rid: RpcId, code: int, message: str, data: Any = None) -> dict[str, Any]:
    """A JSON-RPC error response."""
    err: dict[str, Any] = {"code": code, "message": message}
    if data is not None:
        err["data"] = data
    return {"jsonrpc": "2.0", "id": rid, "error": err}


def success(rid: RpcId, result: Any) -> dict[str, Any]:
    """A JSON-RPC success response."""
    return {"jsonrpc": "2.0", "id": rid, "result": result}


def parse(body: bytes | str) -> Request | dict[str, Any]:
    """Read a ``POST /mcp`` body: the request, or the error response to send. Never raises."""
    try:
        data = _DECODER.decode(body)
    except Exception as exc:  # not JSON, bad UTF-8, nested too deep
        return error(None, PARSE_ERROR, f"Parse error: the body is not JSON ({exc})")
    return request(data)


def request(data: Any) -> Request | dict[str, Any]:
    """Validate decoded JSON as a request: the request, or the error response. Never raises."""
    rid = data.get("id") if isinstance(data, dict) else None
    if not isinstance(rid, int | str) or isinstance(rid, bool):
        rid = None
    try:
        return msgspec.convert(data, Request)
    except msgspec.ValidationError as exc:
        return error(
            rid,
            INVALID_REQUEST,
            f"Invalid Request: {exc}; send "
            '{"jsonrpc": "2.0", "method": "tools/list", "params": {}, "id": 1}',
        )
    except Exception as exc:  # e.g. an integer out of range
        return error(rid, INVALID_REQUEST, f"Invalid Request: {exc}")


def has_tools(env: Any) -> bool:
    """Whether ``env`` serves tools (``mcp_list_tools`` and ``mcp_call_tool``)."""
    return callable(getattr(env, "mcp_call_tool", None)) and callable(
        getattr(env, "mcp_list_tools", None)
    )


async def dispatch(
    env: Any,
    req: Request,
    *,
    server: tuple[str, str] = ("stadium", ""),
    describe: Callable[[BaseException], str] = repr,
) -> dict[str, Any]:
    """Carry out ``req`` on ``env``: the JSON-RPC response. Never raises for what
    the request or the env's tools do (a tool that raises is ``-32603``, its text
    made by ``describe``); ``server`` is the ``(name, version)`` ``initialize`` reports."""
    rid = req.id
    method = req.method
    params = req.params
    try:
        if method == "tools/list":
            tools = await env.mcp_list_tools() if has_tools(env) else []
            return success(rid, {"tools": tools})
        if method == "tools/call":
            name = params.get("name")
            if not isinstance(name, str) or not name:
                return error(rid, INVALID_PARAMS, "Invalid params: 'name' (a string) is required")
            arguments = params.get("arguments")
            if arguments is None:
                arguments = {}
            if not isinstance(arguments, dict):
                return error(rid, INVALID_PARAMS, "Invalid params: 'arguments' must be an object")
            if not has_tools(env):
                raise ToolCallError(f"unknown tool {name!r}: this environment has no tools")
            return success(rid, await env.mcp_call_tool(name, arguments))
        if method == "initialize":
            return success(
                rid,
                {
                    "protocolVersion": MCP_PROTOCOL_VERSION,
                    "capabilities": {"tools": {"listChanged": False}},
                    "serverInfo": {"name": server[0], "version": server[1]},
                },
            )
        if method == "ping":
            return success(rid, {})
        return error(
            rid,
            METHOD_NOT_FOUND,
            f"Method not found: {method!r}; this server answers tools/list, tools/call, "
            "initialize and ping",
        )
    except ToolCallError as exc:
        return error(rid, INVALID_PARAMS, exc.message, exc.context or None)
    except StadiumError as exc:
        return error(rid, INTERNAL_ERROR, exc.message, exc.to_wire())
    except Exception as exc:
        return error(rid, INTERNAL_ERROR, describe(exc), {"exception": type(exc).__name__})


__all__ = [
    "INTERNAL_ERROR",
    "INVALID_PARAMS",
    "INVALID_REQUEST",
    "METHOD_NOT_FOUND",
    "PARSE_ERROR",
    "SERVER_ERROR",
    "Request",
    "dispatch",
    "error",
    "has_tools",
    "parse",
    "request",
    "success",
]

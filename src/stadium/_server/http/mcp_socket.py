"""JSON-RPC over a WebSocket at ``/mcp`` (OpenEnv 0.10's ``WS /mcp``).

Each connection is a session with its own env (a slot like any ``/ws`` session); each
text frame is one MCP JSON-RPC request (``tools/list``, ``tools/call``, ``initialize``,
``ping``, ``openenv/session/create`` ...) and each reply frame the bare JSON-RPC
response. :class:`McpSocket` is a :class:`~stadium._server.sessions.runner.Session` with a
frame adapter each way: a request goes in as the ``{"type": "mcp", "data": ...}``
message of ``/ws``, and the session's ``mcp`` reply goes out as its ``data``. A
session error (no slot: ``CAPACITY_REACHED``; the env could not be built) goes out as
a JSON-RPC error ``-32000`` with the error's fields in ``data``, as OpenEnv's.
"""

from __future__ import annotations

from typing import Any

import msgspec

from stadium._core import mcp as _mcp
from stadium._core.access import Tenant
from stadium._core.frames import Request
from stadium._core.protocol import Encoding
from stadium._env.codecs import UNREADABLE, unreadable_detail
from stadium._server.runtime import Channel, Runtime
from stadium._server.sessions.runner import Session


class _Unwrapping:
    """The channel the session sees: its ``mcp`` replies are sent as their JSON-RPC
    response, its error frames as JSON-RPC errors."""

    __slots__ = ("channel",)

    def __init__(self, channel: Channel) -> None:
        self.channel = channel

    def send(self, data: bytes) -> None:
        try:
            frame = msgspec.json.decode(data)
        except msgspec.DecodeError:  # not one of the session's JSON frames: as it is
            self.channel.send(data)
            return
        kind = frame.get("type") if isinstance(frame, dict) else None
        body = frame.get("data") if isinstance(frame, dict) else None
        if kind == "mcp":
            self.channel.send(msgspec.json.encode(body))
        elif kind == "error" and isinstance(body, dict):
            message = str(body.get("message", "error"))
            reply = _mcp.error(frame.get("id"), _mcp.SERVER_ERROR, message, body)
            self.channel.send(msgspec.json.encode(reply))
        else:
            self.channel.send(data)

    def close(self, code: int, reason: str) -> None:
        self.channel.close(code, reason)


class McpSocket:
    """One ``WS /mcp`` connection: a session fed JSON-RPC requests (see the module)."""

    __slots__ = ("channel", "session")

    def __init__(
        self,
        runtime: Runtime,
        channel: Channel,
        client: str | None = None,
        tenant: Tenant | None = None,
    ) -> None:
        self.channel = channel
        self.session = Session(
            runtime, _Unwrapping(channel), Encoding.JSON, client=client, tenant=tenant
        )
        self.session.start()

    def feed(self, message: bytes) -> None:
        """One JSON-RPC request frame; a frame that is not JSON is answered ``-32700``."""
        try:
            msgspec.json.decode(message)
        except UNREADABLE as exc:
            reply = _mcp.error(None, _mcp.PARSE_ERROR, f"Parse error: {unreadable_detail(exc)}")
            self.channel.send(msgspec.json.encode(reply))
            return
        self.session.feed(msgspec.json.encode(Request("mcp", msgspec.Raw(message))))

    def connection_lost(self, channel: Any = None) -> None:
        self.session.connection_lost()

    @property
    def outcome(self) -> str:
        return self.session.outcome

    @outcome.setter
    def outcome(self, value: str) -> None:
        self.session.outcome = value


__all__ = ["McpSocket"]

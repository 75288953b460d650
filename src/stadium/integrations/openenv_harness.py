"""OpenEnv 0.10's ``WS /harness`` (RFC 005): one agentic harness per connection.

What the env side of the route does, as OpenEnv's ``HTTPEnvServer`` does it: served for a
``HarnessEnvironment`` in production mode; on connect the session's env is reset (its MCP
client session opened around the connection, the harness process started with the env's
tools injected) and ``{"type": "session_started", "data": {"session_id", "harness"}}``
sent; each ``{"type": "message", "content": "..."}`` frame runs one turn, its
``HarnessEvent`` frames streamed as the adapter yields them, the last a
``turn_complete``. A frame that is not JSON or not such a message is answered with a
recoverable ``{"type": "protocol_error", "data": {"message", "code"}}`` (``INVALID_JSON``,
``VALIDATION_ERROR``) and no turn starts. A turn longer than the adapter's
``session_timeout_s``, a harness not running, a turn that raised or whose stream ended
without ``turn_complete`` end the session with a terminal ``error`` event (the adapter's
exception is not sent: it may hold credentials or process output). The connection side
(slots, queueing, closing) is :mod:`stadium._server.http.harness_socket`. The frames
Stadium writes itself (``error``, ``protocol_error``, ``session_started``) are the core's
:class:`~stadium._core.frames.Reply` (``{"type", "data"}``, compact JSON as OpenEnv's
``model_dump_json``); the ``HarnessEvent`` frames are OpenEnv's own models.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Callable
from typing import Any

import msgspec

from stadium._core.frames import Reply

_HARNESS_ENVIRONMENT = "openenv.core.harness.environment"
_JSON = msgspec.json.Encoder()


def is_harness_environment(env_cls: Any) -> bool:
    """Whether ``env_cls`` (a Stadium adapter of an OpenEnv env) wraps a
    ``HarnessEnvironment`` (never imports openenv: such a class has imported it)."""
    module = sys.modules.get(_HARNESS_ENVIRONMENT)
    owner = getattr(env_cls, "openenv_class", None)
    return (
        module is not None
        and isinstance(owner, type)
        and issubclass(owner, module.HarnessEnvironment)
    )


def _openenv_env(stadium_env: Any) -> Any:
    """The OpenEnv env a Stadium adapter wraps (the env itself otherwise)."""
    return getattr(stadium_env, "env", stadium_env)


def error_frame(message: str, code: str) -> bytes:
    """OpenEnv's ``WSErrorResponse``: the session could not start or failed."""
    return _JSON.encode(Reply("error", {"message": message, "code": code}))


def protocol_error(message: str, code: str) -> bytes:
    """OpenEnv's ``HarnessProtocolError``: a recoverable rejection of a client frame."""
    return _JSON.encode(Reply("protocol_error", {"message": message, "code": code}))


def harness_error(message: str) -> bytes:
    """A terminal ``error`` ``HarnessEvent``: the turn failed, the session ends."""
    from openenv.core.harness.events import HarnessEvent, HarnessEventType

    event = HarnessEvent(type=HarnessEventType.ERROR, data={"message": message,
                                                              "recoverable": False})  # fmt: skip
    frame: str = event.model_dump_json()
    return frame.encode()


async def start(stadium_env: Any, session_id: str) -> bytes:
    """Open the env's MCP client session (kept until the env is closed) and reset it,
    which starts the harness; the ``session_started`` frame."""
    opener = getattr(stadium_env, "_mcp_open", None)
    if callable(opener):
        await opener()
    env = _openenv_env(stadium_env)
    await env.reset_async()
    return session_frame(session_id, env.adapter.config.name)


def session_frame(session_id: str, harness: str) -> bytes:
    """The ``session_started`` frame: the session's id and the harness's name."""
    return _JSON.encode(Reply("session_started", {"session_id": session_id, "harness": harness}))


def client_message(raw: bytes) -> str | bytes:
    """A client frame's turn content, or the ``protocol_error`` frame answering it
    (validated by OpenEnv's own ``HarnessClientMessage``, with its messages)."""
    from openenv.core.harness.events import HarnessClientMessage
    from pydantic import ValidationError

    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        return protocol_error(f"Invalid JSON: {exc}", "INVALID_JSON")
    except UnicodeDecodeError as exc:
        return protocol_error(f"Invalid JSON: {exc}", "INVALID_JSON")
    try:
        message = HarnessClientMessage(**data)
    except (ValidationError, TypeError) as exc:
        return protocol_error(f"Invalid message: {exc}", "VALIDATION_ERROR")
    content: str = message.content
    return content


async def turn(
    stadium_env: Any, content: str, send: Callable[[bytes], None], touch: Callable[[], None]
) -> tuple[str, BaseException | None] | None:
    """Run one turn, each event sent as the adapter yields it (``touch`` after each, the
    session's activity); ``None`` when it ended with ``turn_complete``, else the message
    of the terminal error to send (the session then ends) and the exception, if one."""
    from openenv.core.harness.adapter import HarnessNotRunningError
    from openenv.core.harness.events import HarnessEventType

    adapter = _openenv_env(stadium_env).adapter

    async def stream() -> bool:
        if not await adapter.is_alive():
            raise HarnessNotRunningError("harness process is not running")
        terminal = False
        async for event in adapter.send_message_streaming(content):
            send(event.model_dump_json().encode())
            touch()
            terminal = event.type is HarnessEventType.TURN_COMPLETE
        return terminal

    timeout = adapter.config.session_timeout_s
    try:
        completed = await asyncio.wait_for(stream(), timeout)
    except TimeoutError:
        return f"harness turn exceeded {timeout} seconds", None
    except HarnessNotRunningError:
        return "harness process is not running", None
    except Exception as exc:  # its text may hold credentials or process output: not sent
        return "harness turn failed", exc
    if not completed:
        return "harness event stream ended without a TURN_COMPLETE event", None
    return None


__all__ = [
    "client_message",
    "error_frame",
    "harness_error",
    "is_harness_environment",
    "protocol_error",
    "session_frame",
    "start",
    "turn",
]

"""OpenEnv's session methods sent as an ``mcp`` message on ``/ws``, answered on the session
that received them (:func:`session_method`), as OpenEnv 0.10 answers them."""

from __future__ import annotations

from typing import Any

from stadium._core import mcp as _mcp
from stadium._server.runtime import Runtime

SESSION_METHODS = frozenset({"openenv/session/create", "openenv/session/close"})


async def session_method(
    rt: Runtime, own_id: str, req: _mcp.Request, tenant: str | None = None
) -> dict[str, Any]:
    """OpenEnv's session methods sent as an ``mcp`` message on ``/ws``, as OpenEnv 0.10
    answers them: ``create`` returns this session's own id (no new session); ``close``
    of this session is refused (close the WebSocket instead), of an HTTP MCP session
    (of the same ``tenant``, with ``--tenants``) closes it."""
    if req.method == "openenv/session/create":
        return _mcp.success(req.id, {"session_id": own_id})
    sid = req.params.get("session_id")
    if not isinstance(sid, str) or not sid:
        return _mcp.error(req.id, _mcp.INVALID_PARAMS, "Invalid params - 'session_id' is required")
    if sid == own_id:
        return _mcp.error(
            req.id, _mcp.INVALID_REQUEST,
            "Cannot close active WebSocket-managed session via MCP method",
        )  # fmt: skip
    close = rt.close_mcp_session
    if close is None or not await close(sid, tenant):
        return _mcp.error(req.id, _mcp.INVALID_PARAMS, f"Unknown session_id: {sid}")
    return _mcp.success(req.id, {"session_id": sid, "closed": True})


__all__ = ["SESSION_METHODS", "session_method"]

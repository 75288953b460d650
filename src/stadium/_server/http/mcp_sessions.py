"""OpenEnv's HTTP MCP sessions (``openenv/session/create`` / ``close`` over ``POST /mcp``):
:class:`McpSessions`, one env per session id, per worker process, each holding a session
slot (``doorway``) until it is closed or left unused past ``--idle-timeout``.

What it trusts: the runtime (its invoker, doors, reaper rounds). A session id is the
doorway's (:meth:`~stadium._server.admission.doorway.Doorway.mcp_id`), never the caller's;
a caller's id reaches a session only if the caller's tenant made it (another's is answered
as unknown, by ``POST /mcp``: :mod:`.env_calls`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from stadium._core.access import Tenant
from stadium._env.spec import CallMode
from stadium._server.admission.doorway import Door, Pass
from stadium._server.runtime import CLOSE_GOING_AWAY, Runtime

log = logging.getLogger("stadium.http")


@dataclasses.dataclass(slots=True, eq=False)
class _McpSession:
    env: Any
    lock: asyncio.Lock
    last_used: float
    charged: Pass
    """Its slot and its creator's quota (``doorway``), given back when it closes."""
    tenant: str | None = None
    """Its creator's tenant (``--tenants``): only that tenant's tokens reach it."""


class McpSessions:
    """OpenEnv's HTTP MCP sessions (``openenv/session/create``): an env per session id,
    each holding a session slot until ``openenv/session/close`` or until unused for
    ``--idle-timeout`` seconds (300 by default: ``Runtime.detached_idle_timeout``;
    checked at each create and with each round of the worker's
    idle reaper: a client that vanished does not hold its slot). A WebSocket opened at
    ``/ws?session_id=ID`` drives the same env (``Session(attach=ID)``), as OpenEnv's
    ``MCPToolClient`` does. Per worker process.
    """

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self._sessions: dict[str, _McpSession] = {}
        self._sweeping: asyncio.Task[None] | None = None
        runtime.sweepers.append(self._sweep_soon)
        runtime.close_mcp_session = self.close_for

    def __len__(self) -> int:
        return len(self._sessions)

    def _idle(self) -> list[str]:
        limit = self.runtime.detached_idle_timeout
        if limit <= 0:
            return []
        now = asyncio.get_running_loop().time()
        attached = self.runtime.attached
        return [
            sid
            for sid, s in self._sessions.items()
            if now - s.last_used > limit and not s.lock.locked() and sid not in attached
        ]

    async def _sweep(self) -> None:
        for sid in self._idle():
            log.info(
                "MCP session %s closed (reaped): unused for more than %gs",
                sid, self.runtime.detached_idle_timeout,
            )  # fmt: skip
            await self.close(sid, outcome="reaped")

    def _sweep_soon(self) -> None:
        """The reaper's round: close the idle sessions (in a task: closing awaits the env)."""
        if self._sessions and self._sweeping is None and self._idle():
            task = self._sweeping = asyncio.get_running_loop().create_task(self._sweep())
            task.add_done_callback(self._swept)

    def _swept(self, task: asyncio.Task[None]) -> None:
        self._sweeping = None
        if not task.cancelled() and task.exception() is not None:
            log.warning("closing idle MCP sessions failed: %r", task.exception())

    async def create(self, client: str | None = None, tenant: Tenant | None = None) -> str:
        """Open a session of ``client`` (``Door.MCP_CREATE``: its quota until it closes): its
        id. Raises :class:`~stadium.CapacityError` over the quota or when no slot frees."""
        rt = self.runtime
        loop = asyncio.get_running_loop()
        now = loop.time()
        await self._sweep()
        charged = await rt.doors.admit_waiting(Door.MCP_CREATE, client, now, tenant)
        try:
            env = await rt.invoke.call(loop, rt.spec.create_mode, rt.new_env)
        except BaseException:
            rt.doors.release(charged, loop.time())
            raise
        sid = rt.doors.mcp_id()
        owner = None if tenant is None else tenant.name
        self._sessions[sid] = _McpSession(env, asyncio.Lock(), now, charged, owner)
        rt.attachable[sid] = env
        rt.attachable_tenant[sid] = owner
        return sid

    async def run(self, sid: str, call: Callable[[Any], Any], tenant: str | None = None) -> Any:
        """``await call(env)`` on session ``sid``'s env, one call at a time; ``None`` if
        there is no such session (of ``tenant``). Raises :class:`~stadium.CallTimeoutError`
        past ``--step-timeout``."""
        session = self._sessions.get(sid)
        if session is None or session.tenant != tenant:
            return None
        async with session.lock:
            loop = asyncio.get_running_loop()
            session.last_used = loop.time()  # bounded by --step-timeout, as on /ws
            return await self.runtime.invoke.call(loop, CallMode.TASK, call, session.env)

    async def close_for(self, sid: str, tenant: str | None) -> bool:
        """Close session ``sid`` if ``tenant`` made it: whether it did (another's: as none)."""
        session = self._sessions.get(sid)
        return session is not None and session.tenant == tenant and await self.close(sid)

    async def close(self, sid: str, outcome: str = "completed") -> bool:
        """Close session ``sid`` (its env closed, its slot freed, counted as ``outcome``
        in ``stadium_sessions_total``); whether it existed."""
        session = self._sessions.pop(sid, None)
        if session is None:
            return False
        rt = self.runtime
        rt.outcomes[outcome] += 1
        rt.attachable.pop(sid, None)
        rt.attachable_tenant.pop(sid, None)
        attached = rt.attached.get(sid)
        if attached is not None:  # its WebSocket goes with it
            attached.close(CLOSE_GOING_AWAY, "the MCP session was closed")
        try:
            if rt.spec.has_close:
                async with session.lock:
                    loop = asyncio.get_running_loop()
                    await rt.invoke.call(loop, rt.spec.close_mode, session.env.close)
        except Exception as exc:
            rt.env_raised("closing an MCP session's environment raised", exc)
        finally:
            rt.doors.release(session.charged, asyncio.get_running_loop().time())
        return True

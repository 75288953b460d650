"""OpenEnv 0.10's ``WS /harness`` (RFC 005): a session whose frames are harness turns.

Served where OpenEnv serves it: an OpenEnv ``HarnessEnvironment`` in production mode
(:attr:`~stadium._server.http.endpoints.HttpEndpoints.harness`). Each connection is a session
like any ``/ws`` one (a slot, queued for at capacity, refused with ``CAPACITY_REACHED``;
its env built by the worker and closed when the connection ends), whose requests are not
the session protocol's: on open the env is reset (which starts the harness) and
``session_started`` sent, then each frame is one turn streamed back as ``HarnessEvent``
frames (the protocol, and what the env side does: :mod:`stadium.integrations.openenv_harness`).
Turns run one at a time, in order; frames sent meanwhile wait (at most ``MAX_PENDING``).
As on OpenEnv, a connected harness session is never reaped for being quiet (a turn may
take long and send nothing), and a failed turn ends the session (close code 1000).
"""

from __future__ import annotations

import asyncio
from typing import Any

from stadium._core.access import Tenant
from stadium._core.protocol import Encoding
from stadium._server.runtime import (
    CLOSE_INTERNAL_ERROR,
    CLOSE_NORMAL,
    MAX_PENDING,
    Channel,
    Phase,
    Runtime,
)
from stadium._server.sessions.runner import Session
from stadium.integrations import openenv_harness as harness


class HarnessSession(Session):
    """One ``WS /harness`` connection (see the module)."""

    __slots__ = ("_frames",)

    def __init__(
        self,
        runtime: Runtime,
        channel: Channel,
        client: str | None = None,
        tenant: Tenant | None = None,
    ) -> None:
        super().__init__(runtime, channel, Encoding.JSON, client=client, tenant=tenant)
        self._frames: asyncio.Queue[bytes] = asyncio.Queue()

    def feed(self, message: Any) -> None:
        """One client frame: queued for the turn loop (which starts once the env is up)."""
        self.last_active = self.loop.time()
        if self.phase >= Phase.CLOSING:
            return
        if self._frames.qsize() >= MAX_PENDING:
            self.channel.send(harness.protocol_error(
                f"more than {MAX_PENDING} messages queued behind the running turn; wait for "
                "its turn_complete before sending more", "SESSION_ERROR"))  # fmt: skip
            return
        self._frames.put_nowait(bytes(message))

    @property
    def busy(self) -> bool:
        """Never idle while open (OpenEnv exempts a live harness from its reaper)."""
        return self.phase is Phase.OPEN

    def _created(self, _token: Any, env: Any, error: BaseException | None) -> None:
        super()._created(_token, env, error)
        if self.phase is Phase.OPEN and self.env is not None:
            self._task = self.loop.create_task(self._run())

    def _fail_start(self, exc: BaseException) -> None:
        self.outcome = "errored"
        self.runtime.env_raised("creating the environment failed", exc, self)
        detail = f"creating the environment failed: {self.runtime.describe(exc)}"
        self.channel.send(harness.error_frame(detail, "FACTORY_ERROR"))
        self.phase = Phase.CLOSING
        self._finish_close(CLOSE_INTERNAL_ERROR, "environment could not be created")

    async def _run(self) -> None:
        env = self.env
        try:
            started = await harness.start(env, self.sid)
        except Exception as exc:
            self.runtime.env_raised("starting the harness failed", exc, self)
            self.channel.send(harness.error_frame("harness session failed", "SESSION_ERROR"))
            self._end(CLOSE_INTERNAL_ERROR, "the harness could not be started")
            return
        self.channel.send(started)
        while self.phase is Phase.OPEN:
            content = harness.client_message(await self._frames.get())
            if isinstance(content, bytes):  # a protocol_error: no turn, the session goes on
                self.channel.send(content)
                continue
            self.last_active = self.loop.time()
            failed = await harness.turn(env, content, self.channel.send, self._touch)
            if failed is not None:
                message, raised = failed
                if raised is not None:
                    self.runtime.env_raised("a harness turn raised", raised, self)
                self.channel.send(harness.harness_error(message))
                self._end(CLOSE_NORMAL, message)
                return

    def _touch(self) -> None:
        self.last_active = self.loop.time()

    def _end(self, code: int, reason: str) -> None:
        """Close from inside the turn loop (which then returns: not cancelled)."""
        self.outcome = "errored"
        self._task = None
        self.close(code, reason)


__all__ = ["HarnessSession"]

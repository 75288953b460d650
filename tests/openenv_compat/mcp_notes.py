"""An OpenEnv ``MCPEnvironment`` (FastMCP tools) with per-instance state, for tests.

Serve it with ``stadium serve tests/openenv_compat/mcp_notes.py:OpenEnvNotes``.
"""

from __future__ import annotations

from typing import Any

from fastmcp import FastMCP
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.types import Observation, State


class OpenEnvNotes(MCPEnvironment):
    """Notes kept by each instance, reached through FastMCP tools."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        mcp = FastMCP("notes")
        self.notes: list[str] = []

        @mcp.tool
        def add_note(text: str) -> int:
            """Add a note; returns how many notes this session holds."""
            self.notes.append(text)
            return len(self.notes)

        @mcp.tool
        def count() -> int:
            """How many notes this session holds."""
            return len(self.notes)

        @mcp.tool
        def fail() -> int:
            """Always raises."""
            raise RuntimeError("boom")

        super().__init__(mcp)
        self._state = State(episode_id=None, step_count=0)

    def reset(self, seed: Any = None, episode_id: Any = None, **kwargs: Any) -> Observation:
        self.notes.clear()
        self._state = State(episode_id=episode_id, step_count=0)
        return Observation(done=False, reward=0.0, metadata={"ready": True})

    def _step_impl(self, action: Any, timeout_s: Any = None, **kwargs: Any) -> Observation:
        return Observation(done=False, reward=0.0)

    @property
    def state(self) -> State:
        return self._state

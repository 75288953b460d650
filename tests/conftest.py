"""Shared fixtures: in-process servers on port 0, subprocess servers, a scalable time unit."""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator
from typing import Any

import pytest

from stadium import Server, ServerConfig
from stadium._env import Environment

#: Every timeout in the tests is a multiple of this unit (STADIUM_TEST_UNIT scales it).
UNIT = float(os.environ.get("STADIUM_TEST_UNIT", "1.0"))


@contextlib.asynccontextmanager
async def serve(
    target: str | type[Environment[Any, Any, Any]] = "benchmark", **config: Any
) -> AsyncIterator[Server]:
    """Run a Server in this event loop on 127.0.0.1:0; stop it (drain 0) afterwards."""
    env_cls = None if isinstance(target, str) else target
    name = target if isinstance(target, str) else f"{target.__module__}:{target.__qualname__}"
    config.setdefault("drain_timeout", 0.0)
    server = Server(ServerConfig(target=name, host="127.0.0.1", port=0, **config), env_cls)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


@pytest.fixture
def unit() -> float:
    return UNIT

"""The ``openenv`` arm: OpenEnv's own server serving the benchmark env.

Runs under a Python that has ``openenv`` installed (the project's dev venv, or
a cache venv made by ``stadium bench``); it imports nothing from ``stadium``
and is started by its path::

    python openenv_server.py --port 8000 [--workers N] [--max-sessions M]

The environment mirrors Stadium's ``benchmark`` env: ``step`` awaits
``asyncio.sleep(wait_seconds)`` (``step_async``, so OpenEnv runs it on the
event loop, not in its thread pool) and reports ``waited_seconds``, ``pid``,
``session_hash``, ``host``, ``step_count``; ``reset(state_kb=N)`` makes the
session hold N KB. Served by uvicorn through OpenEnv's ``create_app`` with
``max_concurrent_envs`` = ``--max-sessions`` (per worker), as OpenEnv deploys.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import sys
import time
from typing import Any

from openenv.core.env_server.http_server import create_app  # type: ignore[import-untyped, import-not-found, unused-ignore]
from openenv.core.env_server.interfaces import Environment  # type: ignore[import-untyped, import-not-found, unused-ignore]
from openenv.core.env_server.types import Action, Observation, State  # type: ignore[import-untyped, import-not-found, unused-ignore]

_HOST = socket.gethostname()
MAX_SESSIONS = int(os.environ.get("STADIUM_BENCH_MAX_SESSIONS", "100000"))


class BenchAction(Action):  # type: ignore[misc, unused-ignore]
    """How long the step waits, in seconds."""

    wait_seconds: float = 0.0


class BenchObservation(Observation):  # type: ignore[misc, unused-ignore]
    """Where and how long the step ran."""

    waited_seconds: float = 0.0
    pid: int = 0
    session_hash: str = ""
    host: str = ""
    step_count: int = 0


class BenchState(State):  # type: ignore[misc, unused-ignore]
    """Step count plus the held state's size."""

    state_kb: int = 0


class BenchEnv(Environment[BenchAction, BenchObservation, BenchState]):  # type: ignore[misc, unused-ignore]
    """OpenEnv twin of ``stadium.envs.benchmark.BenchmarkEnv``."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._steps = 0
        self._hash = os.urandom(6).hex()
        self._ballast = b""

    def _obs(self, waited: float, reward: float | None) -> BenchObservation:
        return BenchObservation(
            waited_seconds=waited,
            pid=os.getpid(),
            session_hash=self._hash,
            host=_HOST,
            step_count=self._steps,
            reward=reward,
        )

    def reset(
        self,
        seed: int | None = None,
        episode_id: str | None = None,
        state_kb: int = 0,
        **kwargs: Any,
    ) -> BenchObservation:
        self._steps = 0
        self._ballast = os.urandom(int(state_kb) * 1024) if state_kb else b""
        return self._obs(0.0, None)

    async def reset_async(
        self,
        seed: int | None = None,
        episode_id: str | None = None,
        state_kb: int = 0,
        **kwargs: Any,
    ) -> BenchObservation:
        return self.reset(seed=seed, episode_id=episode_id, state_kb=state_kb)

    def step(self, action: BenchAction, timeout_s: float | None = None, **kwargs: Any) -> Any:
        time.sleep(action.wait_seconds)
        self._steps += 1
        return self._obs(action.wait_seconds, 1.0)

    async def step_async(
        self, action: BenchAction, timeout_s: float | None = None, **kwargs: Any
    ) -> BenchObservation:
        if action.wait_seconds > 0:
            await asyncio.sleep(action.wait_seconds)
        self._steps += 1
        return self._obs(action.wait_seconds, 1.0)

    @property
    def state(self) -> BenchState:
        return BenchState(step_count=self._steps, state_kb=len(self._ballast) // 1024)


def make_app() -> Any:
    """The FastAPI app (uvicorn factory)."""
    return create_app(
        BenchEnv,
        BenchAction,
        BenchObservation,
        env_name="benchmark",
        max_concurrent_envs=MAX_SESSIONS,
        state_cls=BenchState,
    )


def main(argv: list[str] | None = None) -> int:
    """Command line: ``--host``, ``--port``, ``--workers``, ``--max-sessions``."""
    parser = argparse.ArgumentParser(prog="openenv_server")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--max-sessions", type=int, default=100000)
    args = parser.parse_args(argv)
    os.environ["STADIUM_BENCH_MAX_SESSIONS"] = str(args.max_sessions)
    os.environ.setdefault("ENABLE_WEB_INTERFACE", "false")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import uvicorn

    print(f"openenv: listening on http://{args.host}:{args.port}", flush=True)
    uvicorn.run(
        "openenv_server:make_app",
        factory=True,
        host=args.host,
        port=args.port,
        workers=args.workers if args.workers > 1 else None,
        backlog=4096,
        log_level="warning",
        access_log=False,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

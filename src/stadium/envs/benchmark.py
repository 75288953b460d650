"""``benchmark``: the scaling study's environment.

``step`` waits ``wait_seconds`` without blocking the event loop and reports
where it ran (``pid``, ``host``, and ``host_url`` = ``"<hostname>:<port>"`` as the
study's env reports it, ``port`` being the one ``stadium serve`` listens on, from
``STADIUM_PORT``, else ``PORT``); ``reset`` returns at once. ``reset(options={"state_kb": N})``
makes the session hold N KB of state, for memory benchmarks.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket
from typing import Annotated, Any

import msgspec

from stadium._env.contract import Environment, State, StepResult

_HOST = socket.gethostname()
_MAX_STATE_KB = 1024 * 1024


def host_url() -> str:
    """``"<hostname>:<port>"``: this host and the port its server listens on
    (``STADIUM_PORT``, set by ``stadium serve``; else OpenEnv's ``PORT``; else 8000)."""
    port = os.environ.get("STADIUM_PORT") or os.environ.get("PORT") or "8000"
    return f"{_HOST}:{port}"


class BenchmarkAction(msgspec.Struct):
    """How long the step should wait, in seconds (0 to 3600)."""

    wait_seconds: Annotated[float, msgspec.Meta(ge=0.0, le=3600.0)] = 0.0


class BenchmarkObservation(msgspec.Struct):
    """Where and how long the step ran."""

    waited_seconds: float
    pid: int
    session_hash: str
    host: str
    step_count: int
    host_url: str = ""
    """``"<hostname>:<port>"``: the server the session runs on (the study's field)."""


class BenchmarkState(State, kw_only=True):
    """Episode counters plus the size of the held state."""

    state_kb: int = 0


class BenchmarkEnv(Environment[BenchmarkAction, BenchmarkObservation, BenchmarkState]):
    """Waits ``wait_seconds`` per step; reports pid, host and a per-session hash."""

    name = "benchmark"
    version = "1.0"

    __slots__ = ("_ballast", "_hash", "_host_url", "_pid", "_steps")

    def __init__(self) -> None:
        self._pid = os.getpid()  # per instance: workers are forked after import
        self._host_url = host_url()
        self._steps = 0
        self._hash = hashlib.blake2s(os.urandom(8), digest_size=6).hexdigest()
        self._ballast = b""

    async def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> BenchmarkObservation:
        self._steps = 0
        if seed is not None:  # reproducible episodes for a given seed
            self._hash = hashlib.blake2s(
                seed.to_bytes(8, "little", signed=True), digest_size=6
            ).hexdigest()
        if options and "state_kb" in options:
            kb = options["state_kb"]
            if not isinstance(kb, int) or isinstance(kb, bool) or not 0 <= kb <= _MAX_STATE_KB:
                raise ValueError(f"state_kb must be an integer from 0 to {_MAX_STATE_KB}")
            # Real, touched memory (not a lazily mapped zero page).
            self._ballast = os.urandom(kb * 1024) if kb else b""
        return BenchmarkObservation(0.0, self._pid, self._hash, _HOST, 0, self._host_url)

    async def step(self, action: BenchmarkAction) -> StepResult[BenchmarkObservation]:
        wait = action.wait_seconds
        if wait > 0.0:
            await asyncio.sleep(wait)
        self._steps += 1
        return StepResult(
            BenchmarkObservation(wait, self._pid, self._hash, _HOST, self._steps, self._host_url),
            reward=1.0,
        )

    def restore(self, data: bytes) -> None:
        super().restore(data)
        self._pid = os.getpid()  # where this instance runs now, not where it was snapshotted
        self._host_url = host_url()

    @property
    def state(self) -> BenchmarkState:
        return BenchmarkState(step_count=self._steps, state_kb=len(self._ballast) // 1024)

"""Env shapes the in-process path serves, for the isolation parity test: sync and async
calls, an async ``state``, a ``state`` property that does work, a tool env. Each
observation carries the pid of the process it was made in."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import msgspec

import stadium


class Act(msgspec.Struct):
    add: int = 1


class Obs(msgspec.Struct):
    total: int
    pid: int


class Counted(stadium.State):
    total: int = 0


class SyncEnv(stadium.Environment[Act, Obs, Counted]):
    """Sync ``reset``/``step``, a plain ``state`` property."""

    state_type = Counted

    def __init__(self) -> None:
        self.total = 0
        self.steps = 0

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Obs:
        self.total, self.steps = seed or 0, 0
        return Obs(self.total, os.getpid())

    def step(self, action: Act) -> stadium.StepResult[Obs]:
        self.total += action.add
        self.steps += 1
        return stadium.StepResult(Obs(self.total, os.getpid()), reward=float(action.add))

    @property
    def state(self) -> Counted:
        return Counted(step_count=self.steps, total=self.total)


class AsyncEnv(SyncEnv):
    """Async ``reset``/``step``/``close``, and an async ``state`` (a property giving a
    coroutine, awaited by the server)."""

    async def reset(  # type: ignore[override]
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> Obs:
        await asyncio.sleep(0)
        return SyncEnv.reset(self, seed=seed)

    async def step(self, action: Act) -> stadium.StepResult[Obs]:  # type: ignore[override]
        await asyncio.sleep(0)
        return SyncEnv.step(self, action)

    @property
    def state(self) -> Any:
        async def read() -> Counted:
            await asyncio.sleep(0)
            return Counted(step_count=self.steps, total=self.total)

        return read()

    async def close(self) -> None:
        await asyncio.sleep(0)


class SlowStateEnv(AsyncEnv):
    """An async ``state`` that never comes (a minute's sleep): bounded by the server."""

    @property
    def state(self) -> Any:
        async def read() -> Counted:
            await asyncio.sleep(60)
            return Counted()

        return read()


class BusyStateEnv(SyncEnv):
    """A blocking env whose ``state`` property does work: ``total`` ms of it (at most 1 s)."""

    blocking = True

    @property
    def state(self) -> Counted:
        time.sleep(min(self.total, 1000) / 1000)
        return Counted(step_count=self.steps, total=sum(range(self.total + 1)))


class ToolShape(stadium.ToolEnvironment):
    """A tool env: tools as step actions and as MCP ``tools/list`` / ``tools/call``."""

    def __init__(self) -> None:
        self.total = 0

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Any:
        self.total = seed or 0
        return self.tools_observation()

    @stadium.tool
    def add(self, n: int) -> dict[str, int]:
        """Add ``n`` to this session's total; returns it (and the process's pid)."""
        self.total += n
        return {"total": self.total, "pid": os.getpid()}


class LoopSyncEnv(SyncEnv):
    """A sync ``step`` that runs an event loop of its own (``asyncio.run``): it sees no
    running loop in its env process, as on a worker's thread in-process."""

    def step(self, action: Act) -> stadium.StepResult[Obs]:
        async def add() -> int:
            await asyncio.sleep(0)
            return action.add

        return SyncEnv.step(self, Act(asyncio.run(add())))


class LoopAsyncEnv(AsyncEnv):
    """An async ``step`` in a task of the env process's loop: ``asyncio.timeout`` and
    ``current_task`` work, before and after it suspends."""

    async def step(self, action: Act) -> stadium.StepResult[Obs]:  # type: ignore[override]
        assert asyncio.current_task() is not None
        async with asyncio.timeout(60):
            await asyncio.sleep(0.001)
        return SyncEnv.step(self, action)

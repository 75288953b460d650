"""Well-behaved sessions stepping beside the hostile ones (the hostile env's ``echo``)."""

from __future__ import annotations

import asyncio

import stadium
from tests.conftest import wait_until


async def stepping(url: str, n: int, stop: asyncio.Event, progress: list[int] | None = None) -> int:
    """A well-behaved session stepping until ``stop`` (at most 2,000 steps); its step
    count, also kept in ``progress[n]`` as it goes (when given: a test waits on it). Every
    reply must be its own echo: a crossed or lost reply fails the test."""
    steps = 0
    async with stadium.AsyncClient(url) as env:
        await env.reset()
        while not stop.is_set() and steps < 2000:
            step = await env.step({"do": "echo", "arg": f"{n}.{steps}"})
            assert step.observation["text"] == f"{n}.{steps}"
            steps += 1
            if progress is not None:
                progress[n] = steps
            await asyncio.sleep(0.01)
    return steps


async def stepped(
    progress: list[int], since: list[int], others: list[asyncio.Future[int]], limit_s: float
) -> None:
    """Wait (at most ``limit_s``) until every neighbour has stepped past ``since`` (its
    count then), or one of them ended (its result, or its failure, is the test's to
    gather). Waiting on the counts, not on time: a neighbour still opening its session
    under load has not stepped yet."""

    def moved() -> bool:
        return any(o.done() for o in others) or all(
            p > s for p, s in zip(progress, since, strict=True)
        )

    await wait_until(moved, limit_s, "every neighbour session stepped")


async def timed_stepping(url: str, n: int, stop: asyncio.Event) -> tuple[int, float]:
    """:func:`stepping`, timed: its step count and its slowest step's seconds (a worker
    whose event loop stalls shows here)."""
    steps, worst = 0, 0.0
    loop = asyncio.get_running_loop()
    async with stadium.AsyncClient(url) as env:
        await env.reset()
        while not stop.is_set() and steps < 2000:
            start = loop.time()
            step = await env.step({"do": "echo", "arg": f"{n}.{steps}"})
            worst = max(worst, loop.time() - start)
            assert step.observation["text"] == f"{n}.{steps}"
            steps += 1
            await asyncio.sleep(0.01)
    return steps, worst

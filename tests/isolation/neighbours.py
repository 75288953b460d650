"""Well-behaved sessions stepping beside the hostile ones (the hostile env's ``echo``)."""

from __future__ import annotations

import asyncio

import stadium


async def stepping(url: str, n: int, stop: asyncio.Event) -> int:
    """A well-behaved session stepping until ``stop`` (at most 2,000 steps); its step
    count. Every reply must be its own echo: a crossed or lost reply fails the test."""
    steps = 0
    async with stadium.AsyncClient(url) as env:
        await env.reset()
        while not stop.is_set() and steps < 2000:
            step = await env.step({"do": "echo", "arg": f"{n}.{steps}"})
            assert step.observation["text"] == f"{n}.{steps}"
            steps += 1
            await asyncio.sleep(0.01)
    return steps


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

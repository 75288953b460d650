"""One process driving many sessions at once, the way a trainer rolls out a batch.

Usage: ``python examples/many_sessions.py URL [SESSIONS]`` against
``stadium serve wordguess``; without URL it starts its own server.
"""

from __future__ import annotations

import asyncio
import random
import sys

import stadium
from stadium.envs.wordguess import WORDS


async def rollout(url: str, sessions: int) -> float:
    """Play one episode per session with a random-guess policy; return the mean return."""
    async with stadium.SessionPool(url, size=sessions) as pool:
        await pool.reset(seeds=range(sessions))
        returns = [0.0] * sessions
        active = list(range(sessions))
        rng = random.Random(0)
        while active:
            batch = [pool.clients[i] for i in active]
            results = await asyncio.gather(*(c.step({"word": rng.choice(WORDS)}) for c in batch))
            still = []
            for i, result in zip(active, results, strict=True):
                returns[i] += result.reward or 0.0
                if not result.done:
                    still.append(i)
            active = still
    return sum(returns) / sessions


async def main() -> None:
    sessions = int(sys.argv[2]) if len(sys.argv) > 2 else 200
    if len(sys.argv) > 1:
        print(f"mean return: {await rollout(sys.argv[1], sessions):.3f}")
        return
    server = stadium.Server(stadium.ServerConfig(target="wordguess", port=0))
    await server.start()
    try:
        print(f"mean return over {sessions} episodes: {await rollout(server.url, sessions):.3f}")
    finally:
        await server.stop(drain_timeout=0)


if __name__ == "__main__":
    asyncio.run(main())

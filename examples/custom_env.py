"""A complete environment in a few lines, served and driven in one script.

Run it: ``python examples/custom_env.py`` (or serve it with
``stadium serve examples/custom_env.py:CountDown``).
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec

import stadium


class Move(msgspec.Struct):
    take: int  # take 1 to 3 from the pile


class Pile(msgspec.Struct):
    left: int


class CountDown(stadium.Environment[Move, Pile, stadium.State]):
    """Take 1-3 items per turn; reward 1 for taking the last one."""

    blocking = False  # cheap pure Python: run inline on the event loop

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Pile:
        self.left = 10 + (seed or 0) % 5
        return Pile(self.left)

    def step(self, action: Move) -> stadium.StepResult[Pile]:
        if not 1 <= action.take <= 3:
            raise ValueError("take must be 1, 2 or 3")
        self.left = max(0, self.left - action.take)
        return stadium.StepResult(
            Pile(self.left), reward=float(self.left == 0), done=self.left == 0
        )

    def sample_action(self, rng: Any) -> Move:
        return Move(take=rng.randint(1, 3))


async def main() -> None:
    print(stadium.check_env(CountDown)[-1])
    server = stadium.Server(stadium.ServerConfig(target="countdown", port=0), CountDown)
    await server.start()
    try:
        async with stadium.AsyncClient(server.url, observation_type=Pile) as env:
            obs = (await env.reset(seed=3)).observation
            while True:
                result = await env.step({"take": min(3, obs.left)})
                obs = result.observation
                print(f"left={obs.left} reward={result.reward}")
                if result.done:
                    break
    finally:
        await server.stop(drain_timeout=0)


if __name__ == "__main__":
    asyncio.run(main())

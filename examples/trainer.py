"""The rollout loop of a GRPO trainer: one process, hundreds of concurrent sessions.

Each iteration samples ``--prompts`` episodes (seeds) and plays each one
``--group`` times (same seed: same secret word), every episode in its own
session, all at once with the async client. Group-relative advantages
(return minus the group's mean, over its standard deviation) then update a
stand-in policy: per-word logits instead of a language model, sampling only
words consistent with the feedback so far. The shape of the loop — batched
reset, multi-turn batched steps until every episode ends, advantages per
group, a policy update — is the one a GRPO trainer runs against an LLM.

Usage::

    python examples/trainer.py                        # starts its own server, small run
    python examples/trainer.py --prompts 64 --group 8 # 512 concurrent sessions
    python examples/trainer.py --url http://127.0.0.1:8000   # against `stadium serve wordguess`
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import statistics
import time
from typing import Any

import stadium
from stadium.envs.wordguess import WORDS, score


class StandInPolicy:
    """A softmax over the word list, restricted to words consistent with the feedback."""

    def __init__(self, seed: int = 0, lr: float = 0.5) -> None:
        self.logits = dict.fromkeys(WORDS, 0.0)
        self.lr = lr
        self.rng = random.Random(seed)

    def act(self, history: list[tuple[str, str]]) -> str:
        """Sample a guess given the (guess, feedback) pairs of the episode so far."""
        candidates = [w for w in WORDS if all(score(w, g) == f for g, f in history)] or list(WORDS)
        weights = [math.exp(self.logits[w]) for w in candidates]
        return self.rng.choices(candidates, weights)[0]

    def update(self, episodes: list[list[str]], advantages: list[float]) -> None:
        """REINFORCE-style step on the sampled words, weighted by their episode's advantage."""
        for words, adv in zip(episodes, advantages, strict=True):
            for word in words:
                self.logits[word] += self.lr * adv / len(words)


def group_advantages(returns: list[float], group: int) -> list[float]:
    """GRPO's advantages: each return normalised within its group of the same prompt."""
    out: list[float] = []
    for start in range(0, len(returns), group):
        chunk = returns[start : start + group]
        mean = statistics.fmean(chunk)
        std = statistics.pstdev(chunk) or 1.0
        out.extend((r - mean) / std for r in chunk)
    return out


async def rollout(
    pool: stadium.SessionPool[Any], policy: StandInPolicy, seeds: list[int]
) -> tuple[list[float], list[list[str]], int]:
    """Play one episode per session; return returns, the words each guessed, steps taken."""
    n = len(pool)
    firsts = await pool.reset(seeds=seeds)
    assert all(not r.done for r in firsts)
    returns = [0.0] * n
    histories: list[list[tuple[str, str]]] = [[] for _ in range(n)]
    active = list(range(n))
    steps = 0
    while active:
        guesses = {i: policy.act(histories[i]) for i in active}
        results = await asyncio.gather(
            *(pool.clients[i].step({"word": guesses[i]}) for i in active)
        )
        steps += len(active)
        still = []
        for i, result in zip(active, results, strict=True):
            returns[i] += result.reward or 0.0
            histories[i].append((guesses[i], result.observation["feedback"]))
            if not result.done:
                still.append(i)
        active = still
    return returns, [[g for g, _ in h] for h in histories], steps


async def train(url: str, prompts: int, group: int, iterations: int) -> None:
    policy = StandInPolicy()
    sessions = prompts * group
    async with stadium.SessionPool(url, size=sessions) as pool:
        print(f"{sessions} concurrent sessions ({prompts} prompts x {group} rollouts) at {url}")
        for it in range(iterations):
            started = time.perf_counter()
            base = it * prompts
            seeds = [base + p for p in range(prompts) for _ in range(group)]
            returns, episodes, steps = await rollout(pool, policy, seeds)
            policy.update(episodes, group_advantages(returns, group))
            elapsed = time.perf_counter() - started
            solved = sum(r >= 1.0 for r in returns) / sessions
            print(
                f"iteration {it}: mean return {statistics.fmean(returns):.3f}, "
                f"solved {solved:.0%}, {steps} steps in {elapsed:.2f}s "
                f"({steps / elapsed:,.0f} steps/s)"
            )


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", help="a server running `stadium serve wordguess`")
    parser.add_argument("--prompts", type=int, default=16, help="episodes (seeds) per iteration")
    parser.add_argument("--group", type=int, default=8, help="rollouts per prompt (GRPO's G)")
    parser.add_argument("--iterations", type=int, default=3)
    args = parser.parse_args()
    if args.url:
        await train(args.url, args.prompts, args.group, args.iterations)
        return
    server = stadium.Server(stadium.ServerConfig(target="wordguess", port=0))
    await server.start()
    try:
        await train(server.url, args.prompts, args.group, args.iterations)
    finally:
        await server.stop(drain_timeout=0)


if __name__ == "__main__":
    asyncio.run(main())

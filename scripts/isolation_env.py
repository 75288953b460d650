"""The env of scripts/bench-isolation.py: ``echo`` steps, or ``burn`` (``ms`` of pure Python)."""

from __future__ import annotations

import time

import msgspec

import stadium


class Work(msgspec.Struct):
    burn_ms: float = 0.0


class Done(msgspec.Struct):
    steps: int


class BenchEnv(stadium.Environment[Work, Done, stadium.State]):
    """Answers each step at once, or after ``burn_ms`` of CPU (a sync, GIL-bound env)."""

    blocking = True

    def __init__(self) -> None:
        self.steps = 0

    def reset(self, *, seed: int | None = None, options: dict[str, object] | None = None) -> Done:
        self.steps = 0
        return Done(0)

    def step(self, action: Work) -> stadium.StepResult[Done]:
        if action.burn_ms:
            end = time.perf_counter() + action.burn_ms / 1000
            while time.perf_counter() < end:
                pass
        self.steps += 1
        return stadium.StepResult(Done(self.steps), reward=1.0)

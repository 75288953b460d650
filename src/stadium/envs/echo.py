"""``echo``: echoes a message back; the reward is the message length / 10."""

from __future__ import annotations

import random
from typing import Any

import msgspec

from stadium._env.contract import Environment, State, StepResult


class EchoAction(msgspec.Struct):
    """The message to echo."""

    message: str


class EchoObservation(msgspec.Struct):
    """The echoed message and its length."""

    echoed_message: str
    message_length: int = 0


class EchoEnv(Environment[EchoAction, EchoObservation, State]):
    """Echoes each message back, with reward ``len(message) / 10``."""

    name = "echo"
    version = "1.0"
    blocking = False  # pure Python and cheap: runs inline on the event loop

    def __init__(self) -> None:
        self._state = State()

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> EchoObservation:
        self._state = State(step_count=0)
        return EchoObservation(echoed_message="Echo environment ready!")

    def step(self, action: EchoAction) -> StepResult[EchoObservation]:
        self._state.step_count += 1
        text = action.message
        return StepResult(EchoObservation(text, len(text)), reward=len(text) * 0.1)

    def sample_action(self, rng: random.Random) -> EchoAction:
        """A random message (used by ``check_env``)."""
        return EchoAction(message="".join(rng.choice("abcdef ") for _ in range(rng.randint(1, 20))))

    @property
    def state(self) -> State:
        return self._state

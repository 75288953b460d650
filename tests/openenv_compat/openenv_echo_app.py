"""An OpenEnv (0.10) echo environment served by OpenEnv's own server, for client tests.

Run: ``python -m uvicorn tests.openenv_compat.openenv_echo_app:app --port P``.
"""

from __future__ import annotations

from typing import Any

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State


class EchoAction(Action):
    message: str


class EchoObservation(Observation):
    echoed_message: str = ""


class OpenEnvEcho(Environment[EchoAction, EchoObservation, State]):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = State(episode_id="e", step_count=0)

    def reset(
        self, seed: int | None = None, episode_id: str | None = None, **kw: Any
    ) -> EchoObservation:
        self._state = State(episode_id=episode_id or "e", step_count=0)
        return EchoObservation(echoed_message="ready")

    def step(
        self, action: EchoAction, timeout_s: float | None = None, **kw: Any
    ) -> EchoObservation:
        self._state.step_count += 1
        return EchoObservation(
            echoed_message=action.message, reward=len(action.message) / 10, done=False
        )

    @property
    def state(self) -> State:
        return self._state


app = create_app(OpenEnvEcho, EchoAction, EchoObservation, env_name="echo", max_concurrent_envs=16)

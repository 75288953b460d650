"""An OpenEnv app built with its web interface (``create_web_interface_app``), as OpenEnv
0.10's tests/core/test_web_interface.py builds it: an env whose ``reset`` takes no keyword,
and one whose ``state`` raises before a reset (as OpenEnv's REPL env's does)."""

from __future__ import annotations

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from openenv.core.env_server.web_interface import create_web_interface_app


class NoKwargAction(Action):
    message: str = "noop"


class NoKwargObservation(Observation):
    response: str
    reward: float | None = None
    done: bool = False


class NoKwargState(State):
    step_count: int = 0
    last_reset_marker: str = "default"


class NoKwargEnvironment(Environment):  # type: ignore[misc]
    """Its ``reset`` accepts no keyword arguments."""

    def __init__(self) -> None:
        super().__init__()
        self._state = NoKwargState()

    def reset(self) -> NoKwargObservation:  # type: ignore[override]
        self._state = NoKwargState(step_count=0, last_reset_marker="default")
        return NoKwargObservation(response="reset")

    def step(self, action: NoKwargAction) -> NoKwargObservation:  # type: ignore[override]
        self._state.step_count += 1
        return NoKwargObservation(response=action.message, reward=0.0, done=False)

    @property
    def state(self) -> NoKwargState:
        return self._state


class NotReadyEnvironment(NoKwargEnvironment):
    """Its ``state`` raises until a reset, as OpenEnv's REPL env's."""

    def __init__(self) -> None:
        super().__init__()
        self._ready = False

    def reset(self) -> NoKwargObservation:  # type: ignore[override]
        self._ready = True
        return super().reset()

    @property
    def state(self) -> NoKwargState:
        if not self._ready:
            raise RuntimeError("Environment not initialized. Call reset() first.")
        return self._state


app = create_web_interface_app(NoKwargEnvironment, NoKwargAction, NoKwargObservation)
not_ready_app = create_web_interface_app(
    NotReadyEnvironment, NoKwargAction, NoKwargObservation, env_name="not_ready"
)

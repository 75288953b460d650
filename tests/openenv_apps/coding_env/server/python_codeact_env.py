"""``PythonCodeActEnv``: ``step(self, action: Action)``; the action model is given only to
``create_app`` (the shape that made Stadium refuse every action before the app target)."""

from __future__ import annotations

import contextlib
import io
import traceback
import uuid
from typing import Any

from openenv.core.env_server.interfaces import Action, Environment, Observation

from ..models import CodeAction, CodeObservation, CodeState

_DANGEROUS = ("import os", "import subprocess", "open(")


class PythonCodeActEnv(Environment):  # type: ignore[type-arg]
    """Runs the code of each CodeAction; variables persist until the next reset."""

    def __init__(self) -> None:
        super().__init__()
        self._globals: dict[str, Any] = {}
        self._state = CodeState()

    def reset(self) -> Observation:  # type: ignore[override]
        self._state = CodeState(episode_id=str(uuid.uuid4()), step_count=0)
        self._globals = {}
        return CodeObservation(stdout="", stderr="", exit_code=0)

    def step(self, action: Action) -> Observation:  # type: ignore[override]
        if not isinstance(action, CodeAction):
            raise ValueError(f"Expected CodeAction, got {type(action)}")
        out, err = io.StringIO(), io.StringIO()
        exit_code = 0
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                exec(compile(action.code, "<code>", "exec"), self._globals)
            except BaseException:
                traceback.print_exc()
                exit_code = 1
        self._state.step_count += 1
        self._state.last_exit_code = exit_code
        reward = -1.0 if any(bad in action.code for bad in _DANGEROUS) else 0.0
        return CodeObservation(
            stdout=out.getvalue(), stderr=err.getvalue(), exit_code=exit_code,
            reward=reward, metadata={"last_code": action.code},
        )  # fmt: skip

    @property
    def state(self) -> CodeState:
        return self._state

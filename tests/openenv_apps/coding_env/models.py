"""The coding env's models (as OpenEnv's ``coding_env/models.py``)."""

from __future__ import annotations

from openenv.core.env_server.interfaces import Action, Observation, State


class CodeAction(Action):
    """A single code execution request."""

    code: str


class CodeObservation(Observation):
    """Result of executing code."""

    stdout: str = ""
    stderr: str = ""
    exit_code: int = 0


class CodeState(State):
    """State with the last exit code."""

    last_exit_code: int = 0

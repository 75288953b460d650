"""The coding env's typed client (as OpenEnv's ``coding_env/client.py``)."""

from __future__ import annotations

from typing import Any

from openenv.core.client_types import StepResult
from openenv.core.env_client import EnvClient

from .models import CodeAction, CodeObservation, CodeState


class CodingEnv(EnvClient[CodeAction, CodeObservation, CodeState]):
    def _step_payload(self, action: CodeAction) -> dict[str, Any]:
        return {"code": action.code}

    def _parse_result(self, payload: dict[str, Any]) -> StepResult[CodeObservation]:
        obs = CodeObservation(**payload["observation"])
        return StepResult(
            observation=obs, reward=payload.get("reward"), done=bool(payload.get("done", False))
        )

    def _parse_state(self, payload: dict[str, Any]) -> CodeState:
        return CodeState(
            episode_id=payload.get("episode_id"),
            step_count=payload.get("step_count", 0),
            last_exit_code=payload.get("last_exit_code", 0),
        )

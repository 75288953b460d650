"""Stand-in of OpenEnv's coding_env: run Python code, keep variables within an episode."""

from .client import CodingEnv
from .models import CodeAction, CodeObservation, CodeState

__all__ = ["CodeAction", "CodeObservation", "CodeState", "CodingEnv"]

"""Reads a file of the session's filesystem: the image its recipe builds, when served with
``--image build``."""

from uuid import uuid4

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State

try:
    from ..models import ReadAction, ReadObservation
except ImportError:  # standalone, as OpenEnv's envs fall back
    from models import ReadAction, ReadObservation  # type: ignore[no-redef]


class RecipeEnvironment(Environment):  # type: ignore[type-arg]
    """``step(message="/etc/x")`` returns the file's text; any other message is echoed."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = State(episode_id=str(uuid4()), step_count=0)

    def reset(self) -> Observation:  # type: ignore[override]
        self._state = State(episode_id=str(uuid4()), step_count=0)
        return ReadObservation(text="ready", done=False, reward=0.0)

    def step(self, action: Action) -> Observation:  # type: ignore[override]
        assert isinstance(action, ReadAction), type(action)
        self._state.step_count += 1
        text = action.message
        if text.startswith("/"):
            try:
                with open(text) as f:
                    text = f.read(4096)
            except OSError as exc:
                text = f"{type(exc).__name__}: {exc}"
        return ReadObservation(text=text, done=False, reward=0.0)

    @property
    def state(self) -> State:
        return self._state

"""The pre-MCP echo env, its ``step`` annotated with OpenEnv's base ``Action``."""

from uuid import uuid4

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State

try:
    from ..models import EchoAction, EchoObservation
except ImportError:  # standalone, as OpenEnv's envs fall back
    from models import EchoAction, EchoObservation  # type: ignore[no-redef]


class EchoEnvironment(Environment):  # type: ignore[type-arg]
    """Echoes each message back; reward 0.1 per character."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = State(episode_id=str(uuid4()), step_count=0)

    def reset(self) -> Observation:  # type: ignore[override]
        self._state = State(episode_id=str(uuid4()), step_count=0)
        return EchoObservation(echoed_message="Echo environment ready!", done=False, reward=0.0)

    def step(self, action: Action) -> Observation:  # type: ignore[override]
        assert isinstance(action, EchoAction), type(action)
        self._state.step_count += 1
        message = action.message
        return EchoObservation(
            echoed_message=message, message_length=len(message), done=False,
            reward=len(message) * 0.1,
            metadata={"original_message": message, "step": self._state.step_count},
        )  # fmt: skip

    @property
    def state(self) -> State:
        return self._state

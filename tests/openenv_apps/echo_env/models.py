"""The echo env's models (as the pre-MCP ``echo_env/models.py``)."""

from openenv.core.env_server.types import Action, Observation


class EchoAction(Action):
    """A message to echo."""

    message: str


class EchoObservation(Observation):
    """The echoed message."""

    echoed_message: str
    message_length: int = 0

"""The recipe env's models."""

from openenv.core.env_server.types import Action, Observation


class ReadAction(Action):
    """A path to read (absolute), or a message to echo."""

    message: str


class ReadObservation(Observation):
    """The file's text (or the message)."""

    text: str

"""Stand-in of OpenEnv's pre-MCP echo_env."""

from .models import EchoAction, EchoObservation

__all__ = ["EchoAction", "EchoObservation"]

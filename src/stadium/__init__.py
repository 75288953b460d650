"""Stadium: serve RL and LLM-agent environments to thousands of concurrent sessions.

Write an environment::

    import msgspec, stadium

    class Say(msgspec.Struct):
        message: str

    class Heard(msgspec.Struct):
        text: str

    class Parrot(stadium.Environment[Say, Heard, stadium.State]):
        def reset(self, *, seed=None, options=None) -> Heard:
            return Heard("ready")

        def step(self, action: Say) -> stadium.StepResult[Heard]:
            return stadium.StepResult(Heard(action.message), reward=1.0)

serve it with ``stadium serve my_module:Parrot`` and drive it with
:class:`stadium.Client` or any OpenEnv client.
"""

from stadium._cli.check import check_env
from stadium._client.pool import Client, SessionPool
from stadium._client.session import AsyncClient
from stadium._env.contract import Environment, State, StepResult
from stadium._env.tools import ToolEnvironment, tool
from stadium._errors import (
    CallTimeoutError,
    CapacityError,
    ConfigError,
    ConnectError,
    EnvCheckError,
    ErrorCode,
    ExecutionError,
    InvalidMessageError,
    ProtocolError,
    RateLimitError,
    ResumeError,
    SessionClosedError,
    SessionError,
    SnapshotError,
    StadiumError,
    TargetError,
    ToolCallError,
    UnknownTypeError,
    ValidationError,
)
from stadium._server.config import ServerConfig
from stadium._server.server import Server, ServerState, run_server
from stadium._server.transports.asgi import AsgiApp, asgi_app
from stadium._version import __version__

# Light: the engines (subprocesses, SLURM, Ray, Podman) are imported when launch() runs.
from stadium.deploy.launch import launch

__all__ = [
    "AsgiApp",
    "AsyncClient",
    "CallTimeoutError",
    "CapacityError",
    "Client",
    "ConfigError",
    "ConnectError",
    "EnvCheckError",
    "Environment",
    "ErrorCode",
    "ExecutionError",
    "InvalidMessageError",
    "ProtocolError",
    "RateLimitError",
    "ResumeError",
    "Server",
    "ServerConfig",
    "ServerState",
    "SessionClosedError",
    "SessionError",
    "SessionPool",
    "SnapshotError",
    "StadiumError",
    "State",
    "StepResult",
    "TargetError",
    "ToolCallError",
    "ToolEnvironment",
    "UnknownTypeError",
    "ValidationError",
    "__version__",
    "asgi_app",
    "check_env",
    "launch",
    "run_server",
    "tool",
]

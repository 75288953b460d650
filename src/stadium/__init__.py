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

``import stadium`` is light: the env contract and the errors load at once; the clients,
the server and ``launch`` load on first use of their names (a trainer that only wants
:class:`stadium.AsyncClient` never loads the server, prometheus-client or click).
"""

import importlib as _importlib
import typing as _typing

from stadium._env.contract import Environment, State, StepResult
from stadium._env.cost import EpisodeCost
from stadium._errors import (
    CallTimeoutError,
    CapacityError,
    ConfigError,
    ConnectError,
    EnvCheckError,
    EnvCrashedError,
    EnvProtocolError,
    ErrorCode,
    ExecutionError,
    InvalidMessageError,
    LimitExceededError,
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
from stadium._version import __version__

if _typing.TYPE_CHECKING:
    from stadium._client.options import ConnectOptions
    from stadium._client.pool import Client, SessionPool
    from stadium._client.session import AsyncClient
    from stadium._env.checker import check_env
    from stadium._env.tool_env import ToolEnvironment, tool
    from stadium._env.workspace import DirEntry, RunResult, Workspace
    from stadium._server.config import ServerConfig
    from stadium._server.server import Server, ServerState, run_server
    from stadium._server.transports.asgi import AsgiApp, asgi_app
    from stadium.deploy.launch import launch

#: The names loaded on first use, and the module each comes from.
_LAZY = {
    "AsyncClient": "stadium._client.session",
    "ConnectOptions": "stadium._client.options",
    "Client": "stadium._client.pool",
    "SessionPool": "stadium._client.pool",
    "ToolEnvironment": "stadium._env.tool_env",
    "tool": "stadium._env.tool_env",
    "Workspace": "stadium._env.workspace",
    "RunResult": "stadium._env.workspace",
    "DirEntry": "stadium._env.workspace",
    "ServerConfig": "stadium._server.config",
    "Server": "stadium._server.server",
    "ServerState": "stadium._server.server",
    "run_server": "stadium._server.server",
    "AsgiApp": "stadium._server.transports.asgi",
    "asgi_app": "stadium._server.transports.asgi",
    "check_env": "stadium._env.checker",
    "launch": "stadium.deploy.launch",
}


def __getattr__(name: str) -> _typing.Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'stadium' has no attribute {name!r}")
    value = getattr(_importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "AsgiApp",
    "AsyncClient",
    "CallTimeoutError",
    "CapacityError",
    "Client",
    "ConfigError",
    "ConnectError",
    "ConnectOptions",
    "DirEntry",
    "EnvCheckError",
    "EnvCrashedError",
    "EnvProtocolError",
    "Environment",
    "EpisodeCost",
    "ErrorCode",
    "ExecutionError",
    "InvalidMessageError",
    "LimitExceededError",
    "ProtocolError",
    "RateLimitError",
    "ResumeError",
    "RunResult",
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
    "Workspace",
    "__version__",
    "asgi_app",
    "check_env",
    "launch",
    "run_server",
    "tool",
]

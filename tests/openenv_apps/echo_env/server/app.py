"""The echo env's app, as OpenEnv's: ``uvicorn server.app:app``."""

import os

from openenv.core.env_server.http_server import create_app

try:
    from ..models import EchoAction, EchoObservation
    from .echo_environment import EchoEnvironment
except ImportError:  # standalone, as OpenEnv's envs fall back
    from models import EchoAction, EchoObservation  # type: ignore[no-redef]
    from server.echo_environment import EchoEnvironment  # type: ignore[no-redef]

max_concurrent = int(os.getenv("MAX_CONCURRENT_ENVS", "8"))

app = create_app(
    EchoEnvironment, EchoAction, EchoObservation, env_name="echo_env",
    max_concurrent_envs=max_concurrent,
)  # fmt: skip

"""The coding env's app, as OpenEnv's: ``uvicorn coding_env.server.app:app``."""

from openenv.core.env_server import create_app

from coding_env.models import CodeAction, CodeObservation
from coding_env.server.python_codeact_env import PythonCodeActEnv

app = create_app(PythonCodeActEnv, CodeAction, CodeObservation, env_name="coding_env")

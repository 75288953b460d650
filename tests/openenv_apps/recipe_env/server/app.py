"""The recipe env's app, as OpenEnv's: ``uvicorn server.app:app``."""

from openenv.core.env_server.http_server import create_app

try:
    from ..models import ReadAction, ReadObservation
    from .recipe_environment import RecipeEnvironment
except ImportError:  # standalone, as OpenEnv's envs fall back
    from models import ReadAction, ReadObservation  # type: ignore[no-redef]
    from server.recipe_environment import RecipeEnvironment  # type: ignore[no-redef]

app = create_app(
    RecipeEnvironment, ReadAction, ReadObservation, env_name="recipe_env", max_concurrent_envs=8
)

"""OpenEnv envs served as their authors wrote them: the app ``create_app`` returned
(``pkg.server.app:app``), an env directory with an ``openenv.yaml``, ``--action-model``.

The envs are stand-ins with the shape of OpenEnv's ``coding_env`` and pre-MCP
``echo_env`` (tests/openenv_apps): their action model is given only to ``create_app``.
The coding env's tests are OpenEnv's ``tests/envs/test_coding_env_integration.py``
(13 tests), run through OpenEnv's typed client against Stadium.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("openenv.core.env_server.http_server")

from stadium._errors import TargetError
from stadium._server.config import ServerConfig
from stadium._server.loader import load_target
from stadium.bench.arms import spawn_server
from tests.conftest import UNIT, serve

APPS = Path(__file__).resolve().parents[1] / "openenv_apps"
CODING = str(APPS / "coding_env")
ECHO = str(APPS / "echo_env")


@pytest.fixture
async def coding_url() -> AsyncIterator[str]:
    async with serve(CODING) as server:
        yield server.url


def _coding() -> Any:
    sys.path.insert(0, str(APPS)) if str(APPS) not in sys.path else None
    import coding_env

    return coding_env


# -- OpenEnv's coding_env integration tests, through its typed client -------------------


async def test_coding_env_integration_suite(coding_url: str) -> None:
    """The 13 tests of OpenEnv's test_coding_env_integration.py, one client, in order."""
    ce = _coding()
    code = ce.CodeAction
    async with ce.CodingEnv(base_url=coding_url) as env:
        result = await env.reset()  # test_reset
        assert result.observation is not None
        assert result.observation.exit_code == 0
        assert result.observation.stderr == ""

        await env.reset()  # test_step_simple_print
        result = await env.step(code(code="print('Hello, World!')"))
        assert result.observation.exit_code == 0
        assert "Hello, World!" in result.observation.stdout
        assert result.reward is not None

        await env.reset()  # test_step_calculation
        result = await env.step(code(code="x = 5 + 3\nprint(f'Result: {x}')"))
        assert result.observation.exit_code == 0
        assert "Result: 8" in result.observation.stdout

        await env.reset()  # test_step_import_math
        result = await env.step(code(code="import math\nprint(f'Pi: {math.pi:.4f}')"))
        assert "Pi: 3.1416" in result.observation.stdout

        await env.reset()  # test_step_multiline
        result = await env.step(code(code="for i in range(1, 4):\n    print(f'{i} sq {i**2}')"))
        assert "3 sq 9" in result.observation.stdout

        await env.reset()  # test_error_division_by_zero
        result = await env.step(code(code="x = 1 / 0"))
        assert result.observation.exit_code == 1
        assert "ZeroDivisionError" in result.observation.stderr

        await env.reset()  # test_error_undefined_variable
        assert (await env.step(code(code="print(undefined_variable)"))).observation.exit_code == 1

        await env.reset()  # test_error_syntax_error
        assert (await env.step(code(code="print('Hello'"))).observation.exit_code == 1

        await env.reset()  # test_state_tracking
        state = await env.state()
        assert state.episode_id is not None
        assert state.step_count == 0
        await env.step(code(code="x = 1"))
        assert (await env.state()).step_count == 1
        await env.step(code(code="y = 2"))
        state = await env.state()
        assert state.step_count == 2
        assert state.last_exit_code == 0

        await env.reset()  # test_reward_safe_code
        assert (await env.step(code(code="x = 5"))).reward >= 0
        await env.reset()  # test_reward_dangerous_code
        assert (await env.step(code(code="import os"))).reward < 0

        await env.reset()  # test_variable_persistence_within_episode
        await env.step(code(code="my_var = 42"))
        result = await env.step(code(code="print(my_var)"))
        assert result.observation.exit_code == 0
        assert "42" in result.observation.stdout

        await env.reset()  # test_reset_clears_variables
        await env.step(code(code="my_var = 42"))
        await env.reset()
        assert (await env.step(code(code="print(my_var)"))).observation.exit_code == 1


async def test_the_action_model_comes_from_create_app(coding_url: str) -> None:
    """The schema and validation use ``CodeAction`` (given only to ``create_app``), not
    OpenEnv's base ``Action``, which forbids every field."""
    async with httpx.AsyncClient() as http:
        schema = (await http.get(coding_url + "/schema")).json()
        assert "code" in schema["action"]["properties"]
        assert "last_exit_code" in schema["state"]["properties"]  # the class's CodeState
        bad = await http.post(coding_url + "/step", json={"action": {"kode": "1"}})
        assert bad.status_code == 422
        assert "code" in bad.json()["detail"]


# -- the pre-MCP echo_env -------------------------------------------------------------


async def test_pre_mcp_echo_env_through_openenv_generic_client() -> None:
    from openenv.core.generic_client import GenericEnvClient

    async with serve(ECHO) as server, GenericEnvClient(base_url=server.url) as env:
        first = await env.reset()
        assert first.observation["echoed_message"] == "Echo environment ready!"
        result = await env.step({"message": "Hello"})
        assert result.observation["echoed_message"] == "Hello"
        assert result.observation["message_length"] == 5
        assert result.reward == pytest.approx(0.5)
        assert (await env.state())["step_count"] == 1
        # create_app(..., max_concurrent_envs=8): the server's limit when none is given
        assert server.runtime.admission.slots.limit == 8


async def test_an_operator_limit_wins_over_the_apps() -> None:
    async with serve(ECHO, max_sessions=3) as server:
        assert server.runtime.admission.slots.limit == 3
    given = ServerConfig.from_options(target=ECHO, max_sessions=8192)
    assert given.for_target(load_target(ECHO)).max_sessions == 8192


def test_the_mode_comes_from_the_app(monkeypatch: pytest.MonkeyPatch) -> None:
    """An app built in production mode (``OPENENV_MODE`` at its import) is served so."""
    from openenv.core.env_server.http_server import create_app

    ce = _coding()
    from coding_env.server.python_codeact_env import PythonCodeActEnv

    from stadium.integrations.openenv_app import app_settings

    app = create_app(PythonCodeActEnv, ce.CodeAction, ce.CodeObservation, mode="production")
    settings = app_settings(app, "test")
    assert settings.mode == "production"
    assert settings.action_cls is ce.CodeAction
    assert settings.max_concurrent_envs is None  # not given: OpenEnv's default 1 is not used
    app = create_app(PythonCodeActEnv, ce.CodeAction, ce.CodeObservation, max_concurrent_envs=1)
    assert app_settings(app, "test").max_concurrent_envs is None  # 1 cannot be told apart


async def test_production_app_is_served_in_production_mode(tmp_path: Path) -> None:
    module = tmp_path / "prod_app.py"
    module.write_text(
        "from echo_env.models import EchoAction, EchoObservation\n"
        "from echo_env.server.echo_environment import EchoEnvironment\n"
        "from openenv.core.env_server import create_app\n"
        "app = create_app(EchoEnvironment, EchoAction, EchoObservation, mode='production',\n"
        "                 max_concurrent_envs=5)\n"
    )
    _coding()
    async with serve(f"{module}:app") as server, httpx.AsyncClient() as http:
        assert (await http.post(server.url + "/step", json={"action": {}})).status_code == 404
        spec = (await http.get(server.url + "/openapi.json")).json()
        assert spec["info"]["x-mode"] == "production"
        assert server.runtime.admission.slots.limit == 5


# -- --action-model -------------------------------------------------------------------


async def test_action_model_names_the_model_of_a_class_target() -> None:
    target = f"{APPS}/coding_env/server/python_codeact_env.py:PythonCodeActEnv"
    bare = load_target(target)
    assert bare.action_type.__name__ == "Action"  # what the class alone says
    async with serve(target, action_model="coding_env.models:CodeAction") as server:
        async with httpx.AsyncClient() as http:
            reply = await http.post(server.url + "/step", json={"action": {"code": "print(6 * 7)"}})
        assert reply.status_code == 200, reply.text
        assert reply.json()["observation"]["stdout"] == "42\n"


def test_action_model_errors_say_what_to_do() -> None:
    with pytest.raises(TargetError, match="not one"):
        load_target("echo", action_model="coding_env.models:CodeAction")
    target = f"{APPS}/coding_env/server/python_codeact_env.py:PythonCodeActEnv"
    with pytest.raises(TargetError, match="not an OpenEnv Action subclass"):
        load_target(target, action_model="coding_env.models:CodeObservation")
    with pytest.raises(TargetError, match=r"without an openenv\.yaml"):
        load_target(str(APPS))


# -- stadium serve, as users run it ---------------------------------------------------


@pytest.mark.slow
def test_stadium_serve_an_app_target_and_an_env_directory() -> None:
    """``stadium serve coding_env.server.app:app`` from the envs directory (as uvicorn is
    run), and ``stadium serve path/to/echo_env``."""
    code = (
        "import asyncio, sys\n"
        "from coding_env import CodeAction, CodingEnv\n"
        "async def main():\n"
        "    async with CodingEnv(base_url=sys.argv[1]) as env:\n"
        "        await env.reset()\n"
        "        r = await env.step(CodeAction(code='print(2 + 2)'))\n"
        "        print(r.observation.stdout.strip())\n"
        "asyncio.run(main())\n"
    )
    cwd = os.getcwd()
    os.chdir(APPS)
    try:
        with spawn_server(
            "coding_env.server.app:app", "--log-level", "warning", timeout=120 * UNIT
        ) as (_, url):
            out = subprocess.run(
                [sys.executable, "-c", code, url], capture_output=True, text=True,
                timeout=120 * UNIT, cwd=APPS,
            )  # fmt: skip
    finally:
        os.chdir(cwd)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "4"
    with spawn_server(ECHO, "--log-level", "warning", timeout=120 * UNIT) as (_, url):
        reply = httpx.post(url + "/step", json={"action": {"message": "hi"}}, timeout=30 * UNIT)
        assert reply.json()["observation"]["echoed_message"] == "hi"
        assert httpx.get(url + "/health").json()["max_sessions"] == 8

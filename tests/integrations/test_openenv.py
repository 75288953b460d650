"""OpenEnv Environment classes served unchanged by Stadium, driven by OpenEnv's own clients."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import uvicorn
import websockets

import stadium
from stadium._env.spec import EnvSpec
from stadium._server.loader import load_target
from tests.conftest import UNIT, serve

pytest.importorskip("openenv")
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from openenv.core.generic_client import GenericEnvClient

TEMPLATE_TARGET = "my_echo.server.my_echo_environment:MyEchoEnvironment"


@pytest.fixture(scope="module")
def openenv_template_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The echo env that ``openenv init`` generates, rendered from openenv's own template."""
    init = pytest.importorskip("openenv.cli.commands.init")
    root = tmp_path_factory.mktemp("openenv_template")
    init._copy_template_directory(
        "openenv.cli.templates.openenv_env",
        "",
        root / "my_echo",
        init._create_template_replacements("my_echo"),
        "my_echo",
    )
    sys.path.insert(0, str(root))
    try:
        yield TEMPLATE_TARGET
    finally:
        sys.path.remove(str(root))
        for name in [m for m in sys.modules if m == "my_echo" or m.startswith("my_echo.")]:
            del sys.modules[name]


class CountAction(Action):
    amount: int


class CountObservation(Observation):
    total: int = 0


class AsyncCounter(Environment[CountAction, CountObservation, State]):
    """An OpenEnv env with async overrides: they must run on the event loop."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self, start: int = 0) -> None:
        super().__init__()
        self.start = start
        self._state = State(episode_id="c", step_count=0)
        self._total = start

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kw: Any) -> Any:
        raise AssertionError("the async override must be used")

    async def reset_async(
        self, seed: int | None = None, episode_id: str | None = None, **kw: Any
    ) -> CountObservation:
        await asyncio.sleep(0)
        self._total = self.start + (seed or 0)
        self._state = State(episode_id=episode_id or "c", step_count=0)
        return CountObservation(total=self._total, metadata={"label": kw.get("label")})

    def step(self, action: CountAction, timeout_s: float | None = None, **kw: Any) -> Any:
        raise AssertionError("the async override must be used")

    async def step_async(
        self, action: CountAction, timeout_s: float | None = None, **kw: Any
    ) -> CountObservation:
        self._total += action.amount
        self._state.step_count += 1
        return CountObservation(
            total=self._total, reward=float(action.amount), done=self._total > 9
        )

    @property
    def state(self) -> State:
        return self._state


async def test_template_env_served_by_stadium_drives_with_openenv_clients(
    openenv_template_env: str,
) -> None:
    cls = load_target(openenv_template_env)
    spec = EnvSpec.of(cls)
    assert spec.blocking
    assert not spec.async_step
    assert spec.schemas()["action"]["properties"]["message"]["type"] == "string"
    from my_echo.client import MyEchoEnv
    from my_echo.models import MyEchoAction

    async with serve(openenv_template_env) as server:
        async with GenericEnvClient(base_url=server.url) as env:
            first = await env.reset()
            assert first.observation["echoed_message"] == "My Echo environment ready!"
            result = await env.step({"message": "hello"})
            assert result.observation["echoed_message"] == "hello"
            assert result.reward == pytest.approx(0.5)
            assert result.observation["metadata"] == {"original_message": "hello", "step": 1}
            assert (await env.state())["step_count"] == 1
            with pytest.raises(RuntimeError, match="VALIDATION_ERROR"):
                await env.step({"wrong": 1})
        async with MyEchoEnv(base_url=server.url) as typed:  # the template's own typed client
            await typed.reset()
            result = await typed.step(MyEchoAction(message="typed"))
            assert result.observation.echoed_message == "typed"
            assert result.observation.message_length == 5


async def test_validation_error_names_the_field() -> None:
    async with serve(load_target(f"{__name__}:AsyncCounter")) as server:
        async with stadium.AsyncClient(server.url) as env:
            await env.reset()
            with pytest.raises(stadium.ValidationError) as err:
                await env.step({"amount": "many"})
            assert err.value.context["field"] == "$.amount"
            with pytest.raises(stadium.ValidationError) as err:
                await env.step({"amount": 1, "extra": True})
            assert err.value.context["field"] == "$.extra"


async def test_async_overrides_run_and_reset_kwargs_pass_through() -> None:
    cls = load_target(f"{__name__}:AsyncCounter")
    spec = EnvSpec.of(cls)
    assert spec.async_reset
    assert spec.async_step
    async with serve(cls, env_kwargs={"start": 5}) as server:
        async with GenericEnvClient(base_url=server.url) as env:
            first = await env.reset(seed=2, label="x")
            assert first.observation["total"] == 7
            assert first.observation["metadata"] == {"label": "x"}
            result = await env.step({"amount": 3})
            assert (result.observation["total"], result.reward, result.done) == (10, 3.0, True)
            assert "reward" not in result.observation
            assert "done" not in result.observation


@contextlib.asynccontextmanager
async def openenv_server(cls: type[Any], action: type[Any], obs: type[Any]) -> AsyncIterator[str]:
    """OpenEnv's own server for ``cls`` (FastAPI under uvicorn) in this event loop."""
    app = create_app(cls, action, obs, env_name="ref", max_concurrent_envs=4)
    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    task = asyncio.ensure_future(uv.serve())
    while not uv.started:
        await asyncio.sleep(0.01)
        if task.done():
            task.result()
    try:
        yield f"ws://127.0.0.1:{uv.servers[0].sockets[0].getsockname()[1]}/ws"
    finally:
        uv.should_exit = True
        await task


async def transcript(url: str) -> list[dict[str, Any]]:
    frames = [
        {"type": "reset", "data": {"seed": 1, "label": "a"}},
        {"type": "step", "data": {"amount": 2}},
        {"type": "state"},
        {"type": "step", "data": {"amount": "x"}},
        {"type": "step", "data": {"amount": 9}},
    ]
    out = []
    async with websockets.connect(url, open_timeout=10 * UNIT) as ws:
        for frame in frames:
            await ws.send(json.dumps(frame))
            out.append(json.loads(await asyncio.wait_for(ws.recv(), 10 * UNIT)))
    return out


async def test_wire_replies_match_openenv_server() -> None:
    async with openenv_server(AsyncCounter, CountAction, CountObservation) as ref_url:
        want = await transcript(ref_url)
    async with serve(load_target(f"{__name__}:AsyncCounter")) as server:
        got = await transcript(server.url.replace("http://", "ws://") + "/ws")
    assert [g["type"] for g in got] == [w["type"] for w in want]
    for g, w in zip(got, want, strict=True):
        if g["type"] == "error":
            assert g["data"]["code"] == w["data"]["code"] == "VALIDATION_ERROR"
            continue
        assert g["data"] == w["data"]


async def test_top_level_metadata_key_matches_openenv() -> None:
    async with serve(load_target(f"{__name__}:AsyncCounter")) as server:
        got = await transcript(server.url.replace("http://", "ws://") + "/ws")
    assert got[0]["data"]["metadata"] == {"label": "a"}


def test_post_step_validates_with_the_pydantic_model(openenv_template_env: str) -> None:
    async def main() -> tuple[int, Any, int, Any]:
        async with serve(openenv_template_env) as server:
            return await asyncio.to_thread(_posts, server.url)

    ok_status, ok_body, bad_status, bad_body = asyncio.run(main())
    assert ok_status == 200
    assert ok_body["observation"]["echoed_message"] == "hi"
    assert bad_status == 422
    assert bad_body["code"] == "VALIDATION_ERROR"


def _posts(url: str) -> tuple[int, Any, int, Any]:
    def post(body: bytes) -> tuple[int, Any]:
        req = urllib.request.Request(url + "/step", data=body, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=10 * UNIT) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    return (*post(b'{"action": {"message": "hi"}}'), *post(b'{"action": {"nope": 1}}'))


class Unfinished(Environment[CountAction, CountObservation, State]):
    """Implements reset only: still abstract."""

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kw: Any) -> Any:
        return CountObservation()


def test_abstract_or_foreign_classes_are_refused() -> None:
    with pytest.raises(stadium.TargetError, match=r"abstract .*step"):
        load_target(f"{__name__}:Unfinished")
    with pytest.raises(stadium.TargetError, match=r"not a stadium\.Environment subclass"):
        load_target("pathlib:Path")


def test_check_env_accepts_openenv_classes(openenv_template_env: str) -> None:
    stadium.check_env(
        load_target(openenv_template_env), actions=[{"message": "a"}, {"message": "bc"}]
    )


async def test_episode_id_from_the_client_reaches_the_openenv_env() -> None:
    async with serve(load_target(f"{__name__}:AsyncCounter")) as server:
        async with GenericEnvClient(base_url=server.url) as env:
            await env.reset(episode_id="run-42")
            assert (await env.state())["episode_id"] == "run-42"

"""Wire compatibility with OpenEnv, both ways, using OpenEnv's published package.

* OpenEnv's own client (GenericEnvClient, async and sync) against a Stadium server.
* Stadium's client against OpenEnv's own server (uvicorn + openenv create_app).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import stadium
from stadium._cli.demo import spawn_server
from tests.conftest import UNIT, serve

#: Process-level: servers, tools or interpreters in subprocesses (`make check` skips it).
pytestmark = pytest.mark.slow

openenv_client = pytest.importorskip("openenv.core.generic_client")
GenericEnvClient = openenv_client.GenericEnvClient
ROOT = Path(__file__).resolve().parents[1]


async def test_openenv_async_client_against_stadium() -> None:
    async with serve("benchmark") as server, GenericEnvClient(base_url=server.url) as env:
        first = await env.reset()
        assert first.observation["step_count"] == 0
        assert first.done is False
        result = await env.step({"wait_seconds": 0.01})
        assert result.observation["waited_seconds"] == 0.01
        assert result.reward == 1.0
        state = await env.state()
        assert state["step_count"] == 1
        assert state["episode_id"]
        with pytest.raises(RuntimeError, match="VALIDATION_ERROR"):
            await env.step({"wait_seconds": "later"})
        # the session survives the error
        assert (await env.step({"wait_seconds": 0})).observation["step_count"] == 2


def test_openenv_sync_client_against_stadium_subprocess() -> None:
    with spawn_server("echo") as (_, url), GenericEnvClient(base_url=url).sync() as env:
        assert env.reset().observation["echoed_message"] == "Echo environment ready!"
        result = env.step({"message": "hello"})
        assert result.observation == {"echoed_message": "hello", "message_length": 5}
        assert result.reward == pytest.approx(0.5)
        assert env.state()["step_count"] == 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def openenv_server() -> Iterator[str]:
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "tests.openenv_compat.openenv_echo_app:app",
         "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60 * UNIT
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert proc.poll() is None, "OpenEnv server exited"
                time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


async def test_stadium_client_against_openenv_server(openenv_server: str) -> None:
    async with stadium.AsyncClient(openenv_server) as env:
        first = await env.reset(seed=1)
        assert first.observation["echoed_message"] == "ready"
        result = await env.step({"message": "hey"})
        assert result.observation["echoed_message"] == "hey"
        assert result.reward == pytest.approx(0.3)
        assert (await env.state())["step_count"] == 1
        with pytest.raises(stadium.ValidationError):
            await env.step({"wrong": 1})


def test_stadium_sync_client_against_openenv_server(openenv_server: str) -> None:
    with stadium.Client(openenv_server) as env:
        env.reset()
        assert env.step({"message": "abc"}).observation["echoed_message"] == "abc"

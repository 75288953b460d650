"""OpenEnv example envs served unchanged, driven through OpenEnv's own clients.

Collected by scripts/openenv-peer-tests.sh with ``PEER_EXAMPLES`` = ``dir=module:app,...``
(each ``dir`` put on ``sys.path``); each server is started with ``python -m uvicorn``,
which the peer plugin turns into ``stadium serve`` for the Stadium run.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from openenv.core.generic_client import GenericEnvClient

EXAMPLES = [e.split("=", 1) for e in os.environ.get("PEER_EXAMPLES", "").split(",") if e]
STARTUP_S = float(os.environ.get("PEER_STARTUP_S", "90"))


@contextlib.contextmanager
def _served(directory: str, target: str) -> Iterator[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path = os.pathsep.join([directory, os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    proc = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", target, "--host", "127.0.0.1", "--port", str(port)],
        cwd=directory, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_S
        while True:
            assert proc.poll() is None, "the server exited"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.mark.parametrize(
    ("directory", "target"), EXAMPLES, ids=[f"{os.path.basename(d)}:{t}" for d, t in EXAMPLES]
)
def test_example_env_reset_step_state(directory: str, target: str) -> None:
    """reset, a step with the first example action the schema allows, state, and the
    stateless HTTP routes, through OpenEnv's GenericEnvClient."""
    with _served(directory, target) as url:
        schema = httpx.get(url + "/schema", timeout=30).json()
        action = _example(schema["action"])
        with GenericEnvClient(base_url=url).sync() as env:
            first = env.reset()
            assert first.done is False
            result = env.step(action)
            assert isinstance(result.observation, dict)
            assert env.state()["step_count"] == 1
        reply = httpx.post(url + "/step", json={"action": action}, timeout=30)
        assert reply.status_code == 200, reply.text


def _example(schema: dict[str, Any]) -> dict[str, Any]:
    """An action for the schema: a string field gets "hello", numbers 1, booleans true,
    objects {}; of an ``anyOf`` (Stadium's schema of an MCP env's actions: its own model,
    then OpenEnv's list_tools / call_tool) the first branch."""
    if "anyOf" in schema and "properties" not in schema:
        return _example(schema["anyOf"][0])
    values = {"string": "hello", "integer": 1, "number": 1.0, "boolean": True, "object": {}}
    action: dict[str, Any] = {}
    for name in schema.get("required", []):
        kind = schema.get("properties", {}).get(name, {}).get("type", "string")
        action[name] = values.get(kind, "hello")
    return action

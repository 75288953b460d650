"""``GET /openapi.json`` and OpenEnv's mode contract; ``openenv validate --url`` 6/6.

The validator is OpenEnv's real CLI (``.venv/bin/openenv``), run against
``stadium serve`` subprocesses: every built-in env, an OpenEnv MCP env, a
Gymnasium env, and one server in production mode (``OPENENV_MODE=production``:
no ``/reset``, ``/step``, ``/state``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from stadium._core.openapi import openapi
from stadium._env.spec import EnvSpec
from stadium.bench.arms import spawn_server
from stadium.envs.wordguess import WordGuessEnv
from tests.conftest import TRANSPORTS, UNIT, serve

ROOT = Path(__file__).resolve().parents[1]
OPENENV = shutil.which("openenv", path=str(Path(sys.executable).parent))
OPENENV_NOTES = f"{ROOT / 'tests/openenv_compat/mcp_notes.py'}:OpenEnvNotes"
CHECKS = {
    "openapi_version_available",
    "health_endpoint",
    "metadata_endpoint",
    "schema_endpoint",
    "mcp_endpoint",
    "mode_endpoint_consistency",
}


#: Runs OpenEnv's CLI app (what ``.venv/bin/openenv`` runs) once per URL read from
#: stdin, in one process: importing the CLI takes seconds, so it is imported once, while
#: the servers start.
_CLI = """
import contextlib, io, json, sys
from openenv.cli.__main__ import app
print("ready", flush=True)
reports = {}
for url in sys.stdin.read().split():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            app(["validate", "--url", url, "--json"], standalone_mode=False)
        except SystemExit:
            pass
    reports[url] = json.loads(out.getvalue())
print(json.dumps(reports))
"""


@contextlib.contextmanager
def _server(target: str, **env: str) -> Iterator[str]:
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the server inherits them
    try:
        with spawn_server(target, "--log-level", "warning", timeout=90 * UNIT) as (_, url):
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            yield url
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.mark.slow
@pytest.mark.skipif(OPENENV is None, reason="OpenEnv's CLI is not installed")
def test_openenv_validate_cli_six_of_six() -> None:
    """``openenv validate --url``: 6/6 for every built-in env, an OpenEnv MCP env and a
    Gymnasium env (simulation mode), and for a server in production mode."""
    pytest.importorskip("gymnasium")
    pytest.importorskip("fastmcp")
    with subprocess.Popen(
        [sys.executable, "-c", _CLI],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as cli:  # its pipes closed however the block ends
        targets = {
            "echo": "echo",
            "benchmark": "benchmark",
            "wordguess": "wordguess",
            "tools": "tools",
            "openenv-mcp": OPENENV_NOTES,
            "gymnasium": "gymnasium:CartPole-v1",
        }
        try:
            with contextlib.ExitStack() as stack:
                urls = {name: stack.enter_context(_server(t)) for name, t in targets.items()}
                production = stack.enter_context(_server("echo", OPENENV_MODE="production"))
                out, _ = cli.communicate(" ".join([*urls.values(), production]), 120 * UNIT)
                with httpx.Client() as http:
                    assert http.post(production + "/reset", json={}).status_code == 404
                    assert http.post(production + "/step", json={"action": {}}).status_code == 404
                    assert http.get(production + "/state").status_code == 404
                    assert http.get(production + "/health").status_code == 200
        finally:
            if cli.poll() is None:
                cli.kill()
                cli.wait()
    assert cli.returncode == 0
    reports = json.loads(out.split("\n", 1)[1])
    for name, url in urls.items():
        report = reports[url]
        passed = {c["id"] for c in report["criteria"] if c["passed"]}
        assert passed == CHECKS, (name, report["criteria"])
        assert report["passed"], name
        assert report["mode"] == "simulation", name
    report = reports[production]
    assert {c["id"] for c in report["criteria"] if c["passed"]} == CHECKS, report
    assert report["mode"] == "production"


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_openapi_document(transport: str) -> None:
    async with serve("wordguess", transport) as server, httpx.AsyncClient() as http:
        reply = await http.get(server.url + "/openapi.json")
        assert reply.status_code == 200
        assert reply.headers["content-type"].startswith("application/json")
        doc = reply.json()
    assert doc["openapi"].startswith("3.1")
    assert doc["info"] == {**doc["info"], "title": "wordguess", "version": WordGuessEnv.version}
    paths = doc["paths"]
    for path in ("/health", "/metadata", "/schema", "/openapi.json", "/mcp", "/ws"):
        assert path in paths
    assert "post" in paths["/reset"]
    assert "post" in paths["/step"]
    assert "get" in paths["/state"]
    schemas = doc["components"]["schemas"]
    assert {"Action", "Observation", "State"} <= set(schemas)
    action = schemas["Action"]
    if "$ref" in action:  # a msgspec Struct: defined once, referred to
        action = schemas[action["$ref"].rsplit("/", 1)[1]]
    assert action["properties"]["word"]["type"] == "string"
    # every local reference resolves inside the document
    text = json.dumps(doc)
    assert "#/$defs/" not in text
    for ref in {part.split('"')[0] for part in text.split('"$ref": "')[1:]}:
        assert ref.startswith("#/components/schemas/")
        assert ref.rsplit("/", 1)[1] in schemas, ref


def test_openapi_modes_and_nested_defs() -> None:
    from stadium.envs.tools import NotesEnv

    spec = EnvSpec.of(NotesEnv)
    sim = openapi(spec)
    prod = openapi(spec, mode="production")
    assert {"/reset", "/step", "/state"} <= set(sim["paths"])
    assert not {"/reset", "/step", "/state"} & set(prod["paths"])
    schemas = sim["components"]["schemas"]
    assert {"CallToolAction", "ListToolsAction"} <= set(schemas)  # hoisted from $defs


async def test_bad_mode_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from stadium._errors import ConfigError
    from stadium.testing import memory_runtime

    monkeypatch.setenv("OPENENV_MODE", "staging")
    with pytest.raises(ConfigError, match="OPENENV_MODE"):
        async with memory_runtime("echo"):
            pass

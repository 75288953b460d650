"""Targets as users lay them out: `openenv init`'s project served as a file path and as a
module (no PYTHONPATH), files in packages importing their siblings, scripts next to helpers.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

import stadium
from stadium._errors import TargetError
from stadium._server.loader import load_target, package_module
from tests.conftest import UNIT, serve

ENV_FILE = "server/my_env_environment.py"
ENV_CLASS = "MyEnvironment"


@pytest.fixture
def isolated(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Undo what loading a target does to sys.path, and forget the modules it imported
    from temporary directories (numpy and the like cannot be imported twice)."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    before = set(sys.modules)
    yield
    tmp = str(Path(tempfile.gettempdir()).resolve())
    for name in set(sys.modules) - before:
        where = getattr(sys.modules[name], "__file__", None) or ""
        if str(Path(where).resolve()).startswith(tmp):
            del sys.modules[name]


@pytest.fixture(scope="module")
def openenv_project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A project made by the real `openenv init my_env` (its CLI, run in-process with
    typer's runner: a subprocess would import openenv again, ~10 s; it works offline)."""
    main = pytest.importorskip("openenv.cli.__main__")
    from typer.testing import CliRunner

    parent = tmp_path_factory.mktemp("openenv_init")
    result = CliRunner().invoke(main.app, ["init", "my_env", "--output-dir", str(parent)])
    assert result.exit_code == 0, result.output
    project = parent / "my_env"
    assert (project / ENV_FILE).is_file()
    assert (project / "models.py").is_file()
    return project


async def _drive(url: str) -> None:
    async with stadium.AsyncClient(url) as env:
        first = await env.reset()
        assert "ready" in first.observation["echoed_message"]
        result = await env.step({"message": "hello"})
        assert result.observation["echoed_message"] == "hello"


@pytest.mark.slow
async def test_openenv_init_served_as_a_file_path(openenv_project: Path, isolated: None) -> None:
    target = f"{openenv_project / ENV_FILE}:{ENV_CLASS}"
    async with serve(target) as server:
        await _drive(server.url)
    # Imported as the package it is in, so `from ..models import ...` worked.
    assert "my_env.server.my_env_environment" in sys.modules


async def test_openenv_init_served_as_a_module_from_its_directory(
    openenv_project: Path, isolated: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(openenv_project)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".")])
    async with serve(f"server.my_env_environment:{ENV_CLASS}") as server:
        await _drive(server.url)
    assert str(openenv_project) == sys.path[0]  # as uvicorn puts it


async def test_a_project_directory_that_is_no_identifier_uses_the_sibling_fallback(
    openenv_project: Path, isolated: None, tmp_path: Path
) -> None:
    copy = tmp_path / "my-env"  # `from ..models` cannot work: `from models` must
    shutil.copytree(openenv_project, copy)
    assert package_module(copy / ENV_FILE) == (copy, "server.my_env_environment")
    async with serve(f"{copy / ENV_FILE}:{ENV_CLASS}") as server:
        await _drive(server.url)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextlib.contextmanager
def _stadium_serve(args: list[str], cwd: Path) -> Iterator[str]:
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    # The console script, not `python -m stadium` (which would put the directory on the path).
    cmd = [str(Path(sys.executable).parent / "stadium"), "serve", *args, "--port", str(port)]
    with subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    ) as proc:
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 120 * UNIT  # it imports openenv (gradio, pandas)
            while True:
                try:
                    with urllib.request.urlopen(url + "/health", timeout=UNIT):
                        break
                except OSError:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        proc.kill()
                        out = proc.communicate()[0].decode(errors="replace")
                        pytest.fail(f"stadium serve {' '.join(args)} did not start:\n{out[-2000:]}")
                    time.sleep(0.05)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(10 * UNIT)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.mark.slow
async def test_stadium_serve_in_the_openenv_project_needs_no_pythonpath(
    openenv_project: Path,
) -> None:
    # The real command, in a subprocess (~10 s: it imports openenv): what uvicorn serves
    # as `uvicorn server.app:app` from the project directory, Stadium serves the same way.
    with _stadium_serve([f"server.my_env_environment:{ENV_CLASS}"], openenv_project) as url:
        await _drive(url)


def test_package_module_finds_the_outermost_package(tmp_path: Path) -> None:
    pkg = tmp_path / "src" / "outer" / "inner"
    pkg.mkdir(parents=True)
    (tmp_path / "src" / "outer" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "env.py").write_text("")
    (tmp_path / "loose.py").write_text("")
    assert package_module(pkg / "env.py") == (tmp_path / "src", "outer.inner.env")
    assert package_module(tmp_path / "loose.py") is None


GAME = """
import msgspec, stadium
from {import_line}

class Act(msgspec.Struct):
    n: int = 0

class Game(stadium.Environment[Act, Obs, stadium.State]):
    blocking = False
    def reset(self, *, seed=None, options=None):
        return Obs(VALUE)
    def step(self, action):
        return stadium.StepResult(Obs(VALUE + action.n))
"""

HELPER = """
import msgspec
VALUE = 7
class Obs(msgspec.Struct):
    v: int
"""


def test_a_file_in_a_package_imports_siblings_relatively(tmp_path: Path, isolated: None) -> None:
    pkg = tmp_path / "gamepkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "helpers.py").write_text(HELPER)
    (pkg / "game.py").write_text(GAME.format(import_line=".helpers import Obs, VALUE"))
    cls = load_target(f"{pkg / 'game.py'}:Game")
    assert cls.__module__ == "gamepkg.game"
    assert stadium.check_env(cls)


def test_a_loose_script_imports_the_modules_next_to_it(tmp_path: Path, isolated: None) -> None:
    (tmp_path / "game_helpers.py").write_text(HELPER)
    (tmp_path / "loose_game.py").write_text(
        GAME.format(import_line="game_helpers import Obs, VALUE")
    )
    cls = load_target(f"{tmp_path / 'loose_game.py'}:Game")
    assert stadium.check_env(cls)


def test_a_module_target_is_found_in_the_working_directory(
    tmp_path: Path, isolated: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "cwd_helpers.py").write_text(HELPER)
    (tmp_path / "cwd_game.py").write_text(GAME.format(import_line="cwd_helpers import Obs, VALUE"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".")])
    assert load_target("cwd_game:Game").__name__ == "Game"


def test_a_shadowed_package_is_named(tmp_path: Path, isolated: None) -> None:
    # A file inside a package named like one already imported from elsewhere.
    pkg = tmp_path / "email"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "parser.py").write_text("")
    with pytest.raises(TargetError, match=r"as email\.parser found .* instead"):
        load_target(f"{pkg / 'parser.py'}:Game")

"""Stadium's distribution is "stadium-rl": a `stadium init` package installs from a locally
built wheel into a fresh virtualenv and serves.

Builds the wheel with uv (hatchling comes from PyPI) and installs Stadium's dependencies
from PyPI (uv's cache makes reruns fast); skipped when uv or the index is unreachable.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import tomllib
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from stadium._cli.scaffold import create_project
from stadium._server.isolation import sandbox_unavailable
from tests.conftest import UNIT
from tests.isolation.test_hardening import MEMFD, _descendants, _exe

#: Process-level: servers, tools or interpreters in subprocesses (`make check` skips it).
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
DIST = "stadium-rl"
UV = shutil.which("uv", path=str(Path(sys.executable).parent)) or shutil.which("uv")
SANDBOX_WHY_NOT = sandbox_unavailable()


def test_the_distribution_name_is_ours_everywhere() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["name"] == DIST
    assert project["scripts"] == {"stadium": "stadium._cli.main:main"}
    assert all(not dep.startswith("stadium[") for dep in project["optional-dependencies"]["dev"])
    assert f"{DIST}[bench,openenv,gym,ray]" in project["optional-dependencies"]["dev"]
    readme = (ROOT / "README.md").read_text()
    assert "pip install 'stadium[" not in readme
    assert f"pip install '{DIST}[openenv]'" in readme


def test_a_generated_project_depends_on_our_distribution(tmp_path: Path) -> None:
    project = create_project("quest", tmp_path)
    deps = tomllib.loads((project / "pyproject.toml").read_text())["project"]["dependencies"]
    assert [d.split(">=")[0] for d in deps] == [DIST]
    assert DIST in (project / "README.md").read_text()


def _run(cmd: list[str], cwd: Path | None = None, limit: float = 240) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    out = subprocess.run(
        cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=limit * UNIT
    )
    if out.returncode != 0:
        text = out.stdout + out.stderr
        if any(s in text for s in ("Failed to fetch", "dns error", "Could not connect")):
            pytest.skip(f"the package index is unreachable: {text[-300:]}")
        raise AssertionError(f"{' '.join(cmd)} failed:\n{text[-3000:]}")
    return out.stdout


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextlib.contextmanager
def _serving(cmd: list[str], cwd: Path, log: Path) -> Iterator[None]:
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield
    finally:
        proc.terminate()
        try:
            proc.wait(10 * UNIT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _get(url: str, limit_s: float) -> dict[str, object]:
    deadline = time.monotonic() + limit_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2 * UNIT) as resp:
                body: dict[str, object] = json.loads(resp.read())
                return body
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


@pytest.mark.skipif(UV is None, reason="needs uv")
def test_a_generated_env_installs_from_a_local_wheel_into_a_fresh_venv_and_serves(
    tmp_path: Path,
) -> None:
    assert UV is not None
    wheels = tmp_path / "wheels"
    _run([UV, "build", "--wheel", "--out-dir", str(wheels), str(ROOT)])
    (wheel,) = wheels.glob("*.whl")
    assert wheel.name.startswith("stadium_rl-")
    venv = tmp_path / "venv"
    _run([UV, "venv", "--quiet", "--python", sys.executable, str(venv)])
    python = venv / "bin" / "python"
    project = create_project("number-quest", tmp_path)
    # The project depends on "stadium-rl": found as the local wheel, not PyPI's "stadium".
    _run([UV, "pip", "install", "--python", str(python), "--find-links", str(wheels), str(project)])
    freeze = _run([UV, "pip", "freeze", "--python", str(python)])
    assert any(line.startswith("stadium-rl") for line in freeze.splitlines()), freeze
    # The recording's native step buffer: in the wheel (stable ABI), loaded by the server.
    assert "-cp311-abi3-" in wheel.name, wheel.name
    native = _run([str(python), "-c", "from stadium._server.ledger import buffer; "
                   "print(buffer.NATIVE)"])  # fmt: skip
    assert native.strip() == "True", native
    assert not any(line.split("==")[0] == "stadium" for line in freeze.splitlines()), freeze
    port = _free_port()
    log = tmp_path / "serve.log"
    cmd = [str(venv / "bin" / "stadium"), "serve", "number_quest.env:Env", "--port", str(port)]
    with _serving(cmd, tmp_path, log):
        try:
            health = _get(f"http://127.0.0.1:{port}/health", 30 * UNIT)
        except OSError:
            pytest.fail(f"the server did not answer /health:\n{log.read_text()[-3000:]}")
        assert health.get("status") == "healthy", health
        # One session, driven by the fresh venv's own client.
        script = (
            "import stadium, sys\n"
            "with stadium.Client(sys.argv[1]) as env:\n"
            "    first = env.reset(seed=1).observation\n"
            "    result = env.step({'number': first['low']})\n"
            "    print(result.observation['guesses_left'])\n"
        )
        out = _run([str(python), "-c", script, f"http://127.0.0.1:{port}"], limit=60)
        assert out.strip() == "6"


@pytest.mark.skipif(UV is None, reason="needs uv")
@pytest.mark.skipif(SANDBOX_WHY_NOT is not None, reason=f"--isolation sandbox: {SANDBOX_WHY_NOT}")
def test_an_installed_wheel_s_sandbox_runs_the_native_init(tmp_path: Path) -> None:
    """The wheel carries the sandbox's native init (built by its hook): installed into a fresh
    venv (pip installs it 0755), a sandboxed session's pid 1 is that init, run from the
    template's execute-only memfd copy; before, an installed Stadium had none."""
    assert UV is not None
    wheels = tmp_path / "wheels"
    _run([UV, "build", "--wheel", "--out-dir", str(wheels), str(ROOT)])
    (wheel,) = wheels.glob("*.whl")
    venv = tmp_path / "venv"
    _run([UV, "venv", "--quiet", "--python", sys.executable, str(venv)])
    _run([UV, "pip", "install", "--python", str(venv / "bin" / "python"), str(wheel)])
    installed = list(venv.glob("lib/python*/site-packages/stadium/_server/isolation/stadium-init"))
    assert len(installed) == 1, installed
    port = _free_port()
    log = tmp_path / "serve.log"
    cmd = [
        str(venv / "bin" / "stadium"), "serve", "benchmark", "--port", str(port),
        "--isolation", "sandbox", "--log-level", "info",
    ]  # fmt: skip
    with _serving(cmd, tmp_path, log):
        try:
            _get(f"http://127.0.0.1:{port}/health", 30 * UNIT)
        except OSError:
            pytest.fail(f"the server did not answer /health:\n{log.read_text()[-3000:]}")
        script = (
            "import stadium, sys, time\n"
            "with stadium.Client(sys.argv[1]) as env:\n"
            "    env.reset()\n"
            "    env.step({'wait_seconds': 0})\n"
            "    print('stepped', flush=True)\n"
            "    sys.stdin.readline()\n"  # the session lives until the test has looked
        )
        with subprocess.Popen(
            [str(venv / "bin" / "python"), "-c", script, f"http://127.0.0.1:{port}"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        ) as client:  # fmt: skip
            assert client.stdout is not None
            assert client.stdin is not None
            try:
                assert client.stdout.readline().strip() == "stepped", log.read_text()[-3000:]
                inits = [p for p in _descendants(os.getpid()) if _exe(p).startswith(MEMFD)]
                assert len(inits) == 1, (inits, log.read_text()[-3000:])
                client.stdin.write("\n")
                client.stdin.flush()
                assert client.wait(30 * UNIT) == 0
            finally:
                if client.poll() is None:
                    client.kill()
    assert "sandboxed sessions' init: native" in log.read_text(), log.read_text()[-3000:]

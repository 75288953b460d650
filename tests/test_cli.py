"""The command line: one clear error line and a non-zero exit code; serve, check, version."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import stadium
from stadium._cli.demo import spawn_server

#: Process-level: servers, tools or interpreters in subprocesses (`make check` skips it).
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "stadium", *args],
        capture_output=True, text=True, timeout=60, cwd=ROOT, env=env,
    )  # fmt: skip


def test_version() -> None:
    out = run("--version")
    assert out.returncode == 0
    assert stadium.__version__ in out.stdout


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["serve", "no_such_env"], "cannot understand target"),
        (["serve", "nosuchmodule:Env"], "no module named 'nosuchmodule'"),
        (["serve", "stadium.envs.echo:Missing"], "has no attribute"),
        (["serve", "stadium.envs.echo:EchoAction"], "not a stadium.Environment"),
        (["serve", "missing/file.py:Env"], "no such file"),
        (["serve", "echo", "--port", "70000"], "--port must be 0..65535"),
        (["serve", "echo", "--workers", "0"], "--workers must be 1..256"),
        (["serve", "echo", "--max-sessions", "0"], "--max-sessions must be at least 1"),
        (["serve", "echo", "--env-kwargs", "{bad"], "--env-kwargs is not valid JSON"),
        (["serve", "echo", "--port", "abc"], "'abc' is not a valid integer"),
        (["serve"], "Missing argument 'TARGET'"),
        (["frobnicate"], "No such command 'frobnicate'"),
        (["check", "stadium.envs.echo:EchoAction"], "not a stadium.Environment"),
    ],
)
def test_errors_print_one_line_and_exit_nonzero(args: list[str], needle: str) -> None:
    out = run(*args)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("error: ")
    assert needle in lines[0]


def test_openenv_env_vars_configure_serve() -> None:
    import os

    env = {**os.environ, "MAX_CONCURRENT_ENVS": "0"}
    out = run("serve", "echo", env=env)
    assert out.returncode == 2
    assert "--max-sessions must be at least 1" in out.stderr


def test_check_builtin_envs() -> None:
    for name in ("echo", "benchmark", "wordguess"):
        out = run("check", name)
        assert out.returncode == 0, out.stderr
        assert "checks passed" in out.stdout


def test_check_a_running_server() -> None:
    with spawn_server("wordguess") as (_, url):
        out = run("check", url)
    assert out.returncode == 0, out.stderr
    assert "GET /schema answers a JSON object" in out.stdout


def test_serve_a_file_target_and_the_workers_env_var() -> None:
    import os

    os.environ["WORKERS"] = "2"
    try:
        with spawn_server(str(ROOT / "examples" / "custom_env.py") + ":CountDown") as (proc, url):
            with stadium.Client(url) as env:
                assert env.reset(seed=1).observation == {"left": 11}
            children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
            assert len(children) == 2
    finally:
        del os.environ["WORKERS"]

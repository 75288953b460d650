"""Stadium in containers, for real: the repository's Containerfile and the Dockerfile that
`stadium init` writes are built with Podman (from a base image made here, see conftest.py), run
with OpenEnv's environment variables, driven with Stadium's clients, health-checked and stopped
with a drain; `stadium.deploy.podman.start` runs replicas and removes them.

Containers share the host's network (`--network host`) and bind 127.0.0.1: Podman's default
here is no network at all (`netns="none"` in scripts/install-container-deps.sh), and the host
network needs no NAT rules."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

import stadium
from stadium import ConfigError
from stadium._cli.scaffold import create_project
from stadium._server.config import DEFAULT_MAX_SESSIONS
from stadium.bench.arms import free_port
from stadium.deploy import podman as launcher
from stadium.deploy.running import Running
from tests.conftest import UNIT
from tests.container.conftest import INIT_IMAGE

# The first test to need the image also makes what it is built from, once per machine: a
# debootstrap (about a minute) and downloads (see conftest.py); hence more than the default limit.
pytestmark = [pytest.mark.container, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "src" / "stadium" / "templates" / "env" / "Dockerfile.tmpl"


def _podman(podman: str, *args: str, limit: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [podman, *args], capture_output=True, text=True, timeout=limit * UNIT, check=False
    )


def _health(url: str, limit_s: float) -> dict[str, object]:
    """GET /health until it answers 200 (bounded by ``limit_s``)."""
    deadline = time.monotonic() + limit_s
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2 * UNIT) as resp:
                body: dict[str, object] = json.loads(resp.read())
                return body
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


@pytest.fixture
def container(podman: str) -> Iterator[list[str]]:
    """Names of containers a test runs by hand; removed afterwards, whatever happened."""
    names: list[str] = []
    yield names
    if names:
        _podman(podman, "rm", "--force", "--ignore", "-t", "0", *names)


# ------------------------------------------------------------------ the files (no Podman)


@pytest.mark.parametrize("path", [ROOT / "Containerfile", TEMPLATE])
def test_the_image_files_follow_the_same_conventions(path: Path) -> None:
    text = path.read_text()
    env = dict(re.findall(r"^\s+(?:ENV\s+)?([A-Z_]+)=(\S+)", text, re.MULTILINE))
    assert env["HOST"] == "0.0.0.0"
    assert env["PORT"] == "8000"
    assert env["WORKERS"] == "1"
    assert int(env["MAX_CONCURRENT_ENVS"]) == DEFAULT_MAX_SESSIONS  # the server's own default
    assert re.search(r"^USER 10001:10001$", text, re.MULTILINE)
    assert re.search(r"^STOPSIGNAL SIGTERM$", text, re.MULTILINE)
    assert re.search(r"^EXPOSE 8000$", text, re.MULTILINE)
    check = re.search(r"^HEALTHCHECK .*\\\n\s+CMD (.*)$", text, re.MULTILINE)
    assert check is not None
    assert json.loads(check.group(1))[0] == "python3"  # no curl
    assert "/health" in check.group(1)
    assert re.search(r"^ARG BASE_IMAGE=python:3\.12-slim$", text, re.MULTILINE)


def test_the_containerfile_is_found_where_build_image_looks() -> None:
    assert launcher.containerfile().read_text() == (ROOT / "Containerfile").read_text()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"replicas": 0}, "replicas"),
        ({"port": 70000}, "port"),
        ({"port": 65535, "replicas": 2}, "port"),
        ({"workers": 0}, "workers"),
        ({"max_sessions": 0}, "max_sessions"),
    ],
)
def test_start_refuses_bad_arguments_before_running_anything(
    kwargs: dict[str, int], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        launcher.start("echo", image="localhost/none:none", podman="/nonexistent/podman", **kwargs)


def test_start_says_when_podman_is_missing() -> None:
    with pytest.raises(ConfigError, match="not installed"):
        launcher.start("echo", podman="/nonexistent/podman")


# ------------------------------------------------------------------ Stadium's image


async def test_the_image_serves_with_openenv_variables_as_non_root_and_drains_on_stop(
    podman: str, stadium_image: str, container: list[str]
) -> None:
    port = free_port()
    name = f"stadium-test-serve-{port}"
    container.append(name)
    run = _podman(
        podman, "run", "--detach", "--name", name, "--network", "host",
        "--env", "HOST=127.0.0.1", "--env", f"PORT={port}", "--env", "WORKERS=2",
        "--env", "MAX_CONCURRENT_ENVS=17", "--env", "STADIUM_TARGET=benchmark", stadium_image,
        "--drain-timeout", str(1.0 * UNIT),  # an option first: the target is STADIUM_TARGET
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    url = f"http://127.0.0.1:{port}"
    try:
        health = await asyncio.to_thread(_health, url, 60 * UNIT)
    except OSError:
        pytest.fail(f"no /health:\n{_podman(podman, 'logs', name).stderr[-3000:]}")
    # configured by the variables OpenEnv images read; STADIUM_TARGET chose the env
    assert health["status"] == "healthy"
    assert (health["max_sessions"], health["workers"]) == (17, 2)
    # not root: the server (PID 1 and its workers) and anything exec'd run as `stadium`
    assert _podman(podman, "exec", name, "id", "-u").stdout.strip() == "10001"
    users = _podman(podman, "top", name, "user").stdout.split()[1:]
    assert users == ["stadium"] * 3, users  # the supervisor and WORKERS=2 workers
    # the image's HEALTHCHECK (python, no curl) passes
    check = _podman(podman, "healthcheck", "run", name)
    assert check.returncode == 0, check.stdout + check.stderr
    # sessions, up to the limit the variable set
    async with stadium.SessionPool(url, size=6) as pool:
        await pool.reset(seeds=range(6))
        results = await pool.step([{"wait_seconds": 0.0}] * 6)
        assert [r.observation["step_count"] for r in results] == [1] * 6
        assert _health(url, 10 * UNIT)["active_sessions"] == 6
    # stop while a session is open and a slow step is in flight: the step is answered, the
    # session closes with 1001 after the drain timeout, the container exits 0 (not killed)
    wait = 2.0 * UNIT
    async with stadium.AsyncClient(url, resume=False) as client:
        await client.reset(seed=1)
        in_flight = asyncio.ensure_future(client.step({"wait_seconds": wait}))
        await asyncio.sleep(0.5 * UNIT)
        stop = asyncio.ensure_future(
            asyncio.to_thread(_podman, podman, "stop", "-t", str(int(60 * UNIT)), name)
        )
        result = await in_flight
        assert result.observation["waited_seconds"] == wait
        with pytest.raises(stadium.SessionClosedError) as closed:
            await client.step({"wait_seconds": 0.0})
        assert closed.value.context.get("close_code") == 1001
        assert (await stop).returncode == 0
    state = _podman(podman, "inspect", "--format", "{{.State.ExitCode}}", name).stdout.strip()
    assert state == "0", _podman(podman, "logs", name).stderr[-3000:]


def test_arguments_choose_the_target_and_reach_stadium_serve(
    podman: str, stadium_image: str, container: list[str]
) -> None:
    port = free_port()
    name = f"stadium-test-args-{port}"
    container.append(name)
    run = _podman(
        podman, "run", "--detach", "--name", name, "--network", "host",
        "--env", "HOST=127.0.0.1", "--env", f"PORT={port}",
        stadium_image, "wordguess", "--max-sessions", "5",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    url = f"http://127.0.0.1:{port}"
    assert _health(url, 60 * UNIT)["max_sessions"] == 5  # the option won over the image's ENV
    with urllib.request.urlopen(f"{url}/metadata", timeout=5 * UNIT) as resp:
        assert json.loads(resp.read())["name"] == "wordguess"
    # the installed wheel carries the Containerfile (build_image's default recipe)
    code = "from stadium.deploy.podman import containerfile as c; print(c().read_text())"
    shipped = _podman(podman, "exec", name, "python3", "-c", code).stdout
    assert shipped.strip() == (ROOT / "Containerfile").read_text().strip()
    # and the sandbox's native init, which the template can load (its sealed memfd copy)
    code = "from stadium._server.isolation.template.child import native_init; print(native_init())"
    assert _podman(podman, "exec", name, "python3", "-c", code).stdout.strip().isdigit()


# ------------------------------------------------------------------ the launcher


async def test_start_runs_replicas_that_clients_balance_over_and_stop_removes_them(
    podman: str, stadium_image: str
) -> None:
    d = await asyncio.to_thread(
        launcher.start, "benchmark", replicas=2, image=stadium_image, max_sessions=8,
        drain_timeout=0.5 * UNIT, podman=podman, timeout_s=60 * UNIT,
    )  # fmt: skip
    try:
        assert isinstance(d, Running)
        assert len(d.endpoints) == len(set(d.endpoints)) == 2
        assert d.router is None
        assert d.url == d.endpoints[0]
        async with stadium.SessionPool(d, size=4) as pool:
            await pool.reset(seeds=range(4))
            await pool.step([{"wait_seconds": 0.0}] * 4)
            loads = [_health(u, 10 * UNIT)["active_sessions"] for u in d.endpoints]
            assert sum(int(str(n)) for n in loads) == 4, loads
            assert 0 not in loads, loads  # spread over both
        listed = _podman(podman, "ps", "--filter", f"label={launcher.LABEL}={d.ident}", "-q")
        assert len(listed.stdout.split()) == 2
    finally:
        await asyncio.to_thread(d.stop, 60 * UNIT)
    assert d.exit_codes == dict.fromkeys(d.containers, 0)  # drained, not killed
    for name in d.containers:
        assert _podman(podman, "container", "exists", name).returncode == 1
    d.stop()  # idempotent


def test_stadium_launch_on_podman_returns_the_same_running_object(
    podman: str, stadium_image: str
) -> None:
    with stadium.launch(
        "echo", replicas=1, on="podman", image=stadium_image, podman=podman, timeout_s=60 * UNIT
    ) as d:
        assert isinstance(d, launcher.PodmanDeployment)
        with stadium.Client(d) as env:
            env.reset(seed=0)
            assert env.step({"message": "hi"}).observation["echoed_message"] == "hi"
    assert d.exit_codes == dict.fromkeys(d.containers, 0)


def test_start_names_the_container_that_never_comes_up_with_its_log(
    podman: str, stadium_image: str
) -> None:
    with pytest.raises(ConfigError) as info:
        launcher.start(
            "no_such_module_here:Env", image=stadium_image, podman=podman, timeout_s=60 * UNIT,
        )  # fmt: skip
    message = info.value.message
    assert "no_such_module_here" in message, message  # the server's own error, from its log
    assert "log lines" in message, message
    left = _podman(podman, "ps", "--all", "--filter", f"name={info.value.context['container']}")
    assert info.value.context["container"] not in left.stdout  # removed


def test_start_refuses_an_image_that_does_not_exist(podman: str) -> None:
    with pytest.raises(ConfigError, match="build it first"):
        launcher.start("echo", image="localhost/stadium-test-missing:none", podman=podman)


# ------------------------------------------------------------------ `stadium init`'s Dockerfile


def test_the_stadium_init_dockerfile_builds_and_serves(
    podman: str, base_image: str, wheels_dir: Path, tmp_path: Path
) -> None:
    project = create_project("number-quest", tmp_path)
    shutil.copytree(wheels_dir, project / "wheels")  # stadium-rl, its dependencies, hatchling
    tag = f"{INIT_IMAGE}:{os.getpid()}"
    try:
        launcher.build_image(
            tag, context=project, file=project / "Dockerfile", base=base_image,
            pull="never", layers=False, podman=podman,
        )  # fmt: skip
        # no target given: the image's STADIUM_TARGET, the project's env
        port = free_port()
        name = f"stadium-test-init-{port}"
        run = _podman(
            podman, "run", "--detach", "--name", name, "--network", "host",
            "--env", "HOST=127.0.0.1", "--env", f"PORT={port}", tag,
        )  # fmt: skip
        try:
            assert run.returncode == 0, run.stderr
            url = f"http://127.0.0.1:{port}"
            assert _health(url, 60 * UNIT)["status"] == "healthy"
            with stadium.Client(url) as env:
                first = env.reset(seed=1).observation
                assert first["guesses_left"] == 7
                result = env.step({"number": first["low"]})
                assert result.observation["guesses_left"] == 6
            assert _podman(podman, "exec", name, "id", "-u").stdout.strip() == "10001"
            assert _podman(podman, "healthcheck", "run", name).returncode == 0
            assert _podman(podman, "stop", "-t", str(int(30 * UNIT)), name).returncode == 0
            code = _podman(podman, "inspect", "--format", "{{.State.ExitCode}}", name)
            assert code.stdout.strip() == "0"
        finally:
            _podman(podman, "rm", "--force", "--ignore", "-t", "0", name)
    finally:
        _podman(podman, "rmi", "--force", "--ignore", tag)

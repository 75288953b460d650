"""Limits from the env's ``openenv.yaml`` and the flags (precedence, errors, warnings),
and the wall time per episode (``--episode-timeout``), on real servers."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

import stadium
from stadium import ConfigError, ErrorCode, ServerConfig
from stadium._cli.main import cli
from stadium._server.isolation import Limits, sandbox_unavailable
from stadium._server.isolation.sandbox import CGROUP_PARENT
from stadium._server.isolation.worker.manifest import (
    find_manifest,
    limits_for,
    read_manifest,
    unenforced,
)
from stadium._server.processes.worker import startup_warnings
from tests.conftest import UNIT, serve, wait_until

EPISODIC = Path(__file__).with_name("episodic.py")
WHY_NO_SANDBOX = sandbox_unavailable()
needs_sandbox = pytest.mark.skipif(
    WHY_NO_SANDBOX is not None, reason=f"--isolation sandbox: {WHY_NO_SANDBOX}"
)

FULL = """
name: episodic
validation:
  resources: {cpu: 0.5, memory_mb: 96, disk_mb: 32, episode_timeout_s: 600}
  network: {mode: allowlist, allowed_hosts: [api.example.com, 10.1.0.0/16]}
"""


def _env_dir(tmp_path: Path, manifest: str) -> str:
    """A folder with ``openenv.yaml`` and the episodic env; the target serving it."""
    folder = tmp_path / "env"
    folder.mkdir(exist_ok=True)
    shutil.copy(EPISODIC, folder / "episodic.py")
    (folder / "openenv.yaml").write_text(manifest)
    return f"{folder}/episodic.py:Episodic"


def _manifest(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "openenv.yaml"
    path.write_text(text)
    return path


def test_the_manifest_is_read_where_openenv_declares_it(tmp_path: Path) -> None:
    m = read_manifest(_manifest(tmp_path, FULL))
    assert (m.cpus, m.memory_mib, m.disk_mib, m.episode_timeout) == (0.5, 96, 32, 600.0)
    assert m.network == "allowlist"
    assert m.allowed_hosts == ("api.example.com", "10.1.0.0/16")
    top = read_manifest(
        _manifest(tmp_path, "resources: {memory_mb: 64}\nnetwork: {mode: no-network}\n")
    )
    assert (top.memory_mib, top.network, top.cpus) == (64, "none", None)
    assert read_manifest(_manifest(tmp_path, "network: {}\n")).network == "public"  # OpenEnv's
    assert read_manifest(_manifest(tmp_path, "name: x\n")).declared() == []


@pytest.mark.parametrize(
    ("text", "field", "hint"),
    [
        ("validation: {resources: {memory_mb: lots}}", "resources.memory_mb", "whole number"),
        ("validation: {resources: {memory_mb: 8}}", "resources.memory_mb", "at least 16"),
        ("validation: {resources: {cpu: -1}}", "resources.cpu", "above 0"),
        ("validation: {resources: {cpu: true}}", "resources.cpu", "number of cores"),
        (
            "validation: {resources: {episode_timeout_s: 0}}",
            "resources.episode_timeout_s",
            "above 0",
        ),
        ("validation: {resources: {disk_mb: 1.5}}", "resources.disk_mb", "whole number"),
        ("validation: {resources: {memory: 64}}", "resources", "memory_mb"),
        ("validation: {network: {mode: internet}}", "network.mode", "no-network"),
        ("validation: {network: {mode: allowlist}}", "network.allowed_hosts", "allowed_hosts"),
        (
            "validation: {network: {mode: allowlist, allowed_hosts: ['*.example.com']}}",
            "network.allowed_hosts",
            "wildcards",
        ),
        (
            "validation: {network: {mode: allowlist, allowed_hosts: ['a.com:443']}}",
            "network.allowed_hosts",
            "ports",
        ),
        (
            "validation: {network: {mode: public, allowed_hosts: [a.com]}}",
            "network.allowed_hosts",
            "only for mode allowlist",
        ),
        ("validation: {resources: 4}", "resources must be a mapping", "mapping"),
        (
            "resources: {cpu: 1}\nvalidation: {resources: {cpu: 2}}",
            "resources is declared both",
            "keep one",
        ),
    ],
)
def test_a_malformed_manifest_names_the_field_and_what_to_write(
    tmp_path: Path, text: str, field: str, hint: str
) -> None:
    with pytest.raises(ConfigError) as info:
        read_manifest(_manifest(tmp_path, text))
    assert field in info.value.message
    assert hint in info.value.message
    assert "openenv.yaml" in info.value.message


def test_flags_override_the_manifest_which_overrides_the_defaults(tmp_path: Path) -> None:
    m = read_manifest(_manifest(tmp_path, FULL))
    plain = limits_for(ServerConfig(target="x"), m, 300.0)
    assert (plain.memory_mib, plain.cpus, plain.disk_mib) == (96, 0.5, 32)
    assert plain.episode_timeout == 600.0
    assert (plain.network, plain.allowed_hosts) == ("allowlist", m.allowed_hosts)
    assert plain.pids == Limits().pids  # not in the manifest
    flags = ServerConfig.from_options(
        target="x", sandbox_memory=1024, sandbox_cpus=2.0, episode_timeout=0.0,
        sandbox_network="none", sandbox_allow=(),
    )  # fmt: skip
    over = limits_for(flags, m, 300.0)  # a flag equal to the default still wins
    assert (over.memory_mib, over.cpus, over.disk_mib) == (1024, 2.0, 32)
    assert over.episode_timeout == 0.0
    assert (over.network, over.allowed_hosts) == ("none", ())
    hosts = limits_for(ServerConfig(target="x", sandbox_allow=("10.9.9.9",)), m, 300.0)
    assert (hosts.network, hosts.allowed_hosts) == ("allowlist", ("10.9.9.9",))
    defaults = limits_for(ServerConfig(target="x"), None, 300.0)
    assert defaults == Limits(call_timeout=300.0)
    with pytest.raises(ConfigError, match="--sandbox-allow HOST"):
        limits_for(ServerConfig(target="x", sandbox_network="allowlist"), None, 300.0)
    with pytest.raises(ConfigError, match="--sandbox-allow is for"):
        limits_for(
            ServerConfig(target="x", sandbox_network="public", sandbox_allow=("a.com",)), m, 1.0
        )
    with pytest.raises(ConfigError, match="--episode-timeout must be"):
        ServerConfig(target="x", episode_timeout=-1)


def test_the_manifest_is_found_beside_or_above_the_served_module(tmp_path: Path) -> None:
    target = _env_dir(tmp_path, "name: x\n")
    folder = Path(target.split(":")[0]).parent
    assert find_manifest(target) == folder / "openenv.yaml"
    assert find_manifest(str(folder)) == folder / "openenv.yaml"  # an env directory
    server = folder / "server"  # OpenEnv's layout: my_env/server/app.py, a package
    server.mkdir()
    (server / "__init__.py").write_text("")
    (server / "app.py").write_text("")
    assert find_manifest(f"{server}/app.py:app") == folder / "openenv.yaml"
    (folder / "openenv.yaml").unlink()
    assert find_manifest(target) is None
    assert find_manifest("echo") is None
    assert find_manifest("gymnasium:CartPole-v1") is None


def test_unenforced_limits_are_warned_of_at_start_and_by_check(tmp_path: Path) -> None:
    target = _env_dir(tmp_path, FULL)
    (warning,) = startup_warnings(ServerConfig(target=target), object)
    assert "resources.memory_mb" in warning
    assert "network.mode" in warning
    assert "--isolation none does not enforce" in warning
    (warning,) = startup_warnings(ServerConfig(target=target, isolation="process"), object)
    assert "episode_timeout_s" not in warning  # process isolation enforces that one
    assert "resources.cpu" in warning
    assert startup_warnings(ServerConfig(target=target, isolation="sandbox"), object) == []
    m = read_manifest(Path(target.split(":")[0]).with_name("openenv.yaml"))
    assert unenforced(m, "sandbox") == []
    out = CliRunner().invoke(cli, ["check", target, "--action", '{"do": "echo", "arg": "a"}'])
    assert out.exit_code == 0, out.output
    assert "warning: " in out.output
    assert "does not enforce" in out.output
    public = _env_dir(tmp_path, "validation: {network: {mode: public}}\n")
    assert startup_warnings(ServerConfig(target=public), object) == []  # nothing to enforce


@pytest.mark.slow
def test_stadium_serve_warns_of_unenforced_limits_at_start(tmp_path: Path) -> None:
    target = _env_dir(tmp_path, FULL)
    proc = subprocess.Popen(
        [sys.executable, "-m", "stadium", "serve", target, "--port", "0"],
        stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        assert "serving" in proc.stdout.readline()
    finally:
        proc.terminate()
        _out, err = proc.communicate(timeout=30 * UNIT)
    assert "does not enforce" in err
    assert "resources.memory_mb" in err


async def test_network_flags_outside_the_sandbox_are_refused() -> None:
    with pytest.raises(ConfigError, match="are for --isolation sandbox"):
        async with serve(f"{EPISODIC}:Episodic", isolation="process", sandbox_network="public"):
            pass
    with pytest.raises(ConfigError, match="--episode-timeout needs --isolation"):
        async with serve(f"{EPISODIC}:Episodic", episode_timeout=5.0):
            pass


async def _error(env: stadium.AsyncClient[Any], do: str, arg: str = "") -> stadium.StadiumError:
    with pytest.raises(stadium.StadiumError) as info:
        await env.step({"do": do, "arg": arg})
    return info.value


MODES = ["process", pytest.param("sandbox", marks=needs_sandbox)]


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
async def test_an_episode_past_its_time_is_killed_and_reset_starts_afresh(
    tmp_path: Path, mode: str
) -> None:
    """From the manifest's ``episode_timeout_s``: an idle episode's process is killed
    when its time runs out, a running call is stopped; episodes that end in time and
    the other sessions are untouched; each kill is counted."""
    limit = 1.5 * UNIT
    target = _env_dir(tmp_path, f"validation: {{resources: {{episode_timeout_s: {limit}}}}}\n")
    async with serve(target, isolation=mode) as server:
        isolation = server.runtime.isolation
        assert isolation.limits.episode_timeout == limit
        async with (
            stadium.AsyncClient(server.url) as env,
            stadium.AsyncClient(server.url) as short,
        ):
            await env.reset()
            await short.reset()
            assert (await short.step({"do": "finish"})).done  # ended in time: no timer left
            await env.step({"do": "echo", "arg": "a"})
            await wait_until(lambda: isolation.limit_kills == 1, 10 * UNIT, "episode killed")
            err = await _error(env, "echo", "b")
            assert err.code == ErrorCode.LIMIT_EXCEEDED
            assert err.context["limit"] == "episode_time"
            assert err.context["value"] == limit
            assert "reset" in err.message
            # Until a reset, reading the state is an error too, not a fresh process's state.
            starts = isolation.starts
            with pytest.raises(stadium.StadiumError, match="reset") as info:
                await env.state()
            assert info.value.code == ErrorCode.SESSION_ERROR
            assert isolation.starts == starts  # no process started for it
            await env.reset()
            assert (await env.step({"do": "echo", "arg": "c"})).observation["text"] == "c"
            # A call still running when the time runs out is stopped with the same error.
            err = await _error(env, "sleep", str(30 * UNIT))
            assert err.context["limit"] == "episode_time"
            starts = isolation.starts
            await env.reset()
            assert isolation.starts == starts + 1  # a fresh process
            assert (await env.step({"do": "finish"})).done
            # The session that finished its episode in time was never killed.
            await asyncio.sleep(limit)
            assert (await short.step({"do": "echo", "arg": "x"})).observation["text"] == "x"
        assert isolation.limit_kills == 2
        assert isolation.crashes == 0
        metrics = await asyncio.to_thread(_get, server.url + "/metrics")
        assert "stadium_isolated_limit_kills_total 2.0" in metrics


@pytest.mark.slow
async def test_the_episode_timeout_flag_overrides_the_manifest(tmp_path: Path) -> None:
    target = _env_dir(tmp_path, "validation: {resources: {episode_timeout_s: 0.01}}\n")
    given = frozenset({"episode_timeout"})  # --episode-timeout 0 on the command line
    async with serve(target, isolation="process", episode_timeout=0.0, given=given) as server:
        assert server.runtime.isolation.limits.episode_timeout == 0.0
        async with stadium.AsyncClient(server.url) as env:
            await env.reset()
            await asyncio.sleep(0.1)
            assert (await env.step({"do": "echo", "arg": "a"})).observation["text"] == "a"
        assert server.runtime.isolation.limit_kills == 0


@pytest.mark.slow
@needs_sandbox
async def test_the_manifest_sets_the_sandbox_cgroup_and_work_directory(tmp_path: Path) -> None:
    target = _env_dir(tmp_path, "validation: {resources: {memory_mb: 48, cpu: 0.25, disk_mb: 8}}\n")
    async with serve(target, isolation="sandbox") as server:
        isolation = server.runtime.isolation
        async with stadium.AsyncClient(server.url) as env:
            await env.reset()
            (proc,) = isolation.live.values()
            memory, cpu, _pids = proc.cgroups[:3]  # (then cpuacct, where mounted apart)
            with open(f"{memory}/memory.limit_in_bytes") as f:  # noqa: ASYNC230
                assert f.read().strip() == str(48 << 20)
            with open(f"{cpu}/cpu.cfs_quota_us") as f:  # noqa: ASYNC230
                assert f.read().strip() == "25000"
            err = await _error(env, "memory")
            assert err.code == ErrorCode.LIMIT_EXCEEDED
            assert err.context["limit"] == "memory"
            assert err.context["value"] == 48
        assert isolation.limits.disk_mib == 8


@pytest.mark.slow
@needs_sandbox
async def test_the_worker_is_scheduled_beside_its_sessions_not_above_them() -> None:
    """The worker's cpu cgroup is a sibling of its sessions' (cgroup v1), so that a session's
    reply wakes it against that session's group, not against the sessions' parent: with the
    worker above, it preempted after nearly every reply (~1.9 wake-ups a step against
    ``process``'s ~1.3). Each session keeps its own CPU quota."""
    async with serve("echo", isolation="sandbox") as server:
        isolation = server.runtime.isolation
        cgroups = isolation.cgroups
        async with stadium.AsyncClient(server.url) as env:
            await env.reset()
            (proc,) = isolation.live.values()
            with open(f"/proc/{os.getpid()}/cgroup") as f:  # noqa: ASYNC230 (this process: the worker)
                lines = [line.split(":", 2) for line in f.read().splitlines()]
            if cgroups.version != 1:  # v2: not moved (its memory and pids would move too)
                assert not any(path.startswith(f"/{CGROUP_PARENT}/") for *_, path in lines)
                return
            (worker,) = [path for _, names, path in lines if "cpu" in names.split(",")]
            cpu = proc.cgroups[1]
            assert worker == f"/{CGROUP_PARENT}/{cgroups.tag}-worker"
            assert Path(cpu).parent == Path(cgroups.parents[1])
            with open(f"{cpu}/cpu.cfs_quota_us") as f:  # noqa: ASYNC230
                assert f.read().strip() == "100000"  # the session's quota: one core
            with open(f"{cgroups.parents[1]}/{cgroups.tag}-worker/cpu.shares") as f:  # noqa: ASYNC230
                assert f.read().strip() == "1024"  # one session's weight
            assert (await env.step({"message": "hi"})).observation is not None


def _get(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=10 * UNIT) as r:
        return str(r.read().decode())


@pytest.fixture
def echo_env_apart(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The ``echo_env`` package unimported, and tests/openenv_apps off ``sys.path``, for the
    test; after it, every ``echo_env`` module it imported forgotten and the others' back (a
    copy's modules left in ``sys.modules`` made a later test load the wrong echo_env)."""

    def ours() -> list[str]:
        return [m for m in sys.modules if m == "echo_env" or m.startswith("echo_env.")]

    saved = {name: sys.modules.pop(name) for name in ours()}
    monkeypatch.setattr(sys, "path", [p for p in sys.path if Path(p).name != "openenv_apps"])
    try:
        yield
    finally:
        for name in ours():
            del sys.modules[name]
        sys.modules.update(saved)


@pytest.mark.slow
@pytest.mark.usefixtures("echo_env_apart")
async def test_an_openenv_env_directory_brings_its_episode_time(tmp_path: Path) -> None:
    """``stadium serve ENV_DIR``: the directory's ``openenv.yaml`` (OpenEnv's layout, an
    app from ``create_app``) gives the episode's time; the resources ``process`` cannot
    enforce are warned of."""
    pytest.importorskip("openenv.core.env_server.http_server")
    # Another test may have imported tests/openenv_apps' echo_env (and put its folder on
    # sys.path): this one serves a copy of it, under the same package name.
    app = tmp_path / "echo_env"
    shutil.copytree(Path(__file__).parents[1] / "openenv_apps" / "echo_env", app)
    manifest = app / "openenv.yaml"
    limit = 1 * UNIT
    manifest.write_text(
        manifest.read_text()
        + f"validation:\n  resources: {{memory_mb: 256, episode_timeout_s: {limit}}}\n"
    )
    (warning,) = startup_warnings(ServerConfig(target=str(app), isolation="process"), object)
    assert "resources.memory_mb" in warning
    async with serve(str(app), isolation="process") as server:
        isolation = server.runtime.isolation
        assert isolation.limits.episode_timeout == limit
        async with stadium.AsyncClient(server.url) as env:
            await env.reset()
            assert (await env.step({"message": "hi"})).observation["echoed_message"] == "hi"
            await wait_until(lambda: isolation.limit_kills == 1, 10 * UNIT, "episode killed")
            with pytest.raises(stadium.StadiumError) as info:
                await env.step({"message": "late"})
            assert info.value.context["limit"] == "episode_time"
            await env.reset()
            assert (await env.step({"message": "again"})).observation["message_length"] == 5


@pytest.mark.slow
def test_stadium_serve_refuses_unusable_limits_before_it_listens(tmp_path: Path) -> None:
    def serve_cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "stadium", "serve", *args, "--port", "0"],
            capture_output=True, text=True, timeout=60 * UNIT, check=False,
        )  # fmt: skip

    out = serve_cli(f"{EPISODIC}:Episodic", "--isolation", "process", "--sandbox-network", "public")
    assert out.returncode != 0
    assert "are for --isolation sandbox" in out.stderr
    assert "serving" not in out.stdout
    out = serve_cli(_env_dir(tmp_path, "validation: {resources: {memory_mb: lots}}\n"))
    assert out.returncode != 0
    assert "resources.memory_mb" in out.stderr
    assert "serving" not in out.stdout

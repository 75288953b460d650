"""``stadium.launch``: the local engine for real (``stadium serve`` processes), the
checks every engine shares, and clients taking what a launcher returns."""

from __future__ import annotations

import asyncio
import gc
import inspect
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

import stadium
from stadium import AsyncClient, ConfigError, SessionClosedError, SessionPool
from stadium._client.balance import balancer_for, forget_all, is_plain, spec_key, static_urls
from stadium.deploy.deployment import Deployment
from stadium.deploy.launch import ENGINES, _target_name
from stadium.deploy.local import LocalDeployment
from stadium.deploy.running import Running
from stadium.envs import EchoEnv
from tests.conftest import UNIT, proc_alive, proc_children, wait_until

#: Process-level: servers, tools or interpreters in subprocesses (`make check` skips it).
pytestmark = pytest.mark.slow


class _Started(Running):
    """A Running with nothing behind it: what clients see of any launcher."""

    def stop(self, timeout: float = 30.0) -> None:
        pass


def _cmdlines_with(marker: str) -> list[int]:
    """Processes whose command line contains ``marker``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if marker.encode() in cmdline and proc_alive(int(pid)):
            found.append(int(pid))
    return found


async def _step_through_stop(d: Running, stop: Any) -> tuple[float, str]:
    """Open a session, start a 1.5 s step, stop the deployment while it runs; the step's
    reply and how the session ended (the drain serves it a while, then closes it)."""
    # A client that resumes sessions would try to resume this one elsewhere: not here.
    no_resume = {"resume": False} if "resume" in inspect.signature(AsyncClient).parameters else {}
    client: AsyncClient[Any] = AsyncClient(d, **no_resume)
    async with client as env:
        await env.reset()
        step = asyncio.ensure_future(env.step({"wait_seconds": 1.5}))
        await asyncio.sleep(0.3)
        stopping = asyncio.ensure_future(asyncio.to_thread(stop))
        result = await asyncio.wait_for(step, 20 * UNIT)
        ended = "still open"
        for _ in range(100):  # the drain serves it for --drain-timeout, then closes it
            try:
                await asyncio.wait_for(env.step({"wait_seconds": 0.1}), 20 * UNIT)
            except SessionClosedError as exc:
                ended = str(exc)
                break
        await asyncio.wait_for(stopping, 60 * UNIT)
        return float(result.observation["waited_seconds"]), ended


# -- clients take deployments (no process) ---------------------------------------------


def test_clients_take_a_deployment_or_a_running_one_as_its_nodes() -> None:
    nodes = ("http://10.1.0.1:8000", "http://10.1.0.2:8000")
    d = Deployment(nodes=nodes, router="http://10.1.0.1:8080")
    running = _Started(d)
    for spec in (d, running):
        assert spec_key(spec) == nodes  # the nodes, never the router
        assert static_urls(spec) == list(nodes)
        assert not is_plain(spec)
    forget_all()
    try:  # one balancer for the same nodes, however they were given
        assert balancer_for(running) is balancer_for(list(nodes)) is balancer_for(d)
    finally:
        forget_all()
    client: AsyncClient[Any] = AsyncClient(running)
    assert client.endpoints is running
    assert client.url == "ws://10.1.0.1:8000/ws"


def test_one_plain_url_is_unchanged() -> None:
    assert is_plain("http://127.0.0.1:8000")
    assert spec_key("http://127.0.0.1:8000") == ("http://127.0.0.1:8000",)
    assert AsyncClient("http://127.0.0.1:8000").endpoints is None


# -- what every engine shares ------------------------------------------------------------


def test_an_unknown_engine_is_refused_with_the_engines_listed() -> None:
    with pytest.raises(ConfigError) as info:
        stadium.launch("echo", on="kubernetes")
    for engine in ENGINES:
        assert repr(engine) in str(info.value)


def test_an_unknown_option_is_refused_with_the_engines_options_listed() -> None:
    with pytest.raises(ConfigError, match=r"no option bogus; its options: .*workers"):
        stadium.launch("echo", on="local", bogus=1)
    with pytest.raises(ConfigError, match="replicas"):
        stadium.launch("echo", replicas=0)


def test_targets_are_strings_or_importable_env_classes() -> None:
    assert _target_name("echo") == "echo"
    assert _target_name(EchoEnv) == f"{EchoEnv.__module__}:EchoEnv"

    class Nested(EchoEnv):
        pass

    with pytest.raises(ConfigError, match="cannot be imported by name"):
        _target_name(Nested)


def test_importing_stadium_loads_no_engine() -> None:
    code = (
        "import sys, stadium\n"
        "mods = ('ray', 'stadium.deploy.local', 'stadium.deploy.ray_cluster',"
        " 'stadium.deploy.slurm', 'stadium.deploy.podman', 'stadium.ray')\n"
        "print([m for m in mods if m in sys.modules])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "[]"


# -- the local engine ------------------------------------------------------------------


def test_local_replicas_take_sessions_and_drain_on_stop() -> None:
    d = stadium.launch("benchmark", replicas=2, on="local", drain_timeout=2, timeout_s=60 * UNIT)
    try:
        assert isinstance(d, LocalDeployment)
        assert d.router is None
        assert len(set(d.endpoints)) == 2
        assert all(url.startswith("http://127.0.0.1:") for url in d.endpoints)

        async def drive() -> tuple[set[Any], set[Any], str | None]:
            pool: SessionPool[Any] = SessionPool(d, size=8)
            async with pool:
                firsts = await pool.reset()
                steps = await pool.step([{"wait_seconds": 0.0}] * 8)
                assert all(s.observation["step_count"] == 1 for s in steps)
                pids = {r.observation["pid"] for r in firsts}
                nodes = {c.endpoint for c in pool.clients}
            async with AsyncClient(d) as env:
                await env.reset()
                one = env.endpoint
            return pids, nodes, one

        pids, nodes, one = asyncio.run(drive())
        assert pids == set(d.pids)  # one worker each: the sessions went to both servers
        assert nodes == set(d.endpoints)
        assert one in d.endpoints

        waited, ended = asyncio.run(_step_through_stop(d, lambda: d.stop(30 * UNIT)))
        assert waited == pytest.approx(1.5, abs=0.05)
        assert "1001" in ended, ended
        assert d.exit_codes == [0, 0]  # drained and exited, not killed
        assert not any(proc_alive(p) for p in d.pids)
        assert not d.log_dir.exists()
    finally:
        d.stop(5 * UNIT)


def test_a_forgotten_local_deployment_is_stopped_when_collected() -> None:
    d = stadium.launch("echo", replicas=1, on="local", workers=2, timeout_s=60 * UNIT)
    leader = d.pids[0]
    asyncio.run(wait_until(lambda: len(proc_children(leader)) == 2, 30 * UNIT, "2 workers"))
    pids = [leader, *proc_children(leader)]  # the supervisor and its workers
    assert all(proc_alive(p) for p in pids)
    del d
    gc.collect()
    assert not any(proc_alive(p) for p in pids)


@pytest.mark.parametrize("how", ["exits", "is killed"])
def test_servers_end_with_a_launcher_that_never_stopped_them(how: str) -> None:
    code = (
        "import os, signal, stadium\n"
        "d = stadium.launch('echo', replicas=1, on='local')\n"
        "print(d.pids[0], flush=True)\n"
        f"if {how == 'is killed'}:\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60 * UNIT
    )
    pid = int(out.stdout.split()[0])
    asyncio.run(wait_until(lambda: not proc_alive(pid), 30 * UNIT, "the server ended"))


def test_a_bad_target_is_a_clear_error_and_leaves_no_process() -> None:
    marker = f"no_such_module_{uuid.uuid4().hex[:8]}"
    with pytest.raises(ConfigError) as info:
        stadium.launch(f"{marker}:Env", replicas=2, on="local", timeout_s=60 * UNIT)
    message = str(info.value)
    assert "exited with code" in message
    assert "stderr" in message
    assert marker in message  # the server's own error, from its stderr
    assert _cmdlines_with(marker) == []

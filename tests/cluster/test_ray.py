"""``stadium.ray`` on a real 2-node Ray cluster in the emulated cluster's namespaces.

The head runs on the host at the bridge address, a worker inside node2; both are
``ray start --block`` processes this module starts (so it owns their pids) and stops by
pid with every process they started (``ray stop`` would end every Ray on the machine).
The test process is the Ray driver. Ray starts in ~15 s, so once per module.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import stadium
import stadium.ray
from stadium import Client, ConfigError, SessionPool
from tests.cluster.harness import Cluster, Node, _env, _kill_pids, _start_time, free_port
from tests.conftest import UNIT, proc_alive
from tests.test_launch import _step_through_stop

# Ray's start (~15 s quiet, more on a busy machine) counts in the first test's time
pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

RAY_OPTIONS = ["--disable-usage-stats", "--num-cpus=2", "--object-store-memory=100000000"]


@dataclasses.dataclass
class RayCluster:
    address: str
    head_ip: str
    worker: Node
    ray: Any  # the ray module


def _descendants(pid: int) -> list[int]:
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for task in tasks:
        try:
            children = Path(f"/proc/{pid}/task/{task}/children").read_text().split()
        except OSError:
            continue
        for child in map(int, children):
            out += [child, *_descendants(child)]
    return out


def _with_marker(marker: str) -> list[int]:
    """Processes whose command line names ``marker`` (this module's Ray temp dir)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(int(pid))
        except OSError:
            continue
    return found


def _wait_started(proc: subprocess.Popen[Any], log: Path, what: str) -> None:
    deadline = time.monotonic() + 90 * UNIT
    while "Ray runtime started" not in log.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
            pytest.fail(f"{what} did not start (exit {proc.returncode}):\n{tail}")
        time.sleep(0.1)


def _wait_listening(proc: subprocess.Popen[Any], addr: tuple[str, int], log: Path) -> None:
    deadline = time.monotonic() + 90 * UNIT
    while True:
        with socket.socket() as s:
            s.settimeout(0.5)
            if s.connect_ex(addr) == 0:
                return
        if proc.poll() is not None or time.monotonic() > deadline:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
            pytest.fail(f"the Ray head's GCS never listened (exit {proc.returncode}):\n{tail}")
        time.sleep(0.1)


@pytest.fixture(scope="module")
def ray_cluster(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayCluster]:
    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'stadium-rl[ray]')")
    ray_bin = str(Path(sys.executable).with_name("ray"))
    if not os.access(ray_bin, os.X_OK):
        pytest.skip(f"no ray command beside {sys.executable}")
    logs = tmp_path_factory.mktemp("ray")
    temp = tempfile.mkdtemp(prefix="stray-", dir="/tmp")  # short: Ray's socket paths
    port = free_port(cluster.host_addr)
    address = f"{cluster.host_addr}:{port}"
    worker = cluster.nodes[1]
    started: list[subprocess.Popen[Any]] = []
    sigterm = signal.getsignal(signal.SIGTERM)  # ray.init replaces it with sys.exit
    try:
        head = [ray_bin, "start", "--head", "--block", f"--port={port}",
                f"--node-ip-address={cluster.host_addr}", "--include-dashboard=false",
                f"--temp-dir={temp}", *RAY_OPTIONS]  # fmt: skip
        with open(logs / "head.out", "wb") as out:
            started.append(subprocess.Popen(head, stdout=out, stderr=subprocess.STDOUT, env=_env()))
        # the worker may start as soon as the head's GCS listens (it then waits for the rest)
        _wait_listening(started[0], (cluster.host_addr, port), logs / "head.out")
        join = [ray_bin, "start", "--block", f"--address={address}",
                f"--node-ip-address={worker.addr}", *RAY_OPTIONS]  # fmt: skip
        with open(logs / "worker.out", "wb") as out:
            started.append(worker.popen(join, stdout=out, stderr=subprocess.STDOUT))
        _wait_started(started[0], logs / "head.out", "the Ray head")
        _wait_started(started[1], logs / "worker.out", "the Ray worker in node2")
        ray.init(
            address=address, _node_ip_address=cluster.host_addr, log_to_driver=False,
            logging_level="WARNING",
        )  # fmt: skip
        deadline = time.monotonic() + 60 * UNIT
        while sum(1 for n in ray.nodes() if n["Alive"]) < 2:
            assert time.monotonic() < deadline, "the Ray worker never joined"
            time.sleep(0.2)
        yield RayCluster(address, cluster.host_addr, worker, ray)
    finally:
        if ray.is_initialized():
            ray.shutdown()
        signal.signal(signal.SIGTERM, sigterm)
        # Every process our two `ray start`s started (raylet, GCS, agents, workers), by pid.
        pids = [p.pid for p in started]
        for p in started:
            pids += _descendants(p.pid)
        pids += _with_marker(temp)
        # SIGTERM makes Ray drain for up to 30 s: SIGKILL after a short grace
        _kill_pids([(p, _start_time(p)) for p in dict.fromkeys(pids)], grace_s=3 * UNIT)
        for p in started:
            p.wait(10 * UNIT)
        left = [p for p in _with_marker(temp) if proc_alive(p)]
        shutil.rmtree(temp, ignore_errors=True)
        assert left == [], f"Ray processes left: {left}"


def _cpus_free(ray: Any) -> float:
    return float(ray.available_resources().get("CPU", 0.0))


def _poll(pred: Any, what: str) -> None:
    deadline = time.monotonic() + 30 * UNIT
    while not pred():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def test_one_server_per_node_balanced_and_drained(ray_cluster: RayCluster) -> None:
    ray = ray_cluster.ray
    d = stadium.ray.start("benchmark", drain_timeout=2, timeout_s=60 * UNIT)
    try:
        ips = sorted([ray_cluster.head_ip, ray_cluster.worker.addr])
        assert sorted(s.node_ip for s in d.servers) == ips
        assert sorted(urllib.parse.urlsplit(u).hostname or "" for u in d.endpoints) == ips
        assert d.router is None

        async def hosts() -> set[str]:
            pool: SessionPool[Any] = SessionPool(d, size=8)
            async with pool:
                firsts = await pool.reset()
                await pool.step([{"wait_seconds": 0.0}] * 8)
                return {str(r.observation["host"]) for r in firsts}

        # balanced by the client over both nodes (the worker's hostname is node2)
        assert asyncio.run(hosts()) == {socket.gethostname(), ray_cluster.worker.name}

        waited, ended = asyncio.run(_step_through_stop(d, lambda: d.stop(30 * UNIT)))
        assert waited == pytest.approx(1.5, abs=0.05)
        assert "1001" in ended, ended
        assert d.exit_codes == [0, 0]
        assert not any(proc_alive(s.pid) for s in d.servers)
        assert ray.util.placement_group_table(d.placement_group)["state"] == "REMOVED"
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(d.actors[0].stop.remote(0.0), timeout=30 * UNIT)
    finally:
        d.stop(5 * UNIT)


def test_launch_on_ray_per_cpu_reserves_the_cpus(ray_cluster: RayCluster) -> None:
    ray = ray_cluster.ray
    total = float(ray.cluster_resources()["CPU"])
    d = stadium.launch(
        "echo", replicas=2, on="ray", cpus_per_server=1, strategy="PACK", timeout_s=60 * UNIT
    )
    try:
        assert isinstance(d, stadium.ray.RayDeployment)
        assert len(set(d.endpoints)) == 2
        _poll(lambda: _cpus_free(ray) == total - 2, "each server's actor holds one CPU")
        for _ in range(4):
            with Client(d) as env:
                env.reset()
                assert env.step({"message": "hi"}).observation["echoed_message"] == "hi"
                assert env.endpoint in d.endpoints
    finally:
        d.stop(10 * UNIT)
    assert d.exit_codes == [0, 0]
    _poll(lambda: _cpus_free(ray) == total, "the CPUs given back")


def test_more_servers_than_nodes_one_per_node_is_a_clear_error(ray_cluster: RayCluster) -> None:
    ray = ray_cluster.ray
    with pytest.raises(ConfigError, match=r"could not place 3 server.*2 node"):
        stadium.ray.start("echo", replicas=3, timeout_s=3 * UNIT)
    states = {g["state"] for g in ray.util.placement_group_table().values()}
    assert states <= {"REMOVED"}, states


def test_a_server_that_cannot_start_is_a_clear_error_and_leaves_nothing(
    ray_cluster: RayCluster,
) -> None:
    ray = ray_cluster.ray
    total = float(ray.cluster_resources()["CPU"])
    with pytest.raises(ConfigError) as info:
        stadium.ray.start("no_such_module_here:Env", timeout_s=30 * UNIT)
    message = str(info.value)
    assert "2 server(s) did not come up" in message
    assert "no_such_module_here" in message  # each server's own error, from its stderr
    assert ray_cluster.worker.addr in message
    states = {g["state"] for g in ray.util.placement_group_table().values()}
    assert states <= {"REMOVED"}, states
    _poll(lambda: _cpus_free(ray) == total, "the actors' CPUs given back")

"""Smoke tests of the emulated cluster: nodes, SLURM, Stadium servers on nodes, HAProxy.

One cluster for the whole package (tests/cluster/conftest.py); every wait is bounded by
a multiple of ``UNIT``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from stadium import AsyncClient
from tests.cluster.harness import (
    RUN_ROOT,
    Cluster,
    ClusterError,
    Node,
    cleanup_stale,
    free_port,
    haproxy_servers,
    stop_process,
)
from tests.conftest import UNIT, proc_alive

pytestmark = pytest.mark.cluster

#: Port the node servers listen on (each node has its own network namespace).
PORT = 8765


def _wait(pred: Callable[[], bool], limit_s: float, what: str) -> None:
    deadline = time.monotonic() + limit_s
    while not pred():
        if time.monotonic() > deadline:
            pytest.fail(f"not true after {limit_s:.1f} s: {what}")
        time.sleep(0.05)


def _health(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout * UNIT) as resp:
            return resp.status == 200 and b"healthy" in resp.read()
    except OSError:
        return False


def _serve_cmd(target: str, port: int = PORT) -> list[str]:
    return [sys.executable, "-m", "stadium", "serve", target, "--host", "0.0.0.0",
            "--port", str(port), "--drain-timeout", "0", "--log-level", "info"]  # fmt: skip


async def _where(url: str) -> dict[str, Any]:
    """Open a session on ``url``, reset the benchmark env and return its observation."""
    client = AsyncClient[dict[str, Any]](url, connect_timeout=5 * UNIT, request_timeout=5 * UNIT)
    async with client as c:
        obs: dict[str, Any] = (await c.reset()).observation
        return obs


@pytest.fixture(scope="module")
def node_servers(cluster: Cluster) -> Iterator[list[subprocess.Popen[Any]]]:
    """``stadium serve benchmark`` on every node, port :data:`PORT`."""
    procs = [
        node.popen(_serve_cmd("benchmark"), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for node in cluster.nodes
    ]
    try:
        for node in cluster.nodes:
            _wait(functools.partial(_health, node.url(PORT)), 20 * UNIT, f"health of {node}")
        yield procs
    finally:
        for proc in procs:
            stop_process(proc)


def test_nodes_have_their_own_hostnames_and_reach_the_host(cluster: Cluster) -> None:
    probe = (
        "import socket, sys; print(socket.gethostname()); "
        "socket.create_connection((sys.argv[1], int(sys.argv[2])), 5).close()"
    )
    for node in cluster.nodes:
        out = node.run(
            [sys.executable, "-c", probe, cluster.host_addr, str(cluster.slurmctld_port)]
        )
        assert out.stdout.strip() == node.name
        assert node.run(["ip", "-4", "route"]).stdout.count("default") == 0  # nothing leaves
    assert socket.gethostname() not in {n.name for n in cluster.nodes}


def test_srun_runs_on_every_node(cluster: Cluster) -> None:
    assert cluster.node_states() == {n.name: "idle" for n in cluster.nodes}
    out = cluster.slurm("srun", "-N3", "hostname", timeout=30 * UNIT)
    assert sorted(out.split()) == ["node1", "node2", "node3"]


def test_echo_servers_on_nodes_answer_health_from_the_host(cluster: Cluster) -> None:
    port = PORT + 1
    procs = [
        n.popen(_serve_cmd("echo", port), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for n in cluster.nodes
    ]
    try:
        for node in cluster.nodes:
            _wait(functools.partial(_health, node.url(port)), 20 * UNIT, f"echo health on {node}")
    finally:
        codes = [stop_process(p, grace_s=10 * UNIT) for p in procs]
    assert codes == [0, 0, 0]  # SIGTERM: drained and exited cleanly


def test_sbatch_job_serves_on_every_node_and_scancel_stops_it(
    cluster: Cluster, tmp_path: Path
) -> None:
    port = PORT + 2
    script = tmp_path / "serve.sh"
    script.write_text(
        "#!/bin/bash\n"
        f"#SBATCH --nodes=3 --ntasks-per-node=1 --output={tmp_path}/job-%j.out\n"
        f"srun --output={tmp_path}/task-%t.out {' '.join(_serve_cmd('benchmark', port))}\n"
    )
    job = cluster.slurm("sbatch", "--parsable", f"--chdir={tmp_path}", str(script)).strip()
    assert job.isdigit()
    try:
        for node in cluster.nodes:
            _wait(functools.partial(_health, node.url(port)), 30 * UNIT, f"job's server on {node}")
        where = [asyncio.run(_where(n.url(port))) for n in cluster.nodes]
        assert [w["host"] for w in where] == [n.name for n in cluster.nodes]
        pids = [int(w["pid"]) for w in where]
        assert all(proc_alive(p) for p in pids)
    finally:
        cluster.slurm("scancel", job)
    _wait(lambda: not any(proc_alive(p) for p in pids), 15 * UNIT, "servers gone")
    _wait(lambda: job not in cluster.jobs(), 15 * UNIT, "job gone from squeue")

    def drained(task: int) -> bool:  # the server logged the SIGTERM it got (not a SIGKILL)
        return "signal received: draining" in (tmp_path / f"task-{task}.out").read_text()

    for task in range(3):
        _wait(functools.partial(drained, task), 5 * UNIT, f"task {task} logged its SIGTERM")


def _haproxy_cfg(port: int, stats: Path, nodes: list[Node]) -> str:
    servers = "\n".join(f"    server {n.name} {n.addr}:{PORT}" for n in nodes)
    return f"""global
    maxconn 256
    stats socket {stats} mode 600 level admin
defaults
    mode http
    timeout connect 2s
    timeout client 30s
    timeout server 30s
    timeout tunnel 1h
frontend stadium
    bind 127.0.0.1:{port}
    default_backend nodes
backend nodes
    balance leastconn
    option httpchk
    http-check send meth GET uri /health ver HTTP/1.1 hdr Host x
    http-check expect status 200
    timeout check 1s
    default-server check inter 200ms fall 2 rise 1
{servers}
"""


async def _sessions_through(url: str, n: int) -> list[dict[str, Any]]:
    """Hold ``n`` sessions open at once through ``url``; a step on each; their observations."""
    async with contextlib.AsyncExitStack() as stack:
        clients = []
        for _ in range(n):  # one after the other: leastconn sees the earlier ones open
            c = AsyncClient[dict[str, Any]](
                url, connect_timeout=5 * UNIT, request_timeout=5 * UNIT, max_retries=2
            )
            clients.append(await stack.enter_async_context(c))
            await c.reset()
        return [(await c.step({"wait_seconds": 0.0})).observation for c in clients]


def test_haproxy_balances_health_and_sessions_across_nodes(
    cluster: Cluster, node_servers: list[subprocess.Popen[Any]]
) -> None:
    port = free_port()
    stats = cluster.workdir / "haproxy-stats.sock"
    proxy = cluster.haproxy(_haproxy_cfg(port, stats, cluster.nodes))
    try:
        up = {n.name: "UP" for n in cluster.nodes}
        _wait(lambda: haproxy_servers(stats, "nodes") == up, 15 * UNIT, "3 servers UP in HAProxy")
        assert _health(f"http://127.0.0.1:{port}")
        obs = asyncio.run(_sessions_through(f"ws://127.0.0.1:{port}/ws", 3))
        assert sorted(o["host"] for o in obs) == ["node1", "node2", "node3"]
        assert all(o["step_count"] == 1 for o in obs)
    finally:
        assert stop_process(proxy) is not None
    assert proxy.returncode is not None


def test_a_disconnected_node_leaves_haproxy_and_comes_back(
    cluster: Cluster, node_servers: list[subprocess.Popen[Any]]
) -> None:
    port = free_port()
    stats = cluster.workdir / "haproxy-stats-2.sock"
    proxy = cluster.haproxy(_haproxy_cfg(port, stats, cluster.nodes))
    node2 = cluster.nodes[1]
    up = {n.name: "UP" for n in cluster.nodes}
    try:
        _wait(lambda: haproxy_servers(stats, "nodes") == up, 15 * UNIT, "3 servers UP")
        node2.disconnect()
        assert not _health(node2.url(PORT), timeout=0.5)  # unreachable from the host
        down = {**up, "node2": "DOWN"}
        _wait(lambda: haproxy_servers(stats, "nodes") == down, 15 * UNIT, "node2 DOWN")
        obs = asyncio.run(_sessions_through(f"ws://127.0.0.1:{port}/ws", 4))
        assert {o["host"] for o in obs} == {"node1", "node3"}
        node2.reconnect()
        _wait(lambda: haproxy_servers(stats, "nodes") == up, 15 * UNIT, "node2 UP again")
        assert _health(node2.url(PORT))
    finally:
        node2.reconnect()
        stop_process(proxy)


def _leftovers(tag: str) -> list[str]:
    """Namespaces, links and UTS mounts of the run ``tag`` that still exist."""
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    mounts = Path("/proc/self/mountinfo").read_text().splitlines()
    return [
        *(w for w in netns.split() if w.startswith(f"stadium-{tag}-")),
        *(name for line in links.splitlines()
          if (name := line.split(":")[1].strip().split("@")[0]).startswith((f"stbr{tag}",
                                                                           f"stv{tag}n"))),
        *(m.split()[4] for m in mounts if f"/stadium-cluster/{tag}/" in m),
    ]  # fmt: skip


class _FailsAtSlurm(Cluster):
    def _start_slurm(self) -> None:
        raise ClusterError("injected failure after network, hostnames and munge")


def test_a_half_done_up_leaves_nothing_and_down_is_idempotent(
    cluster: Cluster, tmp_path: Path
) -> None:
    broken = _FailsAtSlurm(n_nodes=2, workdir=tmp_path)
    with pytest.raises(ClusterError, match="injected"):
        broken.up()
    assert broken.nodes  # it got that far,
    assert broken.subnet != cluster.subnet  # on a network of its own
    assert _leftovers(broken.tag) == []
    assert not broken.run_dir.exists()
    assert not broken._procs
    broken.down()  # again: nothing to do, no error
    assert cluster.node_states() == {n.name: "idle" for n in cluster.nodes}  # untouched


def test_cleanup_stale_undoes_a_killed_run_and_spares_live_ones(
    cluster: Cluster, tmp_path: Path
) -> None:
    code = (
        "import sys, time; from tests.cluster.harness import Cluster; "
        "c = Cluster(n_nodes=1, workdir=sys.argv[1]).up(); "
        "print(c.tag, flush=True); time.sleep(60)"
    )
    run = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True,
        cwd=Path(__file__).parents[2],
    )  # fmt: skip
    try:
        assert run.stdout is not None
        tag = run.stdout.readline().strip()  # bounded by the test timeout
        assert tag == str(run.pid)
        state = json.loads((RUN_ROOT / tag / "state.json").read_text())
        daemons = [int(pid) for pid, _ in state["processes"]]
        assert len(daemons) == 3  # munged, slurmctld, slurmd
        assert all(proc_alive(p) for p in daemons)
    finally:
        run.kill()  # a crash: no teardown ran
        run.wait(10 * UNIT)
        if run.stdout is not None:
            run.stdout.close()
    assert len(_leftovers(tag)) == 4  # netns, bridge, veth, UTS mount
    removed = cleanup_stale()
    assert str(RUN_ROOT / tag) in removed
    assert _leftovers(tag) == []
    _wait(lambda: not any(proc_alive(p) for p in daemons), 10 * UNIT, "daemons of the dead run")
    assert cluster.tag not in " ".join(removed)
    assert cluster.node_states() == {n.name: "idle" for n in cluster.nodes}  # untouched

"""Sandboxed sessions' network modes (``none``, ``allowlist``, ``public``) against an
"outside" host this test makes: a network namespace of its own, joined to this host by
a veth pair, with a listener on two addresses. Traffic goes only to namespaces made
here and to loopback. Root, bubblewrap, iproute2 and nftables (``make sandbox-deps``).

"This host" is itself a network namespace the module makes (:func:`own_host`): the
test's thread joins it, so the servers, their workers and templates, the sessions'
veth pairs and each worker's NAT table are all made inside it, where IPv4 forwarding
is switched on. The machine's own ``net.ipv4.ip_forward`` (0 on a fresh machine) and
its nftables are never touched; the namespace is deleted afterwards."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

import stadium
from stadium import ConfigError
from stadium._server.isolation import sandbox_unavailable
from stadium._server.isolation.worker.netns import (
    LEASES,
    Networks,
    host_addresses,
    leftovers,
    network_tools_missing,
    network_unavailable,
)
from tests.conftest import UNIT, serve, wait_until
from tests.isolation.test_limits import EPISODIC

WHY = sandbox_unavailable() or network_tools_missing()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(WHY is not None, reason=f"sandbox network: {WHY}"),
]
TARGET = f"{EPISODIC}:Episodic"


def _free_port() -> int:
    """A port free on every address of this host (the outside namespace is new: all free)."""
    with socket.create_server(("0.0.0.0", 0)) as probe:
        port: int = probe.getsockname()[1]
    return port


PORT = _free_port()
LISTENER = """
import socket, sys, time
server = socket.create_server(("0.0.0.0", int(sys.argv[1])))
server.settimeout(0.2)
end = time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:
    try:
        conn, _ = server.accept()
    except TimeoutError:
        continue
    conn.sendall(b"hello")
    conn.close()
"""


class Outside:
    """A host outside: its own network namespace, ``allowed`` and ``other`` addresses."""

    def __init__(self) -> None:
        n = os.getpid() % 200 + 20
        self.ns = f"stadiumtest-out-{os.getpid()}"
        self.link = f"sto{os.getpid()}"[:15]
        self.gateway = f"10.214.{n}.1"  # this host's end: one of the host's own addresses
        self.allowed = f"10.214.{n}.2"
        self.other = f"10.214.{n}.3"
        _ip("netns", "add", self.ns)
        _ip("link", "add", self.link, "type", "veth", "peer", "name", "eth0", "netns", self.ns)
        _ip("addr", "add", f"{self.gateway}/24", "dev", self.link)
        _ip("link", "set", self.link, "up")
        for address in (self.allowed, self.other):
            _ip("-n", self.ns, "addr", "add", f"{address}/24", "dev", "eth0")
        _ip("-n", self.ns, "link", "set", "eth0", "up")
        self.listener = subprocess.Popen(
            ["ip", "netns", "exec", self.ns, sys.executable, "-c", LISTENER, str(PORT),
             str(120 * UNIT)],
        )  # fmt: skip
        # This host's own listener on its end of the link (must stay out of reach).
        self.own = subprocess.Popen([sys.executable, "-c", LISTENER, str(PORT), str(120 * UNIT)])

    def close(self) -> None:
        for proc in (self.listener, self.own):
            proc.kill()
            proc.wait()
        subprocess.run(["ip", "link", "del", self.link], check=False, capture_output=True)
        subprocess.run(["ip", "netns", "del", self.ns], check=False, capture_output=True)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@pytest.fixture(scope="module", autouse=True)
def own_host() -> Iterator[str]:
    """This module's host: a new network namespace (its loopback up, forwarding IPv4) that
    the test's thread joins for the module; what it starts (the event loop's threads, each
    server's workers and templates, ``ip`` and ``nft``) is made there. Deleted after."""
    name = f"stadiumtest-host-{os.getpid()}"
    _ip("netns", "add", name)
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        _ip("-n", name, "link", "set", "lo", "up")
        there = os.open(f"/run/netns/{name}", os.O_RDONLY)
        try:
            os.setns(there, os.CLONE_NEWNET)
        finally:
            os.close(there)
        try:
            with open("/proc/sys/net/ipv4/ip_forward", "w") as f:  # this namespace's own
                f.write("1")
            assert network_unavailable() is None, network_unavailable()
            yield name
            own = leftovers()
        finally:
            os.setns(home, os.CLONE_NEWNET)
    finally:
        os.close(home)
        subprocess.run(["ip", "netns", "del", name], check=False, capture_output=True)
    # Nothing of the tests' sessions was made in the machine's own namespace.
    assert [n for n in own["namespaces"] if n.startswith("stadiumtest")] == []
    machine = leftovers()
    assert [t for t in machine["tables"] if t.endswith(f"w{os.getpid()}")] == []


@pytest.fixture
def outside() -> Iterator[Outside]:
    host = Outside()
    try:
        yield host
    finally:
        host.close()


async def _connect(env: stadium.AsyncClient[Any], address: str) -> str:
    step = await env.step({"do": "connect", "arg": address})
    return str(step.observation["text"])


def _no_leftovers() -> None:
    left = leftovers()
    left["tables"] = [t for t in left["tables"] if t.endswith(f"w{os.getpid()}")]
    assert left == {"links": [], "namespaces": [], "tables": [], "leases": []}


async def test_allowlist_reaches_only_the_named_hosts(outside: Outside) -> None:
    async with serve(
        TARGET, isolation="sandbox", step_timeout=20 * UNIT, sandbox_allow=(outside.allowed,)
    ) as server:
        async with (
            stadium.AsyncClient(server.url) as env,
            stadium.AsyncClient(server.url) as neighbour,
        ):
            await env.reset()
            other = (await neighbour.reset()).observation["uid"]  # its process's uid
            assert await _connect(env, f"{outside.allowed}:{PORT}") == "connected hello"
            refused = await _connect(env, f"{outside.other}:{PORT}")
            assert "No route to host" in refused  # rejected by the session's rules
            # The host's own addresses (where the server and the rest listen): refused.
            assert "No route to host" in await _connect(env, f"{outside.gateway}:{PORT}")
            port = server.port
            assert "refused" in await _connect(env, f"127.0.0.1:{port}")  # its own loopback
            # Another session's listener: out of reach.
            listening = (await neighbour.step({"do": "listen"})).observation["text"]
            live = server.runtime.isolation.live
            assert len({p.net.addresses[1] for p in live.values()}) == 2  # no collision
            address = next(p for p in live.values() if p.uid == other).net.addresses[1]
            assert "No route to host" in await _connect(env, f"{address}:{listening}")
            hosts = (await env.step({"do": "hosts"})).observation["text"]
            assert hosts.startswith("127.0.0.1 localhost")
            left = leftovers()
            assert len(left["namespaces"]) == 2
            assert len(left["links"]) == 2
    _no_leftovers()


async def test_an_allowed_name_is_resolved_at_start_into_the_sandbox_hosts_file(
    outside: Outside, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker resolves the name when the session starts (here a resolver that knows
    the outside host; the machine's DNS is not asked); the sandbox reads it from its
    read-only ``/etc/hosts``, with no DNS of its own."""
    from stadium._server.isolation.worker import netns

    asked: list[str] = []

    def resolve(host: str) -> list[str]:
        asked.append(host)
        return [outside.allowed] if host == "outside.test" else []

    monkeypatch.setattr(netns, "resolve", resolve)
    async with serve(TARGET, isolation="sandbox", sandbox_allow=("outside.test",)) as server:
        async with stadium.AsyncClient(server.url) as env:
            await env.reset()
            hosts = (await env.step({"do": "hosts"})).observation["text"]
            assert f"{outside.allowed} outside.test" in hosts.splitlines()
            assert await _connect(env, f"outside.test:{PORT}") == "connected hello"
            assert "No route to host" in await _connect(env, f"{outside.other}:{PORT}")
            with pytest.raises(stadium.StadiumError, match="Read-only file system"):
                await env.step({"do": "write", "arg": "/etc/hosts"})
    assert asked == ["outside.test"]
    _no_leftovers()


async def test_public_reaches_any_address_but_the_hosts_own(outside: Outside) -> None:
    async with serve(TARGET, isolation="sandbox", sandbox_network="public") as server:
        async with (
            stadium.AsyncClient(server.url) as env,
            stadium.AsyncClient(server.url) as neighbour,
        ):
            await env.reset()
            other = (await neighbour.reset()).observation["uid"]  # its process's uid
            assert await _connect(env, f"{outside.allowed}:{PORT}") == "connected hello"
            assert await _connect(env, f"{outside.other}:{PORT}") == "connected hello"
            # The host's own addresses (the server, what else listens there): refused,
            # though this host listens on every address of its own at that port.
            for address in host_addresses():
                if not address.startswith("127."):
                    assert "No route to host" in await _connect(env, f"{address}:{PORT}")
            listening = (await neighbour.step({"do": "listen"})).observation["text"]
            live = server.runtime.isolation.live
            address = next(p for p in live.values() if p.uid == other).net.addresses[1]
            assert "No route to host" in await _connect(env, f"{address}:{listening}")
    _no_leftovers()


async def test_a_killed_sessions_network_is_removed_and_reset_gets_a_new_one(
    outside: Outside,
) -> None:
    async with serve(
        TARGET, isolation="sandbox", sandbox_network="public", episode_timeout=1 * UNIT
    ) as server:
        isolation = server.runtime.isolation
        async with stadium.AsyncClient(server.url) as env:
            await env.reset()
            assert len(leftovers()["namespaces"]) == 1
            await wait_until(lambda: isolation.limit_kills == 1, 10 * UNIT, "episode killed")

            def removed() -> bool:
                left = leftovers()
                return (left["namespaces"], left["links"], left["leases"]) == ([], [], [])

            await wait_until(removed, 10 * UNIT, "the killed session's network removed")
            await env.reset()
            assert await _connect(env, f"{outside.allowed}:{PORT}") == "connected hello"
            assert len(leftovers()["namespaces"]) == 1
    _no_leftovers()


async def test_no_network_by_default(outside: Outside) -> None:
    async with serve(TARGET, isolation="sandbox") as server:
        assert server.runtime.isolation.networks is None  # nothing made, nothing paid
        async with stadium.AsyncClient(server.url) as env:
            await env.reset()
            assert "unreachable" in await _connect(env, f"{outside.allowed}:{PORT}")
        assert leftovers()["namespaces"] == []


def test_a_dead_workers_networks_are_swept() -> None:
    crash = (
        "import os\n"
        "from stadium._server.isolation.worker.netns import Networks\n"
        "nets = Networks('public', (), 'w')\n"
        "nets.create(); nets.create()\n"
        "print(os.getpid(), flush=True)\n"
        "os._exit(9)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", crash], check=False, capture_output=True, text=True
    )
    assert done.returncode == 9, done.stderr
    table = f"stadium_w{int(done.stdout)}"
    assert table in leftovers()["tables"]
    left = leftovers()
    assert len(left["namespaces"]) == 2
    assert len(left["links"]) == 2
    assert len(left["leases"]) == 2
    Networks("public", (), "w").close([])  # any worker starting sweeps them
    _no_leftovers()
    assert table not in leftovers()["tables"]
    assert list(LEASES.iterdir()) == []


async def test_an_allowlist_flag_is_checked_like_the_manifest() -> None:
    for host, why in (("*.example.com", "wildcards"), ("fd00::1", "IPv4")):
        with pytest.raises(ConfigError, match=why):
            async with serve(TARGET, isolation="sandbox", sandbox_allow=(host,)):
                pass
    _no_leftovers()

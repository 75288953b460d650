"""Network for sandboxed sessions that ask for it: ``allowlist`` and ``public``.

A sandboxed session has no network by default (``none``: a network namespace with only
a loopback, made by the session's own process). A server whose sandbox network is
``allowlist`` or ``public`` gives each session, when its process is made:

* a network namespace of its own (``ip netns add stadium-sbx-N``), joined to the host by a
  veth pair: ``stdsbN`` on the host (``10.213.x.y+1/30``), ``eth0`` in the session
  (``+2``, its default route via the host end). ``N`` is a *lease*, a file in
  ``/run/stadium-net`` made with ``O_EXCL``: the addresses never collide across the
  workers and servers of the machine.
* nftables rules *inside* that namespace (the session's uid has no capabilities: it
  cannot change them), an ``output`` chain that drops by default and accepts its own
  loopback, replies, and: ``allowlist``: the addresses of the named hosts, resolved
  now (names written into the sandbox's ``/etc/hosts``, so it needs no DNS), and
  the CIDR ranges as written; ``public``: any IPv4 address but the host's own
  addresses (the server, whatever listens on the host) and every session's range
  (the other sessions). Everything else is rejected (``EHOSTUNREACH`` at once).
* on the host, one nftables table per worker (``stadium_wPID``) masquerading the
  sessions' range (NAT), so that replies find their way back. The host must forward
  IPv4 (``net.ipv4.ip_forward=1``); the server refuses to start otherwise.

When a session's process ends its namespace, veth pair and lease are removed. A
worker that died leaves leases naming its pid: the next worker to start on the machine
removes those (the namespace, the veth pair, the lease, its NAT table). Sessions of a
``none`` server pay none of this.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ipaddress
import logging
import os
import re
import socket
import subprocess
from pathlib import Path

from stadium._errors import ConfigError, ExecutionError

log = logging.getLogger("stadium.isolation")

#: The sessions' addresses: a /30 each (host end .1, session .2).
SUBNET = ipaddress.IPv4Network("10.213.0.0/16")
SLOTS = SUBNET.num_addresses // 4
LEASES = Path("/run/stadium-net")
NETNS_DIR = Path("/run/netns")
NAMESPACE = "stadium-sbx-{}"
HOST_IF = "stdsb{}"
TABLE_PREFIX = "stadium_w"
#: Seconds one ``ip``/``nft`` command may take.
COMMAND_S = 10.0


def network_tools_missing() -> str | None:
    """Which tool sessions' networks need is not installed (``None``: all are)."""
    for tool, package in (("ip", "iproute2"), ("nft", "nftables"), ("nsenter", "util-linux")):
        if _which(tool) is None:
            return f"{tool} is not installed: apt-get install {package} (make sandbox-deps)"
    return None


def network_unavailable() -> str | None:
    """Why sandboxed sessions cannot have network here (``None``: they can). Forwarding
    is a setting of the network namespace the server runs in (``/proc/sys/net`` shows
    the caller's)."""
    missing = network_tools_missing()
    if missing is not None:
        return missing
    try:
        forward = Path("/proc/sys/net/ipv4/ip_forward").read_text().strip()
    except OSError:
        forward = "0"
    if forward != "1":
        return (
            "the host does not forward IPv4 (sessions' traffic is routed through it): "
            "sysctl -w net.ipv4.ip_forward=1"
        )
    return None


def _which(tool: str) -> str | None:
    for folder in ("/usr/sbin", "/sbin", "/usr/bin", "/bin"):
        if os.access(f"{folder}/{tool}", os.X_OK):
            return f"{folder}/{tool}"
    return None


def _run(argv: list[str], stdin: str | None = None, check: bool = True) -> str:
    tool = _which(argv[0]) or argv[0]
    done = subprocess.run(
        [tool, *argv[1:]], input=stdin, capture_output=True, text=True, timeout=COMMAND_S,
        check=False,
    )  # fmt: skip
    if check and done.returncode != 0:
        raise ExecutionError(
            f"setting up the session's network failed: {' '.join(argv[:4])}: "
            f"{done.stderr.strip() or done.returncode}",
            operation="create",
        )
    return done.stdout


@dataclasses.dataclass(slots=True)
class SessionNet:
    """One session's network namespace (its fd is sent to the template)."""

    index: int
    fd: int
    hosts: str
    """``/etc/hosts`` as the session sees it."""

    @property
    def namespace(self) -> str:
        return NAMESPACE.format(self.index)

    @property
    def host_if(self) -> str:
        return HOST_IF.format(self.index)

    @property
    def addresses(self) -> tuple[str, str]:
        """(host end, session end)."""
        base = int(SUBNET.network_address) + 4 * self.index
        return str(ipaddress.IPv4Address(base + 1)), str(ipaddress.IPv4Address(base + 2))


class Networks:
    """One worker's sessions' networks (``allowlist`` or ``public``).

    Args:
        mode: ``allowlist`` or ``public``.
        allowed: ``allowlist``'s hosts (names, IPv4 addresses, CIDR ranges).
        tag: unique per worker (``wPID``).

    Raises:
        ConfigError: the machine cannot give sessions network (says why).
    """

    def __init__(self, mode: str, allowed: tuple[str, ...], tag: str) -> None:
        why = network_unavailable()
        if why is not None:
            raise ConfigError(f"--sandbox-network {mode} cannot run here: {why}")
        self.mode = mode
        self.allowed = allowed
        self.pid = os.getpid()
        self.table = f"{TABLE_PREFIX}{self.pid}"
        LEASES.mkdir(mode=0o700, exist_ok=True)
        sweep()
        _run(["nft", "-f", "-"], stdin=_nat_table(self.table))
        self._next = self.pid % SLOTS
        self._removing: set[int] = set()
        """Networks whose removal runs in the executor (:meth:`close` finishes them)."""

    async def acquire(self) -> SessionNet:
        """:meth:`create`, off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(None, self.create)

    def release(self, net: SessionNet) -> None:
        """:meth:`remove`, off the event loop."""
        self._removing.add(net.index)
        asyncio.get_running_loop().run_in_executor(None, self._remove_later, net)

    def _remove_later(self, net: SessionNet) -> None:
        self.remove(net)
        self._removing.discard(net.index)

    def create(self) -> SessionNet:
        """A new session's namespace, veth pair and rules (blocking: a few ``ip`` and
        ``nft`` commands; the worker runs it off its event loop)."""
        index = self._lease()
        net = SessionNet(index, -1, "")
        try:
            host, mine = net.addresses
            name, host_if = net.namespace, net.host_if
            _run(
                ["ip", "-batch", "-"],
                stdin=f"netns add {name}\n"
                f"link add {host_if} type veth peer name eth0 netns {name}\n"
                f"addr add {host}/30 dev {host_if}\n"
                f"link set {host_if} up\n",
            )
            _run(
                ["ip", "-n", name, "-batch", "-"],
                stdin=f"addr add {mine}/30 dev eth0\nlink set eth0 up\nlink set lo up\n"
                f"route add default via {host}\n",
            )
            rules, net.hosts = self._rules()
            _run(["nsenter", f"--net={NETNS_DIR / name}", "nft", "-f", "-"], stdin=rules)
            net.fd = os.open(NETNS_DIR / name, os.O_RDONLY | os.O_CLOEXEC)
        except BaseException:
            self.remove(net)
            raise
        return net

    def _lease(self) -> int:
        for i in range(SLOTS):
            index = (self._next + i) % SLOTS
            try:
                fd = os.open(LEASES / str(index), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError:
                continue
            with os.fdopen(fd, "w") as f:
                f.write(str(self.pid))
            self._next = (index + 1) % SLOTS
            return index
        raise ExecutionError(
            f"all {SLOTS} session networks of this machine are in use", operation="create"
        )

    def _rules(self) -> tuple[str, str]:
        """The session namespace's nftables rules and its ``/etc/hosts``."""
        hosts = ["127.0.0.1 localhost"]
        accept: list[str] = []
        drop: list[str] = []
        if self.mode == "allowlist":
            for host in self.allowed:
                try:
                    accept.append(str(ipaddress.IPv4Network(host, strict=False)))
                    continue
                except ValueError:
                    pass
                found = resolve(host)
                if not found:
                    log.warning("allowed host %s has no IPv4 address: not reachable", host)
                accept += found
                hosts += [f"{address} {host}" for address in found]
        else:
            drop = [*host_addresses(), str(SUBNET)]
        lines = [
            "table inet stadium {",
            "  chain out {",
            "    type filter hook output priority 0; policy drop;",
            '    oif "lo" accept',
            "    ct state established,related accept",
        ]
        if drop:
            addresses = ", ".join(sorted(set(drop)))
            lines.append(f"    ip daddr {{ {addresses} }} reject with icmpx type admin-prohibited")
        if accept:
            lines.append(f"    ip daddr {{ {', '.join(sorted(set(accept)))} }} accept")
        if self.mode == "public":
            lines.append("    meta nfproto ipv4 accept")
        lines += ["    reject with icmpx type admin-prohibited", "  }", "}"]
        return "\n".join(lines) + "\n", "\n".join(hosts) + "\n"

    def remove(self, net: SessionNet) -> None:
        """Remove ``net``'s namespace, veth pair and lease (idempotent, blocking)."""
        if net.fd >= 0:
            os.close(net.fd)
            net.fd = -1
        _teardown(net.index)

    def close(self, nets: list[SessionNet]) -> None:
        """Remove ``nets`` (the live sessions'), those still being removed, and this
        worker's NAT table (blocking)."""
        for net in {id(n): n for n in nets}.values():
            self.remove(net)
        for index in list(self._removing):
            _teardown(index)
        _run(["nft", "delete", "table", "ip", self.table], check=False)


def _teardown(index: int) -> None:
    host_if, name = HOST_IF.format(index), NAMESPACE.format(index)
    # The host's end first, then the namespace; -force: on past what is gone already.
    _run(
        ["ip", "-force", "-batch", "-"],
        stdin=f"link del {host_if}\nnetns del {name}\n",
        check=False,
    )
    with contextlib.suppress(FileNotFoundError):
        (LEASES / str(index)).unlink()


def _nat_table(table: str) -> str:
    return (
        f"table ip {table} {{\n"
        "  chain post {\n"
        "    type nat hook postrouting priority srcnat; policy accept;\n"
        f'    ip saddr {SUBNET} oifname != "stdsb*" masquerade\n'
        "  }\n"
        "}\n"
    )


def sweep() -> None:
    """Remove what workers that died left: their sessions' networks and NAT tables."""
    if LEASES.is_dir():
        for lease in LEASES.iterdir():
            try:
                owner = int(lease.read_text() or "0")
            except (OSError, ValueError):
                continue
            if owner and not _alive(owner) and lease.name.isdigit():
                _teardown(int(lease.name))
    for table in re.findall(rf"table ip ({TABLE_PREFIX}\d+)", _run(["nft", "list", "tables"])):
        if not _alive(int(table[len(TABLE_PREFIX) :])):
            _run(["nft", "delete", "table", "ip", table], check=False)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def resolve(host: str) -> list[str]:
    """``host``'s IPv4 addresses (none when it does not resolve)."""
    try:
        infos = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)
    except OSError:
        return []
    return sorted({str(info[4][0]) for info in infos})


def host_addresses() -> list[str]:
    """Every IPv4 address of the host's interfaces (the server and what else listens)."""
    out = _run(["ip", "-4", "-o", "addr", "show"])
    return sorted(set(re.findall(r"\binet (\d+\.\d+\.\d+\.\d+)", out)))


def leftovers() -> dict[str, list[str]]:
    """This machine's session namespaces, host veth ends, leases and NAT tables (tests
    assert cleanup with it)."""
    links = re.findall(r"^\d+: (stdsb\d+)[@:]", _run(["ip", "-o", "link", "show"]), re.M)
    names = re.findall(r"^(stadium-sbx-\d+)\b", _run(["ip", "netns", "list"]), re.M)
    tables = re.findall(rf"table ip ({TABLE_PREFIX}\d+)", _run(["nft", "list", "tables"]))
    leases = sorted(p.name for p in LEASES.iterdir()) if LEASES.is_dir() else []
    return {"links": links, "namespaces": names, "tables": tables, "leases": leases}

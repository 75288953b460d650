"""An emulated multi-node cluster on this one machine, for tests (root only).

A node is a network namespace ``stadium-<tag>-nodeK`` plugged into a private bridge
``stbr<tag>`` by a veth pair (host end ``stv<tag>nK``, node end renamed ``eth0``), with
its own hostname ``nodeK`` through a persistent UTS namespace (a file bind-mounted by
``unshare --uts=FILE``). The host has ``<subnet>.1`` on the bridge, node K has
``<subnet>.(10+K)``; namespaces get no default route and nothing is forwarded, so
traffic stays on the bridge. ``<tag>`` is this process's pid (plus a letter for the
second and later cluster of one process), so runs never clash.

On top: one ``munged`` (own key, socket, pid and log), ``slurmctld`` on the host (its
address on the bridge) and one ``slurmd`` per node inside the node; SLURM commands run
from the host with :meth:`Cluster.slurm_env` (``SLURM_CONF`` is always exported, else
they would ask DNS for the controller). :meth:`Cluster.haproxy` runs a HAProxy process
on a config the test writes.

Every process is started in the foreground by this module and stopped by its pid
(never by name). :meth:`Cluster.down` is idempotent and copes with a half-done
:meth:`Cluster.up`: it cancels jobs, stops the processes it started and any process
left in its namespaces, deletes the host veth ends before the namespaces, unmounts the
UTS files and removes the bridge. A state file under ``/run/stadium-cluster/<tag>/``
lets :func:`cleanup_stale` undo a crashed run whose owning process is gone.

/work/shared/CLUSTER.md has the facts this is built on.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

#: Runtime files (UTS namespace files, the munge socket, the state file): a short path
#: whose every directory is o+x, as munged demands.
RUN_ROOT = Path("/run/stadium-cluster")
#: Commands the cluster needs (installed by scripts/install-cluster-deps.sh).
REQUIRED_COMMANDS = (
    "ip", "nsenter", "unshare", "mount", "umount", "munged", "mungekey",
    "slurmctld", "slurmd", "sinfo", "squeue", "srun", "sbatch", "scancel", "haproxy",
)  # fmt: skip
_SBIN_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_TAG_RE = r"(\d+)[a-z]?"
_NETNS_RE = re.compile(rf"^stadium-{_TAG_RE}-node\d+$")
_LINK_RE = re.compile(rf"^(?:stbr{_TAG_RE}|stv{_TAG_RE}n\d+)$")
_instances = 0


class ClusterUnavailable(RuntimeError):
    """This machine cannot host the cluster: not root, commands missing, or no namespaces."""


class ClusterError(RuntimeError):
    """The cluster failed to come up or to do what a test asked (the message says where)."""


# -- small process helpers ------------------------------------------------------


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = env.get("PATH", "") + ":" + _SBIN_PATH
    return env


def _run(
    cmd: Sequence[str],
    *,
    check: bool = True,
    timeout: float = 30.0,
    env: Mapping[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` to completion; raise :class:`ClusterError` with its output if ``check``."""
    try:
        done = subprocess.run(
            list(cmd), capture_output=True, text=True, timeout=timeout,
            env=dict(env) if env is not None else _env(), check=False,
        )  # fmt: skip
    except subprocess.TimeoutExpired as exc:
        raise ClusterError(f"{' '.join(cmd)!r} did not finish in {timeout:.0f} s") from exc
    if check and done.returncode != 0:
        raise ClusterError(
            f"{' '.join(cmd)!r} failed ({done.returncode}): {(done.stderr or done.stdout).strip()}"
        )
    return done


def _start_time(pid: int) -> str | None:
    """The start time of ``pid`` (field 22 of /proc/PID/stat), to tell a reused pid apart."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None
    return None if fields[0] == "Z" else fields[19]


def _alive(pid: int, start: str | None = None) -> bool:
    """Whether ``pid`` runs (not a zombie) and, if ``start`` is given, is that same process."""
    now = _start_time(pid)
    return now is not None and (start is None or now == start)


def _kill_pids(pids: Sequence[tuple[int, str | None]], grace_s: float = 5.0) -> None:
    """SIGTERM each (pid, start time) still alive, then SIGKILL what remains after ``grace_s``."""
    live = [(p, s) for p, s in pids if _alive(p, s)]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid, _ in live:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace_s
        while live and time.monotonic() < deadline:
            time.sleep(0.05)
            for pid, _ in live:  # reap our own children so they do not stay zombies
                with contextlib.suppress(ChildProcessError, OSError):
                    os.waitpid(pid, os.WNOHANG)
            live = [(p, s) for p, s in live if _alive(p, s)]
        if not live:
            return


def stop_process(proc: subprocess.Popen[Any], grace_s: float = 5.0) -> int | None:
    """Stop one started process by its pid: SIGTERM, then SIGKILL after ``grace_s``."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(grace_s)
    return proc.returncode


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def wait_for(pred: Callable[[], bool], limit_s: float, what: str) -> None:
    """Poll ``pred`` until true; raise :class:`ClusterError` after ``limit_s`` seconds."""
    deadline = time.monotonic() + limit_s
    while not pred():
        if time.monotonic() > deadline:
            raise ClusterError(f"not true after {limit_s:.1f} s: {what}")
        time.sleep(0.05)


def haproxy_command(stats_socket: str | Path, command: str, timeout: float = 5.0) -> str:
    """Send one command (``show stat``, ``disable server be/s1`` ...) to HAProxy's
    ``stats socket PATH ... level admin`` and return its answer ("" if it is not up)."""
    try:
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(timeout)
            s.connect(str(stats_socket))
            s.sendall(command.encode() + b"\n")
            data = b""
            while chunk := s.recv(65536):
                data += chunk
    except OSError:
        return ""
    return data.decode(errors="replace")


def haproxy_servers(stats_socket: str | Path, backend: str) -> dict[str, str]:
    """``{server: status}`` (``UP``, ``DOWN``, ``MAINT`` ...) of one HAProxy backend."""
    rows = [r.split(",") for r in haproxy_command(stats_socket, "show stat").splitlines()]
    return {
        r[1]: r[17] for r in rows
        if len(r) > 17 and r[0] == backend and r[1] not in ("FRONTEND", "BACKEND")
    }  # fmt: skip


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


# -- clean-up of crashed runs -----------------------------------------------------


def _tag_owner_dead(tag: str) -> bool:
    m = re.match(_TAG_RE, tag)
    return m is not None and not _alive(int(m.group(1)))


def _netns_pids(netns: str) -> list[int]:
    done = _run(["ip", "netns", "pids", netns], check=False, timeout=10)
    return [int(p) for p in done.stdout.split() if p.isdigit()]


def _teardown_names(state: Mapping[str, Any]) -> None:
    """Delete what a state file names, in a safe order; missing pieces are skipped."""
    _kill_pids([(int(p), s) for p, s in state.get("processes", [])])
    for netns in state.get("netns", []):
        _kill_pids([(p, None) for p in _netns_pids(netns)])
    for link in state.get("veths", []):
        _run(["ip", "link", "del", link], check=False)
    for netns in state.get("netns", []):
        _run(["ip", "netns", "del", netns], check=False)
    for uts in state.get("uts_files", []):
        _run(["umount", uts], check=False)
        with contextlib.suppress(OSError):
            os.unlink(uts)
    if state.get("bridge"):
        _run(["ip", "link", "del", state["bridge"]], check=False)


def cleanup_stale() -> list[str]:
    """Undo what crashed earlier runs of this harness left, only where the owner pid is dead.

    Returns what it removed. Uses the state files under :data:`RUN_ROOT` (processes,
    mounts) and the naming scheme (namespaces, links) for runs that died before writing one.
    """
    removed: list[str] = []
    if RUN_ROOT.is_dir():
        for run_dir in sorted(RUN_ROOT.iterdir()):
            try:
                state = json.loads((run_dir / "state.json").read_text())
                dead = not _alive(int(state["owner"]), state["owner_start"])
            except (OSError, ValueError, KeyError, TypeError):
                state, dead = {}, _tag_owner_dead(run_dir.name)
            if not dead:
                continue
            _teardown_names(state)
            for line in Path("/proc/self/mountinfo").read_text().splitlines():
                mount_point = line.split()[4]
                if mount_point.startswith(f"{run_dir}/"):
                    _run(["umount", mount_point], check=False)
            shutil.rmtree(run_dir, ignore_errors=True)
            removed.append(str(run_dir))
    netns_list = _run(["ip", "netns", "list"], check=False).stdout.split("\n")
    stale_ns = [
        line.split()[0] for line in netns_list
        if line.split() and (m := _NETNS_RE.match(line.split()[0])) and _tag_owner_dead(m.group(1))
    ]  # fmt: skip
    links = [
        line.split(":")[1].strip().split("@")[0]
        for line in _run(["ip", "-o", "link", "show"], check=False).stdout.splitlines()
        if line.count(":") >= 2
    ]
    stale_links = []
    for link in links:
        m = _LINK_RE.match(link)
        if m and _tag_owner_dead(m.group(1) or m.group(2)):
            stale_links.append(link)
    # veths before namespaces, bridges last
    _teardown_names({"netns": stale_ns, "veths": [x for x in stale_links if x.startswith("stv")]})
    _teardown_names({"netns": [], "veths": [x for x in stale_links if x.startswith("stbr")]})
    return removed + stale_ns + stale_links


# -- the cluster --------------------------------------------------------------------


class Node:
    """One emulated host: a network namespace with its own hostname."""

    def __init__(self, cluster: Cluster, index: int) -> None:
        self.cluster = cluster
        self.index = index
        self.name = f"node{index}"
        self.netns = f"stadium-{cluster.tag}-node{index}"
        self.addr = f"{cluster.subnet}.{10 + index}"
        self.veth_host = f"stv{cluster.tag}n{index}"
        self.uts_file = cluster.run_dir / f"{self.name}.uts"

    def __repr__(self) -> str:
        return f"Node({self.name}, {self.addr}, netns={self.netns})"

    def prefix(self) -> list[str]:
        """The command prefix that runs a program inside this node."""
        return ["nsenter", f"--net=/run/netns/{self.netns}", f"--uts={self.uts_file}"]

    def url(self, port: int, scheme: str = "http") -> str:
        return f"{scheme}://{self.addr}:{port}"

    def run(
        self, cmd: Sequence[str], *, timeout: float = 30.0, check: bool = True,
        env: Mapping[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:  # fmt: skip
        """Run ``cmd`` inside the node to completion (text output captured)."""
        return _run([*self.prefix(), *cmd], timeout=timeout, check=check, env=env)

    def disconnect(self) -> None:
        """Cut the node off the bridge (host end of its veth down): a network failure."""
        _run(["ip", "link", "set", self.veth_host, "down"])

    def reconnect(self) -> None:
        """Undo :meth:`disconnect`."""
        _run(["ip", "link", "set", self.veth_host, "up"])

    def popen(self, cmd: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``cmd`` inside the node; :meth:`Cluster.down` stops it if the test did not.

        ``nsenter`` execs the command (no fork), so the handle's pid is the program's.
        """
        kwargs.setdefault("env", _env())
        return self.cluster._track(
            subprocess.Popen([*self.prefix(), *cmd], **kwargs), f"{self.name}:{cmd[0]}"
        )


class Cluster:
    """N emulated nodes with munge, SLURM and (on demand) HAProxy; see the module doc.

    ``subnet`` is the first three octets of the bridge's /24 (``"10.77.0"``); by default
    the first ``10.77.X`` no interface of the machine uses. ``workdir`` holds the logs,
    ``slurm.conf`` and spools (default: a new temporary directory, kept for post-mortems).

    Use as a context manager, or call :meth:`up` and then :meth:`down` (always safe).
    """

    def __init__(
        self, n_nodes: int = 3, subnet: str | None = None, workdir: str | Path | None = None
    ) -> None:
        global _instances
        if not 1 <= n_nodes <= 9:
            raise ValueError("n_nodes must be from 1 to 9")
        suffix = "" if _instances == 0 else chr(ord("a") + (_instances - 1) % 26)
        _instances += 1
        self.tag = f"{os.getpid()}{suffix}"
        self.n_nodes = n_nodes
        self._subnet = subnet
        self.subnet = subnet or "10.77.0"
        self.workdir = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="stadium-cl-"))
        self.run_dir = RUN_ROOT / self.tag
        self.bridge = f"stbr{self.tag}"
        self.host_addr = f"{self.subnet}.1"
        self.nodes: list[Node] = []
        self.slurm_conf = self.workdir / "slurm.conf"
        self.slurmctld_port = 0
        self._procs: list[tuple[str, subprocess.Popen[Any]]] = []
        self._haproxy_count = 0

    # -- lifecycle ----------------------------------------------------------------

    def __enter__(self) -> Cluster:
        self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    def up(self, timeout_s: float = 60.0) -> Cluster:
        """Bring up network, hostnames, munge, slurmctld and the slurmds; wait for idle nodes.

        Raises :class:`ClusterUnavailable` when this machine cannot do it at all, and
        :class:`ClusterError` when a part failed; both leave nothing behind.
        """
        if os.geteuid() != 0:
            raise ClusterUnavailable("the emulated cluster needs root (network namespaces)")
        env = _env()
        missing = [c for c in REQUIRED_COMMANDS if not shutil.which(c, path=env["PATH"])]
        if missing:
            raise ClusterUnavailable(
                f"missing commands {', '.join(missing)}: run scripts/install-cluster-deps.sh"
            )
        cleanup_stale()
        if self._subnet is None:
            self.subnet = self._free_subnet()
            self.host_addr = f"{self.subnet}.1"
        elif self._subnet_used(self._subnet):
            raise ClusterError(f"subnet {self._subnet}.0/24 is in use on this machine")
        self.nodes = [Node(self, k) for k in range(1, self.n_nodes + 1)]
        self.workdir.mkdir(parents=True, exist_ok=True)
        try:
            RUN_ROOT.mkdir(mode=0o755, exist_ok=True)
            os.chmod(RUN_ROOT, 0o755)  # munged wants o+x on every directory above its socket
            self.run_dir.mkdir(mode=0o755, exist_ok=True)
            os.chmod(self.run_dir, 0o755)
        except OSError as exc:
            raise ClusterUnavailable(f"cannot make {self.run_dir}: {exc}") from exc
        self._save_state()
        try:
            self._make_network()
            self._make_hostnames()
            self._start_munge()
            self._write_slurm_conf()
            self._start_slurm()
            self.wait_nodes_idle(timeout_s)
        except BaseException:
            self.down()
            raise
        return self

    def down(self) -> None:
        """Stop and remove everything this cluster started or made; idempotent."""
        ctld = self._find("slurmctld")
        if ctld is not None and ctld.poll() is None:
            with contextlib.suppress(ClusterError):
                self.cancel_all_jobs()
        order = ("haproxy", "envoy", "node", "slurmd", "slurmctld", "munged")
        for role in order:
            for name, proc in reversed(self._procs):
                if name.startswith(role):
                    stop_process(proc)
            if role == "slurmd":  # whatever a job or a node left behind in the namespaces
                for node in self.nodes:
                    _kill_pids([(p, None) for p in _netns_pids(node.netns)])
        self._procs.clear()
        _teardown_names(self._state())
        shutil.rmtree(self.run_dir, ignore_errors=True)

    # -- pieces of up() -----------------------------------------------------------

    @staticmethod
    def _subnet_used(subnet: str) -> bool:
        return f" {subnet}." in _run(["ip", "-o", "-4", "addr", "show"], check=False).stdout

    def _free_subnet(self) -> str:
        for third in range(256):
            subnet = f"10.77.{third}"
            if not self._subnet_used(subnet):
                return subnet
        raise ClusterUnavailable("no free 10.77.X.0/24 subnet for the bridge")

    def _make_network(self) -> None:
        try:
            _run(["ip", "link", "add", self.bridge, "type", "bridge"])
            _run(["ip", "netns", "add", self.nodes[0].netns])
        except ClusterError as exc:
            raise ClusterUnavailable(
                f"cannot create a bridge or a network namespace: {exc}"
            ) from exc
        _run(["ip", "addr", "add", f"{self.host_addr}/24", "dev", self.bridge])
        _run(["ip", "link", "set", self.bridge, "up"])
        for node in self.nodes:
            if node.index > 1:
                _run(["ip", "netns", "add", node.netns])
            peer = f"stp{self.tag}n{node.index}"
            _run(["ip", "link", "add", node.veth_host, "type", "veth", "peer", "name", peer,
                  "netns", node.netns])  # fmt: skip
            _run(["ip", "link", "set", node.veth_host, "master", self.bridge, "up"])
            ns = ["ip", "-n", node.netns]
            _run([*ns, "link", "set", peer, "name", "eth0"])
            _run([*ns, "addr", "add", f"{node.addr}/24", "dev", "eth0"])
            _run([*ns, "link", "set", "eth0", "up"])
            _run([*ns, "link", "set", "lo", "up"])

    def _make_hostnames(self) -> None:
        for node in self.nodes:
            node.uts_file.touch()
            _run(["unshare", f"--uts={node.uts_file}", "hostname", node.name])

    def _start_munge(self) -> None:
        key = self.workdir / "munge.key"
        if not key.exists():
            _run(["mungekey", "-c", "-b", "1024", "-k", str(key)])
        os.chmod(key, 0o600)
        self.munge_socket = self.run_dir / "munge.socket"
        log = self.workdir / "munged.log"
        self._start(
            "munged",
            ["munged", "-F", "-f", f"--key-file={key}", f"--socket={self.munge_socket}",
             f"--pid-file={self.workdir / 'munged.pid'}", f"--log-file={log}",
             f"--seed-file={self.workdir / 'munged.seed'}"],
        )  # fmt: skip
        self._wait(lambda: self.munge_socket.exists(), 10.0, "munged's socket", "munged", log)

    def _write_slurm_conf(self) -> None:
        self.slurmctld_port = free_port("")
        hw = _run(["slurmd", "-C"]).stdout.split()
        layout = " ".join(
            kv for kv in hw
            if kv.split("=")[0] in ("CPUs", "Boards", "SocketsPerBoard", "CoresPerSocket",
                                    "ThreadsPerCore")
        )  # fmt: skip
        w = self.workdir
        for node in self.nodes:
            (w / node.name / "spool").mkdir(parents=True, exist_ok=True)
        (w / "ctld-state").mkdir(exist_ok=True)
        nodes = "\n".join(
            f"NodeName={n.name} NodeAddr={n.addr} NodeHostname={n.name} {layout} State=UNKNOWN"
            for n in self.nodes
        )
        self.slurm_conf.write_text(
            f"""# written by tests/cluster/harness.py
ClusterName=st{self.tag}
SlurmctldHost={socket.gethostname().split(".")[0]}({self.host_addr})
SlurmctldPort={self.slurmctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket}
StateSaveLocation={w}/ctld-state
SlurmctldPidFile={w}/slurmctld.pid
SlurmctldLogFile={w}/slurmctld.log
SlurmdSpoolDir={w}/%n/spool
SlurmdPidFile={w}/%n/slurmd.pid
SlurmdLogFile={w}/slurmd-%n.log
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SchedulerType=sched/builtin
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
KillWait=3
MinJobAge=2
InactiveLimit=0
SlurmctldTimeout=30
SlurmdTimeout=30
MessageTimeout=10
{nodes}
PartitionName=all Nodes={",".join(n.name for n in self.nodes)} Default=YES MaxTime=INFINITE State=UP
"""
        )

    def _start_slurm(self) -> None:
        env = self.slurm_env()
        log = self.workdir / "slurmctld.log"
        self._start("slurmctld", ["slurmctld", "-D", "-c", "-f", str(self.slurm_conf)], env=env)

        def ctld_listens() -> bool:
            with socket.socket() as s:
                s.settimeout(0.5)
                return s.connect_ex((self.host_addr, self.slurmctld_port)) == 0

        self._wait(ctld_listens, 20.0, "slurmctld listening", "slurmctld", log)
        for node in self.nodes:
            out = open(self.workdir / f"slurmd-{node.name}.out", "wb")  # noqa: SIM115
            proc = subprocess.Popen(
                [*node.prefix(), "slurmd", "-D", "-N", node.name, "-f", str(self.slurm_conf)],
                env=env, stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip
            out.close()
            self._track(proc, f"slurmd@{node.name}")

    # -- what tests use -----------------------------------------------------------

    def slurm_env(self) -> dict[str, str]:
        """The environment to run ``sinfo``/``sbatch``/``srun``/``scancel`` from the host."""
        env = _env()
        env["SLURM_CONF"] = str(self.slurm_conf)
        return env

    def slurm(self, *args: str, timeout: float = 30.0, check: bool = True) -> str:
        """Run a SLURM command (``cluster.slurm("sinfo", "-N")``) and return its stdout."""
        return _run(args, timeout=timeout, check=check, env=self.slurm_env()).stdout

    def node_states(self) -> dict[str, str]:
        """``{node name: state}`` as ``sinfo`` reports it (``idle``, ``alloc``, ``down*`` ...)."""
        out = self.slurm("sinfo", "-h", "-N", "-o", "%N %t", check=False, timeout=10)
        return dict(line.split(None, 1) for line in out.splitlines() if " " in line)

    def wait_nodes_idle(self, timeout_s: float = 60.0) -> None:
        """Wait until every node is ``idle``; raise :class:`ClusterError` with the logs if not."""
        want = {n.name for n in self.nodes}
        self._wait(
            lambda: {k for k, v in self.node_states().items() if v == "idle"} >= want,
            timeout_s, "every node idle in sinfo", "slurmctld", self.workdir / "slurmctld.log",
        )  # fmt: skip

    def jobs(self) -> list[str]:
        """The ids of the jobs ``squeue`` lists."""
        return self.slurm("squeue", "-h", "-o", "%A", timeout=10).split()

    def cancel_all_jobs(self, timeout_s: float = 15.0) -> None:
        """``scancel`` every job and wait (bounded) until the queue is empty."""
        jobs = self.jobs()
        if jobs:
            self.slurm("scancel", *jobs, check=False, timeout=10)
            self._wait(lambda: not self.jobs(), timeout_s, "the job queue empty")

    def haproxy(self, cfg_text: str) -> subprocess.Popen[Any]:
        """Check ``cfg_text`` with ``haproxy -c`` and run a HAProxy on it (stopped by pid)."""
        self._haproxy_count += 1
        cfg = self.workdir / f"haproxy-{self._haproxy_count}.cfg"
        cfg.write_text(cfg_text)
        _run(["haproxy", "-c", "-q", "-f", str(cfg)])
        log = open(self.workdir / f"haproxy-{self._haproxy_count}.out", "wb")  # noqa: SIM115
        proc = subprocess.Popen(
            ["haproxy", "-db", "-f", str(cfg), "-p", str(cfg.with_suffix(".pid"))],
            stdout=log, stderr=subprocess.STDOUT, env=_env(),
        )  # fmt: skip
        log.close()
        return self._track(proc, f"haproxy-{self._haproxy_count}")

    def envoy(self, cfg_text: str, concurrency: int = 1) -> subprocess.Popen[Any]:
        """Check ``cfg_text`` with ``envoy --mode validate`` and run an Envoy on it (hot
        restart off, so several run side by side; stopped by pid)."""
        from stadium.deploy.envoy import check_config, command

        self._haproxy_count += 1
        cfg = self.workdir / f"envoy-{self._haproxy_count}.json"
        cfg.write_text(cfg_text)
        check_config(cfg_text)
        log = open(self.workdir / f"envoy-{self._haproxy_count}.out", "wb")  # noqa: SIM115
        proc = subprocess.Popen(
            command(str(cfg), concurrency=concurrency), stdout=log, stderr=subprocess.STDOUT,
            env=_env(),
        )  # fmt: skip
        log.close()
        return self._track(proc, f"envoy-{self._haproxy_count}")

    # -- internals ----------------------------------------------------------------

    def _start(self, name: str, cmd: list[str], env: Mapping[str, str] | None = None) -> None:
        out = open(self.workdir / f"{name}.out", "wb")  # noqa: SIM115
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=dict(env) if env else _env()
        )
        out.close()
        self._track(proc, name)

    def _track(self, proc: subprocess.Popen[Any], name: str) -> subprocess.Popen[Any]:
        self._procs.append((name, proc))
        self._save_state()
        return proc

    def _find(self, name: str) -> subprocess.Popen[Any] | None:
        return next((p for n, p in self._procs if n == name), None)

    def _wait(
        self,
        pred: Callable[[], bool],
        limit_s: float,
        what: str,
        proc_name: str = "",
        log: Path | None = None,
    ) -> None:
        deadline = time.monotonic() + limit_s
        proc = self._find(proc_name) if proc_name else None
        while not pred():
            exited = proc is not None and proc.poll() is not None
            if exited or time.monotonic() > deadline:
                why = f"{proc_name} exited ({proc.returncode})" if exited and proc else "timeout"
                out = self.workdir / f"{proc_name}.out"
                raise ClusterError(
                    f"{what}: not reached after {limit_s:.0f} s ({why})\n"
                    f"{_tail(log) if log else ''}\n{_tail(out) if out.exists() else ''}"
                )
            time.sleep(0.1)

    def _state(self) -> dict[str, Any]:
        return {
            "owner": os.getpid(),
            "owner_start": _start_time(os.getpid()),
            "workdir": str(self.workdir),
            "bridge": self.bridge,
            "netns": [n.netns for n in self.nodes],
            "veths": [n.veth_host for n in self.nodes],
            "uts_files": [str(n.uts_file) for n in self.nodes],
            "processes": [(p.pid, _start_time(p.pid)) for _, p in self._procs if p.poll() is None],
        }

    def _save_state(self) -> None:
        if self.run_dir.is_dir():
            tmp = self.run_dir / "state.json.tmp"
            tmp.write_text(json.dumps(self._state()))
            tmp.replace(self.run_dir / "state.json")


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m tests.cluster.harness [N]``: bring a cluster up, print it, wait for Enter."""
    args = list(sys.argv[1:] if argv is None else argv)
    with Cluster(n_nodes=int(args[0]) if args else 3) as cluster:
        print(f"workdir {cluster.workdir}; export SLURM_CONF={cluster.slurm_conf}")
        for node in cluster.nodes:
            print(f"{node.name} {node.addr}: {' '.join(node.prefix())} CMD")
        print(cluster.slurm("sinfo"))
        with contextlib.suppress(EOFError, KeyboardInterrupt):
            input("Enter to tear down> ")
    return 0


if __name__ == "__main__":
    sys.exit(main())

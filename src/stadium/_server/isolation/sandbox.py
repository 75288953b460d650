"""Sandbox isolation: the limits, the cgroups (v1 and v2), bubblewrap, and the set-up of one
session's process (:mod:`.template.confine` enters it).

The worker starts its template process under ``bwrap`` (new pid, network, ipc and uts
namespaces; a read-only view of the interpreter and the env's code; a private
``/tmp``; see :func:`bwrap_argv`). Per session, the worker makes a cgroup with the
session's limits (:class:`Cgroups`), and the process the template forks for it
(:func:`~.template.confine.enter_sandbox`) joins that cgroup, takes new mount, network, ipc and uts
namespaces of its own, mounts a private size-bounded tmpfs as its work directory
(``/sandbox``, also its home and ``TMPDIR``; ``/tmp`` is the same tmpfs, or read-only when
the code lives under ``/tmp``), mounts a ``devpts`` instance of its own with a small
``max`` (:attr:`Limits.ptys`: one session cannot take the host's pseudo-terminals), hides
the cgroup tree, and drops to an unprivileged uid of its own (never root, never the
server's user; unique among the node's live sessions: :class:`UidLease`) with
``no_new_privs``, and a ``/proc`` that shows only its own processes (``hidepid=2``).
Sessions cannot see each other's files nor signal each other's processes (distinct
uids), reach no
network (unless the server's sandbox network is ``allowlist`` or ``public``: then the
session joins the network namespace :mod:`.worker.netns` made for it, with its own
``/etc/hosts``), and are bounded in memory, CPU, processes, work-directory size and
wall time (per call and per episode).
The template gives each session a pid namespace of its own (:mod:`.template.child`) and, after
:func:`~.template.confine.enter_sandbox`, the seccomp filter (:mod:`.template.seccomp`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import os
import shutil
import signal
import stat
import sys
from collections.abc import Iterable
from pathlib import Path

from stadium._errors import ConfigError

CGROUP_ROOT = Path("/sys/fs/cgroup")
#: The folder under each hierarchy holding the sessions' cgroups.
CGROUP_PARENT = "stadium"
#: Where a sandboxed session works (its private tmpfs), as its process sees it. Not ``/tmp``:
#: the code may live under ``/tmp`` (a checkout there), and a mount there would hide it.
#: ``/tmp`` is the same private tmpfs when no code lives under it, else read-only.
WORK_DIR = "/sandbox"
#: The first uid of sandboxed sessions; each live session has its own (:class:`UidLease`).
UID_BASE = 1_000_000
#: The last uid a session may have (below 2**31: tools take uids as signed ints).
UID_LAST = 2**31 - 2
#: Uids per block a worker leases.
UID_BLOCK = 4096
#: Where the node's workers lease their blocks of uids (root's alone).
UID_RUN_DIR = "/run/stadium-uids"
MIB = 1024 * 1024


@dataclasses.dataclass(frozen=True, slots=True)
class Limits:
    """What one sandboxed session may use (defaults hold with no flag).

    Attributes:
        memory_mib: cgroup memory limit (RSS and page cache); past it the kernel
            kills the process (``LIMIT_EXCEEDED``, ``limit: memory``).
        cpus: CPU quota, in cores (cgroup CPU bandwidth).
        pids: processes and threads the session may have at once (fork bombs).
        disk_mib: size of the private work directory (a tmpfs).
        call_timeout: seconds one call (reset, step) may run before the process is
            killed (``LIMIT_EXCEEDED``, ``limit: wall_time``): ``--step-timeout``, or
            300 s when that is unset.
        episode_timeout: seconds from a ``reset`` until the episode ends (a step
            returns ``done``); past it the process is killed (``LIMIT_EXCEEDED``,
            ``limit: episode_time``). 0: none. Process isolation enforces it too.
        network: ``none`` (no network at all), ``allowlist`` (only
            ``allowed_hosts``) or ``public`` (any address but the host's own);
            see :mod:`~stadium._server.isolation.worker.netns`.
        allowed_hosts: host names, addresses or CIDR ranges of ``allowlist``.
        ptys: pseudo-terminals the session may hold at once (its own ``devpts``
            instance's ``max``; the host's and other sessions' are not shared).
    """

    memory_mib: int = 1024
    cpus: float = 1.0
    pids: int = 128
    disk_mib: int = 256
    call_timeout: float = 300.0
    network: str = "none"
    episode_timeout: float = 0.0
    allowed_hosts: tuple[str, ...] = ()
    ptys: int = 16

    def __post_init__(self) -> None:
        if self.memory_mib < 16:
            raise ConfigError("--sandbox-memory must be at least 16 MiB", value=self.memory_mib)
        if not 0.01 <= self.cpus <= 1024:
            raise ConfigError("--sandbox-cpus must be between 0.01 and 1024", value=self.cpus)
        if self.pids < 4:
            raise ConfigError("--sandbox-pids must be at least 4", value=self.pids)
        if not 1 <= self.ptys <= 1024:
            raise ConfigError("a session's pseudo-terminals must be 1..1024", value=self.ptys)
        if self.disk_mib < 1:
            raise ConfigError("--sandbox-disk must be at least 1 MiB", value=self.disk_mib)
        if self.episode_timeout < 0:
            raise ConfigError(
                "--episode-timeout must be >= 0 (0: none)", value=self.episode_timeout
            )
        if self.network not in ("none", "allowlist", "public"):
            raise ConfigError(
                "--sandbox-network must be none, allowlist or public", value=self.network
            )
        if self.network == "allowlist" and not self.allowed_hosts:
            raise ConfigError("a network allowlist needs hosts: give --sandbox-allow HOST")


def cgroup_version() -> int:
    """2 when the unified hierarchy holds the controllers, 1 for v1 hierarchies, 0: none."""
    if (CGROUP_ROOT / "cgroup.controllers").is_file():
        return 2
    if all((CGROUP_ROOT / c / "cgroup.procs").is_file() for c in ("memory", "cpu", "pids")):
        return 1
    return 0


def sandbox_unavailable() -> str | None:
    """Why ``--isolation sandbox`` cannot run here (``None``: it can)."""
    if os.geteuid() != 0:
        return "it needs root (to make cgroups and to give each session its own uid)"
    if shutil.which("bwrap") is None:
        return "bubblewrap (bwrap) is not installed: apt-get install bubblewrap"
    if cgroup_version() == 0:
        return "no cgroup memory, cpu and pids controllers are mounted under /sys/fs/cgroup"
    return None


class Cgroups:
    """The cgroups of one worker's sandboxed sessions (v1: memory, cpu, pids, and cpuacct
    where it is a hierarchy apart, read by the episode ledger; or v2).

    Args:
        limits: what each session's cgroup allows.
        tag: unique per worker (its pid), so workers never share a cgroup.
    """

    def __init__(self, limits: Limits, tag: str) -> None:
        self.limits = limits
        self.version = cgroup_version()
        self.tag = tag
        if self.version == 2:
            parent = CGROUP_ROOT / CGROUP_PARENT
            parent.mkdir(exist_ok=True)
            _write(parent / "cgroup.subtree_control", "+memory +cpu +pids")
            self._parents = [parent]
        else:
            hierarchies = ["memory", "cpu", "pids"]
            if (
                not (CGROUP_ROOT / "cpu" / "cpuacct.usage").exists()
                and (CGROUP_ROOT / "cpuacct" / "cgroup.procs").is_file()
            ):  # cpuacct mounted apart from cpu: the episode ledger reads its CPU
                hierarchies.append("cpuacct")
            self._parents = [CGROUP_ROOT / c / CGROUP_PARENT for c in hierarchies]
            for parent in self._parents:
                parent.mkdir(exist_ok=True)
        self.parents = [str(p) for p in self._parents]
        """The folders holding the sessions' cgroups (one per hierarchy)."""
        # The sessions together weigh as much as the machine's cores (a cgroup weighs as
        # one process by default: 8 busy sessions would get one process's share).
        cores = os.cpu_count() or 1
        if self.version == 2:
            _write(self._parents[0] / "cpu.weight", str(min(10000, 100 * cores)), optional=True)
        else:
            _write(self._parents[1] / "cpu.shares", str(1024 * cores), optional=True)

    def place_worker(self, pid: int) -> str | None:
        """Put the worker ``pid`` (every thread) in a cpu cgroup of its own beside its
        sessions' (v1: ``cpu/stadium/TAG-worker``); its path, or ``None`` (v2, or refused:
        the worker stays where it is, and only scheduling differs).

        Why: with the worker outside the sessions' parent, the worker woken by a session's
        reply is weighed against the whole parent's scheduling entity, which runs on from
        one session to the next, so the worker preempts it after nearly every reply (about
        two wake-ups a step); beside the sessions, it is weighed against the replying
        session's own group, just picked, which it lets finish its few µs, and it then finds
        several replies ready (as with ``--isolation process``). Its weight is one
        session's (``process``'s too: each env process weighs as the worker). Each session
        keeps its own quota. Its memory and pids stay the server's (v1 only moves ``cpu``).
        The cgroup is left when the worker ends (removed with the dead workers' cgroups).
        """
        if self.version != 1:
            return None
        path = self._parents[1] / f"{self.tag}-worker"
        try:
            path.mkdir(exist_ok=True)
            _write(path / "cpu.shares", "1024")
            _write(path / "cgroup.procs", str(pid))
        except OSError:
            return None
        return str(path)

    def create(self, name: str) -> list[str]:
        """Make session ``name``'s cgroup(s) with the limits; returns their paths."""
        lim = self.limits
        mem = lim.memory_mib * MIB
        period = 100_000
        quota = max(1000, int(lim.cpus * period))
        paths = [p / f"{self.tag}-{name}" for p in self._parents]
        for path in paths:
            path.mkdir(exist_ok=True)
        if self.version == 2:
            (path,) = paths
            _write(path / "memory.max", str(mem))
            _write(path / "memory.swap.max", "0", optional=True)
            _write(path / "cpu.max", f"{quota} {period}")
            _write(path / "pids.max", str(lim.pids))
        else:
            memory, cpu, pids = paths[:3]  # (then cpuacct's, no limit: only read)
            _write(memory / "memory.limit_in_bytes", str(mem))
            _write(memory / "memory.memsw.limit_in_bytes", str(mem), optional=True)
            _write(cpu / "cpu.cfs_period_us", str(period))
            _write(cpu / "cpu.cfs_quota_us", str(quota))
            _write(pids / "pids.max", str(lim.pids))
        return [str(p) for p in paths]

    def reclaim(self, paths: list[str]) -> None:
        """Give back the pages an emptied cgroup is still charged for (the page cache of
        files its session read or wrote), so a session that reuses it (a spare) starts
        with its whole memory limit. v1: ``memory.force_empty``; v2: ``memory.reclaim``."""
        if self.version == 2:
            with contextlib.suppress(OSError, ValueError):
                used = (Path(paths[0]) / "memory.current").read_text().strip()
                _write(Path(paths[0]) / "memory.reclaim", used, optional=True)
        else:
            _write(Path(paths[0]) / "memory.force_empty", "0", optional=True)

    def counters(self, paths: list[str]) -> dict[str, int]:
        """``oom_kill`` (memory limit kills) and ``pids_max`` (forks refused) so far."""
        if self.version == 2:
            mem_events = pid_events = paths[0]
            mem_file = "memory.events"
        else:
            mem_events, pid_events = paths[0], paths[2]
            mem_file = "memory.oom_control"
        mem = _keyed(Path(mem_events) / mem_file)
        pids = _keyed(Path(pid_events) / "pids.events")
        return {"oom_kill": mem.get("oom_kill", 0), "pids_max": pids.get("max", 0)}

    def kill(self, paths: list[str]) -> bool:
        """SIGKILL every process in the session's cgroup (a few rounds: it may be forking).
        ``True``: it held processes (killed; they may take a moment to be gone)."""
        procs = Path(paths[2 if len(paths) > 1 else 0]) / "cgroup.procs"  # pids (v1), v2's
        found = False
        for _ in range(8):
            try:
                pids = [int(x) for x in procs.read_text().split()]
            except OSError:
                return found
            if not pids:
                return found
            found = True
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        return found

    def remove(self, paths: Iterable[str]) -> bool:
        """Remove the session's cgroups; ``False`` if one still holds a process."""
        done = True
        for path in paths:
            try:
                os.rmdir(path)
            except FileNotFoundError:
                pass
            except OSError:
                done = False
        return done


def _write(path: Path, value: str, *, optional: bool = False) -> None:
    try:
        path.write_text(value)
    except OSError:
        if not optional:
            raise


def _keyed(path: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        text = path.read_text()
    except OSError:
        return out
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if value.strip().isdigit():
            out[key] = int(value)
    return out


class UidLease:
    """The uids of one worker's sandboxed sessions: unique per live session across every
    worker and server of the node.

    A worker leases blocks of :data:`UID_BLOCK` uids node-wide: block ``b`` is the file
    ``run_dir/block-b``, held with ``flock`` for the worker's life (the descriptor is
    close-on-exec: no child holds it). A worker that dies, however it dies, lets its
    lease go with its descriptor, and the kernel has ended its sessions by then (each
    family's init dies with the template, which dies with the worker; a pid namespace
    ends with its init): the next worker finds the block free (a non-blocking ``flock``).
    ``run_dir`` is root's alone (``0700``; refused otherwise). Inside its blocks the worker
    hands uids out round-robin, skipping those still held by a live process (a session's,
    or a copy ``fork`` made, which shares its parent's uid); when every uid of its blocks
    is live it leases another block. ``take`` is O(1) amortized while fewer than half
    the uids are live.

    Args:
        run_dir: the folder of the leases.
        start: the block to try first (spread: the worker's pid), then the next ones.
        block: uids per block (tests use small ones).
    """

    def __init__(self, run_dir: str = UID_RUN_DIR, start: int = 0, block: int = UID_BLOCK) -> None:
        self.run_dir = run_dir
        self.block = block
        self.blocks = (UID_LAST - UID_BASE + 1) // block
        self._next_block = start % self.blocks
        self._fds: list[int] = []
        self._bases: list[int] = []
        self._live: dict[int, int] = {}
        self._cursor = 0
        _private_dir(run_dir)
        self._lease()

    def _lease(self) -> None:
        for _ in range(self.blocks):
            b = self._next_block
            self._next_block = (b + 1) % self.blocks
            fd = os.open(
                os.path.join(self.run_dir, f"block-{b}"),
                os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW,
                0o600,
            )
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # a live worker's
                os.close(fd)
                continue
            self._fds.append(fd)
            self._bases.append(UID_BASE + b * self.block)
            return
        raise ConfigError(f"every block of sandbox uids in {self.run_dir} is leased")

    @property
    def leased(self) -> list[range]:
        """The uids this worker holds."""
        return [range(base, base + self.block) for base in self._bases]

    def take(self) -> int:
        """A uid no live process of any worker of the node has (held once: :meth:`release`)."""
        size = len(self._bases) * self.block
        if len(self._live) * 2 >= size:  # crowded: a new block keeps take() short
            self._lease()
            size += self.block
        for _ in range(size):
            i, self._cursor = self._cursor, (self._cursor + 1) % size
            uid = self._bases[i // self.block] + i % self.block
            if uid not in self._live:
                self._live[uid] = 1
                return uid
        raise AssertionError("unreachable: fewer than half the leased uids are live")

    def hold(self, uid: int) -> None:
        """One more live process with ``uid`` (a copy made by ``fork``)."""
        self._live[uid] = self._live.get(uid, 0) + 1

    def release(self, uid: int) -> None:
        """A process with ``uid`` ended: at the last one, the uid may be handed out again."""
        left = self._live.get(uid, 0) - 1
        if left > 0:
            self._live[uid] = left
        else:
            self._live.pop(uid, None)

    def close(self) -> None:
        """Give the leases back (the worker's end does the same)."""
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()


def _private_dir(path: str) -> None:
    """Make ``path`` (root's, ``0700``), or check that it is so."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o077:
        raise ConfigError(
            f"{path} must be a folder of the server's user that only it can open (0700): "
            "it holds the node's leases of sandbox uids"
        )


def bwrap_argv(extra_ro: Iterable[str], *, resolver: bool = False) -> list[str]:
    """``bwrap`` and its arguments for a worker's template process (the command follows).

    New pid, network, ipc and uts namespaces; ``/usr`` and the system's library
    folders, the interpreter's prefixes, every folder on ``sys.path`` and
    ``extra_ro`` read-only; a fresh ``/proc``, a minimal ``/dev``, a tmpfs ``/tmp``;
    the cgroup tree (each session hides it again before it runs env code). The
    template keeps root's capabilities inside (it makes each session's namespaces
    and mounts, then drops them for good when it becomes the session's uid).
    """
    argv = [
        shutil.which("bwrap") or "bwrap",
        "--die-with-parent",
        "--unshare-pid",
        "--unshare-net",
        "--unshare-ipc",
        "--unshare-uts",
        "--hostname",
        "stadium-sandbox",
        "--cap-add",
        "ALL",
    ]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            argv += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            argv += ["--ro-bind", top, top]
    argv += ["--ro-bind", "/usr", "/usr", "--perms", "0755", "--dir", "/etc"]
    etcs = ["/etc/ld.so.cache", "/etc/localtime", "/etc/nsswitch.conf", "/etc/alternatives"]
    if resolver:  # ``public`` network: names resolve with the host's resolver
        etcs += ["/etc/resolv.conf", "/etc/hosts", "/etc/gai.conf"]
    for etc in etcs:
        argv += ["--ro-bind-try", etc, etc]
    roots: list[str] = []
    for path in (sys.prefix, sys.base_prefix, sys.exec_prefix, *sys.path, *extra_ro):
        if not path or not os.path.isdir(path):
            continue
        path = os.path.realpath(path)
        if path == "/" or path.startswith("/usr/") or path.startswith("/proc"):
            continue
        roots.append(path)
    exe_dir = os.path.dirname(os.path.realpath(sys.executable))
    roots.append(os.path.dirname(exe_dir) if exe_dir.endswith("/bin") else exe_dir)
    kept: list[str] = []
    for path in sorted(set(roots), key=len):  # a folder inside one bound already: skipped
        if not any(path == k or path.startswith(k + "/") for k in kept):
            kept.append(path)
    argv += ["--tmpfs", "/tmp"]  # first: code under /tmp is bound on top of it below
    made: set[str] = set()
    for path in kept:  # the folders above: traversable (bwrap makes them 0700 otherwise)
        parts = path.strip("/").split("/")[:-1]
        for i in range(1, len(parts) + 1):
            folder = "/" + "/".join(parts[:i])
            if folder not in made:
                made.add(folder)
                argv += ["--perms", "0755", "--dir", folder]
        argv += ["--ro-bind", path, path]
    if any(path == "/tmp" or path.startswith("/tmp/") for path in kept):
        argv += ["--remount-ro", "/tmp"]  # code lives there: nothing is written beside it
    argv += [
        "--perms", "0755", "--dir", WORK_DIR,
        "--proc", "/proc",
        "--dev", "/dev",
        "--bind", str(CGROUP_ROOT), str(CGROUP_ROOT),
        "--new-session",
        "--",
    ]  # fmt: skip
    return argv

"""Arms: the servers a benchmark compares, and how each is started and capped.

An arm is one of:

* ``stadium`` — ``python -m stadium serve benchmark`` (the full server);
  ``stadium@REF`` runs the same from a temporary git worktree of REF;
* ``floor`` — :mod:`stadium.bench.floor`, started by its file path (no
  Stadium code in the server process);
* ``openenv`` — OpenEnv's server (:mod:`stadium.bench.openenv_server`) under
  a Python that has ``openenv`` (the project's venv if it imports there, else
  a venv under the cache directory, created on demand);
* ``url`` — a server already running at ``--url`` (optionally ``--server-pid``
  for server-side figures); never started or stopped. ``--url`` takes any
  form of a server's address (``http://H:P``, ``ws://H:P/ws``, ``H:P``, ...:
  :func:`~stadium.bench.loadspec.ws_url`), and several endpoints (repeated,
  comma-separated, or a deployment file): each point's sessions are then
  spread over them, weighted by the free capacity each reports on ``GET
  /health`` at the point's start (:func:`endpoint_weights`).

``ARM+batchB`` (``stadium+batch64``, ``url+batch256``) is that arm's server
loaded with B sessions per connection, stepped with one batch frame per round
(:attr:`Arm.batch`, :mod:`stadium.bench.batched`); only Stadium servers speak
batches, so the floor and OpenEnv have no such arm.

Started arms run in a fresh process group per point and are stopped with
SIGTERM, then SIGKILL to the group after a grace period. Resource caps are
applied to the server right after it starts (children it forks inherit them):
CPUs with ``sched_setaffinity``; memory with a cgroup (v1
``memory.limit_in_bytes`` or v2 ``memory.max``, a child of this process's own
cgroup), falling back to ``RLIMIT_AS`` per process. :class:`CapReport` says
which was used.

:func:`spawn_server` starts ``stadium serve ARGS`` the same way (own process
group, ready on ``GET /health``, stopped by :class:`RunningServer`) for the
length of a ``with`` block: ``stadium demo`` and the tests use it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from stadium._core.urls import ws_url
from stadium._errors import ConfigError
from stadium._util.health import healthy, probe
from stadium.bench.loadspec import ws_urls

BENCH_DIR = Path(__file__).resolve().parent
FLOOR_SCRIPT = BENCH_DIR / "floor.py"
OPENENV_SCRIPT = BENCH_DIR / "openenv_server.py"
OPENENV_VERSION = "0.10.0"
KINDS = ("stadium", "floor", "openenv", "url")
BATCH_KINDS = ("stadium", "url")
"""Arms whose servers may speak batches (``ARM+batchB``)."""
STADIUM_SERVE = (sys.executable, "-m", "stadium", "serve")
"""How every Stadium server is started: ``stadium serve`` under this interpreter."""


@dataclass(frozen=True, slots=True)
class Arm:
    """One arm of a comparison. ``name`` labels it in every output.

    A ``url`` arm's ``urls`` are its endpoints as WebSocket URLs (normalised
    from ``url`` when not given; ``url`` is then the first); its
    ``server_pids`` are the processes whose trees make its server-side
    figures (``server_pid`` alone is one), normally one per endpoint.
    Raises :class:`ConfigError` for a URL that is not a server's. ``batch`` B > 0:
    the load puts B sessions on each connection (``ARM+batchB``).
    """

    name: str
    kind: str
    url: str | None = None
    server_pid: int | None = None
    git_ref: str | None = None
    urls: tuple[str, ...] = ()
    server_pids: tuple[int, ...] = ()
    batch: int = 0

    def __post_init__(self) -> None:
        if self.kind != "url":
            return
        urls = tuple(ws_url(u) for u in self.urls) or (ws_urls([self.url]) if self.url else ())
        if not urls:
            raise ConfigError("the url arm needs --url http://HOST:PORT (or ws://HOST:PORT/ws)")
        pids = self.server_pids or (() if self.server_pid is None else (self.server_pid,))
        object.__setattr__(self, "urls", urls)
        object.__setattr__(self, "url", urls[0])
        object.__setattr__(self, "server_pids", pids)
        object.__setattr__(self, "server_pid", pids[0] if pids else None)

    @classmethod
    def remote(
        cls, specs: Sequence[str], server_pids: Sequence[int] = (), name: str = "url"
    ) -> Arm:
        """The ``url`` arm of ``specs`` (URLs, comma lists, deployment files: every
        endpoint) and the server processes to sample."""
        return cls(name, "url", urls=ws_urls(specs), server_pids=tuple(server_pids))

    def batched(self, batch: int) -> Arm:
        """This arm's server loaded with ``batch`` sessions per connection (``NAME+batchB``).
        Raises :class:`ConfigError` for an arm without batches (floor, openenv)."""
        if self.kind not in BATCH_KINDS:
            raise ConfigError(
                f"the {self.name} arm has no batches (only {', '.join(BATCH_KINDS)} do): "
                f"drop +batch{batch}"
            )
        if batch <= 0:
            raise ConfigError(f"batch must be a positive number of sessions, not {batch}")
        base = self.name.partition("+batch")[0]
        return dataclasses.replace(self, name=f"{base}+batch{batch}", batch=batch)

    @classmethod
    def parse(cls, text: str, *, url: str | None = None, server_pid: int | None = None) -> Arm:
        """``stadium``, ``stadium@REF``, ``floor``, ``openenv``, ``url`` or ``url=URL``
        (``url`` takes ``url``: one URL or several separated by commas), each but the
        floor and openenv optionally ``+batchB``."""
        base, plus, size = text.rpartition("+batch")
        if plus:
            try:
                batch = int(size)
            except ValueError:
                raise ConfigError(
                    f"not a batch size in arm {text!r} (try stadium+batch64)"
                ) from None
            return cls.parse(base, url=url, server_pid=server_pid).batched(batch)
        if text.startswith("stadium@"):
            return cls(text, "stadium", git_ref=text.partition("@")[2])
        if text.startswith("url="):
            return cls("url", "url", url=text[4:], server_pid=server_pid)
        if text not in KINDS:
            raise ConfigError(f"unknown arm {text!r}; choose from {', '.join(KINDS)}, stadium@REF")
        if text == "url":
            if not url:
                raise ConfigError("the url arm needs --url http://HOST:PORT (or ws://HOST:PORT/ws)")
            return cls("url", "url", url=url, server_pid=server_pid)
        return cls(text, text)


@dataclass(frozen=True, slots=True)
class Caps:
    """Resource caps for the server of each point (``None``: no cap)."""

    cpus: tuple[int, ...] | None = None
    mem_bytes: int | None = None


@dataclass(slots=True)
class CapReport:
    """How the caps were applied (goes into the report)."""

    cpu: str = "none"
    mem: str = "none"


@dataclass(slots=True)
class ServerSettings:
    """Options passed to every started server."""

    workers: int = 1
    max_sessions: int = 100_000
    cache_dir: Path = field(default_factory=lambda: Path.home() / ".cache" / "stadium-bench")
    worktrees: dict[str, Path] = field(default_factory=dict)
    serve_args: tuple[str, ...] = ()
    """Extra arguments of every started Stadium server (``--serve-arg``)."""


def parse_size(text: str) -> int:
    """``512M``, ``2G``, ``1.5g``, ``1048576`` → bytes (powers of 1024)."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = 1
    for suffix, m in (("K", 1 << 10), ("M", 1 << 20), ("G", 1 << 30), ("T", 1 << 40)):
        if t.endswith(suffix):
            t, mult = t[:-1], m
            break
    try:
        return int(float(t) * mult)
    except ValueError:
        raise ConfigError(f"not a size: {text!r} (try 512M or 2G)") from None


def parse_cpus(text: str) -> tuple[int, ...]:
    """``0``, ``0,1``, ``0-3,6`` → a tuple of CPU numbers."""
    cpus: list[int] = []
    try:
        for part in text.split(","):
            if "-" in part:
                lo, hi = part.split("-")
                cpus.extend(range(int(lo), int(hi) + 1))
            elif part.strip():
                cpus.append(int(part))
    except ValueError:
        raise ConfigError(f"not a CPU list: {text!r} (try 0 or 0-1,3)") from None
    if not cpus:
        raise ConfigError("empty CPU list")
    return tuple(sorted(set(cpus)))


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` at the time of the call."""
    with socket.socket() as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


# ------------------------------------------------------------------ python envs


def _imports(python: str, module: str) -> bool:
    try:
        r = subprocess.run(
            [python, "-c", f"import {module}"], capture_output=True, timeout=60, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0


def openenv_python(cache_dir: Path, *, install: bool = True) -> str:
    """A Python that imports ``openenv`` and ``uvicorn``.

    The project's own interpreter when it has them; else ``cache_dir /
    openenv-VERSION`` (a venv created with ``uv`` or ``venv`` + pip and
    ``openenv==VERSION uvicorn`` installed into it, never into the project's).
    Raises :class:`ConfigError` when neither exists and ``install`` is false.
    """
    if _imports(sys.executable, "openenv.core.env_server.http_server, uvicorn"):
        return sys.executable
    venv = cache_dir / f"openenv-{OPENENV_VERSION}"
    py = venv / "bin" / "python"
    if py.exists() and _imports(str(py), "openenv.core.env_server.http_server, uvicorn"):
        return str(py)
    if not install:
        raise ConfigError(f"openenv is not installed (looked in {sys.executable} and {venv})")
    venv.parent.mkdir(parents=True, exist_ok=True)
    uv = shutil.which("uv") or str(Path(sys.executable).parent / "uv")
    pkgs = [f"openenv=={OPENENV_VERSION}", "uvicorn"]
    if Path(uv).exists():
        subprocess.run([uv, "venv", "--python", sys.executable, str(venv)], check=True)
        subprocess.run([uv, "pip", "install", "--python", str(py), *pkgs], check=True, timeout=1800)
    else:
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(py), "-m", "pip", "install", *pkgs], check=True, timeout=1800)
    return str(py)


@contextlib.contextmanager
def git_worktree(ref: str, parent: Path) -> Iterator[Path]:
    """A temporary detached worktree of ``ref`` of the current repository, removed after."""
    parent.mkdir(parents=True, exist_ok=True)
    path = parent / f"worktree-{ref.replace('/', '_')}-{os.getpid()}"
    repo = Path(__file__).resolve().parents[3]
    subprocess.run(
        ["git", "-C", str(repo), "worktree", "add", "--detach", str(path), ref],
        check=True,
        capture_output=True,
    )
    try:
        yield path
    finally:
        subprocess.run(
            ["git", "-C", str(repo), "worktree", "remove", "--force", str(path)],
            check=False,
            capture_output=True,
        )


# ---------------------------------------------------------------------- launch


def server_command(
    arm: Arm, port: int, settings: ServerSettings, openenv_py: str | None = None
) -> tuple[list[str], dict[str, str]]:
    """The command line and extra environment that start ``arm`` on ``port``.

    This is the one place to adjust how each server is launched.
    """
    host = "127.0.0.1"
    env: dict[str, str] = {}
    if arm.kind == "stadium":
        cmd = [
            *STADIUM_SERVE, "benchmark",
            "--host", host, "--port", str(port),
            "--workers", str(settings.workers),
            "--max-sessions", str(settings.max_sessions),
            "--log-level", "warning",
        ]  # fmt: skip
        cmd += settings.serve_args
        if any(x.split("=", 1)[0] == "--tenants" for x in settings.serve_args):
            # The token in the bench's environment is its clients' (a tenant's), not the
            # server's: a server with --tenants refuses one of its own.
            env["STADIUM_AUTH_TOKEN"] = ""
        if arm.git_ref is not None:
            tree = settings.worktrees.get(arm.git_ref)
            if tree is None:
                raise ConfigError(f"no worktree for {arm.git_ref!r}")
            env["PYTHONPATH"] = os.pathsep.join(
                [str(tree / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]
            )
        return cmd, env
    if arm.kind == "floor":
        cmd = [sys.executable, str(FLOOR_SCRIPT), "--host", host, "--port", str(port)]
        if settings.workers > 1:
            cmd += ["--workers", str(settings.workers)]
        return cmd, env
    if arm.kind == "openenv":
        py = openenv_py or openenv_python(settings.cache_dir)
        cmd = [
            py, str(OPENENV_SCRIPT), "--host", host, "--port", str(port),
            "--workers", str(settings.workers), "--max-sessions", str(settings.max_sessions),
        ]  # fmt: skip
        return cmd, env
    raise ConfigError(f"arm {arm.name!r} is not started by the harness")


_CGROUP_SEQ = itertools.count()


def _own_cgroup_dir(
    controller: str = "memory", v1_knob: str = "memory.limit_in_bytes"
) -> tuple[Path, str] | None:
    """This process's cgroup directory for ``controller`` and its version, if writable
    (v1: the controller's own hierarchy, where ``v1_knob`` exists; v2: the unified
    one, with ``controller`` enabled for children)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        names = controllers.split(",")
        if controller in names:
            d = Path("/sys/fs/cgroup") / ",".join(names) / path.lstrip("/")
            if (d / v1_knob).exists() and os.access(d, os.W_OK):
                return d, "v1"
    for line in lines:
        if line.startswith("0::"):
            d = Path("/sys/fs/cgroup") / line[3:].lstrip("/")
            ctl = d / "cgroup.subtree_control"
            if ctl.exists() and controller in ctl.read_text().split() and os.access(d, os.W_OK):
                return d, "v2"
    return None


class CpuCap:
    """A CPU cap shared by a set of processes: a child cgroup with a CFS quota of
    ``cpus`` CPUs (v1 ``cpu.cfs_quota_us`` over ``cpu.cfs_period_us``, v2 ``cpu.max``;
    ``None``: no quota) and, optionally, a scheduling weight ``shares`` (v1
    ``cpu.shares``, 1024 the default; v2 ``cpu.weight``, scaled from it) that
    favours these processes over the machine's others when a core is contended.

    :meth:`create` makes it (:class:`ConfigError` where no writable cpu cgroup
    exists); :meth:`add` moves a process in (children it forks later inherit;
    ``procs_file`` lets a wrapper move itself before it execs the server:
    ``sh -c 'echo $$ > FILE && exec "$@"'``); :meth:`stat` reads ``cpu.stat``
    (``nr_throttled``, ...); :meth:`remove` deletes it once its processes are gone.
    The emulated cluster's scale-out measurement caps each node with one.
    """

    def __init__(
        self,
        cpus: float | None,
        name: str = "",
        period_us: int = 100_000,
        shares: int | None = None,
    ) -> None:
        if cpus is not None and cpus <= 0:
            raise ConfigError(f"a CPU cap must be > 0 CPUs, got {cpus}")
        self.cpus = cpus
        self.shares = shares
        self.period_us = period_us
        self.name = name or f"stadium-bench-cpu-{os.getpid()}-{next(_CGROUP_SEQ)}"
        self.cgroup: Path | None = None
        self.version = ""

    @property
    def procs_file(self) -> Path:
        """The cgroup's ``cgroup.procs`` (after :meth:`create`)."""
        if self.cgroup is None:
            raise ConfigError("the CPU cap's cgroup is not created")
        return self.cgroup / "cgroup.procs"

    def create(self) -> str:
        """Make the cgroup and set its quota; return how (for a report)."""
        own = _own_cgroup_dir("cpu", "cpu.cfs_quota_us")
        if own is None:
            raise ConfigError("no writable cpu cgroup (needs root, cgroup v1 cpu or v2 +cpu)")
        base, version = own
        d = base / self.name
        quota = max(1000, round(self.cpus * self.period_us)) if self.cpus is not None else 0
        try:
            d.mkdir()
            if version == "v1":
                if quota:
                    (d / "cpu.cfs_period_us").write_text(str(self.period_us))
                    (d / "cpu.cfs_quota_us").write_text(str(quota))
                if self.shares is not None:
                    (d / "cpu.shares").write_text(str(self.shares))
            else:
                if quota:
                    (d / "cpu.max").write_text(f"{quota} {self.period_us}")
                if self.shares is not None:
                    weight = max(1, min(10_000, self.shares * 100 // 1024))
                    (d / "cpu.weight").write_text(str(weight))
        except OSError as exc:
            with contextlib.suppress(OSError):
                d.rmdir()
            raise ConfigError(f"cannot make the CPU cap's cgroup {d}: {exc}") from None
        self.cgroup, self.version = d, version
        knob = "cpu.cfs_quota_us" if version == "v1" else "cpu.max"
        parts = [f"{knob}: {quota} µs per {self.period_us} µs = {self.cpus:g} CPU"] if quota else []
        if self.shares is not None:
            parts.append(f"{'cpu.shares' if version == 'v1' else 'cpu.weight'} from {self.shares}")
        return f"cgroup {version} ({', '.join(parts) or 'no limit'})"

    def add(self, pid: int) -> None:
        """Move ``pid`` into the cgroup."""
        self.procs_file.write_text(str(pid))

    def stat(self) -> dict[str, int]:
        """``cpu.stat`` as a dict (``nr_periods``, ``nr_throttled``, ...); {} if unknown."""
        if self.cgroup is None:
            return {}
        out: dict[str, int] = {}
        with contextlib.suppress(OSError, ValueError):
            for line in (self.cgroup / "cpu.stat").read_text().splitlines():
                key, _, value = line.partition(" ")
                out[key] = int(value)
        return out

    def remove(self) -> None:
        """Move the processes still in the cgroup back to its parent, then remove it
        (bounded retries)."""
        if self.cgroup is None:
            return
        with contextlib.suppress(OSError):
            for pid in self.procs_file.read_text().split():
                with contextlib.suppress(OSError):
                    (self.cgroup.parent / "cgroup.procs").write_text(pid)
        _remove_cgroup(self.cgroup)
        self.cgroup = None


class MemoryCap:
    """A memory cap on one server: a child cgroup, else ``RLIMIT_AS``."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.cgroup: Path | None = None
        self.version = ""
        self.method = "none"

    def apply(self, pid: int) -> str:
        """Cap ``pid`` (its future children inherit); return the method used."""
        own = _own_cgroup_dir()
        if own is not None:
            base, version = own
            d = base / f"stadium-bench-{os.getpid()}-{next(_CGROUP_SEQ)}"
            try:
                d.mkdir()
                if version == "v1":
                    (d / "memory.limit_in_bytes").write_text(str(self.limit))
                    with contextlib.suppress(OSError):
                        (d / "memory.memsw.limit_in_bytes").write_text(str(self.limit))
                else:
                    (d / "memory.max").write_text(str(self.limit))
                    with contextlib.suppress(OSError):
                        (d / "memory.swap.max").write_text("0")
                (d / "cgroup.procs").write_text(str(pid))
                self.cgroup, self.version = d, version
                knob = "memory.limit_in_bytes" if version == "v1" else "memory.max"
                self.method = f"cgroup {version} ({knob} = {self.limit} bytes, whole process tree)"
                return self.method
            except OSError:
                with contextlib.suppress(OSError):
                    d.rmdir()
        import resource

        try:
            resource.prlimit(pid, resource.RLIMIT_AS, (self.limit, self.limit))
            self.method = f"RLIMIT_AS = {self.limit} bytes (address space, per process)"
        except (OSError, ValueError, AttributeError) as exc:
            self.method = f"none (could not cap memory: {exc})"
        return self.method

    def oom_killed(self) -> bool:
        """Whether the kernel OOM-killed a process of the cgroup."""
        if self.cgroup is None:
            return False
        name = "memory.oom_control" if self.version == "v1" else "memory.events"
        try:
            for line in (self.cgroup / name).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill" and int(value) > 0:
                    return True
        except (OSError, ValueError):
            pass
        return False

    def remove(self) -> None:
        """Remove the cgroup (after its processes are gone); bounded retries."""
        if self.cgroup is None:
            return
        _remove_cgroup(self.cgroup)
        self.cgroup = None


def _remove_cgroup(cgroup: Path) -> None:
    """``rmdir`` a cgroup, retried for up to 5 s while its last processes exit."""
    for _ in range(50):
        try:
            cgroup.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.1)


def _health(url: str, timeout: float) -> dict[str, object] | None:
    """``GET /health`` of the server of WebSocket URL ``url`` (its base path), parsed;
    ``None`` when it does not answer 200 with a JSON object."""
    import ssl

    ctx = None
    if url.startswith(("wss:", "https:")):
        ctx = ssl.create_default_context()
        ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE  # only reads a count
    try:
        health = probe(url, timeout, ssl=ctx)
    except (OSError, ValueError):
        return None
    return health.data if health.ok and isinstance(health.body, dict) else None


def endpoint_weights(urls: Sequence[str], timeout: float = 2.0) -> tuple[int, ...]:
    """Each endpoint's free session capacity (``max_sessions - active_sessions`` from
    ``GET /health``), read once; all equal (1 each) when any endpoint does not say.

    The weights of :func:`~stadium.bench.loadspec.spread`.
    """
    free: list[int] = []
    for url in urls:
        h = _health(url, timeout) or {}
        cap, active = h.get("max_sessions"), h.get("active_sessions")
        if not isinstance(cap, int) or not isinstance(active, int) or cap <= 0:
            return (1,) * len(urls)
        free.append(max(0, cap - active))
    return tuple(free) if any(free) else (1,) * len(urls)


def wait_healthy(port: int, proc: subprocess.Popen[bytes] | None, timeout: float = 60.0) -> None:
    """Poll ``GET /health`` until 200; raise :class:`ConfigError` on exit or timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise ConfigError(f"the server exited with {proc.returncode} before it was ready")
        if healthy(f"http://127.0.0.1:{port}", 2.0):
            return
        time.sleep(0.1)
    raise ConfigError(f"the server on port {port} was not healthy after {timeout:.0f} s")


@dataclass
class RunningServer:
    """A server for one point. ``pid`` is what to sample (``None``: unknown); a url
    arm's several endpoints and server processes are ``urls`` and ``pids``."""

    url: str
    pid: int | None
    urls: tuple[str, ...] = ()
    pids: tuple[int, ...] = ()
    proc: subprocess.Popen[bytes] | None = None
    mem: MemoryCap | None = None
    log: Path | None = None
    killed_by_us: bool = False

    def stop(self, grace: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL to the process group after ``grace`` s; the exit code."""
        p = self.proc
        if p is None:
            return None
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self.killed_by_us = True
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10.0)
        # Descendants left in the group we created (e.g. workers of a crashed master).
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGKILL)
        if self.mem is not None:
            self.mem.remove()
        return p.returncode

    def oom(self) -> bool:
        """Whether the server (or one of its processes) was OOM-killed."""
        if self.mem is not None and self.mem.oom_killed():
            return True
        p = self.proc
        return (
            p is not None
            and p.returncode == -signal.SIGKILL
            and not self.killed_by_us
            and self.mem is not None
        )


def start_server(
    arm: Arm,
    settings: ServerSettings,
    caps: Caps,
    log_dir: Path,
    tag: str,
    *,
    openenv_py: str | None = None,
    ready_timeout: float = 60.0,
) -> tuple[RunningServer, CapReport]:
    """Start (or, for ``url``, just describe) the server of one point.

    The caller must call :meth:`RunningServer.stop` (in a ``finally``).
    """
    report = CapReport()
    if arm.kind == "url":
        assert arm.url is not None
        pids = arm.server_pids
        return RunningServer(arm.url, pids[0] if pids else None, arm.urls, pids), report
    port = free_port()
    cmd, extra_env = server_command(arm, port, settings, openenv_py)
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"{tag}.log"
    with log.open("wb") as fh:
        proc = _launch(cmd, fh, extra_env)
    server = RunningServer(url=f"ws://127.0.0.1:{port}/ws", pid=proc.pid, proc=proc, log=log)
    try:
        if caps.cpus is not None:
            os.sched_setaffinity(proc.pid, caps.cpus)
            report.cpu = f"sched_setaffinity (taskset) to CPUs {','.join(map(str, caps.cpus))}"
        if caps.mem_bytes is not None:
            server.mem = MemoryCap(caps.mem_bytes)
            report.mem = server.mem.apply(proc.pid)
        wait_healthy(port, proc, ready_timeout)
    except BaseException:
        server.stop(grace=2.0)
        raise
    return server, report


def _launch(
    cmd: Sequence[str], output: IO[bytes], extra_env: Mapping[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """Start a server process in its own process group, its output (and errors) to
    ``output``; stop it with :meth:`RunningServer.stop`."""
    env = {**os.environ, **(extra_env or {}), "PYTHONUNBUFFERED": "1"}
    for name in [k for k, v in (extra_env or {}).items() if not v]:  # "": unset
        del env[name]
    return subprocess.Popen(
        list(cmd), stdout=output, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        env=env, start_new_session=True,
    )  # fmt: skip


@contextlib.contextmanager
def spawn_server(
    *args: str, timeout: float = 30.0
) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """Run ``stadium serve ARGS`` on a free loopback port for the ``with`` block.

    Yields (the process, its base URL ``http://127.0.0.1:PORT``) once ``GET
    /health`` answers 200 (a ``--port`` in ARGS is used as given). Raises
    :class:`ConfigError`, with the end of the server's output, if it exits or is
    not healthy within ``timeout`` seconds. After the block, or on error: SIGTERM,
    then SIGKILL to its process group after 15 s (:meth:`RunningServer.stop`).
    """
    cmd = [*STADIUM_SERVE, *args]
    if "--port" in args:
        port = int(args[args.index("--port") + 1])
    else:
        port = free_port()
        cmd += ["--port", str(port)]
    with tempfile.TemporaryFile() as output:
        proc = _launch(cmd, output)
        server = RunningServer(url=f"http://127.0.0.1:{port}", pid=proc.pid, proc=proc)
        try:
            try:
                wait_healthy(port, proc, timeout)
            except ConfigError as exc:
                output.seek(0)
                tail = output.read()[-2000:].decode(errors="replace")
                raise ConfigError(f"{exc.message}: {shlex.join(cmd)}\n{tail}") from None
            yield proc, server.url
        finally:
            server.stop(grace=15.0)

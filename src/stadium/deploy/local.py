"""``stadium.launch(..., on="local")``: N ``stadium serve`` processes on this machine.

Each replica is one ``python -m stadium serve TARGET`` subprocess (its own process
group, so a terminal's Ctrl-C reaches only the caller, which then drains them) on a
port the kernel picks (``--port 0``, read back from the server's announce line), bound
to ``127.0.0.1`` unless ``host`` says otherwise. :func:`start` returns once every
server answers ``GET /health`` (or raises :class:`~stadium.ConfigError` with the end of
the failed server's stderr, leaving no process behind). Clients balance over the
servers themselves (no router): ``stadium.SessionPool(running, size=...)``.

Stopping (:meth:`LocalDeployment.stop`, or leaving the ``with`` block): SIGTERM to
every server (they drain: in-flight steps finish, sessions close with 1001, for up to
their ``--drain-timeout``), a bounded wait, then SIGKILL to the process group of any
server still running. A deployment that is never stopped is stopped when it is garbage
collected or when the interpreter exits; a server whose launcher process dies (killed,
crashed) gets SIGTERM from the kernel (Linux ``PR_SET_PDEATHSIG``).

:class:`ServerProcess`, one such subprocess, is also what each Ray actor runs
(:mod:`stadium.deploy.ray_cluster`).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from stadium._errors import ConfigError
from stadium._util.health import healthy
from stadium.deploy.deployment import Deployment, refuse_token_in_argv
from stadium.deploy.running import Running, Stopper

#: The server's announce line names its URL (``--port 0``: the port the kernel chose).
_ANNOUNCE = re.compile(r"listening on (https?://\S+:\d+)")

#: Run as ``python -c _DIE_WITH_PARENT PARENT_PID PROGRAM ARG...``: ask the kernel for
#: SIGTERM when the parent dies (``PR_SET_PDEATHSIG``, kept across ``exec``), then exec.
_DIE_WITH_PARENT = (
    "import os, signal, sys\n"
    "from stadium._util.libc import die_with_parent\n"
    "die_with_parent(signal.SIGTERM)\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit('stadium: the launcher is gone')\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


def serve_command(
    target: str,
    *,
    host: str,
    port: int = 0,
    workers: int = 1,
    max_sessions: int | None = None,
    drain_timeout: float | None = None,
    serve_args: Sequence[str] = (),
    python: str = sys.executable,
) -> list[str]:
    """The ``stadium serve`` command line of one server (never with ``--auth-token``: the
    token goes in its environment, ``STADIUM_AUTH_TOKEN``)."""
    refuse_token_in_argv(serve_args)
    cmd = [python, "-m", "stadium", "serve", target, "--host", host, "--port", str(port)]
    cmd += ["--workers", str(workers)]
    if max_sessions is not None:
        cmd += ["--max-sessions", str(max_sessions)]
    if drain_timeout is not None:
        cmd += ["--drain-timeout", str(drain_timeout)]
    return [*cmd, *serve_args]


def _tail(path: Path, lines: int = 20) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no output)"
    return "\n".join(text.splitlines()[-lines:]) or "(no output)"


class ServerProcess:
    """One ``stadium serve`` subprocess: started in its own process group, its stdout and
    stderr in ``log_dir``, its URL read from its announce line.

    ``die_with_parent``: the kernel sends it SIGTERM when the thread that started it
    ends (Linux; only use it from a thread that lives as long as the server should).
    """

    def __init__(
        self,
        cmd: Sequence[str],
        *,
        log_dir: Path,
        name: str,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        die_with_parent: bool = False,
    ) -> None:
        self.cmd = list(cmd)
        self.name = name
        self.out_path = log_dir / f"{name}.out"
        self.err_path = log_dir / f"{name}.err"
        argv = self.cmd
        if die_with_parent and sys.platform == "linux":
            argv = [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), *self.cmd]
        with open(self.out_path, "wb") as out, open(self.err_path, "wb") as err:
            self.proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                env={**os.environ, **(env or {})},
                cwd=cwd,
                start_new_session=True,
            )
        self.pid = self.proc.pid
        self.url: str | None = None

    def check(self) -> str | None:
        """The server's URL once it answers ``/health``; None while it starts.
        :class:`ConfigError` with its stderr if it exited."""
        code = self.proc.poll()
        if code is not None:
            raise ConfigError(
                f"{self.name} exited with code {code} before serving "
                f"({' '.join(self.cmd[2:5])} ...); its stderr ends with:\n{_tail(self.err_path)}",
                exit_code=code,
            )
        if self.url is None:
            with contextlib.suppress(OSError):
                if found := _ANNOUNCE.search(self.out_path.read_text(errors="replace")):
                    self.url = found.group(1)
        if self.url is not None and healthy(self.url, 1.0):
            return self.url
        return None

    def wait_ready(self, timeout_s: float) -> str:
        """Wait until :meth:`check` gives the URL; :class:`ConfigError` after ``timeout_s``."""
        return wait_all_ready([self], timeout_s)[0]

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM (the server drains), wait up to ``timeout``, then SIGKILL its process
        group; the exit code (None if it could not be reaped). Idempotent."""
        return stop_all([self], timeout)[0]

    def __repr__(self) -> str:
        return f"<ServerProcess {self.name} pid={self.pid} url={self.url}>"


def wait_all_ready(servers: Sequence[ServerProcess], timeout_s: float) -> list[str]:
    """Wait (one shared deadline) until every server answers ``/health``; their URLs.
    :class:`ConfigError` naming the first that failed or did not come up."""
    deadline = time.monotonic() + timeout_s
    urls: dict[int, str] = {}
    while len(urls) < len(servers):
        for i, server in enumerate(servers):
            if i not in urls and (url := server.check()) is not None:
                urls[i] = url
        if len(urls) == len(servers):
            break
        if time.monotonic() > deadline:
            late = next(s for i, s in enumerate(servers) if i not in urls)
            raise ConfigError(
                f"{late.name} did not answer /health within {timeout_s:.0f} s "
                f"(pid {late.pid}, url {late.url or 'not announced'}); its stderr ends "
                f"with:\n{_tail(late.err_path)}"
            )
        time.sleep(0.05)
    return [urls[i] for i in range(len(servers))]


def stop_all(servers: Sequence[ServerProcess], timeout: float) -> list[int | None]:
    """Drain every server at once (SIGTERM), wait up to ``timeout`` for all, then SIGKILL
    the process groups of those left; their exit codes."""
    for s in servers:
        if s.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                s.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + max(0.0, timeout)
    for s in servers:
        with contextlib.suppress(subprocess.TimeoutExpired):
            s.proc.wait(max(0.0, deadline - time.monotonic()))
    for s in servers:
        if s.proc.returncode == 0:
            continue  # drained: its workers were stopped by its supervisor
        # still running, or crashed: the whole group (a supervisor's orphaned workers too)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(s.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            s.proc.wait(5.0)
    return [s.proc.returncode for s in servers]


class _LocalStopper(Stopper[list[int | None]]):
    """Stops the local servers (and removes the log folder this launcher made)."""

    def __init__(self, servers: list[ServerProcess], log_dir: Path, owns_log_dir: bool) -> None:
        super().__init__()
        self.servers = servers
        self.log_dir = log_dir
        self.owns_log_dir = owns_log_dir

    def stop(self, timeout: float) -> list[int | None]:
        codes = stop_all(self.servers, timeout)
        if self.owns_log_dir:
            shutil.rmtree(self.log_dir, ignore_errors=True)
        return codes


class LocalDeployment(Running):
    """Servers started by :func:`start`: ``servers`` (their processes), ``log_dir``."""

    def __init__(
        self, servers: list[ServerProcess], urls: list[str], stopper: _LocalStopper
    ) -> None:
        super().__init__(Deployment.of(urls))
        self.servers = servers
        self.log_dir = stopper.log_dir
        self._stopper = stopper
        # forgotten: stopped when collected or at exit (weakref.finalize runs at exit)
        self._finalizer = self._stop_when_dropped(stopper)

    @property
    def pids(self) -> list[int]:
        """The servers' process ids."""
        return [s.pid for s in self.servers]

    def stop(self, timeout: float = 30.0) -> None:
        """Drain every server (SIGTERM), wait up to ``timeout``, SIGKILL what is left."""
        self._finalizer.detach()
        self._stopper(timeout)

    @property
    def exit_codes(self) -> list[int | None] | None:
        """The servers' exit codes once stopped (0: drained and exited)."""
        return self._stopper.codes


def start(
    target: str,
    *,
    replicas: int = 1,
    host: str = "127.0.0.1",
    port: int = 0,
    workers: int = 1,
    max_sessions: int | None = None,
    drain_timeout: float | None = None,
    serve_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    python: str = sys.executable,
    log_dir: str | os.PathLike[str] | None = None,
    timeout_s: float = 60.0,
) -> LocalDeployment:
    """Start ``replicas`` ``stadium serve TARGET`` processes here; return once all serve.

    Args:
        target: what ``stadium serve`` takes (``echo``, ``pkg.module:Env``, ``file.py:Env``).
        replicas: how many servers.
        host: the address they bind (``0.0.0.0``: every interface; clients then use
            ``127.0.0.1``).
        port: 0 (default): a free port each; else the first port, servers on
            ``port``, ``port + 1``, ...
        workers, max_sessions, drain_timeout: each server's ``--workers``,
            ``--max-sessions`` (default: the server's) and ``--drain-timeout``.
        serve_args: more ``stadium serve`` options (``["--step-timeout", "5"]``).
        env: environment variables added to this process's for the servers.
        cwd: their working directory (module targets are imported from it).
        python: the interpreter that runs them (default: this one).
        log_dir: where their stdout and stderr go (kept); default: a temporary
            directory removed on stop.
        timeout_s: how long to wait for every server to answer ``/health``.

    Raises:
        ConfigError: bad arguments, or a server that exited or never answered (with the
            end of its stderr); the other servers are stopped first.
    """
    if replicas < 1:
        raise ConfigError("replicas must be at least 1", replicas=replicas)
    if workers < 1:
        raise ConfigError("workers must be at least 1", workers=workers)
    if not 0 <= port <= 65535 - replicas + 1:
        raise ConfigError("port must be 0 (pick free ports) or a port from 1 to 65535", port=port)
    owns = log_dir is None
    logs = Path(tempfile.mkdtemp(prefix="stadium-local-") if log_dir is None else log_dir)
    logs.mkdir(parents=True, exist_ok=True)
    # PR_SET_PDEATHSIG fires when the *thread* that forked ends: only from the main thread
    main = threading.current_thread() is threading.main_thread()
    servers: list[ServerProcess] = []
    stopper = _LocalStopper(servers, logs, owns)
    try:
        for i in range(replicas):
            cmd = serve_command(
                target, host=host, port=port + i if port else 0, workers=workers,
                max_sessions=max_sessions, drain_timeout=drain_timeout,
                serve_args=serve_args, python=python,
            )  # fmt: skip
            servers.append(
                ServerProcess(
                    cmd, log_dir=logs, name=f"server{i + 1}", env=env,
                    cwd=None if cwd is None else os.fspath(cwd), die_with_parent=main,
                )
            )  # fmt: skip
        urls = wait_all_ready(servers, timeout_s)
    except BaseException:
        stopper(0.0)
        raise
    return LocalDeployment(servers, urls, stopper)


__all__ = ["LocalDeployment", "ServerProcess", "serve_command", "start", "stop_all"]

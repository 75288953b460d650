"""Server lifecycle: bind, serve, drain; one process or a supervisor with N forked workers.

``Server`` runs one worker's event loop part and can be used in-process::

    server = Server(ServerConfig(target="echo", port=0))
    await server.start()
    ...  # ws://127.0.0.1:{server.port}/ws
    await server.stop()

``run_server(config)`` is what ``stadium serve`` calls: it binds the listening
socket once (backlog at the kernel's maximum), then either serves in this
process (``workers == 1``) or forks the workers, which share the socket and a
server-wide session limit (:class:`~stadium._server.admission.slots.SharedSlots`), under
:class:`~stadium._server.processes.supervisor.Supervisor`. SIGTERM or SIGINT stops accepting,
lets sessions finish for up to ``drain_timeout``, closes the rest with 1001
after their in-flight request, and exits 0. SIGHUP recycles the workers (see
:func:`run_server`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import enum
import errno
import gc
import inspect
import json
import logging
import math
import os
import resource
import shutil
import signal
import socket
import ssl
import sys
import time
from collections.abc import Callable
from typing import Any

from stadium._core.access import AccessPolicy, exposure_warnings
from stadium._env.contract import Environment
from stadium._env.spec import EnvSpec, bare
from stadium._errors import ConfigError
from stadium._server.admission.slots import SharedSlots, Slots
from stadium._server.admission.tenants import TenantDirectory
from stadium._server.config import ServerConfig, default_session_store
from stadium._server.durability.records import process_key, read_key_file
from stadium._server.durability.session_store import store_from_url
from stadium._server.invoke import running_pool_threads
from stadium._server.isolation.remote import Description
from stadium._server.loader import load_target
from stadium._server.metrics import MetricsBoard
from stadium._server.processes.supervisor import Supervisor
from stadium._server.processes.worker import (
    Worker,
    isolation_config,
    probe_durable,
    record_config,
    startup_warnings,
    untrusted_spec,
)
from stadium._server.runtime import CLOSE_GOING_AWAY, SESSION_ID
from stadium._server.transports.handoff import Handoff, private_dir
from stadium._server.transports.picows import PicowsTransport
from stadium._util.process import RECYCLE_EXIT_CODE, flush_logs, new_event_loop, raise_nofile_limit
from stadium._util.throttle import Throttle

log = logging.getLogger("stadium.server")

#: After the drain timeout, how long in-flight requests still get before they are cancelled.
FINAL_GRACE_S = 5.0
#: After that, how long a worker told to stop may still take before the supervisor kills it.
KILL_MARGIN_S = 5.0
#: At exit, how long env threads get to finish their calls before they count as stuck.
STUCK_EXIT_WAIT_S = 0.5
#: Descriptors a worker needs besides its sessions' sockets (loop, pipes, files, HTTP requests).
FD_HEADROOM = 64
#: A worker with fewer free descriptors than this is short of them (it logs so).
FD_LOW_WATER = 16
#: How often a worker checks that it has file descriptors left, and how often it says it has not.
FD_CHECK_INTERVAL_S = 1.0
FD_LOG_INTERVAL_S = 60.0


class ServerState(enum.Enum):
    """Lifecycle of a server (or of one worker)."""

    CREATED = "created"
    SERVING = "serving"
    DRAINING = "draining"
    STOPPED = "stopped"


def server_ssl_context(config: ServerConfig) -> ssl.SSLContext | None:
    """The TLS context of ``--tls-cert``/``--tls-key`` (``None`` without them).

    TLS 1.2 or later (the default of ``PROTOCOL_TLS_SERVER``), ALPN ``http/1.1``
    (WebSocket upgrades and the HTTP endpoints both speak HTTP/1.1). Raises
    ConfigError when the files are not a matching PEM certificate and key.
    """
    if config.tls_cert is None or config.tls_key is None:
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        ctx.load_cert_chain(config.tls_cert, config.tls_key)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(
            f"cannot load --tls-cert/--tls-key: {exc}; give a PEM certificate (chain) "
            "and its PEM private key, unencrypted",
            cert=config.tls_cert,
            key=config.tls_key,
        ) from None
    ctx.set_alpn_protocols(["http/1.1"])
    return ctx


#: What to do when the bind fails, by errno (appended to the OS's reason).
_LISTEN_HINTS = {
    errno.EADDRINUSE: "; another process listens there (another `stadium serve`?): stop it, "
    "or give another --port (--port 0 picks a free one)",
    errno.EACCES: "; ports below 1024 need root (or CAP_NET_BIND_SERVICE): give --port 1024 "
    "or above",
    errno.EADDRNOTAVAIL: "; --host is not an address of this machine: give one of its "
    "addresses, 127.0.0.1 or 0.0.0.0",
}


def listen_socket(host: str, port: int) -> socket.socket:
    """Bind and listen with the largest backlog the kernel allows."""
    try:
        sock = socket.create_server(
            (host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET
        )
    except OSError as exc:
        hint = _LISTEN_HINTS.get(exc.errno or 0, "")
        raise ConfigError(
            f"cannot listen on {host}:{port}: {exc.strerror}{hint}", host=host, port=port
        ) from None
    sock.listen(_max_backlog())
    sock.setblocking(False)
    return sock


def _max_backlog() -> int:
    try:
        with open("/proc/sys/net/core/somaxconn") as f:
            return max(int(f.read().strip()), 128)
    except (OSError, ValueError):
        return 4096


def check_fd_budget(config: ServerConfig, soft_limit: int) -> bool:
    """Warn when a worker's open-file limit cannot hold its share of the sessions.

    A worker needs about ``max_sessions / workers`` sockets plus :data:`FD_HEADROOM`;
    past its limit the kernel refuses new connections (EMFILE). Returns False after
    warning.
    """
    if soft_limit == resource.RLIM_INFINITY:
        return True
    needed = math.ceil(config.max_sessions / config.workers) + FD_HEADROOM
    if soft_limit >= needed:
        return True
    fits = (soft_limit - FD_HEADROOM) * config.workers
    log.warning(
        "the open-file limit (%d per process) is below the ~%d descriptors each of the "
        "%d worker(s) needs for --max-sessions %d (a socket per session, plus %d): "
        "connections past the limit will be dropped. Raise the hard limit (ulimit -Hn; "
        "systemd LimitNOFILE=; docker --ulimit nofile=), add --workers, or lower "
        "--max-sessions%s.",
        soft_limit, needed, config.workers, config.max_sessions, FD_HEADROOM,
        f" to {fits}" if fits > 0 else "",
    )  # fmt: skip
    return False


class _FdWatch:
    """Says (rate-limited) when this worker is out of file descriptors.

    When ``accept`` fails with EMFILE or ENFILE, uvloop (libuv) accepts and closes
    the waiting connections with a spare descriptor and reports nothing, so the
    failure would go unseen. Every :data:`FD_CHECK_INTERVAL_S` the watch duplicates
    the listening socket: the lowest free descriptor is a lower bound on those in
    use, and the duplicate fails exactly when none is left. Near or at the limit,
    it logs a WARNING, at most once per :data:`FD_LOG_INTERVAL_S`.
    """

    def __init__(self, sock: socket.socket, loop: asyncio.AbstractEventLoop) -> None:
        self._fd = sock.fileno()
        self._loop = loop
        self._soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        self._throttle = Throttle(FD_LOG_INTERVAL_S)
        self._timer: asyncio.TimerHandle | None = loop.call_later(FD_CHECK_INTERVAL_S, self._check)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _check(self) -> None:
        self._timer = self._loop.call_later(FD_CHECK_INTERVAL_S, self._check)
        if self._soft == resource.RLIM_INFINITY:
            return
        try:
            probe = os.dup(self._fd)
        except OSError as exc:
            if exc.errno not in (errno.EMFILE, errno.ENFILE):
                return
            self._short(f"none of the {self._soft} allowed is free", errno.errorcode[exc.errno])
            return
        os.close(probe)
        if probe >= self._soft - FD_LOW_WATER:
            self._short(f"at least {probe} of the {self._soft} allowed are in use", "EMFILE")

    def _short(self, state: str, code: str) -> None:
        held = self._throttle.report(time.monotonic())
        if held is None:
            return
        log.warning(
            "worker out of file descriptors: %s; new connections are refused (%s) and "
            "dropped unanswered. Raise ulimit -n, add --workers or lower --max-sessions%s",
            state, code, f" (short {held} more time(s) since the last report)" if held else "",
        )  # fmt: skip


class Server:
    """One worker: the transport, the sessions and their drain."""

    def __init__(
        self,
        config: ServerConfig,
        env_cls: type[Environment[Any, Any, Any]] | None = None,
        *,
        sock: socket.socket | None = None,
        slots: Slots | None = None,
        board: MetricsBoard | None = None,
        handoff_dir: str | None = None,
        described: Description | None = None,
        tenants: TenantDirectory | None = None,
    ) -> None:
        self.worker = Worker.build(
            config, env_cls, slots=slots, board=board, described=described, tenants=tenants
        )
        self.config = self.worker.config
        self._handoff_dir = handoff_dir
        """The server's private directory of hand-off sockets (``handoff.private_dir``),
        shared by its workers; ``None``: this worker makes its own, removed on stop."""
        self._own_handoff_dir: str | None = None
        self.spec = self.worker.spec
        self.runtime = self.worker.runtime
        self.endpoints = self.worker.endpoints
        self.state = ServerState.CREATED
        self._sock = sock
        tenants = self.runtime.doors.tenants
        self.transport = PicowsTransport(
            self.runtime,
            self.endpoints,
            max_message_bytes=config.max_message_bytes,
            ping_interval=config.ping_interval,
            ping_timeout=config.ping_timeout,
            header_timeout=config.header_timeout,
            body_timeout=config.body_timeout,
            keepalive_timeout=config.keepalive_timeout,
            access=AccessPolicy.from_config(config, None if tenants is None else tenants.book),
        )
        self._ssl = server_ssl_context(config)
        self._server: asyncio.Server | None = None
        self._stopped = asyncio.Event()
        self._fd_watch: _FdWatch | None = None

    @property
    def port(self) -> int:
        assert self._sock is not None, "server not started"
        return int(self._sock.getsockname()[1])

    @property
    def url(self) -> str:
        host = self.config.host
        host = "127.0.0.1" if host in ("0.0.0.0", "", "::") else host
        host = f"[{host}]" if ":" in host else host
        return f"{'https' if self._ssl else 'http'}://{host}:{self.port}"

    async def start(self) -> None:
        """Raise the open-file limit, bind (unless given a socket) and start accepting."""
        raise_nofile_limit()
        if self._sock is None:
            self._sock = listen_socket(self.config.host, self.config.port)
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            self.transport,
            sock=self._sock,
            backlog=_max_backlog(),
            ssl=self._ssl,
            ssl_handshake_timeout=self.config.header_timeout if self._ssl else None,
        )
        self.state = ServerState.SERVING
        self.worker.start()
        self._fd_watch = _FdWatch(self._sock, loop)
        # Resumes landing on this worker for another worker's session are passed to it.
        directory = self._handoff_dir
        if directory is None:
            directory = self._own_handoff_dir = private_dir()
        self.transport.handoff = Handoff(loop, directory, self.transport.adopt)

    async def stop(self, drain_timeout: float | None = None) -> None:
        """Stop accepting, let sessions finish, close the rest with 1001."""
        if self.state in (ServerState.DRAINING, ServerState.STOPPED):
            await self._stopped.wait()
            return
        self.state = ServerState.DRAINING
        rt = self.runtime
        rt.draining = True
        rt.stop_reaper()
        if self._fd_watch is not None:
            self._fd_watch.stop()
        if self._server is not None:
            self._server.close()
        if self.transport.handoff is not None:
            self.transport.handoff.close()
            self.transport.handoff = None
        if self._own_handoff_dir is not None:
            shutil.rmtree(self._own_handoff_dir, ignore_errors=True)
            self._own_handoff_dir = None
        rt.admission.refuse_all()
        for http in list(self.transport.http_connections):
            http.shutdown()
        timeout = self.config.drain_timeout if drain_timeout is None else drain_timeout
        await self._wait_sessions(timeout)
        for session in list(rt.sessions):
            session.close(CLOSE_GOING_AWAY, "server shutting down")
        await self._wait_sessions(FINAL_GRACE_S)
        for session in list(rt.sessions):  # still running after the grace: cancel
            session.channel.close(CLOSE_GOING_AWAY, "server shutting down")
            session.connection_lost()
        await asyncio.sleep(0)
        rt.shutdown()
        self.state = ServerState.STOPPED
        self._stopped.set()

    async def _wait_sessions(self, limit_s: float) -> None:
        deadline = time.monotonic() + limit_s
        # Polled, only while shutting down: sessions end from many callbacks.
        while self.runtime.sessions and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.02)


class JsonLogFormatter(logging.Formatter):
    """``--log-format json``: one JSON object per line: ``time`` (ISO 8601, UTC), ``level``,
    ``logger``, ``message``, ``pid`` (the worker), ``session`` (the short id of the session
    the line is about, when there is one: :data:`~stadium._server.runtime.SESSION_ID` or a
    record's ``session`` extra), ``exception`` (the traceback, when there is one)."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "pid": record.process,
        }
        session = getattr(record, "session", None) or SESSION_ID.get()
        if session is not None:
            entry["session"] = session
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def _setup_logging(level: str, log_format: str = "text") -> None:
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(JsonLogFormatter())
    else:
        handler.setFormatter(
            logging.Formatter("%(asctime)s %(levelname)s [%(process)d] %(name)s: %(message)s")
        )
    logging.basicConfig(level=level.upper(), handlers=[handler])
    if level != "debug":
        # picows logs every connect and disconnect at INFO: per-session noise at scale.
        logging.getLogger("stadium.picows").setLevel(logging.WARNING)


GC_THRESHOLDS = (50_000, 50, 100)
"""The cyclic collector's thresholds in a serving process (CPython's default: 700, 10, 10).

Every session holds a few dozen long-lived objects; with the default thresholds
the collector re-scans them over and over while sessions arrive, ~25 % of the
server's CPU in a burst of 8,192 sessions (measured; see BENCHMARKS.md).
Reference counting frees almost everything; cycles are still collected, later.
"""


def _tune_gc() -> None:
    """Freeze the objects of start-up (never scanned again) and raise the thresholds."""
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


async def _serve_until_signal(
    server: Server,
    *,
    on_serving: Callable[[], None] | None = None,
    on_retiring: Callable[[], None] | None = None,
    alone: bool = False,
) -> int:
    """Serve until SIGTERM/SIGINT, or until the watchdog asks for a recycle, then drain.

    ``alone``: no supervisor, so SIGHUP is logged and ignored here (a forked worker
    ignores it: it is the supervisor's). ``on_retiring`` tells the supervisor that
    this worker drains on its own (it forks the replacement at once). Returns the
    exit code: 0, or :data:`~stadium._util.process.RECYCLE_EXIT_CODE` after a recycle.
    """
    _tune_gc()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    directory = server.runtime.doors.tenants
    if alone and directory is not None:  # --tenants: SIGHUP reloads them, in place
        loop.add_signal_handler(signal.SIGHUP, directory.reload)
    elif alone:
        loop.add_signal_handler(
            signal.SIGHUP,
            log.warning,
            "SIGHUP ignored: with one worker there is no supervisor to recycle it "
            "(serve with --workers 2 or more for a rolling recycle on SIGHUP)",
        )
    await server.start()
    recycle: list[str] = []

    def on_recycle(why: str) -> None:  # memory cap, stuck threads (the watchdog logged why)
        recycle.append(why)
        if on_retiring is not None:
            on_retiring()
        stop.set()

    watchdog = server.worker.watch(on_recycle)
    if on_serving is not None:
        on_serving()
    try:
        await stop.wait()
        if recycle:
            log.warning("recycling: draining %d sessions", len(server.runtime.sessions))
        else:
            log.info("signal received: draining %d sessions", len(server.runtime.sessions))
        await server.stop()
    finally:
        watchdog.stop()
    return RECYCLE_EXIT_CODE if recycle else 0


def _exit_past_stuck_threads(code: int) -> None:
    """End the process now when env threads are still running calls after a drain.

    A thread stuck in an env call never returns, and Python joins the pool threads
    at exit (``concurrent.futures`` registers that), so the process would never
    exit: flush the logs and ``os._exit`` instead. Forked workers always end with
    ``os._exit``.
    """
    stuck = running_pool_threads(STUCK_EXIT_WAIT_S)
    if stuck:
        log.warning(
            "%d env thread(s) still running a call that never returned; exiting without "
            "waiting for them",
            stuck,
        )
        flush_logs()
        os._exit(code)


def _check_env_kwargs(spec: EnvSpec, env_kwargs: dict[str, Any]) -> None:
    """Refuse ``--env-kwargs`` the env's constructor cannot take (or its missing required
    arguments) at start, rather than failing every session's creation.

    Raises:
        ConfigError: naming the constructor's signature and what to give.
    """
    try:
        signature = inspect.signature(spec.factory)
    except (TypeError, ValueError):  # no signature to read: the sessions will tell
        return
    try:
        signature.bind(**env_kwargs)
    except TypeError as exc:
        given = json.dumps(env_kwargs) if env_kwargs else "none"
        raise ConfigError(
            f"--env-kwargs (given: {given}) do not fit {spec.name}{bare(signature)}: {exc}; give "
            "its constructor's keyword arguments as a JSON object, e.g. --env-kwargs "
            "'{\"name\": value}'",
            env_kwargs=env_kwargs,
        ) from None


def _announce(config: ServerConfig, sock: socket.socket, spec_name: str) -> None:
    """Print where the server listens; warn when it is exposed (see ``exposure_warnings``)."""
    host, port = sock.getsockname()[:2]
    wildcard = host in ("0.0.0.0", "::")
    shown = "127.0.0.1" if wildcard else f"[{host}]" if ":" in host else host
    tls = config.tls_cert is not None
    http, ws = ("https", "wss") if tls else ("http", "ws")
    # The HOST env var (OpenEnv deployments set it) widens the bind silently otherwise.
    from_env = os.environ.get("HOST") == config.host
    source = " (from the HOST environment variable)" if from_env else ""
    bound = f", bound to {config.host or 'all interfaces'}" if wildcard else ""
    # --tenants authenticates too: each request's bearer token names its tenant.
    token = config.auth_token is not None or config.tenants is not None
    access = "bearer token required" if token else "no authentication"
    if config.tenants is not None:
        access += f" (tenants from {config.tenants})"
    print(
        f"stadium: serving {spec_name!r} with {config.workers} worker(s), "
        f"max {config.max_sessions} sessions; listening on {http}://{shown}:{port} "
        f"(WebSocket {ws}://{shown}:{port}/ws){bound}{source}; {access}",
        flush=True,
    )
    for warning in exposure_warnings(config.host, token=token, tls=tls):
        log.warning("%s%s", warning, source)


def run_server(config: ServerConfig) -> int:
    """Serve until SIGTERM/SIGINT; return the process exit code.

    The open-file soft limit is raised to the hard limit first, with a warning if
    that cannot hold the sessions. With ``workers == 1`` the server runs in this
    process; otherwise a :class:`~stadium._server.processes.supervisor.Supervisor` forks the
    workers.

    Signals:

    * SIGTERM, SIGINT: stop accepting, let sessions finish for up to
      ``drain_timeout``, close the rest with 1001 after their in-flight request,
      exit 0. With workers, a worker still running ``drain_timeout`` + 10 s after
      is killed, and the exit code is then 1.
    * SIGHUP (workers >= 2): a rolling recycle, one worker at a time: a fresh
      worker is forked and, once it accepts connections, the old one stops
      accepting and drains its sessions as on SIGTERM (served for up to
      ``drain_timeout``, then closed with 1001 after their in-flight request).
      No connection is refused meanwhile (the listening socket stays open), the
      session limit still holds across old and new workers, and the supervisor
      keeps its pid. Code and configuration are not reloaded (the new workers
      are forks of the supervisor). With ``workers == 1`` SIGHUP is logged and
      ignored.
    * A worker that crashes is restarted after a delay that doubles with each
      quick crash of that worker (0.05 s up to ``restart_max_delay``); the others
      keep serving.

    Envs that misbehave (see :mod:`stadium._server.processes.watchdog`):

    * A worker whose event loop is stuck past ``stall_limit`` (an env call that
      never yields) ends itself with exit code
      :data:`~stadium._util.process.RECYCLE_EXIT_CODE` (75); its sessions are lost (a
      stuck loop cannot drain them). A worker past ``max_worker_memory``, or with
      more than 4 x the env pool's core (cpus+4) threads stuck in abandoned env calls,
      stops accepting, drains its sessions as on SIGTERM and exits with the same
      code. With workers >= 2 the supervisor replaces such a worker at once (no
      crash counted, no backoff; the others keep serving). With ``workers == 1``
      there is no supervisor: the process exits with code 75, for a process
      manager to restart it (systemd ``Restart=on-failure``, Docker
      ``--restart``, Kubernetes); serve with ``--workers 2`` or more to have
      Stadium replace it while the other worker serves.
    * Shutdown never waits for a thread stuck in an env call: once the drain is
      over, a process whose env threads are still running calls ends with
      ``os._exit`` (after flushing its logs) instead of joining them forever.
    """
    _setup_logging(config.log_level, config.log_format)
    env_cls: type[Environment[Any, Any, Any]] | None = None
    described: Description | None = None
    if config.untrusted_env_code:  # never imported here: described by a sandboxed process
        config, spec, described = untrusted_spec(config)
        log.info(
            "--untrusted-env-code: %s %s described by a sandboxed process; its code runs "
            "only in sessions' sandboxes", spec.name, spec.version,
        )  # fmt: skip
    else:
        env_cls = load_target(
            config.target, env_kwargs=config.env_kwargs, action_model=config.action_model
        )
        config = config.for_target(env_cls)  # e.g. an OpenEnv app's max_concurrent_envs
        spec = EnvSpec.of(env_cls)  # fail fast, before binding, on a bad env class
        _check_env_kwargs(spec, config.env_kwargs)  # and on arguments it cannot take
        isolation_config(config, env_cls)  # fail fast, before binding, on unusable limits
    record_config(config, check=True)  # and on a --record-filter or --record-redact
    for warning in startup_warnings(config, env_cls):  # openenv.yaml limits left unenforced
        log.warning("%s", warning)
    check_fd_budget(config, raise_nofile_limit())
    server_ssl_context(config)  # fail fast, before binding, on unusable TLS files
    if config.durable:  # made before the workers fork: they share the directory and the key
        if not config.session_store:
            config = dataclasses.replace(config, session_store=default_session_store())
        if config.session_store_key:
            read_key_file(config.session_store_key)  # refused here, not in every worker
        else:
            process_key()
        store_from_url(config.session_store)
        if env_cls is not None and isolation_config(config, env_cls) is None:
            probe_durable(config, spec)  # an env that cannot be snapshotted: refused now
        log.info(
            "--durable: session records in %s, signed with %s",
            config.session_store,
            "the key in --session-store-key" if config.session_store_key else "a key made now",
        )
    sock = listen_socket(config.host, config.port)
    # Where this server listens, for envs that report it (the benchmark env's host_url).
    os.environ["STADIUM_PORT"] = str(sock.getsockname()[1])
    _announce(config, sock, spec.name)
    if config.workers == 1:
        server = Server(config, env_cls, sock=sock, described=described)
        with asyncio.Runner(loop_factory=new_event_loop) as runner:
            code = runner.run(_serve_until_signal(server, alone=True))
        _exit_past_stuck_threads(code)
        return code

    board = MetricsBoard(Supervisor.counters_for(config.workers))
    tenants = None  # read before the fork: the workers share its counters and reloads
    if config.tenants is not None:
        tenants = TenantDirectory.open(config.tenants, Supervisor.counters_for(config.workers))
    handoff_dir = private_dir()  # before the fork: the workers find each other there

    def run_worker(
        slots: SharedSlots, on_serving: Callable[[], None], on_retiring: Callable[[], None]
    ) -> int:
        server = Server(
            config, env_cls, sock=sock, slots=slots, board=board, handoff_dir=handoff_dir,
            described=described, tenants=tenants,
        )  # fmt: skip
        with asyncio.Runner(loop_factory=new_event_loop) as runner:
            return runner.run(
                _serve_until_signal(server, on_serving=on_serving, on_retiring=on_retiring)
            )

    supervisor = Supervisor(
        workers=config.workers,
        max_sessions=config.max_sessions,
        max_sessions_per_client=config.max_sessions_per_client,
        rate_limit=config.rate_limit,
        rate_burst=config.rate_burst,
        restart_max_delay=config.restart_max_delay,
        stop_grace_s=config.drain_timeout + FINAL_GRACE_S + KILL_MARGIN_S,
        run_worker=run_worker,
        listener=sock,
        metrics=board,
        tenants=tenants,
    )
    try:
        return supervisor.run()
    finally:
        shutil.rmtree(handoff_dir, ignore_errors=True)

"""Server lifecycle: bind, serve, drain; one process or a supervisor with N forked workers.

``Server`` runs one worker's event loop part and can be used in-process::

    server = Server(ServerConfig(target="echo", port=0))
    await server.start()
    ...  # ws://127.0.0.1:{server.port}/ws
    await server.stop()

``run_server(config)`` is what ``stadium serve`` calls: it binds the listening
socket once (backlog at the kernel's maximum), then either serves in this
process (``workers == 1``) or forks the workers, which share the socket and a
server-wide session limit (:class:`~stadium._admission.SharedSlots`). SIGTERM or
SIGINT stops accepting, lets sessions finish for up to ``drain_timeout``, closes
the rest with 1001 after their in-flight request, and exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import gc
import logging
import os
import signal
import socket
import sys
import time
from typing import Any

from stadium._admission import SharedSlots, Slots
from stadium._config import ServerConfig
from stadium._env import Environment
from stadium._errors import ConfigError
from stadium._loader import load_target
from stadium._picows import PicowsTransport
from stadium._session import CLOSE_GOING_AWAY
from stadium._spec import EnvSpec
from stadium._worker import Worker

log = logging.getLogger("stadium.server")

#: After the drain timeout, how long in-flight requests still get before they are cancelled.
FINAL_GRACE_S = 5.0


class ServerState(enum.Enum):
    """Lifecycle of a server (or of one worker)."""

    CREATED = "created"
    SERVING = "serving"
    DRAINING = "draining"
    STOPPED = "stopped"


def listen_socket(host: str, port: int) -> socket.socket:
    """Bind and listen with the largest backlog the kernel allows."""
    try:
        sock = socket.create_server(
            (host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET
        )
    except OSError as exc:
        raise ConfigError(
            f"cannot listen on {host}:{port}: {exc.strerror}", host=host, port=port
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


class Server:
    """One worker: the transport, the sessions and their drain."""

    def __init__(
        self,
        config: ServerConfig,
        env_cls: type[Environment[Any, Any, Any]] | None = None,
        *,
        sock: socket.socket | None = None,
        slots: Slots | None = None,
    ) -> None:
        self.config = config
        self.worker = Worker.build(config, env_cls, slots=slots)
        self.spec = self.worker.spec
        self.runtime = self.worker.runtime
        self.endpoints = self.worker.endpoints
        self.state = ServerState.CREATED
        self._sock = sock
        self.transport = PicowsTransport(
            self.runtime,
            self.endpoints,
            max_message_bytes=config.max_message_bytes,
            ping_interval=config.ping_interval,
            ping_timeout=config.ping_timeout,
        )
        self._server: asyncio.Server | None = None
        self._stopped = asyncio.Event()

    @property
    def port(self) -> int:
        assert self._sock is not None, "server not started"
        return int(self._sock.getsockname()[1])

    @property
    def url(self) -> str:
        host = self.config.host
        host = "127.0.0.1" if host in ("0.0.0.0", "") else host
        return f"http://{host}:{self.port}"

    async def start(self) -> None:
        """Bind (unless given a socket) and start accepting."""
        if self._sock is None:
            self._sock = listen_socket(self.config.host, self.config.port)
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            self.transport, sock=self._sock, backlog=_max_backlog()
        )
        self.state = ServerState.SERVING
        self.worker.start()

    async def stop(self, drain_timeout: float | None = None) -> None:
        """Stop accepting, let sessions finish, close the rest with 1001."""
        if self.state in (ServerState.DRAINING, ServerState.STOPPED):
            await self._stopped.wait()
            return
        self.state = ServerState.DRAINING
        rt = self.runtime
        rt.draining = True
        rt.stop_reaper()
        if self._server is not None:
            self._server.close()
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


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)s [%(process)d] %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if level != "debug":
        # picows logs every connect and disconnect at INFO: per-session noise at scale.
        logging.getLogger("stadium.picows").setLevel(logging.WARNING)


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        return asyncio.new_event_loop()
    loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    return loop


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


async def _serve_until_signal(server: Server) -> None:
    _tune_gc()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await server.start()
    await stop.wait()
    log.info("signal received: draining %d sessions", len(server.runtime.sessions))
    await server.stop()


def _announce(config: ServerConfig, sock: socket.socket, spec_name: str) -> None:
    host, port = sock.getsockname()[:2]
    shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    print(
        f"stadium: serving {spec_name!r} with {config.workers} worker(s), "
        f"max {config.max_sessions} sessions; listening on http://{shown}:{port} "
        f"(WebSocket ws://{shown}:{port}/ws)",
        flush=True,
    )


def run_server(config: ServerConfig) -> int:
    """Serve until SIGTERM/SIGINT; return the process exit code (0 after a clean drain)."""
    _setup_logging(config.log_level)
    env_cls = load_target(config.target, env_kwargs=config.env_kwargs)
    spec = EnvSpec.of(env_cls)  # fail fast, before binding, on a bad env class
    sock = listen_socket(config.host, config.port)
    _announce(config, sock, spec.name)
    if config.workers == 1:
        server = Server(config, env_cls, sock=sock)
        with asyncio.Runner(loop_factory=_new_loop) as runner:
            runner.run(_serve_until_signal(server))
        return 0
    return _Supervisor(config, env_cls, sock).run()


def _die_with_parent() -> None:
    """Ask Linux to SIGTERM this worker if the supervisor dies (no orphaned workers)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGTERM)
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        pass


class _Supervisor:
    """Forks the workers, restarts any that crash, forwards stop signals."""

    def __init__(
        self, config: ServerConfig, env_cls: type[Environment[Any, Any, Any]], sock: socket.socket
    ) -> None:
        self.config = config
        self.env_cls = env_cls
        self.sock = sock
        self.slots = SharedSlots(config.max_sessions, config.workers)
        self.children: dict[int, int] = {}  # pid -> worker index
        self.stopping = False

    def _spawn(self, index: int) -> None:
        pid = os.fork()
        if pid == 0:  # worker
            code = 1
            try:
                _die_with_parent()
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                self.slots.bind(index)
                server = Server(self.config, self.env_cls, sock=self.sock, slots=self.slots)
                with asyncio.Runner(loop_factory=_new_loop) as runner:
                    runner.run(_serve_until_signal(server))
                code = 0
            except BaseException:
                log.exception("worker %d failed", index)
            finally:
                os._exit(code)
        self.children[pid] = index

    def _signal(self, signum: int, frame: Any) -> None:
        self.stopping = True
        for pid in list(self.children):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._signal)
        signal.signal(signal.SIGINT, self._signal)
        for index in range(self.config.workers):
            self._spawn(index)
        failures = 0
        while self.children:
            try:
                pid, status = os.wait()
            except ChildProcessError:
                break
            except InterruptedError:  # pragma: no cover - PEP 475 retries
                continue
            if pid not in self.children:
                continue
            index = self.children.pop(pid)
            self.slots.forget_worker(index)
            code = os.waitstatus_to_exitcode(status)
            if not self.stopping:
                failures += 1
                log.error("worker %d (pid %d) exited with %d; restarting", index, pid, code)
                if failures > 10 * self.config.workers:
                    log.error("workers keep failing; giving up")
                    self._signal(signal.SIGTERM, None)
                    return 1
                time.sleep(min(1.0, 0.05 * failures))
                self._spawn(index)
        return 0

"""Server configuration: one validated dataclass, fed by options, env vars or code."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from typing import Any

import click

from stadium._errors import ConfigError

DEFAULT_MAX_SESSIONS = 8192


@dataclasses.dataclass(frozen=True, slots=True)
class ServerConfig:
    """Everything ``stadium serve`` can be told.

    Attributes:
        target: built-in env name, ``package.module:Class`` or ``file.py:Class``.
        host, port: where to listen (port 0 picks a free port).
        workers: processes sharing the listening socket.
        max_sessions: concurrent sessions for the whole server, across workers.
        admission_timeout: seconds a new session waits for a free slot before
            ``CAPACITY_REACHED``.
        idle_timeout: seconds without a request before a session is closed (0: never).
        max_message_bytes: largest accepted WebSocket message.
        drain_timeout: on SIGTERM, seconds in-flight requests get to finish.
        ping_interval, ping_timeout: keepalive pings that detect half-open peers (0: off).
        executor_threads: size of the shared pool for blocking sync environments.
        restart_max_delay: with several workers, the longest wait before a worker
            that keeps crashing is restarted (the wait doubles from 0.05 s with
            each quick crash of that worker).
        env_kwargs: keyword arguments for the environment's constructor.
    """

    target: str
    host: str = "127.0.0.1"
    port: int = 8000
    workers: int = 1
    max_sessions: int = DEFAULT_MAX_SESSIONS
    admission_timeout: float = 5.0
    idle_timeout: float = 300.0
    max_message_bytes: int = 10 * 1024 * 1024
    drain_timeout: float = 30.0
    ping_interval: float = 20.0
    ping_timeout: float = 20.0
    executor_threads: int = min(32, (os.cpu_count() or 1) + 4)
    restart_max_delay: float = 30.0
    env_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    log_level: str = "info"

    def __post_init__(self) -> None:
        _check(0 <= self.port <= 65535, "--port must be 0..65535", port=self.port)
        _check(1 <= self.workers <= 256, "--workers must be 1..256", workers=self.workers)
        _check(self.max_sessions >= 1, "--max-sessions must be at least 1", value=self.max_sessions)
        _check(self.admission_timeout >= 0, "--admission-timeout must be >= 0")
        _check(self.idle_timeout >= 0, "--idle-timeout must be >= 0 (0 disables it)")
        _check(self.drain_timeout >= 0, "--drain-timeout must be >= 0")
        _check(self.ping_interval >= 0 and self.ping_timeout >= 0, "ping settings must be >= 0")
        _check(
            1024 <= self.max_message_bytes <= 1 << 30,
            "--max-message-bytes must be between 1024 and 1 GiB",
            value=self.max_message_bytes,
        )
        _check(1 <= self.executor_threads <= 1024, "--executor-threads must be 1..1024")
        _check(
            0.05 <= self.restart_max_delay <= 3600,
            "--restart-max-delay must be between 0.05 and 3600 seconds",
            value=self.restart_max_delay,
        )
        _check(
            self.log_level in ("debug", "info", "warning", "error"),
            "--log-level must be debug, info, warning or error",
        )

    @classmethod
    def from_options(cls, **options: Any) -> ServerConfig:
        """Build from click options (``None`` means: use the default)."""
        raw = options.pop("env_kwargs", None)
        kwargs = {k: v for k, v in options.items() if v is not None}
        if raw:
            try:
                env_kwargs = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"--env-kwargs is not valid JSON: {exc}") from None
            if not isinstance(env_kwargs, dict):
                raise ConfigError("--env-kwargs must be a JSON object, e.g. '{\"size\": 4}'")
            kwargs["env_kwargs"] = env_kwargs
        return cls(**kwargs)


def _check(ok: bool, message: str, **context: Any) -> None:
    if not ok:
        raise ConfigError(message, **context)


def serve_click_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The options of ``stadium serve`` (env vars as OpenEnv deployments name them)."""
    options = [
        click.option("--host", envvar="HOST", help="Address to bind [env HOST; 127.0.0.1]."),
        click.option("--port", type=int, envvar="PORT", help="Port; 0 picks one [env PORT; 8000]."),
        click.option(
            "--workers", type=int, envvar="WORKERS", help="Worker processes [env WORKERS; 1]."
        ),
        click.option(
            "--max-sessions",
            type=int,
            envvar="MAX_CONCURRENT_ENVS",
            help=f"Concurrent sessions, server-wide [env MAX_CONCURRENT_ENVS; "
            f"{DEFAULT_MAX_SESSIONS}].",
        ),
        click.option(
            "--admission-timeout", type=float, help="Seconds to wait for a free slot [5]."
        ),
        click.option(
            "--idle-timeout", type=float, help="Close sessions idle this long; 0 off [300]."
        ),
        click.option("--max-message-bytes", type=int, help="Largest message accepted [10 MiB]."),
        click.option(
            "--drain-timeout", type=float, help="Seconds to finish in-flight work on SIGTERM [30]."
        ),
        click.option(
            "--ping-interval", type=float, help="Keepalive ping when idle this long; 0 off [20]."
        ),
        click.option(
            "--ping-timeout", type=float, help="Drop a peer that does not pong in time [20]."
        ),
        click.option(
            "--executor-threads", type=int, help="Threads for blocking sync envs [cpus+4]."
        ),
        click.option(
            "--restart-max-delay",
            type=float,
            help="Longest wait before restarting a worker that keeps crashing [30].",
        ),
        click.option("--env-kwargs", help="JSON object of constructor arguments for the env."),
        click.option(
            "--log-level",
            type=click.Choice(["debug", "info", "warning", "error"]),
            help="Logging level [info].",
        ),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn

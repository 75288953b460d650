"""Server configuration: one validated dataclass, fed by options, env vars or code."""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

import click

from stadium._errors import ConfigError

DEFAULT_MAX_SESSIONS = 8192
DEFAULT_DETACHED_IDLE_TIMEOUT = 300.0
"""Seconds an HTTP MCP session (no live connection) may sit unused before it is closed,
unless ``--idle-timeout`` is given."""


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
        max_waiting_per_connection: sessions one connection (a batch) may have
            waiting for a slot; more are refused at once (0: no bound).
        max_waiting_per_client: sessions one client address may have waiting for
            a slot, over its connections; more are refused at once (0: no bound).
        idle_timeout: seconds without a request before a session is closed (0: never).
            ``None`` (the default): a session with a live connection (whose peer answers
            pings) is never closed for being quiet; sessions without one (HTTP MCP
            sessions) are closed after :data:`DEFAULT_DETACHED_IDLE_TIMEOUT`. A number
            applies to every session, connected or not.
        max_message_bytes: largest accepted WebSocket message.
        drain_timeout: on SIGTERM, seconds in-flight requests get to finish.
        resume_grace: seconds a resumable session (one a Stadium client opened) keeps
            its env and slot after losing its connection, for the client to resume it
            (0: no session is resumable).
        ping_interval, ping_timeout: keepalive pings that detect half-open peers (0: off).
        executor_threads: the most threads a worker runs blocking sync env calls on
            at once (the pool grows with demand and shrinks when idle); 0: one per
            session the worker can hold (``max_sessions``, at most 4096), so every
            session may block in a sync call at once, as on OpenEnv.
        restart_max_delay: with several workers, the longest wait before a worker
            that keeps crashing is restarted (the wait doubles from 0.05 s with
            each quick crash of that worker).
        step_timeout: seconds an env call that waits (create, reset, step; over
            HTTP also ``GET /state``) may run before its request is answered
            ``TIMEOUT`` and its session closed (1011) (0: no limit). OpenEnv's
            per-request ``timeout_s`` may shorten it, never lengthen it. Calls
            that never yield the event loop are the watchdog's (``stall_limit``).
        stall_limit: seconds a worker's event loop may be stuck (an env that
            never yields) before the worker is ended and replaced, its sessions
            lost (exit code 75; one worker: for a process manager to restart);
            stalls over a second are logged with the loop's stack (0: off).
        max_worker_memory: MiB of resident memory after which a worker stops
            taking sessions, drains and is replaced (0: no cap; sampled every
            second; ignored, with an error, when a worker starts above it).
        header_timeout: seconds a new connection has to send its request line and
            headers (HTTP and the WebSocket upgrade).
        body_timeout: seconds an HTTP request has to send its body once its
            headers are in.
        keepalive_timeout: seconds an HTTP keep-alive connection may sit idle
            between requests.
        auth_token: a bearer token every WebSocket upgrade and HTTP request must
            carry (``Authorization: Bearer ...``); ``None``: no authentication.
            Never shown in logs or ``repr``.
        allowed_origins: browser origins allowed to open WebSocket sessions
            (exact ``scheme://host[:port]`` or ``*``); same-host origins are always
            allowed, requests without ``Origin`` (non-browser clients) too. Their
            hosts are also accepted as ``Host`` on loopback connections, which
            otherwise only accept ``localhost`` and IP literals (DNS rebinding);
            ``*`` turns both checks off. See :mod:`stadium._core.access`.
        max_sessions_per_client: concurrent sessions one client address may hold
            (0: no per-client limit).
        rate_limit: requests per second one client address may send, on average,
            with bursts of ``rate_burst`` (0: no limit).
        rate_burst: requests a client may send at once above ``rate_limit``.
        tls_cert, tls_key: PEM files; with both, the server speaks TLS (wss://, https://).
        debug_errors: error replies carry exceptions' full text (else absolute
            paths are cut to their last part), and every exception an env raises
            is logged at ERROR with its traceback (else at most one WARNING per
            10 s); may reveal server paths: for debugging only.
        durable: write each resumable session's env snapshot and counters to
            ``session_store`` before each reply, so that a session whose worker or
            node died is restored when its client resumes (``durable``).
        session_store: where durable sessions are written: a directory (``dir:/path``
            or a path; shared between nodes on a cluster), owned by the server's user
            and writable by it only. Default: a private directory the server creates
            (``0700``, an unpredictable name under ``$XDG_RUNTIME_DIR`` or the
            temporary directory), removed when it exits.
        session_store_key: a file (``0600``, the server's user's) holding the key the
            records are signed with, for a store other servers read too (another node,
            a restart). Default: a key generated when the server starts, held in its
            processes' memory only (records outlive a worker, not the server).
        isolation: where each session's env runs: ``none`` (an object in the worker),
            ``process`` (its own OS process, forked from a per-worker template that
            imported the env's code) or ``sandbox`` (a process in its own namespaces,
            as an unprivileged uid, with the ``sandbox_*`` limits and no network).
            ``None``: the env class's ``isolation`` attribute, else ``none``.
        warm_pool: env processes each worker forks ahead (their envs built), so a
            new isolated session pays no start (0: fork on demand).
        sandbox_memory, sandbox_cpus, sandbox_pids, sandbox_disk: per-session limits
            of ``sandbox``: MiB of memory, CPU cores, processes, MiB of work directory.
            Each call is bounded by ``step_timeout`` (300 s when that is 0).
            Given, each overrides the env's ``openenv.yaml`` (``resources``), which
            overrides the default.
        episode_timeout: seconds from a ``reset`` until the episode ends, for isolated
            sessions (``process`` and ``sandbox``): past it the env's process is killed
            (``LIMIT_EXCEEDED``, ``episode_time``). 0: none, unless ``openenv.yaml``
            declares ``resources.episode_timeout_s``.
        sandbox_network: ``none`` (the default), ``allowlist`` (only ``sandbox_allow``)
            or ``public`` (any address but the host's own); ``None``: the env's
            ``openenv.yaml`` ``network``, else ``none``.
        sandbox_allow: the hosts (names, addresses, CIDR ranges) of ``allowlist``.
        sandbox_reply_mib: isolated sessions (``process`` and ``sandbox``): MiB one reply
            of a session's env process may take in its worker, as a frame and, estimated,
            decoded (each; so at most twice this held per session at a time). A reply
            over it, or malformed, ends its call with ``ENV_PROTOCOL`` and the process.
        image_cache_mib: the node's image cache budget (``stadium._server.images``,
            docs/IMAGES.md): MiB its layers may take before the least recently used images
            no session leases are evicted. 0: no budget.
        sandbox_seccomp: ``on`` (each sandboxed session runs under Stadium's seccomp
            filter; the server refuses to start without libseccomp) or ``off``.
        sandbox_output: what isolated env processes print (their stdout and stderr, a
            pipe of their own, never the server's): ``log`` (the server's log, bounded in
            rate, escaped, tagged with the session) or ``drop`` (``/dev/null``).
        untrusted_env_code: the env's code is third-party (``--isolation sandbox``
            only): its module is imported only by each session's process, inside its
            sandbox, never by the server's processes or the template; the server learns
            the env's name and schemas from a sandboxed process
            (:mod:`stadium._server.isolation.remote`). Costs each session the import.
        image: ``sandbox``: the task image every session runs in (its ``/``: the image's
            layers under a private copy-on-write layer; commands from the image), a
            ``REF`` (``dir:/rootfs``, ...), or ``build``/``build:BASE``: the env
            directory's recipe built with Podman (``stadium._server.images.build``);
            ``images``: the others a reset may choose with
            ``options={"image": REF}`` (a file of REFs, or comma-separated patterns).
        preload: with ``untrusted_env_code``, operator-trusted modules (``numpy``) the
            template imports once, so that sessions share them instead of importing them.
        action_model: ``module:Class`` (or ``file.py:Class``): the pydantic action
            model of an OpenEnv env class or app target, over the one it declares.
        record: a directory each worker writes its episodes to as Parquet shards
            (``ledger.record``, docs/RECORDING.md); empty: no recording.
        record_sample, record_filter, record_redact: the fraction of episodes recorded
            (chosen at reset), an expression an episode must match to be written
            (``reward>0.9``, ``error``, ...), a ``module:function`` that redacts (or drops)
            each episode's record before it is written.
        given: the names of the settings the operator gave (options, their environment
            variables, or values other than the defaults in code); a setting an OpenEnv
            app target's ``create_app`` was given (``max_concurrent_envs``) applies
            where the operator gave none (:meth:`for_target`).
    """

    target: str
    host: str = "127.0.0.1"
    port: int = 8000
    workers: int = 1
    max_sessions: int = DEFAULT_MAX_SESSIONS
    admission_timeout: float = 5.0
    max_waiting_per_connection: int = 4096
    max_waiting_per_client: int = 16384
    idle_timeout: float | None = None
    max_message_bytes: int = 10 * 1024 * 1024
    drain_timeout: float = 30.0
    resume_grace: float = 60.0
    ping_interval: float = 20.0
    ping_timeout: float = 20.0
    executor_threads: int = 0
    restart_max_delay: float = 30.0
    env_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    log_level: str = "info"
    log_format: str = "text"
    """``text`` or ``json`` (one JSON object per line; ``server._setup_logging``)."""
    # Envs that misbehave.
    step_timeout: float = 0.0
    stall_limit: float = 60.0
    max_worker_memory: int = 0
    # Sockets.
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    keepalive_timeout: float = 15.0
    # Access control.
    auth_token: str | None = dataclasses.field(default=None, repr=False)
    tenants: str | None = None
    """``--tenants FILE``: the tenants and their tokens (``tenants``)."""
    allowed_origins: tuple[str, ...] = ()
    max_sessions_per_client: int = 0
    rate_limit: float = 0.0
    rate_burst: int = 100
    tls_cert: str | None = None
    tls_key: str | None = None
    debug_errors: bool = False
    durable: bool = False
    session_store: str = ""
    """``""``: :func:`default_session_store`, looked up only with ``durable``."""
    session_store_key: str = ""
    """``""``: a key of the server's own (``durable.process_key``)."""
    # Isolated sessions.
    isolation: str | None = None
    warm_pool: int = 0
    sandbox_memory: int = 1024
    sandbox_cpus: float = 1.0
    sandbox_pids: int = 128
    sandbox_disk: int = 256
    episode_timeout: float = 0.0
    sandbox_network: str | None = None
    sandbox_allow: tuple[str, ...] = ()
    sandbox_seccomp: str = "on"
    sandbox_output: str = "log"
    untrusted_env_code: bool = False
    preload: tuple[str, ...] = ()
    sandbox_reply_mib: int = 64
    image: str | None = None
    images: str | None = None
    image_cache_mib: int = 0
    action_model: str | None = None
    record: str = ""
    record_sample: float = 1.0
    record_filter: str = ""
    record_redact: str = ""
    given: frozenset[str] = dataclasses.field(default=frozenset(), compare=False)

    def __post_init__(self) -> None:
        differ = {
            f.name
            for f in dataclasses.fields(self)
            if f.name != "given"
            and f.default is not dataclasses.MISSING
            and getattr(self, f.name) != f.default
        }
        object.__setattr__(self, "given", self.given | differ)
        _check(0 <= self.port <= 65535, "--port must be 0..65535", port=self.port)
        _check(1 <= self.workers <= 256, "--workers must be 1..256", workers=self.workers)
        _check(self.max_sessions >= 1, "--max-sessions must be at least 1", value=self.max_sessions)
        _check(self.admission_timeout >= 0, "--admission-timeout must be >= 0")
        _check(self.max_waiting_per_connection >= 0, "--max-waiting-per-connection must be >= 0")
        _check(self.max_waiting_per_client >= 0, "--max-waiting-per-client must be >= 0")
        _check(
            self.idle_timeout is None or self.idle_timeout >= 0,
            "--idle-timeout must be >= 0 (0 disables it)",
        )
        _check(self.drain_timeout >= 0, "--drain-timeout must be >= 0")
        _check(
            0 <= self.resume_grace <= 86400,
            "--resume-grace must be between 0 (no resume) and 86400 seconds",
            value=self.resume_grace,
        )
        _check(
            not (self.durable and self.resume_grace == 0),
            "--durable needs resumable sessions: give --resume-grace above 0",
        )
        _check(
            self.durable or not (self.session_store or self.session_store_key),
            "--session-store and --session-store-key are for durable sessions: add --durable",
        )
        _check(self.ping_interval >= 0 and self.ping_timeout >= 0, "ping settings must be >= 0")
        _check(
            1024 <= self.max_message_bytes <= 1 << 30,
            "--max-message-bytes must be between 1024 and 1 GiB",
            value=self.max_message_bytes,
        )
        _check(
            0 <= self.executor_threads <= 65536,
            "--executor-threads must be 0..65536 (0: one per session, at most 4096)",
        )
        _check(
            0.05 <= self.restart_max_delay <= 3600,
            "--restart-max-delay must be between 0.05 and 3600 seconds",
            value=self.restart_max_delay,
        )
        _check(
            self.log_level in ("debug", "info", "warning", "error"),
            "--log-level must be debug, info, warning or error",
        )
        _check(self.log_format in ("text", "json"), "--log-format must be text or json")
        _check(self.step_timeout >= 0, "--step-timeout must be >= 0 (0 disables it)")
        _check(
            self.isolation in (None, "none", "process", "sandbox"),
            "--isolation must be none, process or sandbox",
            value=self.isolation,
        )
        _check(
            self.episode_timeout >= 0,
            "--episode-timeout must be >= 0 seconds (0: none)",
            value=self.episode_timeout,
        )
        _check(
            self.sandbox_network in (None, "none", "allowlist", "public"),
            "--sandbox-network must be none, allowlist or public",
            value=self.sandbox_network,
        )
        _check(
            self.sandbox_seccomp in ("on", "off"),
            "--sandbox-seccomp must be on or off",
            value=self.sandbox_seccomp,
        )
        _check(
            self.sandbox_output in ("log", "drop"),
            "--sandbox-output must be log or drop",
            value=self.sandbox_output,
        )
        _check(
            not self.untrusted_env_code or self.isolation == "sandbox",
            "--untrusted-env-code needs --isolation sandbox (the env's code is imported "
            "only inside a sandbox, so its class cannot ask for the mode itself)",
            value=self.isolation,
        )
        _check(
            not self.preload or self.untrusted_env_code,
            "--preload is for --untrusted-env-code (otherwise the template imports the "
            "env's code, and what it imports, already)",
        )
        for module in self.preload:
            _check(
                all(part.isidentifier() for part in module.split(".")),
                "--preload takes module names (numpy, torch.nn)",
                value=module,
            )
        _check(
            8 <= self.sandbox_reply_mib <= 4096,
            "--sandbox-reply-mib must be 8..4096 (MiB a reply may take)",
            value=self.sandbox_reply_mib,
        )
        _check(
            not (self.image or self.images) or self.isolation in (None, "sandbox"),
            "--image and --images need --isolation sandbox (a session's image is the root "
            "of its sandbox)",
            value=self.isolation,
        )
        _check(
            self.image_cache_mib >= 0,
            "--image-cache-mib must be 0 (no budget) or more (MiB of image layers)",
            value=self.image_cache_mib,
        )
        _check(0 <= self.warm_pool <= 4096, "--warm-pool must be 0..4096", value=self.warm_pool)
        _check(
            0 < self.record_sample <= 1,
            "--record-sample must be a fraction above 0, at most 1 (1: every episode)",
            value=self.record_sample,
        )
        _check(
            bool(self.record)
            or (not (self.record_filter or self.record_redact) and self.record_sample == 1),
            "--record-sample, --record-filter and --record-redact go with --record DIR",
        )
        _check(
            self.stall_limit == 0 or self.stall_limit >= 1,
            "--stall-limit must be 0 (off) or at least 1 second",
            value=self.stall_limit,
        )
        _check(
            self.max_worker_memory == 0 or self.max_worker_memory >= 32,
            "--max-worker-memory must be 0 (off) or at least 32 MiB",
            value=self.max_worker_memory,
        )
        for name in ("header_timeout", "body_timeout", "keepalive_timeout"):
            _check(
                getattr(self, name) > 0,
                f"--{name.replace('_', '-')} must be > 0",
                value=getattr(self, name),
            )
        _check(
            self.auth_token is None or len(self.auth_token) >= 16,
            "the auth token must be at least 16 characters (try: "
            "python -c 'import secrets; print(secrets.token_urlsafe())')",
        )
        _check(
            self.auth_token is None
            or (self.auth_token.isprintable() and " " not in self.auth_token),
            "the auth token must be printable, without spaces",
        )
        _check(
            self.tenants is None or self.auth_token is None,
            "--tenants and an auth token (--auth-token-file, STADIUM_AUTH_TOKEN) go apart: "
            "the token is a one-tenant shorthand; list it as a tenant in the file instead",
        )
        for origin in self.allowed_origins:
            _check(
                origin == "*" or ("://" in origin and not origin.endswith("/")),
                "--allow-origin takes 'scheme://host[:port]' (no path, no trailing /) or '*'",
                value=origin,
            )
        _check(self.max_sessions_per_client >= 0, "--max-sessions-per-client must be >= 0")
        _check(self.rate_limit >= 0, "--rate-limit must be >= 0 (0 disables it)")
        _check(self.rate_burst >= 1, "--rate-burst must be at least 1")
        _check(
            (self.tls_cert is None) == (self.tls_key is None),
            "--tls-cert and --tls-key go together: give both or neither",
        )
        for path in (self.tls_cert, self.tls_key):
            _check(
                path is None or os.path.isfile(path),
                "TLS file not found",
                path=path,
            )

    @property
    def connected_idle_timeout(self) -> float:
        """Seconds a quiet session with a live connection is kept (0: forever, the default)."""
        return self.idle_timeout or 0.0

    @property
    def detached_idle_timeout(self) -> float:
        """Seconds a session without a live connection (HTTP MCP) is kept unused (0: forever)."""
        return DEFAULT_DETACHED_IDLE_TIMEOUT if self.idle_timeout is None else self.idle_timeout

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
        token_file = kwargs.pop("auth_token_file", None)
        if token_file is not None:
            if "auth_token" in kwargs:
                raise ConfigError("give STADIUM_AUTH_TOKEN or --auth-token-file, not both")
            kwargs["auth_token"] = read_token_file(token_file)
        if "sandbox_allow" in kwargs:
            kwargs["sandbox_allow"] = tuple(kwargs["sandbox_allow"])
            if not kwargs["sandbox_allow"]:
                del kwargs["sandbox_allow"]
        if "preload" in kwargs:
            kwargs["preload"] = tuple(
                name.strip() for item in kwargs["preload"] for name in item.split(",") if name
            )
            if not kwargs["preload"]:
                del kwargs["preload"]
        if "allowed_origins" in kwargs:
            kwargs["allowed_origins"] = tuple(kwargs["allowed_origins"])
        return cls(**kwargs, given=frozenset(kwargs))

    def for_target(self, env_cls: type[Any]) -> ServerConfig:
        """This configuration with the settings ``env_cls`` brings where the operator gave
        none: an OpenEnv app target's ``max_concurrent_envs`` becomes ``max_sessions``."""
        app = getattr(env_cls, "openenv_app", None)
        limit = getattr(app, "max_concurrent_envs", None)
        if limit is None or "max_sessions" in self.given or limit == self.max_sessions:
            return self
        return dataclasses.replace(self, max_sessions=int(limit), given=self.given)


_DEFAULT_STORE: list[str] = []
"""This process's default store directory, once made (inherited by forked workers)."""


def default_session_store() -> str:
    """``--session-store``'s default: a private directory this server creates (``0700``,
    owned by its user, an unpredictable name) under ``$XDG_RUNTIME_DIR`` when that is
    the user's own, else in the temporary directory; the same one for every worker
    forked after the first call; removed when the process that made it exits.

    Raises:
        ConfigError: there is no usable temporary directory (e.g. a read-only root).
    """
    if _DEFAULT_STORE:
        return _DEFAULT_STORE[0]
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    try:
        info = os.stat(runtime) if runtime else None
    except OSError:
        info = None
    private = info is not None and info.st_uid == os.getuid() and not info.st_mode & 0o077
    try:
        path = tempfile.mkdtemp(prefix="stadium-sessions-", dir=runtime if private else None)
    except OSError as exc:
        raise ConfigError(
            f"--durable: cannot create a private directory for the session store "
            f"({exc.strerror or exc}); give --session-store DIR"
        ) from None
    _DEFAULT_STORE.append(path)
    owner = os.getpid()

    def remove() -> None:
        if os.getpid() == owner:  # not in forked workers (they end with os._exit anyway)
            shutil.rmtree(path, ignore_errors=True)

    atexit.register(remove)
    return path


def read_token_file(path: str) -> str:
    """The token in ``path`` (its first line, stripped); ConfigError if unreadable or empty."""
    try:
        with open(path, encoding="utf-8") as f:
            token = f.readline().strip()
    except OSError as exc:
        raise ConfigError(f"cannot read --auth-token-file: {exc.strerror}", path=path) from None
    if not token:
        raise ConfigError("--auth-token-file is empty", path=path)
    return token


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
            "--max-waiting-per-connection",
            type=int,
            help="Sessions one connection may have waiting for a slot; 0 no bound [4096].",
        ),
        click.option(
            "--max-waiting-per-client",
            type=int,
            help="Sessions one client address may have waiting for a slot; 0 no bound [16384].",
        ),
        click.option(
            "--idle-timeout",
            type=float,
            help="Close sessions idle this long, connected ones too; 0 off [connected: "
            "never; HTTP MCP sessions: 300].",
        ),
        click.option("--max-message-bytes", type=int, help="Largest message accepted [10 MiB]."),
        click.option(
            "--drain-timeout", type=float, help="Seconds to finish in-flight work on SIGTERM [30]."
        ),
        click.option(
            "--resume-grace",
            type=float,
            help="Seconds a lost session waits for its client to resume it; 0 off [60].",
        ),
        click.option(
            "--ping-interval", type=float, help="Keepalive ping when idle this long; 0 off [20]."
        ),
        click.option(
            "--ping-timeout", type=float, help="Drop a peer that does not pong in time [20]."
        ),
        click.option(
            "--executor-threads",
            type=int,
            help="Most threads for blocking sync env calls; 0: one per session, at most 4096 [0].",
        ),
        click.option(
            "--restart-max-delay",
            type=float,
            help="Longest wait before restarting a worker that keeps crashing [30].",
        ),
        click.option("--env-kwargs", help="JSON object of constructor arguments for the env."),
        click.option(
            "--action-model",
            metavar="MODULE:CLASS",
            help="The pydantic action model of an OpenEnv env class or app (for envs that "
            "give it only to create_app) [the one the env declares].",
        ),
        click.option(
            "--log-level",
            type=click.Choice(["debug", "info", "warning", "error"]),
            help="Logging level [info].",
        ),
        click.option(
            "--log-format",
            type=click.Choice(["text", "json"]),
            help="Log lines as text, or as one JSON object per line (time, level, logger, "
            "message, pid, session) [text].",
        ),
        click.option(
            "--step-timeout",
            type=float,
            help="Seconds an env call may run before it is answered TIMEOUT and its "
            "session closed; 0 off [0].",
        ),
        click.option(
            "--stall-limit",
            type=float,
            help="Replace a worker whose event loop is stuck this long (its sessions are "
            "lost); 0 off [60].",
        ),
        click.option(
            "--max-worker-memory",
            type=int,
            help="MiB of RSS after which a worker drains and is replaced; 0 off [0].",
        ),
        click.option("--header-timeout", type=float, help="Seconds to send request headers [10]."),
        click.option("--body-timeout", type=float, help="Seconds to send a request body [30]."),
        click.option(
            "--keepalive-timeout",
            type=float,
            help="Seconds an idle HTTP keep-alive connection is kept [15].",
        ),
        # Read from the environment only: `stadium serve` refuses it on the command line,
        # where every local user can read it (/proc/PID/cmdline).
        click.option("--auth-token", envvar="STADIUM_AUTH_TOKEN", hidden=True),
        click.option(
            "--auth-token-file",
            type=click.Path(dir_okay=False),
            help="Read the bearer token clients must send from this file's first line "
            "[env STADIUM_AUTH_TOKEN; none].",
        ),
        click.option(
            "--tenants",
            type=click.Path(dir_okay=False),
            help="A TOML or YAML file of tenants: their token hashes or token files, "
            "weights in the fair share of sessions, quotas and rate limits over the node "
            "(docs/TENANTS.md); SIGHUP reloads it [none].",
        ),
        click.option(
            "--allow-origin",
            "allowed_origins",
            multiple=True,
            help="Browser Origin allowed to open sessions (repeatable; '*' any) [same host].",
        ),
        click.option(
            "--max-sessions-per-client",
            type=int,
            help="Concurrent sessions per client address; 0 off [0].",
        ),
        click.option(
            "--rate-limit", type=float, help="Requests per second per client address; 0 off [0]."
        ),
        click.option("--rate-burst", type=int, help="Burst above --rate-limit [100]."),
        click.option(
            "--tls-cert", type=click.Path(dir_okay=False), help="PEM certificate: serve TLS."
        ),
        click.option("--tls-key", type=click.Path(dir_okay=False), help="PEM private key."),
        click.option(
            "--debug-errors",
            is_flag=True,
            default=None,
            help="Full exception text (paths) in error replies; log every env traceback.",
        ),
        click.option(
            "--durable",
            is_flag=True,
            default=None,
            help="Snapshot sessions to --session-store after each reply; a session whose "
            "worker or node dies is restored when its client resumes.",
        ),
        click.option(
            "--session-store",
            metavar="DIR",
            help="Where --durable writes sessions: a directory only the server's user can "
            "write (shared between nodes on a cluster) [a private one, made at start].",
        ),
        click.option(
            "--session-store-key",
            metavar="FILE",
            type=click.Path(dir_okay=False),
            help="Key file (0600, >= 32 bytes) signing --session-store records, for a store "
            "other servers or nodes read too [a key made at start, in memory only].",
        ),
        click.option(
            "--isolation",
            type=click.Choice(["none", "process", "sandbox"]),
            envvar="STADIUM_ISOLATION",
            help="Each session's env in the worker (none), in its own process (process), or "
            "in its own sandboxed process (sandbox: namespaces, unprivileged uid, cgroup "
            "limits, no network) [the env's `isolation` attribute, else none].",
        ),
        click.option(
            "--warm-pool",
            type=int,
            help="Isolated env processes each worker forks ahead, envs built [0].",
        ),
        click.option(
            "--sandbox-memory", type=int, help="MiB of memory per sandboxed session [1024]."
        ),
        click.option("--sandbox-cpus", type=float, help="CPU cores per sandboxed session [1]."),
        click.option("--sandbox-pids", type=int, help="Processes per sandboxed session [128]."),
        click.option(
            "--sandbox-disk", type=int, help="MiB of work directory per sandboxed session [256]."
        ),
        click.option(
            "--image",
            metavar="REF",
            help="With --isolation sandbox: the task image every session runs in (its / is "
            "the image, private copy-on-write on top; commands come from the image): "
            "dir:/rootfs, localhost/name:tag, oci:DIR; build: the env directory's "
            "Dockerfile, built with Podman (build:BASE: FROM a local BASE) [none].",
        ),
        click.option(
            "--images",
            metavar="PATTERN|FILE",
            help="Images a reset may choose (options={'image': REF}): comma-separated "
            "patterns (localhost/swe-*) or a file of REFs, one a line [only --image].",
        ),
        click.option(
            "--episode-timeout",
            type=float,
            metavar="SECONDS",
            help="Isolated sessions: seconds from a reset until the episode ends; past it "
            "the env's process is killed [openenv.yaml resources.episode_timeout_s, else none].",
        ),
        click.option(
            "--sandbox-network",
            type=click.Choice(["none", "allowlist", "public"]),
            help="Sandboxed sessions' network: none, allowlist (only --sandbox-allow hosts) "
            "or public (any address but the host's own) [openenv.yaml network, else none].",
        ),
        click.option(
            "--sandbox-allow",
            multiple=True,
            metavar="HOST",
            help="A host (name, address or CIDR range) sandboxed sessions may reach "
            "(repeat it; implies --sandbox-network allowlist).",
        ),
        click.option(
            "--sandbox-seccomp",
            type=click.Choice(["on", "off"]),
            help="The seccomp filter of sandboxed sessions (off: none; on needs libseccomp) [on].",
        ),
        click.option(
            "--sandbox-output",
            type=click.Choice(["log", "drop"]),
            help="What isolated env processes print: log (the server's log, bounded, tagged "
            "with the session) or drop [log].",
        ),
        click.option(
            "--untrusted-env-code",
            is_flag=True,
            default=None,
            envvar="STADIUM_UNTRUSTED_ENV_CODE",
            help="The env's code is third-party (with --isolation sandbox): imported only "
            "inside each session's sandbox, never by the server or its template; each "
            "session pays the import [env STADIUM_UNTRUSTED_ENV_CODE; off].",
        ),
        click.option(
            "--preload",
            multiple=True,
            metavar="MODULES",
            help="With --untrusted-env-code: operator-trusted modules (comma-separated or "
            "repeated, e.g. numpy) the template imports once for every session.",
        ),
        click.option(
            "--sandbox-reply-mib",
            type=int,
            help="Isolated sessions: MiB one reply of an env process may take in the worker, "
            "as a frame and decoded; over it: ENV_PROTOCOL [64].",
        ),
        click.option(
            "--image-cache-mib",
            type=int,
            help="MiB the node's image cache (STADIUM_IMAGE_CACHE_DIR, default "
            "/var/lib/stadium/images) may take; past it, the least recently used images no "
            "session uses are evicted (0: no budget) [0].",
        ),
        click.option(
            "--record",
            metavar="DIR",
            help="Write every episode (env, seed, options, actions, observations, rewards, "
            "errors, timings, cost) to DIR as Parquet shards (docs/RECORDING.md) [off].",
        ),
        click.option(
            "--record-sample",
            type=float,
            metavar="FRACTION",
            help="With --record: the fraction of episodes recorded, chosen at reset [1].",
        ),
        click.option(
            "--record-filter",
            metavar="EXPR",
            help="With --record: write only episodes matching EXPR, e.g. 'reward>0.9', "
            "'error', 'steps>=100 and not truncated' (docs/RECORDING.md) [all].",
        ),
        click.option(
            "--record-redact",
            metavar="MODULE:FUNCTION",
            help="With --record: a function given each episode's record (a dict) that "
            "returns it redacted, or None to store nothing.",
        ),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn

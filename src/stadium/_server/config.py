"""Server configuration: one validated dataclass, fed by options, env vars or code.

:class:`ServerConfig` is the one home of every ``stadium serve`` setting: each field that
the command line sets carries a :class:`Flag` in its metadata (the option's help, name,
env var, choices), from which ``stadium._cli`` builds the option and its help, the
default shown from the field's own. This module imports no click.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

from stadium._errors import ConfigError

DEFAULT_MAX_SESSIONS = 8192
DEFAULT_DETACHED_IDLE_TIMEOUT = 300.0
"""Seconds an HTTP MCP session (no live connection) may sit unused before it is closed,
unless ``--idle-timeout`` is given."""

FLAG = "stadium.flag"
"""The key of a field's :class:`Flag` in its ``dataclasses.Field.metadata``."""


@dataclasses.dataclass(frozen=True, slots=True)
class Flag:
    """How ``stadium serve`` takes a :class:`ServerConfig` field (the field's metadata).

    Attributes:
        help: what the option does, without its default (:func:`help_text` adds it).
        flag: the option's name; ``""``: ``--`` and the field's name with dashes.
        env: the environment variable read when the option is not given.
        choices: the values it takes (also checked by :class:`ServerConfig`).
        metavar: the value's name in the help; ``""``: click's (from the type).
        path: the value is a file's path (click checks it is not a directory).
        hidden: left out of ``--help``.
        means: what the default means (for ``None`` or empty: all that is shown).
        show: how the default is shown; ``None``: as a number, a word or on/off.
    """

    help: str
    flag: str = ""
    env: str = ""
    choices: tuple[str, ...] = ()
    metavar: str = ""
    path: bool = False
    hidden: bool = False
    means: str = ""
    show: Callable[[Any], str] | None = None


def _flag(
    default: Any,
    text: str,
    *,
    repr: bool = True,
    **flag: Any,
) -> Any:
    """A field that ``stadium serve`` sets: ``dataclasses.field`` with a :class:`Flag`."""
    return dataclasses.field(default=default, repr=repr, metadata={FLAG: Flag(text, **flag)})


def _mib(value: int) -> str:
    return f"{value} ({value / (1 << 20):g} MiB)"


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
    host: str = _flag("127.0.0.1", "Address to bind", env="HOST")
    port: int = _flag(8000, "Port; 0 picks one", env="PORT")
    workers: int = _flag(1, "Worker processes", env="WORKERS")
    max_sessions: int = _flag(
        DEFAULT_MAX_SESSIONS, "Concurrent sessions, server-wide", env="MAX_CONCURRENT_ENVS"
    )
    admission_timeout: float = _flag(5.0, "Seconds to wait for a free slot")
    max_waiting_per_connection: int = _flag(
        4096, "Sessions one connection may have waiting for a slot; 0 no bound"
    )
    max_waiting_per_client: int = _flag(
        16384, "Sessions one client address may have waiting for a slot; 0 no bound"
    )
    idle_timeout: float | None = _flag(
        None,
        "Close sessions idle this long, connected ones too; 0 off",
        means=f"connected: never; HTTP MCP sessions: {DEFAULT_DETACHED_IDLE_TIMEOUT:g}",
    )
    max_message_bytes: int = _flag(10 * 1024 * 1024, "Largest message accepted", show=_mib)
    drain_timeout: float = _flag(30.0, "Seconds to finish in-flight work on SIGTERM")
    resume_grace: float = _flag(
        60.0, "Seconds a lost session waits for its client to resume it; 0 off"
    )
    ping_interval: float = _flag(20.0, "Keepalive ping when idle this long; 0 off")
    ping_timeout: float = _flag(20.0, "Drop a peer that does not pong in time")
    executor_threads: int = _flag(
        0, "Most threads for blocking sync env calls; 0: one per session, at most 4096"
    )
    restart_max_delay: float = _flag(
        30.0, "Longest wait before restarting a worker that keeps crashing"
    )
    env_kwargs: dict[str, Any] = dataclasses.field(
        default_factory=dict,
        metadata={FLAG: Flag("JSON object of constructor arguments for the env", means="none")},
    )
    log_level: str = _flag("info", "Logging level", choices=("debug", "info", "warning", "error"))
    log_format: str = _flag(
        "text",
        "Log lines as text, or as one JSON object per line (time, level, logger, message, "
        "pid, session)",
        choices=("text", "json"),
    )
    """``text`` or ``json`` (one JSON object per line; ``server._setup_logging``)."""
    # Envs that misbehave.
    step_timeout: float = _flag(
        0.0,
        "Seconds an env call may run before it is answered TIMEOUT and its session closed; 0 off",
    )
    stall_limit: float = _flag(
        60.0,
        "Replace a worker whose event loop is stuck this long (its sessions are lost); 0 off",
    )
    max_worker_memory: int = _flag(
        0, "MiB of RSS after which a worker drains and is replaced; 0 off"
    )
    # Sockets.
    header_timeout: float = _flag(10.0, "Seconds to send request headers")
    body_timeout: float = _flag(30.0, "Seconds to send a request body")
    keepalive_timeout: float = _flag(15.0, "Seconds an idle HTTP keep-alive connection is kept")
    # Access control. The token is read from the environment only: `stadium serve` refuses it
    # on the command line, where every local user can read it (/proc/PID/cmdline).
    auth_token: str | None = _flag(None, "", env="STADIUM_AUTH_TOKEN", hidden=True, repr=False)
    tenants: str | None = _flag(
        None,
        "A TOML or YAML file of tenants: their token hashes or token files, weights in the "
        "fair share of sessions, quotas and rate limits over the node (docs/TENANTS.md); "
        "SIGHUP reloads it",
        path=True,
        means="none",
    )
    """``--tenants FILE``: the tenants and their tokens (``tenants``)."""
    allowed_origins: tuple[str, ...] = _flag(
        (),
        "Browser Origin allowed to open sessions (repeatable; '*' any)",
        flag="--allow-origin",
        means="same host",
    )
    max_sessions_per_client: int = _flag(0, "Concurrent sessions per client address; 0 off")
    rate_limit: float = _flag(0.0, "Requests per second per client address; 0 off")
    rate_burst: int = _flag(100, "Burst above --rate-limit")
    tls_cert: str | None = _flag(None, "PEM certificate: serve TLS", path=True, means="none")
    tls_key: str | None = _flag(None, "PEM private key", path=True, means="none")
    debug_errors: bool = _flag(
        False, "Full exception text (paths) in error replies; log every env traceback"
    )
    durable: bool = _flag(
        False,
        "Snapshot sessions to --session-store after each reply; a session whose worker or "
        "node dies is restored when its client resumes",
    )
    session_store: str = _flag(
        "",
        "Where --durable writes sessions: a directory only the server's user can write "
        "(shared between nodes on a cluster)",
        metavar="DIR",
        means="a private one, made at start",
    )
    """``""``: :func:`default_session_store`, looked up only with ``durable``."""
    session_store_key: str = _flag(
        "",
        "Key file (0600, >= 32 bytes) signing --session-store records, for a store other "
        "servers or nodes read too",
        metavar="FILE",
        path=True,
        means="a key made at start, in memory only",
    )
    """``""``: a key of the server's own (``durable.process_key``)."""
    # Isolated sessions.
    isolation: str | None = _flag(
        None,
        "Each session's env in the worker (none), in its own process (process), or in its "
        "own sandboxed process (sandbox: namespaces, unprivileged uid, cgroup limits, no "
        "network), or in a microVM of its own (vm: its own guest kernel)",
        choices=("none", "process", "sandbox", "vm"),
        env="STADIUM_ISOLATION",
        means="the env's `isolation` attribute, else none",
    )
    warm_pool: int = _flag(0, "Isolated env processes each worker forks ahead, envs built")
    sandbox_memory: int = _flag(1024, "MiB of memory per sandboxed session")
    sandbox_cpus: float = _flag(1.0, "CPU cores per sandboxed session")
    sandbox_pids: int = _flag(128, "Processes per sandboxed session")
    sandbox_disk: int = _flag(256, "MiB of work directory per sandboxed session")
    episode_timeout: float = _flag(
        0.0,
        "Isolated sessions: seconds from a reset until the episode ends; past it the env's "
        "process is killed",
        metavar="SECONDS",
        means="openenv.yaml resources.episode_timeout_s, else none",
    )
    sandbox_network: str | None = _flag(
        None,
        "Sandboxed sessions' network: none, allowlist (only --sandbox-allow hosts) or public "
        "(any address but the host's own)",
        choices=("none", "allowlist", "public"),
        means="openenv.yaml network, else none",
    )
    sandbox_allow: tuple[str, ...] = _flag(
        (),
        "A host (name, address or CIDR range) sandboxed sessions may reach (repeat it; "
        "implies --sandbox-network allowlist)",
        metavar="HOST",
        means="none",
    )
    sandbox_seccomp: str = _flag(
        "on",
        "The seccomp filter of sandboxed sessions (off: none; on needs libseccomp)",
        choices=("on", "off"),
    )
    sandbox_output: str = _flag(
        "log",
        "What isolated env processes print: log (the server's log, bounded, tagged with the "
        "session) or drop",
        choices=("log", "drop"),
    )
    untrusted_env_code: bool = _flag(
        False,
        "The env's code is third-party (with --isolation sandbox): imported only inside each "
        "session's sandbox, never by the server or its template; each session pays the import",
        env="STADIUM_UNTRUSTED_ENV_CODE",
    )
    preload: tuple[str, ...] = _flag(
        (),
        "With --untrusted-env-code: operator-trusted modules (comma-separated or repeated, "
        "e.g. numpy) the template imports once for every session",
        metavar="MODULES",
        means="none",
    )
    sandbox_reply_mib: int = _flag(
        64,
        "Isolated sessions: MiB one reply of an env process may take in the worker, as a "
        "frame and decoded; over it: ENV_PROTOCOL",
    )
    image: str | None = _flag(
        None,
        "With --isolation sandbox: the task image every session runs in (its / is the image, "
        "private copy-on-write on top; commands come from the image): dir:/rootfs, "
        "localhost/name:tag, oci:DIR; build: the env directory's Dockerfile, built with "
        "Podman (build:BASE: FROM a local BASE)",
        metavar="REF",
        means="none",
    )
    images: str | None = _flag(
        None,
        "Images a reset may choose (options={'image': REF}): comma-separated patterns "
        "(localhost/swe-*) or a file of REFs, one a line",
        metavar="PATTERN|FILE",
        means="only --image",
    )
    image_cache_mib: int = _flag(
        0,
        "MiB the node's image cache (STADIUM_IMAGE_CACHE_DIR, default /var/lib/stadium/images) "
        "may take; past it, the least recently used images no session uses are evicted "
        "(0: no budget)",
    )
    action_model: str | None = _flag(
        None,
        "The pydantic action model of an OpenEnv env class or app (for envs that give it "
        "only to create_app)",
        metavar="MODULE:CLASS",
        means="the one the env declares",
    )
    record: str = _flag(
        "",
        "Write every episode (env, seed, options, actions, observations, rewards, errors, "
        "timings, cost) to DIR as Parquet shards (docs/RECORDING.md)",
        metavar="DIR",
        means="off",
    )
    record_sample: float = _flag(
        1.0,
        "With --record: the fraction of episodes recorded, chosen at reset",
        metavar="FRACTION",
    )
    record_filter: str = _flag(
        "",
        "With --record: write only episodes matching EXPR, e.g. 'reward>0.9', 'error', "
        "'steps>=100 and not truncated' (docs/RECORDING.md)",
        metavar="EXPR",
        means="all",
    )
    record_redact: str = _flag(
        "",
        "With --record: a function given each episode's record (a dict) that returns it "
        "redacted, or None to store nothing",
        metavar="MODULE:FUNCTION",
        means="none",
    )
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
        _check(self.step_timeout >= 0, "--step-timeout must be >= 0 (0 disables it)")
        for f, flag in flags():  # --log-level, --isolation, --sandbox-network, ...
            value = getattr(self, f.name)
            unset = value is None and f.default is None  # the env's or openenv.yaml's say
            if flag.choices and value not in flag.choices and not unset:
                raise ConfigError(
                    f"{option_name(f)} must be {', '.join(flag.choices[:-1])} or "
                    f"{flag.choices[-1]}",
                    value=value,
                )
        _check(
            self.episode_timeout >= 0,
            "--episode-timeout must be >= 0 seconds (0: none)",
            value=self.episode_timeout,
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
        if "preload" in kwargs:
            kwargs["preload"] = [
                name.strip() for item in kwargs["preload"] for name in item.split(",") if name
            ]
        for name in ("allowed_origins", "sandbox_allow", "preload"):  # repeatable: () not given
            if name in kwargs:
                kwargs[name] = tuple(kwargs[name])
                if not kwargs[name]:
                    del kwargs[name]
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
        raise ConfigError(
            f"cannot read --auth-token-file {path}: {exc.strerror}", path=path
        ) from None
    if not token:
        raise ConfigError("--auth-token-file is empty", path=path)
    return token


def _check(ok: bool, message: str, **context: Any) -> None:
    if not ok:
        raise ConfigError(message, **context)


def flags() -> Iterator[tuple[dataclasses.Field[Any], Flag]]:
    """Each field ``stadium serve`` sets, with its :class:`Flag`, in the fields' order."""
    for f in dataclasses.fields(ServerConfig):
        flag = f.metadata.get(FLAG)
        if isinstance(flag, Flag):
            yield f, flag


def option_name(f: dataclasses.Field[Any]) -> str:
    """The option that sets ``f``: its :class:`Flag`'s ``flag``, else ``--field-name``."""
    flag: Flag = f.metadata[FLAG]
    return flag.flag or "--" + f.name.replace("_", "-")


def field_default(f: dataclasses.Field[Any]) -> Any:
    """The default of ``f`` (its factory's value for a mutable one)."""
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def shown_default(f: dataclasses.Field[Any]) -> str:
    """The default of ``f`` as ``--help`` shows it, in brackets: ``[env PORT; 8000]``;
    an empty or ``None`` default by what it means (``[none]``, ``[same host]``)."""
    flag: Flag = f.metadata[FLAG]
    default = field_default(f)
    if flag.show is not None:
        value = flag.show(default)
    elif isinstance(default, bool):
        value = "on" if default else "off"
    elif default is None or default in ("", (), {}):
        value = ""
    elif isinstance(default, float):
        value = f"{default:g}"
    else:
        value = str(default)
    said = ": ".join(part for part in (value, flag.means) if part)
    return f"[env {flag.env}; {said}]" if flag.env else f"[{said}]"


def help_text(f: dataclasses.Field[Any]) -> str:
    """The option's help line: its :class:`Flag`'s text and :func:`shown_default`."""
    return f"{f.metadata[FLAG].help} {shown_default(f)}."

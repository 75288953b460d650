"""One worker's serving parts, built once from a configuration, for every transport.

``stadium serve`` (picows) and the ASGI app both serve through a :class:`Worker`:
the target loaded, its class compiled to an :class:`~stadium._env.spec.EnvSpec`, the
:class:`~stadium._server.runtime.Runtime` (admission, env calls, idle reaping) and the
:class:`~stadium._server.http.endpoints.HttpEndpoints`. Transports add only the bytes.

With ``--isolation sandbox --untrusted-env-code`` nothing of the env is imported here: the
spec is built from the description a sandboxed process gave
(:mod:`stadium._server.isolation.remote`: :func:`untrusted_spec`), asked once by the
supervisor before it binds (inherited by forked workers) or by an in-process server when
it is built; ``openenv.yaml`` is found by looking and read as data.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import Callable
from typing import Any

import msgspec

from stadium._core.limits import ClientLimits
from stadium._env.contract import Environment
from stadium._env.snapshot import why_not_durable
from stadium._env.spec import CallMode, EnvSpec
from stadium._errors import ConfigError
from stadium._server.admission.fair import FairAdmission
from stadium._server.admission.slots import Admission, LocalSlots, Slots
from stadium._server.admission.tenants import TenantDirectory
from stadium._server.config import ServerConfig, default_session_store
from stadium._server.durability.records import Durable, read_key_file
from stadium._server.durability.session_store import store_from_url, why_not_private
from stadium._server.http.endpoints import HttpEndpoints
from stadium._server.http.openenv_routes import OpenEnvRoutes
from stadium._server.http.recordings import RecordingsRoutes
from stadium._server.images.build import build_image, build_spec
from stadium._server.isolation import (
    MODES,
    Isolation,
    IsolationConfig,
    isolated_spec,
    sandbox_unavailable,
)
from stadium._server.isolation.remote import Description, remote_spec
from stadium._server.isolation.template.seccomp import seccomp_unavailable
from stadium._server.isolation.wire import WireLimits
from stadium._server.isolation.worker.describe import describe_remote
from stadium._server.isolation.worker.manifest import (
    Manifest,
    find_manifest,
    limits_for,
    manifest_warning,
    read_manifest,
)
from stadium._server.isolation.worker.vm import VmIsolation, vm_unavailable
from stadium._server.ledger import RecordConfig
from stadium._server.ledger.record import load_redactor
from stadium._server.loader import add_to_path, load_target, target_files
from stadium._server.metrics import MetricsBoard
from stadium._server.processes.watchdog import Watchdog
from stadium._server.runtime import Runtime
from stadium._server.thread_pool import auto_limit

#: Each isolated call's limit when --step-timeout is 0 (an isolated env is always bounded).
DEFAULT_CALL_TIMEOUT_S = 300.0


def _durable(config: ServerConfig, spec: EnvSpec) -> Durable:
    """The session store of ``--durable``, once a probe env showed it can be snapshotted.

    Raises:
        ConfigError: the env cannot be durable (the message says why), or the store
            cannot be opened.
    """
    if spec.env_cls not in _PROBED:  # (the server probed it at start, before forking us)
        probe_durable(config, spec)
    return _store(config)


_PROBED: set[type[Any]] = set()


def probe_durable(config: ServerConfig, spec: EnvSpec) -> None:
    """Make one env of ``spec`` and check it can be snapshotted (``--durable``, in process):
    at start, before the server says it serves, and in each worker.

    Raises:
        ConfigError: it cannot be made or snapshotted (the message says why and what to do).
    """
    try:
        env = spec.factory(**config.env_kwargs)
    except Exception as exc:  # the server would fail to create sessions just the same
        raise ConfigError(f"--durable: creating a probe {spec.name} env failed: {exc!r}") from exc
    try:
        why = why_not_durable(env)
    finally:
        if spec.has_close and spec.close_mode is not CallMode.TASK:
            env.close()
    if why is not None:
        raise ConfigError(
            f"--durable: {spec.name} sessions cannot be made durable: {why}; implement "
            "snapshot() and restore() on the env, or serve it without --durable"
        )
    _PROBED.add(spec.env_cls)


def _store(config: ServerConfig) -> Durable:
    """The session store of ``--durable`` (``--session-store``, ``--session-store-key``)."""
    key = read_key_file(config.session_store_key) if config.session_store_key else None
    return Durable(store_from_url(config.session_store or default_session_store()), key)


def _name(env_cls: type[Any] | None) -> str:
    return str(getattr(env_cls, "name", None) or getattr(env_cls, "__name__", "the env"))


def record_config(config: ServerConfig, *, check: bool = False) -> RecordConfig | None:
    """``--record`` and its companions, or ``None`` (no recording); ``check``: import the
    ``--record-redact`` function and pyarrow too (ConfigError if they cannot be)."""
    if not config.record:
        return None
    record = RecordConfig(
        config.record, config.record_sample, config.record_filter, config.record_redact
    )
    if check:
        private_record_dir(record.directory)
        load_redactor(record.redact)
        try:  # here, before the workers fork: they share its pages
            import pyarrow.parquet  # noqa: F401
        except ImportError as exc:
            raise ConfigError(f"--record needs pyarrow ({exc}): pip install pyarrow") from None
    return record


def private_record_dir(path: str) -> None:
    """Make ``--record``'s directory (``0700``) if missing, and refuse one another user
    could write: shards are written under predictable names there (a planted link would
    be followed by the server's writer, and a planted shard read by ``stadium replay`` and
    ``/web``), as the session store's directory is refused (docs/SECURITY.md).

    Raises:
        ConfigError: it cannot be made, or is not private to the server's user.
    """
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        why = why_not_private(path)
    except OSError as exc:
        raise ConfigError(
            f"--record {path!r} is not usable: {exc.strerror or exc}", path=path
        ) from None
    if why is not None:
        raise ConfigError(
            f"--record {path!r} {why}: another user could plant files where the shards are "
            "written; give a directory owned by the server's user that only it can write "
            "(chmod 700), or a new path (made 0700)",
            path=path,
        )


def isolation_mode(config: ServerConfig, env_cls: type[Any] | None) -> str:
    """``--isolation``, else the env class's ``isolation`` attribute, else ``none``.

    Raises:
        ConfigError: an unknown mode.
    """
    mode = config.isolation or getattr(env_cls, "isolation", None) or "none"
    if mode not in MODES:
        raise ConfigError(
            f"{_name(env_cls)}.isolation is {mode!r}: use 'none', 'process', 'sandbox' or 'vm'",
            value=mode,
        )
    return str(mode)


def manifest_of(config: ServerConfig) -> Manifest | None:
    """The limits the served target's ``openenv.yaml`` declares (``None``: it has none).

    Raises:
        ConfigError: the manifest is malformed (names the field).
    """
    target = config.target
    if config.untrusted_env_code:  # its module is not imported here: found by looking
        _module, sep, attr = target.rpartition(":")
        _folders, file = target_files(target) if sep or os.path.isdir(target) else ([], None)
        if file is not None and not os.path.isdir(target):
            target = f"{file}:{attr}"
    path = find_manifest(target)
    return read_manifest(path) if path is not None else None


def startup_warnings(config: ServerConfig, env_cls: type[Any] | None) -> list[str]:
    """What ``stadium serve`` (and ``stadium check``) warn of before serving: an
    ``openenv.yaml`` declaring limits the isolation level does not enforce."""
    manifest = manifest_of(config)
    if manifest is None:
        return []
    warning = manifest_warning(manifest, isolation_mode(config, env_cls))
    return [warning] if warning else []


def isolation_config(config: ServerConfig, env_cls: type[Any] | None) -> IsolationConfig | None:
    """How sessions are isolated: ``--isolation`` (or the env class's ``isolation``
    attribute) with its limits; ``None`` when sessions' envs live in the worker.
    Checked before the server binds (``run_server``) and in each worker.

    Raises:
        ConfigError: an unknown mode, ``sandbox`` where it cannot run (says why), a
            malformed ``openenv.yaml``, or a setting the mode cannot enforce.
    """
    mode = isolation_mode(config, env_cls)
    if mode != "sandbox" and (config.sandbox_network or config.sandbox_allow):
        raise ConfigError(
            f"--sandbox-network and --sandbox-allow are for --isolation sandbox (this "
            f"server isolates with {mode!r}: its sessions' network is not restricted)"
        )
    if (config.image or config.images) and mode != "sandbox":
        raise ConfigError(
            f"--image and --images need --isolation sandbox (this server isolates with "
            f"{mode!r}; a session's image is the root of its sandbox)"
        )
    if mode == "none":
        if config.episode_timeout:
            raise ConfigError(
                "--episode-timeout needs --isolation process or sandbox (the env's own "
                "process is what is stopped when an episode runs out of time)"
            )
        return None
    if mode == "sandbox":
        why = sandbox_unavailable()
        if why is not None:
            asked = (
                ""
                if config.isolation
                else f" ({_name(env_cls)} asks for it; --isolation process or none overrides that)"
            )
            raise ConfigError(f"--isolation sandbox cannot run here: {why}{asked}")
        if config.sandbox_seccomp == "on" and (why := seccomp_unavailable()) is not None:
            raise ConfigError(f"--isolation sandbox will not start without its filter: {why}")
    if mode == "vm" and (why := vm_unavailable()) is not None:
        raise ConfigError(f"--isolation vm cannot run here: {why}")
    target = config.target
    module, sep, attr = target.rpartition(":")
    if sep and (module.endswith(".py") or "/" in module):  # a file: absolute for the template
        target = f"{os.path.abspath(module)}:{attr}"
    elif not sep and "/" in target and os.path.isdir(target):  # an env directory: absolute too
        target = os.path.abspath(target)
    untrusted = config.untrusted_env_code
    if untrusted:
        if config.sandbox_seccomp != "on":
            raise ConfigError(
                "--untrusted-env-code needs the seccomp filter: drop --sandbox-seccomp off "
                "(the env's import-time code would run unfiltered)"
            )
        for folder in target_files(config.target)[0]:  # bound read-only in the sandbox
            add_to_path(folder)
    limits = limits_for(config, manifest_of(config), config.step_timeout or DEFAULT_CALL_TIMEOUT_S)
    env_kwargs = dict(config.env_kwargs)
    prepare = getattr(env_cls, "prepare_kwargs", None)  # trusted env code, on the server's files
    if callable(prepare):
        env_kwargs = prepare(env_kwargs)
    image = config.image
    build, base = build_spec(image)
    if build:  # the env directory's recipe, built now (then a cache hit in each worker)
        image = build_image(config.target, base)
    return IsolationConfig(
        mode, target, env_kwargs, config.warm_pool, limits,
        seccomp=config.sandbox_seccomp == "on", output=config.sandbox_output,
        untrusted=untrusted, preload=config.preload, action_model=config.action_model,
        replies=WireLimits.of_mib(config.sandbox_reply_mib), image=image,
        images=config.images, image_cache_mib=config.image_cache_mib,
    )  # fmt: skip


def untrusted_spec(
    config: ServerConfig, described: Description | None = None
) -> tuple[ServerConfig, EnvSpec, Description]:
    """``--untrusted-env-code``: the env's spec from a sandboxed process's description
    (asked for now unless ``described`` is given), and the configuration with what it
    brings (an OpenEnv app's ``max_concurrent_envs``). Nothing of the env is imported.

    Raises:
        ConfigError, TargetError: see :func:`isolation_config` and
            :func:`~stadium._server.isolation.worker.describe.describe_remote`.
    """
    settings = isolation_config(config, None)
    assert settings is not None  # --untrusted-env-code goes with --isolation sandbox
    if described is None:
        described = describe_remote(settings)
        app = described.app
        limit = app.max_concurrent_envs if app is not None else None
        if app is not None and limit is not None and limit > config.max_sessions:
            # an untrusted env may lower the session limit the operator left, not raise it
            app = msgspec.structs.replace(app, max_concurrent_envs=None)
            described = msgspec.structs.replace(described, app=app)
    spec = remote_spec(described)
    return config.for_target(spec.env_cls), spec, described


def _isolation(config: ServerConfig, spec: EnvSpec) -> Isolation | None:
    """The worker's :class:`Isolation` (see :func:`isolation_config`)."""
    settings = isolation_config(config, spec.env_cls)
    if settings is not None and settings.mode == "vm":
        return VmIsolation(settings)
    return Isolation(settings) if settings is not None else None


@dataclasses.dataclass(frozen=True, slots=True)
class Worker:
    """What one worker process serves with (see the module docstring)."""

    config: ServerConfig
    spec: EnvSpec
    runtime: Runtime
    endpoints: HttpEndpoints

    @classmethod
    def build(
        cls,
        config: ServerConfig,
        env_cls: type[Environment[Any, Any, Any]] | None = None,
        *,
        slots: Slots | None = None,
        board: MetricsBoard | None = None,
        described: Description | None = None,
        tenants: TenantDirectory | None = None,
    ) -> Worker:
        """Load ``config.target`` (unless ``env_cls`` is given) and build the worker's parts.

        Args:
            config: the validated server configuration.
            env_cls: the environment class, already loaded.
            slots: the server-wide session slots (shared across forked workers);
                default: this process's own, ``config.max_sessions`` of them.
            board: where the worker publishes its metrics (shared across forked
                workers); default: a board of its own.
            described: ``--untrusted-env-code``: the env's description (the supervisor's,
                inherited); default: asked of a sandboxed process now.
            tenants: ``--tenants``, read before the fork (shared by the workers);
                default: read now from ``config.tenants`` (for this process alone).

        Raises:
            TargetError: the target cannot be loaded or breaks the env contract.
        """
        if config.untrusted_env_code:  # the env's code is imported in sandboxes only
            if env_cls is not None:
                raise ConfigError(
                    "--untrusted-env-code serves a target by name: an env class given "
                    "in-process has been imported in this process already"
                )
            config, spec, _ = untrusted_spec(config, described)
        else:
            if env_cls is None:
                env_cls = load_target(
                    config.target, env_kwargs=config.env_kwargs, action_model=config.action_model
                )
            config = config.for_target(env_cls)  # e.g. an OpenEnv app's max_concurrent_envs
            spec = EnvSpec.of(env_cls)
        isolation = _isolation(config, spec)
        if isolation is not None:
            spec = isolated_spec(spec, isolation)
        durable = None
        if config.durable and isolation is not None:
            # No probe env in the worker (its code is not to run here): each session's env
            # is snapshotted in its own process; one that cannot be ends its durability.
            isolation.durable = True
            durable = _store(config)
        elif config.durable:
            durable = _durable(config, spec)
        if tenants is None and config.tenants is not None:
            tenants = TenantDirectory.open(config.tenants, 1)
        if tenants is not None:
            admission: Admission = FairAdmission(
                slots or LocalSlots(config.max_sessions),
                config.admission_timeout,
                tenants,
                per_connection=config.max_waiting_per_connection,
                per_client=config.max_waiting_per_client,
            )
        else:
            admission = Admission(
                slots or LocalSlots(config.max_sessions),
                config.admission_timeout,
                per_connection=config.max_waiting_per_connection,
                per_client=config.max_waiting_per_client,
            )
        runtime = Runtime(
            spec,
            admission,
            executor_threads=config.executor_threads
            or auto_limit(config.max_sessions, min(32, (os.cpu_count() or 1) + 4)),
            # Isolated: each call's limit is the env process's own (it is killed past it).
            step_timeout=0.0 if isolation is not None else config.step_timeout,
            env_kwargs=config.env_kwargs,
            limits=ClientLimits.of(
                config.max_sessions_per_client, config.rate_limit, config.rate_burst
            ),
            debug_errors=config.debug_errors,
            board=board,
            resume_grace=config.resume_grace,
            durable=durable,
            record=record_config(config),
        )
        runtime.isolation = isolation
        endpoints = HttpEndpoints(runtime, workers=config.workers)
        # the recorded episodes' JSON API, then OpenEnv's web JSON API and Task API
        endpoints.openenv = RecordingsRoutes(endpoints, OpenEnvRoutes(endpoints))
        return cls(config, spec, runtime, endpoints)

    def start(self) -> None:
        """Start the worker's timers (idle reaping, metrics, the session store's sweep)
        on the running event loop."""
        self.runtime.start_reaper(
            self.config.connected_idle_timeout, self.config.detached_idle_timeout
        )
        self.runtime.start_metrics()
        if self.runtime.doors.tenants is not None:
            self.runtime.doors.tenants.start()  # picks up a reloaded --tenants
        if self.runtime.isolation is not None:
            self.runtime.isolation.start()
        durable = self.runtime.durable
        if durable is not None:
            # Records of sessions nobody resumed (their server was drained or died): gone
            # once older than any live session's could be (idle sessions are reaped).
            idle = self.config.connected_idle_timeout or 86400.0
            durable.start_sweeping(idle + self.config.resume_grace + 60.0)
        if self.runtime.ledger.recorder is not None:  # --record's writer process, ready
            self.runtime.ledger.recorder.start()

    def watch(self, on_recycle: Callable[[str], None]) -> Watchdog:
        """Start the worker's :class:`~stadium._server.processes.watchdog.Watchdog` on the
        running loop.

        For a process that owns its worker (``stadium serve``): past ``--stall-limit``
        it ends the process; past ``--max-worker-memory``, or with too many stuck
        threads, it calls ``on_recycle(reason)`` once (drain, then exit with
        :data:`~stadium._util.process.RECYCLE_EXIT_CODE`). In-process servers and the
        ASGI app do not start one: their process is not theirs to end.
        """
        config = self.config
        invoke = self.runtime.invoke
        watchdog = Watchdog(
            asyncio.get_running_loop(),
            stall_limit=config.stall_limit,
            max_memory_mib=config.max_worker_memory,
            stuck_threads=lambda: (invoke.stuck, invoke.stuck_limit),
            on_recycle=on_recycle,
        )
        watchdog.start()
        self.runtime.watchdog = watchdog
        return watchdog

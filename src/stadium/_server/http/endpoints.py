"""Plain-HTTP endpoints, shared by every transport: :class:`HttpEndpoints` answers every
request (its rate and tenant checked first; the :class:`~.responses.ExtraRoutes` before its
own routes).

Answered here: ``GET /health``, ``/metadata``, ``/metrics`` (Prometheus, ``metrics``),
``/schema``, ``/openapi.json``, ``/tenant/usage`` (``--tenants``), and ``GET /dashboard``
and ``GET /web``, the browser pages of ``stadium/web/`` (self-contained HTML; ``/web`` off
when ``ENABLE_WEB_INTERFACE`` is false). OpenEnv's stateless ``POST /reset``,
``POST /step`` and ``GET /state`` (each on a fresh environment instance, as OpenEnv does)
and ``POST /mcp`` (MCP JSON-RPC, ``mcp``) are its base's, :class:`~.env_calls.EnvCalls`. In
OpenEnv's ``production`` mode (``OPENENV_MODE=production``) ``/reset``, ``/step`` and
``/state`` are absent. Handlers take the method, path and body and return an
:class:`~.responses.HttpResponse`; transports only move bytes.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import os
from typing import Any

import msgspec

from stadium._core.access import Tenant
from stadium._core.openapi import MODE_ENV, MODES, SIMULATION, openapi
from stadium._core.protocol import PROTOCOL_VERSION
from stadium._errors import ConfigError, StadiumError
from stadium._server.admission.doorway import CALLER
from stadium._server.admission.tenants import tenant_exposition
from stadium._server.http.env_calls import EnvCalls
from stadium._server.http.mcp_sessions import McpSessions
from stadium._server.http.responses import (
    NO_EXTRA_ROUTES,
    UPGRADE_REQUIRED,
    ExtraRoutes,
    HttpResponse,
    _error,
    _json,
)
from stadium._server.images.collector import ImageStoreCollector
from stadium._server.metrics import CONTENT_TYPE_LATEST, StadiumCollector, exposition, registry_for
from stadium._server.runtime import NODE_NAME, Runtime
from stadium._util.throttle import ThrottledLog
from stadium._version import __version__
from stadium.integrations.openenv_harness import is_harness_environment

log = logging.getLogger("stadium.http")


class HttpEndpoints(EnvCalls):
    """The HTTP surface of one worker: :meth:`handle` routes every request; the GET
    endpoints that wait on no environment are answered here (:meth:`get`), those that
    call one are :class:`~.env_calls.EnvCalls`' (its base).
    """

    def __init__(self, runtime: Runtime, *, workers: int = 1, mode: str | None = None) -> None:
        self.runtime = runtime
        self.workers = workers
        spec = runtime.spec
        self._schema = msgspec.json.encode(spec.schemas())
        app = getattr(spec.env_cls, "openenv_app", None)  # an OpenEnv app's own mode
        mode = mode or (app.mode if app is not None else None)
        mode = (mode or os.environ.get(MODE_ENV) or SIMULATION).strip().lower()
        if mode not in MODES:
            raise ConfigError(
                f"{MODE_ENV}={mode!r} is not a mode: use {' or '.join(MODES)}", mode=mode
            )
        self.mode = mode
        """OpenEnv's server mode: ``simulation`` (default) or ``production`` (no
        ``/reset``, ``/step``, ``/state``); given, else the one an OpenEnv app target's
        routes were registered for, else from ``OPENENV_MODE``."""
        self.production = mode != SIMULATION
        self.harness = self.production and is_harness_environment(spec.env_cls)
        """Whether ``WS /harness`` is served: as OpenEnv 0.10, for a ``HarnessEnvironment``
        in production mode (``stadium._server.http.harness_socket``)."""
        self._openapi = msgspec.json.encode(
            openapi(
                spec, mode=mode, server_version=__version__,
                api_version=str(getattr(spec.env_cls, "api_version", "")),
            )
        )  # fmt: skip
        self.mcp_sessions = McpSessions(runtime)
        images = runtime.isolation.policy.slots() if runtime.isolation is not None else []
        self._metrics = registry_for(
            StadiumCollector(runtime.board, runtime.publish_metrics, runtime.spec.name, images)
        )
        """``GET /metrics``: the server's metrics, summed over its workers (``metrics``);
        with ``--tenants`` the per-tenant series the caller may see follow (:meth:`metrics`)."""
        if images and runtime.isolation is not None:  # the node's image store's figures
            self._metrics.register(ImageStoreCollector(runtime.isolation.images.store))
        self.web = web_enabled()
        """Whether ``GET /web`` is served (``ENABLE_WEB_INTERFACE``, OpenEnv's switch)."""
        self.openenv: ExtraRoutes = NO_EXTRA_ROUTES
        """More routes (OpenEnv's web-interface JSON endpoints and Task API:
        ``openenv_routes.OpenEnvRoutes``, set by ``Worker.build``)."""

    async def handle(
        self,
        method: str,
        path: str,
        body: bytes,
        client: str | None = None,
        tenant: Tenant | None = None,
    ) -> HttpResponse:
        """Answer any request: GET and POST endpoints, 405 otherwise, 500 on a bug.

        ``client`` is the peer's address, for the per-client limits (when on): a
        request over its client's ``--rate-limit`` is answered ``429 RATE_LIMITED``
        with ``Retry-After``; one that builds an environment (``POST /reset``,
        ``POST /step``, ``GET /state``, a stateless ``POST /mcp`` tool call) is a session
        of its client while it runs, and an MCP ``openenv/session/create`` one until it
        is closed (``doorway``): ``429 CAPACITY_REACHED`` over ``--max-sessions-per-client``.
        ``tenant``: the tenant the request's token names (``--tenants``), charged as the
        client is (its quota and rate over the node); ``GET /tenant/usage`` is its usage.
        """
        if self.runtime.limits is not None or tenant is not None:
            refused = self.over_rate(client, tenant)
            if refused is not None:
                return refused
            CALLER.set((client, tenant))  # for the routes not told (the Task API)
        if tenant is not None and path.split("?", 1)[0].rstrip("/") == TENANT_USAGE_PATH:
            return (
                self.tenant_usage(tenant)
                if method == "GET"
                else _error(405, f"{TENANT_USAGE_PATH} takes GET", "METHOD_NOT_ALLOWED")
            )
        if tenant is not None and method == "GET" and path.split("?", 1)[0] == "/metrics":
            return self.metrics(tenant)
        return await self._answer(method, path, body, client, tenant)

    def over_rate(self, client: str | None, tenant: Tenant | None = None) -> HttpResponse | None:
        """``429 RATE_LIMITED`` if ``client``'s or ``tenant``'s bucket is empty (a token
        is spent if not)."""
        err = self.runtime.doors.request(client, asyncio.get_running_loop().time(), tenant)
        return None if err is None else self._refusal(429, err)

    def tenant_usage(self, tenant: Tenant) -> HttpResponse:
        """``GET /tenant/usage``: what the caller's tenant holds and used over the node."""
        directory = self.runtime.doors.tenants
        if directory is None:
            return self.not_found(TENANT_USAGE_PATH)
        return _json(200, directory.usage(tenant))

    def metrics(self, viewer: Tenant | None = None) -> HttpResponse:
        """``GET /metrics``; with ``--tenants`` ``viewer``'s series (``tenant_exposition``)."""
        body = exposition(self._metrics)
        if self.runtime.doors.tenants is not None:
            body += tenant_exposition(self.runtime.doors.tenants, viewer)
        return HttpResponse(200, body, CONTENT_TYPE_LATEST)

    def _refusal(self, status: int, err: StadiumError) -> HttpResponse:
        """A request refused by a limit: ``err`` as JSON, with ``Retry-After`` (whole seconds)."""
        self.runtime.errors_total[str(err.code)] += 1
        retry = err.context.get("retry_after_s", 1.0)
        body = msgspec.json.encode({"detail": err.message, **err.to_wire()})
        return HttpResponse(status, body, headers=(("Retry-After", str(max(1, math.ceil(retry)))),))

    async def _answer(
        self, method: str, path: str, body: bytes, client: str | None, tenant: Tenant | None
    ) -> HttpResponse:
        extra = self.openenv.route(method, path.split("?", 1)[0].rstrip("/") or "/")
        if extra is not None:
            try:
                return await extra(body)
            except Exception as exc:
                return self._internal_error(method, path, exc)
        if method == "GET":
            if self._env_get(path.split("?", 1)[0].rstrip("/") or "/"):
                return await self.state(client, tenant)
            return self.get(path)  # (with --tenants, a page or a document: its rate spent)
        if method != "POST":
            return _error(405, f"{method} is not supported: use GET or POST", "METHOD_NOT_ALLOWED")
        try:
            return await self.post(path, body, client, tenant)
        except Exception as exc:
            return self._internal_error(method, path, exc)

    def builds_env(self, path: str) -> bool:
        """Whether GET ``path`` builds an environment, or with ``--tenants`` is a tenant's
        request (its rate spent; ``/metrics`` its view): only :meth:`handle` answers it."""
        path = path.split("?", 1)[0].rstrip("/") or "/"
        tenants = self.runtime.doors.tenants is not None
        return self._env_get(path) or (tenants and path in _TENANT_GETS)

    def _env_get(self, path: str) -> bool:
        """Whether GET ``path`` (its query and trailing slash off) builds an environment."""
        env_paths = () if self.production else HttpEndpoints.ENV_GET_PATHS
        return path in env_paths or self.openenv.async_get(path)

    def get(self, path: str) -> HttpResponse:
        """Answer a GET that waits on no environment (not :data:`ENV_GET_PATHS`); never raises."""
        try:
            return self._get(path)
        except Exception as exc:
            return self._internal_error("GET", path, exc)

    def _get(self, path: str) -> HttpResponse:
        raw = path.split("?", 1)[0]
        path = raw.rstrip("/") or "/"
        if path == "/health":
            return self.health()
        if path == "/openapi.json":
            return HttpResponse(200, self._openapi)
        if self.production and path in self.SIMULATION_PATHS:
            return self.not_found(path)
        if path == "/schema":
            return HttpResponse(200, self._schema)
        if path == "/metadata":
            return _json(200, self.metadata())
        if path == "/metrics":
            return self.metrics()
        if path in self.ENV_GET_PATHS:  # a transport bug: these wait on an environment
            return _error(500, f"GET {path} must be answered through handle()", "INTERNAL_ERROR")
        if path in self.POST_PATHS:
            return _error(405, f"{path} takes POST", "METHOD_NOT_ALLOWED")
        if path == "/ws":  # reached without an HTTP/1.1 WebSocket upgrade
            return UPGRADE_REQUIRED
        if self.openenv.web and raw in ("/", "/web"):  # OpenEnv's: its web interface, /web/
            return HttpResponse(307, b"", headers=(("Location", "/web/"),))
        if path in PAGES and (self.web or not path.startswith("/web")):
            return page(PAGES[path])
        extra = self.openenv.route("GET", path)
        if extra is not None:  # e.g. /list_environments, /web/metadata: no env to wait on
            return _error(500, f"GET {path} must be answered through handle()", "INTERNAL_ERROR")
        return self.not_found(path)

    def health(self) -> HttpResponse:
        """``/health``: 200 ``healthy`` or, while draining, 503 ``draining`` (routers stop
        placing sessions here), with the node's load for balancers: its sessions, capacity,
        waiting sessions, workers and host name."""
        rt = self.runtime
        slots = rt.admission.slots
        load = {
            "active_sessions": slots.active(),
            "max_sessions": slots.limit,
            "waiting_sessions": rt.admission.waiting,
            "workers": self.workers,
            "node": NODE_NAME,
        }
        if rt.draining:
            return _json(503, {"status": "draining", **load})
        return _json(200, {"status": "healthy", **load})

    def metadata(self) -> dict[str, Any]:
        spec = self.runtime.spec
        slots = self.runtime.admission.slots
        return {
            "name": spec.name,
            "description": spec.description,
            "version": spec.version,
            "readme_content": None,
            "author": None,
            "documentation_url": None,
            "server": "stadium",
            "server_version": __version__,
            "protocol_version": PROTOCOL_VERSION,
            "capacity": {
                "max_sessions": slots.limit,
                "active_sessions": slots.active(),
                "waiting_sessions": self.runtime.admission.waiting,
                "workers": self.workers,
            },
            "worker": {  # counters of the worker process that answered
                "pid": os.getpid(),
                "sessions_total": self.runtime.sessions_total,
                "steps_total": self.runtime.steps_total,
                "errors_total": dict(self.runtime.errors_total),
                **_misbehaving(self.runtime),
            },
        }

    def _internal_error(self, method: str, path: str, exc: Exception) -> HttpResponse:
        """``500 INTERNAL_ERROR``: a server bug (logged, throttled, with its traceback)."""
        if self.runtime.debug_errors:
            log.error("%s %s failed", method, path, exc_info=exc)
        else:
            _INTERNAL_ERRORS("%s %s failed: %r", method, path, exc, exc=exc)
        text = self.runtime.describe(exc)
        return _error(500, f"{method} {path} failed: {text}", "INTERNAL_ERROR")


TENANT_USAGE_PATH = "/tenant/usage"
"""``GET``: the usage of the tenant the request's token names (``--tenants``)."""
PAGES = {"/dashboard": "dashboard.html", "/web": "play.html", "/web/episodes": "episodes.html"}
"""The browser pages: path -> file of ``stadium/web/`` (package data)."""
_TENANT_GETS = {"/metadata", "/schema", "/openapi.json", "/metrics", TENANT_USAGE_PATH, *PAGES}
WEB_ENV = "ENABLE_WEB_INTERFACE"
_PAGE_HEADERS = (
    # Self-contained pages: nothing but this server may be fetched, framed or connected to.
    (
        "Content-Security-Policy",
        "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
        "img-src 'self' data:; connect-src 'self'; frame-ancestors 'none'; base-uri 'none'",
    ),
    ("Cache-Control", "no-cache"),
)


def web_enabled() -> bool:
    """``GET /web`` is served unless ``ENABLE_WEB_INTERFACE`` is false (``0``, ``false``,
    ``no``, ``off``): OpenEnv mounts its web UI only when the variable is true; Stadium's
    page holds no state of its own and passes the same access checks as ``/ws``, so it is on
    by default."""
    value = os.environ.get(WEB_ENV, "").strip().lower()
    return value not in ("0", "false", "no", "off")


@functools.cache
def page(name: str) -> HttpResponse:
    """A page of ``stadium/web/`` as ``text/html`` (read once per process)."""
    from importlib import resources

    body = resources.files("stadium").joinpath("web", name).read_bytes()
    return HttpResponse(200, body, "text/html; charset=utf-8", _PAGE_HEADERS)


def _misbehaving(rt: Runtime) -> dict[str, Any]:
    """``/metadata`` worker counters of envs that misbehave (timeouts, stuck threads, stalls)."""
    invoke = rt.invoke
    watchdog = rt.watchdog
    return {
        "timeouts_total": invoke.timeouts,
        "stuck_threads": invoke.stuck,
        "executor_threads": invoke.executor.live,
        "executor_busy": invoke.executor.busy,
        "executor_limit": invoke.executor.limit,
        "loop_stalls": watchdog.stalls if watchdog is not None else 0,
    }


_INTERNAL_ERRORS = ThrottledLog(log, logging.ERROR)

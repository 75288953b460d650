"""Plain-HTTP endpoints, shared by every transport.

``GET /health``, ``/metadata``, ``/metrics`` (Prometheus, ``metrics``), ``/schema``,
``/openapi.json``, ``/state`` and
OpenEnv's stateless ``POST /reset`` and ``POST /step`` (each on a fresh environment
instance, as OpenEnv does), and ``POST /mcp`` (MCP JSON-RPC, ``mcp``). In OpenEnv's
``production`` mode (``OPENENV_MODE=production``) ``/reset``, ``/step`` and
``/state`` are absent. ``GET /dashboard`` and ``GET /web`` serve the browser pages of
``stadium/web/`` (self-contained HTML; ``/web`` off when ``ENABLE_WEB_INTERFACE`` is
false). Handlers take the method, path and body and return an
:class:`HttpResponse`; transports only move bytes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import inspect
import logging
import math
import os
import uuid
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

import msgspec

from stadium._core import mcp as _mcp
from stadium._core.access import Tenant
from stadium._core.frames import ObservationBody
from stadium._core.openapi import MODE_ENV, MODES, SIMULATION, openapi
from stadium._core.protocol import PROTOCOL_VERSION, reset_call
from stadium._env.codecs import UNREADABLE, unreadable_detail
from stadium._env.contract import StepResult
from stadium._env.spec import CallMode
from stadium._errors import (
    CallTimeoutError,
    CapacityError,
    ConfigError,
    StadiumError,
    ValidationError,
)
from stadium._server.admission.doorway import CALLER, Door, Pass
from stadium._server.admission.tenants import tenant_exposition
from stadium._server.images.collector import ImageStoreCollector
from stadium._server.invoke import awaited
from stadium._server.metrics import CONTENT_TYPE_LATEST, StadiumCollector, exposition, registry_for
from stadium._server.runtime import CLOSE_GOING_AWAY, NODE_NAME, Runtime
from stadium._util.throttle import ThrottledLog
from stadium._version import __version__
from stadium.integrations.openenv_harness import is_harness_environment

log = logging.getLogger("stadium.http")

_JSON = "application/json"


@dataclasses.dataclass(frozen=True, slots=True)
class HttpResponse:
    status: int
    body: bytes
    content_type: str = _JSON
    headers: tuple[tuple[str, str], ...] = ()
    """Extra response headers (e.g. ``Retry-After``), beside Content-Type and -Length."""


def _json(status: int, payload: Any) -> HttpResponse:
    return HttpResponse(status, msgspec.json.encode(payload))


def error_response(status: int, message: str, code: str, **extra: Any) -> HttpResponse:
    """A JSON error body ``{"detail": message, "code": code, ...}``."""
    return _json(status, {"detail": message, "code": code, **extra})


_error = error_response

TOO_LARGE = error_response(413, "request body too large", "TOO_LARGE")
UPGRADE_REQUIRED = error_response(
    426,
    "/ws is a WebSocket endpoint: open it with an HTTP/1.1 GET carrying "
    "'Upgrade: websocket' (a WebSocket client does this)",
    "UPGRADE",
)


class ExtraRoutes(Protocol):
    """Routes answered before the endpoints' own (``openenv_http.OpenEnvRoutes``)."""

    web: bool
    """Whether ``GET /`` redirects to the web interface (``/web/``)."""

    def route(
        self, method: str, path: str
    ) -> Callable[[bytes], Awaitable[HttpResponse]] | None: ...

    def async_get(self, path: str) -> bool: ...


class _NoRoutes:
    web = False

    def route(self, method: str, path: str) -> None:
        return None

    def async_get(self, path: str) -> bool:
        return False


NO_EXTRA_ROUTES: ExtraRoutes = _NoRoutes()


class HttpEndpoints:
    """The HTTP surface of one worker.

    ``POST /reset``, ``POST /step`` and ``GET /state`` build (and close) an
    environment per request, through the runtime's ``Invoker``, and each holds a
    session slot for its duration: they count against ``--max-sessions`` with the
    WebSocket sessions, wait in the same admission queue, and are answered ``503``
    ``CAPACITY_REACHED`` (with ``Retry-After``) when no slot frees in time.
    """

    GET_PATHS = ("/health", "/metadata", "/metrics", "/schema", "/openapi.json", "/state")
    POST_PATHS = ("/reset", "/step", "/mcp")
    SIMULATION_PATHS = ("/reset", "/step", "/state")
    """Absent in OpenEnv's production mode."""
    ENV_GET_PATHS = ("/state",)
    """GET endpoints that build an environment: only :meth:`handle` (async) answers them."""

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
        ``openenv_http.OpenEnvRoutes``, set by ``Worker.build``)."""

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

    def not_found(self, path: str) -> HttpResponse:
        return _error(
            404,
            f"no endpoint {path}; try GET {', '.join(self.GET_PATHS)}, "
            f"POST {', '.join(self.POST_PATHS)} or a WebSocket at /ws",
            "NOT_FOUND",
        )

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

    async def post(
        self, path: str, body: bytes, client: str | None = None, tenant: Tenant | None = None
    ) -> HttpResponse:
        """Answer a POST: OpenEnv's stateless reset and step, MCP; ``client``: the peer."""
        path = path.split("?", 1)[0].rstrip("/")
        if path == "/mcp":
            return await self.mcp(body, client, tenant)
        if path not in self.POST_PATHS or (self.production and path in self.SIMULATION_PATHS):
            if path in self.GET_PATHS:
                return _error(405, f"{path} takes GET", "METHOD_NOT_ALLOWED")
            return self.not_found(path)
        try:
            data = msgspec.json.decode(body) if body.strip() else {}
        except UNREADABLE as exc:
            return _error(400, f"body is not valid JSON: {unreadable_detail(exc)}", "INVALID_JSON")
        if not isinstance(data, dict):
            return _error(422, "body must be a JSON object", "VALIDATION_ERROR")
        rt = self.runtime
        spec = rt.spec
        try:
            if path == "/reset":
                call = reset_call(
                    None,
                    data,
                    _new_episode_id,
                    takes_episode_id=spec.reset_takes_episode_id,
                    where="$",
                )
                reset = functools.partial(_reset, kwargs=call.reset_kwargs)
                result = await self._run(
                    spec.reset_mode, reset, what="reset", client=client, tenant=tenant
                )
            else:
                if "action" not in data:
                    raise ValidationError('body needs an "action" object', field="$.action")
                action = spec.action.convert(data["action"], "action")
                timeout_s = _timeout_s(data.get("timeout_s"))
                if timeout_s is not None and rt.step_takes_timeout_s:  # OpenEnv's env.step takes it
                    step = functools.partial(_step, action=action, timeout_s=timeout_s)
                else:
                    step = functools.partial(_step, action=action)
                result = await self._run(
                    spec.step_mode, step, limit=rt.invoke.bound(timeout_s), what="step",
                    client=client, tenant=tenant,
                )  # fmt: skip
                rt.doors.steps(tenant, 1)
        except StadiumError as exc:
            return self._stadium_error(exc)
        except Exception as exc:
            return self._env_error(path[1:], exc)
        if isinstance(result, StepResult):
            answer = ObservationBody(result.observation, result.reward, result.done)
        else:
            answer = ObservationBody(result)
        return HttpResponse(200, spec.json_encoder.encode(answer))

    async def mcp(
        self, body: bytes, client: str | None = None, tenant: Tenant | None = None
    ) -> HttpResponse:
        """Answer ``POST /mcp`` (always 200 with a JSON-RPC response, as OpenEnv does).

        ``tools/list`` / ``tools/call`` run on the OpenEnv MCP session named by
        ``params.session_id``, else on a fresh env built for the request (a
        ``tools/call`` holds a session slot, as ``POST /step`` does; a ``tools/list``
        takes none, so it is answered at capacity too, as on OpenEnv).
        ``openenv/session/create`` and ``openenv/session/close`` open and close such
        sessions (OpenEnv's ``MCPToolClient`` does so); each holds a slot while it lives,
        and counts against ``client``'s ``--max-sessions-per-client`` until closed.
        """
        req = _mcp.parse(body)
        if isinstance(req, dict):
            return _json(200, req)
        rt = self.runtime
        sessions = self.mcp_sessions
        dispatch = functools.partial(
            _mcp.dispatch, req=req, server=(rt.spec.name, rt.spec.version), describe=rt.describe
        )
        try:
            if req.method == "openenv/session/create":
                created = await sessions.create(client, tenant)
                return _json(200, _mcp.success(req.id, {"session_id": created}))
            sid = req.params.get("session_id")
            if sid is not None and not isinstance(sid, str):
                return _rpc_error(req.id, _mcp.INVALID_PARAMS, "session_id must be a string")
            owner = None if tenant is None else tenant.name
            if req.method == "openenv/session/close":
                if not isinstance(sid, str) or not await sessions.close_for(sid, owner):
                    return _rpc_error(req.id, _mcp.INVALID_PARAMS, f"Unknown session_id: {sid!r}")
                return _json(200, _mcp.success(req.id, {"session_id": sid, "closed": True}))
            if sid is not None:
                response = await sessions.run(sid, dispatch, owner)
                if response is None:
                    response = _mcp.error(
                        req.id, _mcp.INVALID_PARAMS,
                        f"Unknown session_id: {sid!r}; open one with openenv/session/create",
                    )  # fmt: skip
                return HttpResponse(200, rt.spec.json_encoder.encode(response))
            if req.method in _MCP_ENV_METHODS:  # a fresh env for the request (OpenEnv's)
                # tools/list only reads: answered at capacity too, as OpenEnv does
                listing = req.method == "tools/list"
                response = await self._run(
                    CallMode.TASK, dispatch, what="mcp", client=client, slot=not listing,
                    tenant=tenant,
                )  # fmt: skip
            else:  # initialize, ping, unknown methods: no env needed
                response = await dispatch(None)
            return HttpResponse(200, rt.spec.json_encoder.encode(response))
        except StadiumError as exc:
            if isinstance(exc, CapacityError | CallTimeoutError):
                rt.errors_total[str(exc.code)] += 1
            return _rpc_error(req.id, _mcp.SERVER_ERROR, exc.message, exc.to_wire())
        except Exception as exc:  # building or closing the env raised
            rt.env_raised("the environment raised (POST /mcp)", exc)
            rt.errors_total["EXECUTION_ERROR"] += 1
            data = {"exception": type(exc).__name__}
            return _rpc_error(req.id, _mcp.INTERNAL_ERROR, rt.describe(exc), data)

    async def state(self, client: str | None = None, tenant: Tenant | None = None) -> HttpResponse:
        """Answer ``GET /state``: a fresh env's state, built and read as its create mode says
        (on the thread pool for a blocking env, never inline on the loop)."""
        spec = self.runtime.spec
        try:
            state = await self._run(
                spec.create_mode, _state, what="state", client=client, tenant=tenant
            )
            return HttpResponse(200, spec.json_encoder.encode(state))
        except StadiumError as exc:
            return self._stadium_error(exc)
        except Exception as exc:
            return self._env_error("state", exc)

    def _stadium_error(self, exc: StadiumError) -> HttpResponse:
        body = msgspec.json.encode({"detail": exc.message, **exc.to_wire()})
        if isinstance(exc, CapacityError):
            self.runtime.errors_total[str(exc.code)] += 1
            retry = str(max(1, math.ceil(exc.retry_after_s)))
            # The client's own quota is 429 (too many of its requests); the server's 503.
            own = "max_sessions_per_client" in exc.context or "tenant" in exc.context
            status = 429 if own else 503
            return HttpResponse(status, body, headers=(("Retry-After", retry),))
        if isinstance(exc, CallTimeoutError):
            self.runtime.errors_total[str(exc.code)] += 1
            return HttpResponse(504, body)
        return HttpResponse(422 if isinstance(exc, ValidationError) else 500, body)

    def _env_error(self, op: str, exc: Exception) -> HttpResponse:
        """``500 EXECUTION_ERROR``: the environment raised (type and message, no paths)."""
        rt = self.runtime
        rt.env_raised(f"the environment's {op} raised (HTTP)", exc)
        rt.errors_total["EXECUTION_ERROR"] += 1
        return _error(
            500,
            f"{op} raised {rt.describe(exc)}",
            "EXECUTION_ERROR",
            exception=type(exc).__name__,
            operation=op,
        )

    def _internal_error(self, method: str, path: str, exc: Exception) -> HttpResponse:
        """``500 INTERNAL_ERROR``: a server bug (logged, throttled, with its traceback)."""
        if self.runtime.debug_errors:
            log.error("%s %s failed", method, path, exc_info=exc)
        else:
            _INTERNAL_ERRORS("%s %s failed: %r", method, path, exc, exc=exc)
        text = self.runtime.describe(exc)
        return _error(500, f"{method} {path} failed: {text}", "INTERNAL_ERROR")

    async def _run(
        self,
        mode: CallMode,
        call: Callable[[Any], Any],
        *,
        limit: float | None = None,
        what: str = "call",
        client: str | None = None,
        slot: bool = True,
        tenant: Tenant | None = None,
    ) -> Any:
        """``call(env)`` on a fresh env instance, run as ``mode`` says; the env is closed after.

        A session of ``client`` through the doorway (``Door.HTTP``): holds a session slot
        throughout (waiting for one as a WebSocket session does) and counts against the
        client's and tenant's quotas (no slot with ``slot=False``, as OpenEnv answers a
        stateless ``tools/list`` or a Task API call at capacity); raises
        :class:`~stadium.CapacityError` over a quota or when no slot frees in time, and
        :class:`~stadium.CallTimeoutError` (504) when creating the env or ``call``
        runs past ``limit`` seconds (``None``: ``--step-timeout``); the env is then closed
        without waiting (the abandoned call may still be running on it).
        """
        rt = self.runtime
        loop = asyncio.get_running_loop()
        doors, now = rt.doors, loop.time()
        charged = await doors.admit_waiting(Door.HTTP, client, now, tenant) if slot else None
        charged = charged or doors.enter(Door.HTTP, client, now, tenant=tenant)  # no slot
        try:
            spec = rt.spec
            try:
                env = await rt.invoke.call(loop, spec.create_mode, rt.new_env)
            except CallTimeoutError as exc:
                raise _timed_out("create", exc) from None
            timed_out = False
            try:
                result = await rt.invoke.call(loop, mode, call, env, limit=limit)
                if inspect.isawaitable(result):  # an async ``state`` (an isolated env's too),
                    # read before the env is closed, within the same limit
                    result = await rt.invoke.call(loop, CallMode.TASK, awaited, result, limit=limit)
                return result
            except CallTimeoutError as exc:
                timed_out = True
                raise _timed_out(what, exc) from None
            finally:
                if spec.has_close and timed_out:
                    rt.invoke.run(loop, spec.close_mode, env.close, (), _ignore)
                elif spec.has_close:
                    await rt.invoke.call(loop, spec.close_mode, env.close)
        finally:
            (rt.doors.release if slot else rt.doors.leave)(charged, loop.time())


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


def _rpc_error(rid: Any, code: int, message: str, data: Any = None) -> HttpResponse:
    """A ``POST /mcp`` answer carrying a JSON-RPC error (HTTP 200, as OpenEnv answers)."""
    return _json(200, _mcp.error(rid, code, message, data))


_MCP_ENV_METHODS = frozenset({"tools/list", "tools/call"})
"""The ``POST /mcp`` methods that run on an env (a fresh one without ``session_id``)."""


@dataclasses.dataclass(slots=True, eq=False)
class _McpSession:
    env: Any
    lock: asyncio.Lock
    last_used: float
    charged: Pass
    """Its slot and its creator's quota (``doorway``), given back when it closes."""
    tenant: str | None = None
    """Its creator's tenant (``--tenants``): only that tenant's tokens reach it."""


class McpSessions:
    """OpenEnv's HTTP MCP sessions (``openenv/session/create``): an env per session id,
    each holding a session slot until ``openenv/session/close`` or until unused for
    ``--idle-timeout`` seconds (300 by default: ``Runtime.detached_idle_timeout``;
    checked at each create and with each round of the worker's
    idle reaper: a client that vanished does not hold its slot). A WebSocket opened at
    ``/ws?session_id=ID`` drives the same env (``Session(attach=ID)``), as OpenEnv's
    ``MCPToolClient`` does. Per worker process.
    """

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self._sessions: dict[str, _McpSession] = {}
        self._sweeping: asyncio.Task[None] | None = None
        runtime.sweepers.append(self._sweep_soon)
        runtime.close_mcp_session = self.close_for

    def __len__(self) -> int:
        return len(self._sessions)

    def _idle(self) -> list[str]:
        limit = self.runtime.detached_idle_timeout
        if limit <= 0:
            return []
        now = asyncio.get_running_loop().time()
        attached = self.runtime.attached
        return [
            sid
            for sid, s in self._sessions.items()
            if now - s.last_used > limit and not s.lock.locked() and sid not in attached
        ]

    async def _sweep(self) -> None:
        for sid in self._idle():
            log.info(
                "MCP session %s closed (reaped): unused for more than %gs",
                sid, self.runtime.detached_idle_timeout,
            )  # fmt: skip
            await self.close(sid, outcome="reaped")

    def _sweep_soon(self) -> None:
        """The reaper's round: close the idle sessions (in a task: closing awaits the env)."""
        if self._sessions and self._sweeping is None and self._idle():
            task = self._sweeping = asyncio.get_running_loop().create_task(self._sweep())
            task.add_done_callback(self._swept)

    def _swept(self, task: asyncio.Task[None]) -> None:
        self._sweeping = None
        if not task.cancelled() and task.exception() is not None:
            log.warning("closing idle MCP sessions failed: %r", task.exception())

    async def create(self, client: str | None = None, tenant: Tenant | None = None) -> str:
        """Open a session of ``client`` (``Door.MCP_CREATE``: its quota until it closes): its
        id. Raises :class:`~stadium.CapacityError` over the quota or when no slot frees."""
        rt = self.runtime
        loop = asyncio.get_running_loop()
        now = loop.time()
        await self._sweep()
        charged = await rt.doors.admit_waiting(Door.MCP_CREATE, client, now, tenant)
        try:
            env = await rt.invoke.call(loop, rt.spec.create_mode, rt.new_env)
        except BaseException:
            rt.doors.release(charged, loop.time())
            raise
        sid = rt.doors.mcp_id()
        owner = None if tenant is None else tenant.name
        self._sessions[sid] = _McpSession(env, asyncio.Lock(), now, charged, owner)
        rt.attachable[sid] = env
        rt.attachable_tenant[sid] = owner
        return sid

    async def run(self, sid: str, call: Callable[[Any], Any], tenant: str | None = None) -> Any:
        """``await call(env)`` on session ``sid``'s env, one call at a time; ``None`` if
        there is no such session (of ``tenant``). Raises :class:`~stadium.CallTimeoutError`
        past ``--step-timeout``."""
        session = self._sessions.get(sid)
        if session is None or session.tenant != tenant:
            return None
        async with session.lock:
            loop = asyncio.get_running_loop()
            session.last_used = loop.time()  # bounded by --step-timeout, as on /ws
            return await self.runtime.invoke.call(loop, CallMode.TASK, call, session.env)

    async def close_for(self, sid: str, tenant: str | None) -> bool:
        """Close session ``sid`` if ``tenant`` made it: whether it did (another's: as none)."""
        session = self._sessions.get(sid)
        return session is not None and session.tenant == tenant and await self.close(sid)

    async def close(self, sid: str, outcome: str = "completed") -> bool:
        """Close session ``sid`` (its env closed, its slot freed, counted as ``outcome``
        in ``stadium_sessions_total``); whether it existed."""
        session = self._sessions.pop(sid, None)
        if session is None:
            return False
        rt = self.runtime
        rt.outcomes[outcome] += 1
        rt.attachable.pop(sid, None)
        rt.attachable_tenant.pop(sid, None)
        attached = rt.attached.get(sid)
        if attached is not None:  # its WebSocket goes with it
            attached.close(CLOSE_GOING_AWAY, "the MCP session was closed")
        try:
            if rt.spec.has_close:
                async with session.lock:
                    loop = asyncio.get_running_loop()
                    await rt.invoke.call(loop, rt.spec.close_mode, session.env.close)
        except Exception as exc:
            rt.env_raised("closing an MCP session's environment raised", exc)
        finally:
            rt.doors.release(session.charged, asyncio.get_running_loop().time())
        return True


def _reset(env: Any, kwargs: Mapping[str, Any]) -> Any:
    return env.reset(**kwargs)


def _step(env: Any, action: Any, timeout_s: float | None = None) -> Any:
    if timeout_s is None:
        return env.step(action)
    return env.step(action, timeout_s=timeout_s)


def _timeout_s(value: Any) -> float | None:
    """OpenEnv's ``timeout_s`` of ``POST /step``: ``None`` or seconds over 0."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < 1e9:
        raise ValidationError(
            f"timeout_s must be a number of seconds over 0, got {value!r}", field="$.timeout_s"
        )
    return float(value)


def _timed_out(what: str, exc: CallTimeoutError) -> CallTimeoutError:
    limit = exc.context.get("timeout_s")
    return CallTimeoutError(
        f"{what} ran longer than {limit:g} s (the server's --step-timeout or the request's "
        "timeout_s) and was abandoned",
        operation=what,
        timeout_s=limit,
    )


def _ignore(_token: Any, _result: Any, _error: BaseException | None) -> None:
    """The outcome of closing an env whose call was abandoned: nobody to tell."""


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


def _state(env: Any) -> Any:
    return env.state


def _new_episode_id() -> str:
    return uuid.uuid4().hex


_INTERNAL_ERRORS = ThrottledLog(log, logging.ERROR)

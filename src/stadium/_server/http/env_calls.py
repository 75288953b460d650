"""OpenEnv's HTTP requests that call an environment: the stateless ``POST /reset``,
``POST /step`` and ``GET /state`` (each on a fresh env instance, as OpenEnv does; absent in
its ``production`` mode) and ``POST /mcp`` (MCP JSON-RPC through ``_core.mcp``: on a fresh
env, or on an :class:`~.mcp_sessions.McpSessions` entry), with the catalogue of the
endpoints' paths they route by. :class:`EnvCalls` is the base of
:class:`~.endpoints.HttpEndpoints`, which routes requests here and sets what these read
(``runtime``, ``production``, ``mcp_sessions``).

What it trusts: the runtime (its spec, invoker and doors). A request's body is decoded here
with msgspec into a JSON object (else ``400 INVALID_JSON`` / ``422``), its action by the
env's codec (``VALIDATION_ERROR``), ``timeout_s`` checked (:func:`_timeout_s`); an env's
exception is answered ``500 EXECUTION_ERROR`` with its type and message, never a traceback.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import math
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import msgspec

from stadium._core import mcp as _mcp
from stadium._core.access import Tenant
from stadium._core.frames import ObservationBody
from stadium._core.protocol import reset_call
from stadium._env.codecs import UNREADABLE, unreadable_detail
from stadium._env.contract import StepResult
from stadium._env.spec import CallMode
from stadium._errors import CallTimeoutError, CapacityError, StadiumError, ValidationError
from stadium._server.admission.doorway import Door
from stadium._server.http.mcp_sessions import McpSessions
from stadium._server.http.responses import HttpResponse, _error, _json
from stadium._server.invoke import awaited
from stadium._server.runtime import Runtime


class EnvCalls:
    """The endpoints that build (and close) an environment per request, through the
    runtime's ``Invoker``: ``POST /reset``, ``POST /step`` and ``GET /state`` each hold a
    session slot for its duration: they count against ``--max-sessions`` with the
    WebSocket sessions, wait in the same admission queue, and are answered ``503``
    ``CAPACITY_REACHED`` (with ``Retry-After``) when no slot frees in time.
    """

    GET_PATHS = ("/health", "/metadata", "/metrics", "/schema", "/openapi.json", "/state")
    POST_PATHS = ("/reset", "/step", "/mcp")
    SIMULATION_PATHS = ("/reset", "/step", "/state")
    """Absent in OpenEnv's production mode."""
    ENV_GET_PATHS = ("/state",)
    """GET endpoints that build an environment: only ``HttpEndpoints.handle`` answers them."""

    # Set by HttpEndpoints.__init__ (the subclass, which routes requests to these):
    runtime: Runtime
    production: bool
    mcp_sessions: McpSessions

    def not_found(self, path: str) -> HttpResponse:
        return _error(
            404,
            f"no endpoint {path}; try GET {', '.join(self.GET_PATHS)}, "
            f"POST {', '.join(self.POST_PATHS)} or a WebSocket at /ws",
            "NOT_FOUND",
        )

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


def _rpc_error(rid: Any, code: int, message: str, data: Any = None) -> HttpResponse:
    """A ``POST /mcp`` answer carrying a JSON-RPC error (HTTP 200, as OpenEnv answers)."""
    return _json(200, _mcp.error(rid, code, message, data))


_MCP_ENV_METHODS = frozenset({"tools/list", "tools/call"})
"""The ``POST /mcp`` methods that run on an env (a fresh one without ``session_id``)."""


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


def _state(env: Any) -> Any:
    return env.state


def _new_episode_id() -> str:
    return uuid.uuid4().hex

"""OpenEnv 0.10's other HTTP routes: the web interface's JSON endpoints and the Task API.

**Web interface** (served when ``ENABLE_WEB_INTERFACE`` is true: ``1``, ``true``,
``yes``, OpenEnv's switch; not in production mode): ``POST /web/reset``, ``POST
/web/step`` (``{"action": {...}}`` or a chat env's ``{"message": "..."}``), ``GET
/web/state``, ``GET /web/metadata``; ``GET /`` and ``GET /web`` redirect to ``/web/`` (which
serves Stadium's page). An OpenEnv app built with its web interface
(``create_web_interface_app``) has them whatever the variable says. As on OpenEnv,
they drive **one** env per worker process, built at its first use, shared by every
web user and kept as long as the worker (no session slot: it is the page's env); with
``--tenants`` they answer ``403`` (that env would be shared between tenants).

**Task API** (where the env provides it: ``list_splits``, ``list_tasks``, ``num_tasks``,
``get_task``, ``get_task_range``, OpenEnv's ``TaskProvider``): ``GET
/list_environments``, ``GET /{env}/splits``, ``POST /{env}/tasks | num_tasks | task |
task_range``. Each call runs on a fresh env (no session slot; the methods are
side-effect-free discovery, as OpenEnv's contract says), closed after; the env counts in
its client's and tenant's quotas while it lives. Errors: ``404``
an unknown env name, ``501`` a method the env does not provide, ``400`` an index out of
range (``IndexError``), ``422`` a bad body.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import os
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from stadium._core.frames import ObservationBody
from stadium._core.protocol import reset_call
from stadium._env.codecs import UNREADABLE, unreadable_detail
from stadium._env.contract import StepResult
from stadium._env.spec import CallMode
from stadium._errors import StadiumError, ValidationError
from stadium._server.admission.doorway import CALLER
from stadium._server.http.endpoints import HttpEndpoints
from stadium._server.http.env_calls import _new_episode_id, _reset, _step
from stadium._server.http.responses import HttpResponse, error_response
from stadium._server.invoke import awaited

TASK_METHODS = ("list_splits", "list_tasks", "num_tasks", "get_task", "get_task_range")
_TASK_POSTS = {"tasks": "list_tasks", "num_tasks": "num_tasks", "task": "get_task",
               "task_range": "get_task_range"}  # fmt: skip


def web_api_enabled() -> bool:
    """Whether ``ENABLE_WEB_INTERFACE`` is true, as OpenEnv reads it (``1``, ``true``,
    ``yes``): then the web JSON endpoints, which drive a shared env, are served. (Stadium's
    ``GET /web`` page, which holds no state, is on unless the variable is false.)"""
    return os.environ.get("ENABLE_WEB_INTERFACE", "").strip().lower() in ("1", "true", "yes")


def provides_tasks(env_cls: type[Any]) -> bool:
    """Whether instances of ``env_cls`` (or the OpenEnv env it wraps) have a task method."""
    owner = getattr(env_cls, "openenv_class", env_cls)
    return any(callable(getattr(owner, name, None)) for name in TASK_METHODS)


def _task_owner(env: Any) -> Any:
    """Where the task methods live: the wrapped OpenEnv env of an adapter, else ``env``."""
    return env.env if hasattr(type(env), "openenv_class") else env


class OpenEnvRoutes:
    """The routes above, for one worker's :class:`HttpEndpoints`."""

    def __init__(self, endpoints: HttpEndpoints) -> None:
        self.endpoints = endpoints
        runtime = endpoints.runtime
        self.runtime = runtime
        app = getattr(runtime.spec.env_cls, "openenv_app", None)
        self.web = (web_api_enabled() or bool(getattr(app, "web", False))) and (
            not endpoints.production
        )
        """Whether the web interface's JSON endpoints (and ``/``, ``/web`` -> ``/web/``) are
        served: ``ENABLE_WEB_INTERFACE``, or an OpenEnv app that has its web interface."""
        self.env_name = str(app.env_name if app is not None else runtime.spec.name)
        self.tasks = provides_tasks(runtime.spec.env_cls)
        self._web_env: Any = None
        self._web_lock = asyncio.Lock()

    def async_get(self, path: str) -> bool:
        """Whether GET ``path`` is one of these (answered by :meth:`route`'s handler)."""
        return (self.web or self.tasks) and self.route("GET", path) is not None

    def route(self, method: str, path: str) -> Callable[[bytes], Awaitable[HttpResponse]] | None:
        """The handler of ``method path`` if it is one of these routes, else ``None``."""
        if self.web and path.startswith("/web/"):
            if path in _SHARED and self.runtime.doors.tenants is not None:
                return self._shared_refused
            if method == "POST" and path == "/web/reset":
                return self._web_reset
            if method == "POST" and path == "/web/step":
                return self._web_step
            if method == "GET" and path == "/web/state":
                return self._web_state
            if method == "GET" and path == "/web/metadata":
                return self._web_metadata
            return None
        if not self.tasks:
            return None
        if method == "GET" and path == "/list_environments":
            return self._list_environments
        head, _, tail = path[1:].partition("/")
        if not head or "/" in tail:
            return None
        if method == "GET" and tail == "splits":
            return functools.partial(self._task, head, "list_splits")
        if method == "POST" and tail in _TASK_POSTS:
            return functools.partial(self._task, head, _TASK_POSTS[tail])
        return None

    # -- the web interface ---------------------------------------------------------

    async def _shared_refused(self, body: bytes) -> HttpResponse:
        return self._error(
            403,
            "the web interface's env is one env shared by every caller: with --tenants it "
            "would be shared between tenants, so it is off; use a session of your own "
            "(WebSocket /ws, or POST /reset and /step)",
            "FORBIDDEN",
        )

    async def _web_env_ready(self) -> Any:
        if self._web_env is None:
            rt = self.runtime
            loop = asyncio.get_running_loop()
            self._web_env = await rt.invoke.call(loop, rt.spec.create_mode, rt.new_env)
        return self._web_env

    async def _web_reset(self, body: bytes) -> HttpResponse:
        data = _body(body)
        if isinstance(data, str):
            return self._error(422, data, "VALIDATION_ERROR")
        rt = self.runtime
        spec = rt.spec
        try:
            call = reset_call(
                None, data, _new_episode_id, takes_episode_id=spec.reset_takes_episode_id,
                where="$",
            )  # fmt: skip
            async with self._web_lock:
                env = await self._web_env_ready()
                reset = functools.partial(_reset, kwargs=call.reset_kwargs)
                result = await rt.invoke.call(asyncio.get_running_loop(), spec.reset_mode,
                                              reset, env)  # fmt: skip
        except Exception as exc:
            return self._failed("reset", exc)
        return self._observation(result)

    async def _web_step(self, body: bytes) -> HttpResponse:
        data = _body(body)
        if isinstance(data, str):
            return self._error(422, data, "VALIDATION_ERROR")
        rt = self.runtime
        spec = rt.spec
        raw = {"message": data["message"]} if "message" in data else data.get("action", {})
        try:
            action = spec.action.convert(raw, "action")
            async with self._web_lock:
                env = await self._web_env_ready()
                step = functools.partial(_step, action=action)
                result = await rt.invoke.call(asyncio.get_running_loop(), spec.step_mode,
                                              step, env)  # fmt: skip
        except Exception as exc:
            return self._failed("step", exc)
        return self._observation(result)

    async def _web_state(self, _body: bytes) -> HttpResponse:
        try:
            async with self._web_lock:
                env = await self._web_env_ready()
                state = env.state
                if inspect.isawaitable(state):  # an async state (an isolated env's too)
                    state = await self.runtime.invoke.call(
                        asyncio.get_running_loop(), CallMode.TASK, awaited, state
                    )
        except Exception as exc:
            return self._failed("state", exc, status=409)
        return HttpResponse(200, self.runtime.spec.json_encoder.encode(state))

    async def _web_metadata(self, _body: bytes) -> HttpResponse:
        return HttpResponse(200, msgspec.json.encode(self.endpoints.metadata()))

    # -- the Task API --------------------------------------------------------------

    async def _list_environments(self, _body: bytes) -> HttpResponse:
        return HttpResponse(200, msgspec.json.encode([self.env_name]))

    async def _task(self, name: str, method: str, body: bytes) -> HttpResponse:
        if name.lower() != self.env_name.lower():
            return self._error(404, f"unknown environment {name!r}", "NOT_FOUND")
        args: tuple[Any, ...] = ()
        if method != "list_splits":
            data = _body(body)
            if isinstance(data, str):
                return self._error(422, data, "VALIDATION_ERROR")
            try:
                args = _task_args(method, data)
            except ValidationError as exc:
                return self._error(422, exc.message, "VALIDATION_ERROR")

        async def call(env: Any) -> Any:
            fn = getattr(_task_owner(env), method, None)
            if not callable(fn):
                raise NotImplementedError
            if inspect.iscoroutinefunction(fn):
                return await fn(*args)
            result = await asyncio.to_thread(fn, *args)  # a provider may read a dataset
            return await result if inspect.isawaitable(result) else result

        try:
            client, tenant = CALLER.get()  # its env counts in their quotas while it lives
            result = await self.endpoints._run(
                CallMode.TASK, call, what=method, client=client, slot=False, tenant=tenant
            )
        except NotImplementedError:
            return self._error(501, f"{method} is not supported for this environment",
                               "NOT_IMPLEMENTED")  # fmt: skip
        except IndexError:
            return self._error(400, "Invalid task index", "INVALID_INDEX")
        except Exception as exc:
            return self._failed(method, exc)
        payload: Any
        if method == "list_splits":
            payload = [_split(s) for s in result]
        elif method == "list_tasks":
            payload = {"tasks": _plain(result), "env_name": self.env_name}
        elif method == "num_tasks":
            payload = {"num_tasks": result}
        elif method == "get_task":
            payload = {"task": _plain(result)}
        else:
            payload = {"tasks": _plain(result)}
        return HttpResponse(200, msgspec.json.encode(payload))

    # -- answers ---------------------------------------------------------------------

    def _observation(self, result: Any) -> HttpResponse:
        if isinstance(result, StepResult):
            body = ObservationBody(result.observation, result.reward, result.done)
        else:
            body = ObservationBody(result)
        return HttpResponse(200, self.runtime.spec.json_encoder.encode(body))

    def _failed(self, op: str, exc: Exception, status: int = 500) -> HttpResponse:
        if isinstance(exc, StadiumError):
            return self.endpoints._stadium_error(exc)
        if status != 500:
            return self._error(status, f"{op} raised {self.runtime.describe(exc)}", "CONFLICT")
        return self.endpoints._env_error(op, exc)

    @staticmethod
    def _error(status: int, message: str, code: str) -> HttpResponse:
        return error_response(status, message, code)


_SHARED = frozenset({"/web/reset", "/web/step", "/web/state"})
"""The web interface's routes on its one shared env (off with ``--tenants``)."""


def _body(body: bytes) -> dict[str, Any] | str:
    """The JSON object of a request body (``{}`` when empty), or what is wrong with it."""
    if not body.strip():
        return {}
    try:
        data = msgspec.json.decode(body)
    except UNREADABLE as exc:
        return f"body is not valid JSON: {unreadable_detail(exc)}"
    return data if isinstance(data, dict) else "body must be a JSON object"


def _task_args(method: str, data: dict[str, Any]) -> tuple[Any, ...]:
    """The arguments of a Task API method from its request body (OpenEnv's models)."""
    split = data.get("split")
    if not isinstance(split, str):
        raise ValidationError('"split" (a string) is required', field="$.split")
    if method == "get_task":
        index = data.get("index")
        if not isinstance(index, int) or isinstance(index, bool):
            raise ValidationError('"index" (an integer) is required', field="$.index")
        return split, index
    if method == "get_task_range":
        bounds = [data.get("start"), data.get("stop")]
        for key, value in zip(("start", "stop"), bounds, strict=True):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                raise ValidationError(f'"{key}" must be an integer or null', field=f"$.{key}")
        return split, bounds[0], bounds[1]
    return (split,)


def _split(split: Any) -> dict[str, Any]:
    """A split descriptor as OpenEnv normalizes it: ``{"name", "type", ...}``."""
    if isinstance(split, str):
        kind = split if split in ("train", "validation", "test") else "validation"
        return {"name": split, "type": kind}
    plain = _plain(split)
    return plain if isinstance(plain, dict) else {"name": str(split), "type": "validation"}


def _plain(value: Any) -> Any:
    """``value`` as JSON values (pydantic models dumped, msgspec/dataclasses converted)."""
    if value is None or isinstance(value, str | int | float | bool):
        return value
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    dump = getattr(value, "model_dump", None)
    if callable(dump):
        return dump(mode="json")
    try:
        return msgspec.to_builtins(value)
    except TypeError:
        return str(value)


__all__ = ["TASK_METHODS", "OpenEnvRoutes", "provides_tasks"]

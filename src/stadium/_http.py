"""Plain-HTTP endpoints, shared by every transport.

``GET /health``, ``/metadata``, ``/schema``, ``/state`` and OpenEnv's stateless
``POST /reset`` and ``POST /step`` (each on a fresh environment instance, as
OpenEnv does). Handlers take the method, path and body and return an
:class:`HttpResponse`; transports only move bytes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import os
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import msgspec

from stadium._env import StepResult
from stadium._errors import StadiumError, ValidationError
from stadium._protocol import PROTOCOL_VERSION, reset_call
from stadium._session import Runtime
from stadium._spec import CallMode
from stadium._version import __version__

log = logging.getLogger("stadium.http")

_JSON = "application/json"


@dataclasses.dataclass(frozen=True, slots=True)
class HttpResponse:
    status: int
    body: bytes
    content_type: str = _JSON


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


class HttpEndpoints:
    """The HTTP surface of one worker."""

    GET_PATHS = ("/health", "/metadata", "/schema", "/state")
    POST_PATHS = ("/reset", "/step")

    def __init__(self, runtime: Runtime, *, workers: int = 1) -> None:
        self.runtime = runtime
        self.workers = workers
        spec = runtime.spec
        self._schema = msgspec.json.encode(spec.schemas())

    async def handle(self, method: str, path: str, body: bytes) -> HttpResponse:
        """Answer any request: GET and POST endpoints, 405 otherwise, 500 on a bug."""
        if method == "GET":
            return self.get(path)
        if method != "POST":
            return _error(405, f"{method} is not supported: use GET or POST", "METHOD_NOT_ALLOWED")
        try:
            return await self.post(path, body)
        except Exception as exc:
            return _internal_error(method, path, exc)

    def get(self, path: str) -> HttpResponse:
        """Answer a GET (synchronously: these never wait on an environment); never raises."""
        try:
            return self._get(path)
        except Exception as exc:
            return _internal_error("GET", path, exc)

    def _get(self, path: str) -> HttpResponse:
        path = path.split("?", 1)[0].rstrip("/") or "/"
        rt = self.runtime
        if path == "/health":
            if rt.draining:
                return _json(503, {"status": "draining"})
            return _json(200, {"status": "healthy"})
        if path == "/schema":
            return HttpResponse(200, self._schema)
        if path == "/metadata":
            return _json(200, self.metadata())
        if path == "/state":
            env = rt.new_env()
            try:
                return HttpResponse(200, rt.spec.json_encoder.encode(env.state))
            finally:
                _close_env(rt, env)
        if path in self.POST_PATHS:
            return _error(405, f"{path} takes POST", "METHOD_NOT_ALLOWED")
        if path == "/ws":  # reached without an HTTP/1.1 WebSocket upgrade
            return UPGRADE_REQUIRED
        return self.not_found(path)

    def not_found(self, path: str) -> HttpResponse:
        return _error(
            404,
            f"no endpoint {path}; try GET {', '.join(self.GET_PATHS)}, "
            f"POST {', '.join(self.POST_PATHS)} or a WebSocket at /ws",
            "NOT_FOUND",
        )

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
            },
        }

    async def post(self, path: str, body: bytes) -> HttpResponse:
        """Answer a POST: OpenEnv's stateless reset and step."""
        path = path.split("?", 1)[0].rstrip("/")
        if path not in self.POST_PATHS:
            if path in self.GET_PATHS:
                return _error(405, f"{path} takes GET", "METHOD_NOT_ALLOWED")
            return self.not_found(path)
        try:
            data = msgspec.json.decode(body) if body.strip() else {}
        except msgspec.DecodeError as exc:
            return _error(400, f"body is not valid JSON: {exc}", "INVALID_JSON")
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
                result = await self._run(spec.reset_mode, reset)
            else:
                if "action" not in data:
                    raise ValidationError('body needs an "action" object', field="$.action")
                action = spec.action.convert(data["action"], "action")
                result = await self._run(spec.step_mode, functools.partial(_step, action=action))
        except StadiumError as exc:
            status = 422 if isinstance(exc, ValidationError) else 500
            return _json(status, {"detail": exc.message, **exc.to_wire()})
        except Exception as exc:
            return _error(500, f"{path[1:]} raised {type(exc).__name__}: {exc}", "EXECUTION_ERROR")
        if isinstance(result, StepResult):
            payload = {
                "observation": result.observation,
                "reward": result.reward,
                "done": result.done,
            }
        else:
            payload = {"observation": result, "reward": None, "done": False}
        return HttpResponse(200, spec.json_encoder.encode(payload))

    async def _run(self, mode: CallMode, call: Callable[[Any], Any]) -> Any:
        """``call(env)`` on a fresh env instance, run as ``mode`` says; the env is closed after."""
        rt = self.runtime
        spec = rt.spec
        loop = asyncio.get_running_loop()
        env = await rt.invoke.call(loop, spec.create_mode, rt.new_env)
        try:
            return await rt.invoke.call(loop, mode, call, env)
        finally:
            if spec.has_close:
                await rt.invoke.call(loop, spec.close_mode, env.close)


def _reset(env: Any, kwargs: Mapping[str, Any]) -> Any:
    return env.reset(**kwargs)


def _step(env: Any, action: Any) -> Any:
    return env.step(action)


def _new_episode_id() -> str:
    return uuid.uuid4().hex


def _internal_error(method: str, path: str, exc: Exception) -> HttpResponse:
    log.exception("%s %s failed", method, path)
    return _error(500, f"{method} {path} failed: {type(exc).__name__}: {exc}", "INTERNAL_ERROR")


def _close_env(runtime: Runtime, env: Any) -> None:
    """Close a request's env without waiting (as the env's close mode says); log a failure."""
    if not runtime.spec.has_close:
        return
    loop = asyncio.get_running_loop()
    runtime.invoke.run(loop, runtime.spec.close_mode, env.close, (), _log_close_error)


def _log_close_error(_token: Any, _result: Any, error: BaseException | None) -> None:
    if error is not None and not isinstance(error, asyncio.CancelledError):
        log.warning("closing a request's environment raised: %r", error)

"""What the HTTP endpoints answer with, shared by every route and transport: an
:class:`HttpResponse` (status, body, content type, extra headers), JSON error bodies
(:func:`error_response`, the ready-made ``413`` and ``426``) and :class:`ExtraRoutes`, the
routes (OpenEnv's web-interface and Task API, the recordings) answered before the
endpoints' own.

Plain values and a protocol: no I/O, nothing read from a request. The transports only move
these bytes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import msgspec

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
    """Routes answered before the endpoints' own (``openenv_routes.OpenEnvRoutes``)."""

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

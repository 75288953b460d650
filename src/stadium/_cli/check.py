"""``stadium check``: a thin front over :func:`stadium._env.checker.check_env` (an env
class, by its target) and :func:`check_server` (a running server, by its URL), with the
``--action`` / ``--actions-file`` values (:func:`load_actions`).

``check_env``, ``schema_action`` and ``sample_value`` live in ``stadium._env.checker``
beside the env contract; they are imported here too, where they were before.
"""

from __future__ import annotations

import os
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

from stadium._env.checker import check_env, sample_value, schema_action
from stadium._errors import EnvCheckError, StadiumError

__all__ = [
    "check_env",
    "check_server",
    "check_target",
    "load_actions",
    "sample_value",
    "schema_action",
]


def check_server(url: str, *, actions: Sequence[Any] | None = None) -> list[str]:
    """Check a running server: HTTP endpoints, then a session's reset, steps, state and close.

    The session steps with each of ``actions`` (JSON values), if given, until one ends
    the episode.
    A server started with a bearer token is checked with ``$STADIUM_AUTH_TOKEN``.
    """
    from stadium._client.pool import Client
    from stadium._client.session import TOKEN_ENV, ws_url

    base = ws_url(url).replace("ws://", "http://", 1).replace("wss://", "https://", 1)
    base = base.rsplit("/ws", 1)[0]
    log: list[str] = []
    token = os.environ.get(TOKEN_ENV)  # the session client reads it too
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    for path in ("/health", "/schema", "/metadata"):
        try:
            request = urllib.request.Request(base + path, headers=headers)
            with urllib.request.urlopen(request, timeout=10) as resp:
                body = msgspec.json.decode(resp.read())
        except Exception as exc:
            refused = isinstance(getattr(exc, "reason", None), ConnectionRefusedError)
            hint = (
                "; nothing listens there: is the server running, on this port?" if refused else ""
            )
            raise EnvCheckError(f"GET {base}{path} failed: {exc}{hint}", check=path) from None
        if not isinstance(body, dict):
            raise EnvCheckError(f"GET {path} did not return a JSON object", check=path)
        log.append(f"GET {path} answers a JSON object")
    session: Client[Any] = Client(url, max_retries=2)
    with session as client:
        client.reset(seed=0)
        log.append("a WebSocket session answers reset")
        for i, action in enumerate(actions or ()):
            try:
                result = client.step(action)
            except StadiumError as exc:
                raise EnvCheckError(
                    f"step with action #{i + 1} failed: {exc}", check="step"
                ) from exc
            if not isinstance(result.done, bool):
                raise EnvCheckError(f"step reply's done is not a bool: {result.done!r}")
            if i == 0:
                log.append("step answers an observation with reward and done")
            if result.done:
                break
        state = client.state()
        if not isinstance(state, dict) or "step_count" not in state:
            raise EnvCheckError(f"state reply lacks step_count: {state!r}", check="state")
        log.append("state carries step_count")
    log.append("close ends the session")
    return log


def check_target(
    target: str, *, steps: int = 5, seed: int = 0, actions: Sequence[Any] | None = None
) -> list[str]:
    """``stadium check``: a URL is checked as a server, anything else as an env class.

    ``actions`` (decoded JSON values, e.g. from ``--action``) are the actions to
    step with; without them an env class is tried with its ``sample_action`` or
    an action derived from its schema, and a server is not stepped.
    """
    if target.startswith(("ws://", "wss://", "http://", "https://")):
        return check_server(target, actions=actions)
    from stadium._server.loader import load_target

    return check_env(load_target(target), steps=steps, seed=seed, actions=actions)


def load_actions(texts: Sequence[str], files: Sequence[str]) -> list[Any] | None:
    """The actions ``stadium check`` was given: ``--action JSON`` values, then each
    ``--actions-file`` (a JSON array of actions, or JSON Lines: one action a line).
    ``None`` when none were given.

    Raises:
        ConfigError: a value or file is not valid JSON, or a file cannot be read.
    """
    from stadium._errors import ConfigError

    if not texts and not files:
        return None
    out: list[Any] = []
    for text in texts:
        try:
            out.append(msgspec.json.decode(text))
        except msgspec.DecodeError as exc:
            raise ConfigError(f"--action {text!r} is not valid JSON: {exc}") from None
    for name in files:
        try:
            data = Path(name).read_bytes()
        except OSError as exc:
            raise ConfigError(f"cannot read --actions-file {name}: {exc.strerror}") from None
        try:
            whole = msgspec.json.decode(data)
            out.extend(whole if isinstance(whole, list) else [whole])
            continue
        except msgspec.DecodeError:
            pass
        for number, line in enumerate(data.splitlines(), 1):
            if not line.strip():
                continue
            try:
                out.append(msgspec.json.decode(line))
            except msgspec.DecodeError as exc:
                raise ConfigError(
                    f"--actions-file {name} line {number} is not valid JSON: {exc} (give a "
                    "JSON array of actions, or one JSON action a line)"
                ) from None
    return out

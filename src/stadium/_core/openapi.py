"""``GET /openapi.json``: an OpenAPI 3.1 description of a worker's endpoints, built once.

The document lists every HTTP endpoint present in the server's mode (OpenEnv's
contract: ``simulation`` has ``/reset``, ``/step`` and ``/state``; ``production``
has none of them) and the env's action, observation and state JSON Schemas as
``components.schemas`` (their ``$defs`` hoisted there, references rewritten),
with ``info.title`` / ``info.version`` the env's name and version. OpenEnv's
``openenv validate --url`` reads ``info.version`` and the paths (mode detection).
Pure: no I/O.
"""

from __future__ import annotations

from typing import Any

from stadium._env.spec import EnvSpec

SIMULATION = "simulation"
PRODUCTION = "production"
MODES = (SIMULATION, PRODUCTION)
#: The environment variable OpenEnv deployments set to choose the mode (default simulation).
MODE_ENV = "OPENENV_MODE"

_DEFS = "#/$defs/"
_COMPONENTS = "#/components/schemas/"


def _hoist(schema: Any, defs: dict[str, Any]) -> Any:
    """``schema`` with its ``$defs`` moved into ``defs`` and its refs pointed there."""
    if isinstance(schema, dict):
        out: dict[str, Any] = {}
        for key, value in schema.items():
            if key == "$defs" and isinstance(value, dict):
                for name, sub in value.items():
                    defs[name] = _hoist(sub, defs)
            elif key == "$ref" and isinstance(value, str) and value.startswith(_DEFS):
                out[key] = _COMPONENTS + value[len(_DEFS) :]
            else:
                out[key] = _hoist(value, defs)
        return out
    if isinstance(schema, list):
        return [_hoist(item, defs) for item in schema]
    return schema


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _body(properties: dict[str, Any], *required: str) -> dict[str, Any]:
    """A JSON object request body; required (with those fields) when any field is."""
    schema: dict[str, Any] = {"type": "object", "properties": properties}
    body: dict[str, Any] = {"content": {"application/json": {"schema": schema}}}
    if required:
        schema["required"] = list(required)
        body["required"] = True
    return body


def _ref(name: str) -> dict[str, Any]:
    return {"$ref": _COMPONENTS + name}


_ERROR = _json(
    {
        "type": "object",
        "properties": {"detail": {"type": "string"}, "code": {"type": "string"}},
        "required": ["detail", "code"],
    },
    "An error: what was wrong and its code",
)
_ANY_OBJECT: dict[str, Any] = {"type": "object"}


def openapi(
    spec: EnvSpec, *, mode: str = SIMULATION, server_version: str = "", api_version: str = ""
) -> dict[str, Any]:
    """The OpenAPI 3.1 document of a server of ``spec`` in ``mode``.

    ``info.version`` is the env's version, or ``api_version`` when given (an OpenEnv
    env: OpenEnv's HTTP API version, as OpenEnv's server reports it; the env's own
    version then goes in ``info.x-env-version``)."""
    defs: dict[str, Any] = {}
    schemas = spec.schemas()
    components = {
        "Action": _hoist(schemas["action"], defs),
        "Observation": _hoist(schemas["observation"], defs),
        "State": _hoist(schemas["state"], defs),
    }
    for name, schema in defs.items():
        components.setdefault(name, schema)
    step_reply = {
        "type": "object",
        "properties": {
            "observation": _ref("Observation"),
            "reward": {"type": ["number", "null"]},
            "done": {"type": "boolean"},
        },
        "required": ["observation", "reward", "done"],
    }
    paths: dict[str, Any] = {
        "/health": {
            "get": {
                "summary": "Health and load (503 while draining)",
                "responses": {
                    "200": _json(_ANY_OBJECT, "healthy"),
                    "503": _json(_ANY_OBJECT, "draining"),
                },
            }
        },
        "/metadata": {
            "get": {
                "summary": "Name, description, version and capacity of the environment",
                "responses": {"200": _json(_ANY_OBJECT, "The metadata")},
            }
        },
        "/schema": {
            "get": {
                "summary": "Action, observation and state JSON Schemas",
                "responses": {
                    "200": _json(
                        {
                            "type": "object",
                            "properties": {
                                "action": _ref("Action"),
                                "observation": _ref("Observation"),
                                "state": _ref("State"),
                            },
                        },
                        "The schemas",
                    )
                },
            }
        },
        "/openapi.json": {
            "get": {
                "summary": "This document",
                "responses": {"200": _json(_ANY_OBJECT, "OpenAPI 3.1")},
            }
        },
        "/mcp": {
            "post": {
                "summary": "MCP JSON-RPC 2.0: tools/list, tools/call (and OpenEnv's "
                "openenv/session/create, openenv/session/close)",
                "requestBody": _body(
                    {
                        "jsonrpc": {"const": "2.0"},
                        "method": {"type": "string"},
                        "params": {"type": "object"},
                        "id": {"type": ["integer", "string", "null"]},
                    },
                    "jsonrpc",
                    "method",
                ),
                "responses": {"200": _json(_ANY_OBJECT, "A JSON-RPC response (result or error)")},
            }
        },
        "/ws": {
            "get": {
                "summary": "WebSocket session (upgrade): reset, step, state, close, mcp messages",
                "responses": {"101": {"description": "Switching protocols"}},
            }
        },
    }
    if mode == SIMULATION:
        paths["/reset"] = {
            "post": {
                "summary": "Reset a fresh environment; its first observation",
                "requestBody": _body(
                    {
                        "seed": {"type": ["integer", "null"]},
                        "episode_id": {"type": ["string", "null"]},
                        "options": {"type": ["object", "null"]},
                    }
                ),
                "responses": {"200": _json(step_reply, "The observation"), "422": _ERROR},
            }
        }
        paths["/step"] = {
            "post": {
                "summary": "Step a fresh environment with an action",
                "requestBody": _body(
                    {"action": _ref("Action"), "timeout_s": {"type": ["number", "null"]}},
                    "action",
                ),
                "responses": {"200": _json(step_reply, "The observation"), "422": _ERROR},
            }
        }
        paths["/state"] = {
            "get": {
                "summary": "The state of a fresh environment",
                "responses": {"200": _json(_ref("State"), "The state")},
            }
        }
    return {
        "openapi": "3.1.0",
        "info": {
            "title": spec.name,
            "version": api_version or spec.version,
            **({"x-env-version": spec.version} if api_version else {}),
            "description": spec.description,
            "x-server": f"stadium {server_version}".strip(),
            "x-mode": mode,
        },
        "paths": paths,
        "components": {"schemas": components},
    }


__all__ = ["MODES", "MODE_ENV", "PRODUCTION", "SIMULATION", "openapi"]

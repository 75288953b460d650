"""Env code that never runs outside a sandbox (``--isolation sandbox --untrusted-env-code``).

For a third-party env (an environment hub's, someone else's OpenEnv env) the env's module
is imported only by each session's process, after it entered its sandbox (its own uid,
no capabilities, ``no_new_privs``, the seccomp filter): never by the supervisor, the
workers or the template. What they need to know of the env they learn from a sandboxed
process over the wire, as untrusted input:

* :func:`describe_remote` (the supervisor, once before the server binds; an in-process
  server when it is built): a throwaway template, one sandboxed session process, whose
  answer to ``["describe"]`` is a :class:`Description` (name, version, description, the
  action / observation / state JSON Schemas, the ``GET /schema`` extras, whether it has
  MCP tools, an OpenEnv app's mode, name and session limit), decoded into that Struct
  with limits on its size (:data:`MAX_DESCRIPTION_BYTES`), its text, and its schemas'
  depth and node count (:func:`check_schema`).
* :func:`remote_spec` turns it into the worker's :class:`~stadium._env.spec.EnvSpec`: a
  stand-in class (never instantiated: :func:`~.proxy.isolated_spec` puts the proxy env in
  its place) and codecs that describe the schemas but do not decode actions: an action
  is passed through as its bytes and encoding (:class:`PassAction`), decoded and
  validated by the env's own codec in the session's process (:func:`action_decoder`),
  whose validation error comes back as the same ``VALIDATION_ERROR`` an in-process server
  answers (code, message, ``field``).

The session process's side: :func:`load_spec` (the import, in the sandbox),
:func:`describe` (the ``describe`` reply) and :func:`action_decoder`.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Annotated, Any, Literal

import msgspec

from stadium._env.codecs import (
    UNREADABLE,
    TypeCodec,
    enc_hook_default,
    msgpack_enc_hook,
    unreadable_detail,
    validation_error,
)
from stadium._env.contract import Environment
from stadium._env.spec import CallMode, EnvSpec
from stadium._errors import ConfigError, InvalidMessageError, StadiumError
from stadium._server.loader import load_target

#: The largest description accepted (its MessagePack bytes).
MAX_DESCRIPTION_BYTES = 1024 * 1024
#: The deepest nesting and the most values a description's schemas may hold.
MAX_SCHEMA_DEPTH = 64
MAX_SCHEMA_NODES = 50_000

# No control characters (they reach logs and the operator's terminal); text keeps \t and \n.
_Name = Annotated[str, msgspec.Meta(max_length=256, pattern=r"^[^\x00-\x1f\x7f]*$")]
_Text = Annotated[str, msgspec.Meta(max_length=8192, pattern=r"^[^\x00-\x08\x0b-\x1f\x7f]*$")]


class RemoteApp(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What an OpenEnv app target's ``create_app`` was given, as the worker reads it."""

    env_name: _Name
    mode: Literal["simulation", "production"] | None = None
    max_concurrent_envs: Annotated[int, msgspec.Meta(ge=1, le=1_000_000)] | None = None


class Description(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """An env as a sandboxed process describes it (untrusted: decoded with limits)."""

    name: _Name
    version: _Name
    description: _Text
    action: dict[str, Any]
    observation: dict[str, Any]
    state: dict[str, Any]
    schema_extra: dict[str, Any] = {}
    info_key: _Name = "info"
    tools: bool = False
    reset_takes_episode_id: bool = False
    step_before_reset: bool = False
    step_takes_timeout_s: bool = False
    api_version: _Name = ""
    app: RemoteApp | None = None


class PassAction(msgspec.Struct, frozen=True, array_like=True):
    """An action the worker cannot decode (it has no type): its bytes and their encoding
    (``json``, ``msgpack``, or ``value``: an HTTP body's already-parsed value, as
    MessagePack), decoded by the env's codec in the session's process."""

    kind: Literal["json", "msgpack", "value"]
    data: bytes


_description_decoder = msgspec.msgpack.Decoder(Description)
_pass_decoder = msgspec.msgpack.Decoder(PassAction)


def decode_description(body: Any) -> Description:
    """A ``describe`` reply's bytes as a :class:`Description`.

    Raises:
        ConfigError: too large, not a description, or schemas past the limits.
    """
    if not isinstance(body, bytes):
        raise ConfigError("--untrusted-env-code: the env's description is not bytes")
    if len(body) > MAX_DESCRIPTION_BYTES:
        raise ConfigError(
            f"--untrusted-env-code: the env's description is {len(body)} bytes, over the "
            f"{MAX_DESCRIPTION_BYTES} allowed (its JSON Schemas are too large)"
        )
    try:
        described = _description_decoder.decode(body)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise ConfigError(
            f"--untrusted-env-code: the env's description is invalid: {exc}"
        ) from None
    nodes = 0
    for what in ("action", "observation", "state", "schema_extra"):
        nodes += check_schema(getattr(described, what), what, MAX_SCHEMA_NODES - nodes)
    return described


def check_schema(value: Any, what: str, budget: int = MAX_SCHEMA_NODES) -> int:
    """The number of values in ``value`` (a decoded schema); ConfigError past
    :data:`MAX_SCHEMA_DEPTH` levels or ``budget`` values (walked without recursion)."""
    count = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        count += 1
        if count > budget or depth > MAX_SCHEMA_DEPTH:
            raise ConfigError(
                f"--untrusted-env-code: the env's {what} schema is past the limits "
                f"({MAX_SCHEMA_DEPTH} levels, {MAX_SCHEMA_NODES} values in all)"
            )
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)
    return count


# -- the session process's side ----------------------------------------------------------


def load_spec(settings: dict[str, Any]) -> EnvSpec:
    """Import the target (in the session's process, inside its sandbox) and compile it:
    ``--preload`` modules the template imported are there already."""
    env_cls = load_target(
        settings["target"],
        env_kwargs=settings.get("env_kwargs") or {},
        action_model=settings.get("action_model"),
    )
    return EnvSpec.of(env_cls)


#: Stadium's own modules the loader uses (its built-in envs among them: trusted code),
#: imported by the template so that sessions share them.
STADIUM_PRELOAD = ("stadium.envs", "stadium.integrations.openenv_app")


def preload(modules: list[str]) -> None:
    """Import Stadium's loader modules and the operator-trusted ``--preload`` modules (in
    the template, privileged: nothing of the env's)."""
    for name in (*STADIUM_PRELOAD, *modules):
        importlib.import_module(name)


def describe(spec: EnvSpec) -> bytes:
    """The ``describe`` reply: ``spec``'s :class:`Description`, as MessagePack."""
    env_cls = spec.env_cls
    app = getattr(env_cls, "openenv_app", None)
    remote_app = None
    if app is not None:
        mode = getattr(app, "mode", None)
        remote_app = RemoteApp(
            env_name=str(getattr(app, "env_name", spec.name)),
            mode=mode if mode in ("simulation", "production") else None,
            max_concurrent_envs=getattr(app, "max_concurrent_envs", None),
        )
    try:
        takes_timeout = "timeout_s" in inspect.signature(env_cls.step).parameters
    except (TypeError, ValueError):
        takes_timeout = False
    described = Description(
        name=spec.name,
        version=spec.version,
        description=spec.description,
        action=spec.action.schema(),
        observation=spec.observation.schema(),
        state=spec.state.schema(),
        schema_extra=spec.schema_extra,
        info_key=spec.info_key,
        tools=_has_tools(env_cls),
        reset_takes_episode_id=spec.reset_takes_episode_id,
        step_before_reset=spec.step_before_reset,
        step_takes_timeout_s=takes_timeout,
        api_version=str(getattr(env_cls, "api_version", "") or ""),
        app=remote_app,
    )
    return msgspec.msgpack.encode(described, enc_hook=enc_hook_default)


def action_decoder(spec: EnvSpec) -> Callable[[bytes], Any]:
    """How a session's process reads a ``step``'s action: a :class:`PassAction` (from a
    worker serving with ``--untrusted-env-code``) decoded and validated by the env's own
    codec, its errors those an in-process server answers."""
    codec = spec.action

    def decode(body: bytes) -> Any:
        passed = _pass_decoder.decode(body)
        try:
            if passed.kind == "json":
                return codec.json_decoder.decode(passed.data)
            if passed.kind == "msgpack":
                return codec.msgpack_decoder.decode(passed.data)
            return codec.convert(msgspec.msgpack.decode(passed.data), "action")
        except msgspec.ValidationError as exc:
            raise validation_error(exc, "action") from None
        except StadiumError:
            raise
        except UNREADABLE as exc:
            kind = "JSON" if passed.kind == "json" else "MessagePack"
            detail = unreadable_detail(exc)
            raise InvalidMessageError(f"Invalid {kind}: {detail}", encoding=kind.lower()) from None

    return decode


def _has_tools(env_cls: Any) -> bool:
    return callable(getattr(env_cls, "mcp_call_tool", None)) and callable(
        getattr(env_cls, "mcp_list_tools", None)
    )


# -- the worker's side -------------------------------------------------------------------


class _PassDecoder:
    """``decode(bytes)`` to a :class:`PassAction` (what the protocol's action decoder does)."""

    __slots__ = ("kind",)

    def __init__(self, kind: Literal["json", "msgpack"]) -> None:
        self.kind: Literal["json", "msgpack"] = kind

    def decode(self, buf: Any) -> PassAction:
        return PassAction(self.kind, bytes(buf))


def _pass_value(value: Any, _what: str) -> PassAction:
    return PassAction("value", msgspec.msgpack.encode(value, enc_hook=enc_hook_default))


def _unchecked(_value: Any, _what: str) -> None:
    """Outputs come from the env's process, as it gave them (it checks nothing either)."""


def _codec(name: str, schema: dict[str, Any], *, action: bool = False) -> TypeCodec:
    """A codec of a type the worker only knows by its schema."""
    declared = type(name, (), {})
    if action:
        return TypeCodec(
            Any, _PassDecoder("json"), _PassDecoder("msgpack"), declared,
            validator=_pass_value, describe=lambda: schema, checker=_unchecked,
        )  # fmt: skip
    return TypeCodec(
        Any, msgspec.json.Decoder(), msgspec.msgpack.Decoder(), declared,
        validator=lambda value, _what: value, describe=lambda: schema, checker=_unchecked,
    )  # fmt: skip


_STAND_IN = "a stand-in for an env served with --untrusted-env-code: its sandbox serves"


def stand_in(described: Description) -> type[Environment[Any, Any, Any]]:
    """The class the worker's spec names for the env: its name, version and the attributes
    the server reads (``openenv_app``, ``api_version``, the MCP tool methods, ``step``'s
    ``timeout_s``), no behaviour. Never instantiated (the proxy env serves)."""

    async def reset(self: Any, **kwargs: Any) -> Any:  # never called
        raise TypeError(_STAND_IN)

    async def step(self: Any, action: Any) -> Any:  # never called
        raise TypeError(_STAND_IN)

    async def step_timed(self: Any, action: Any, timeout_s: float | None = None) -> Any:
        raise TypeError(_STAND_IN)

    namespace: dict[str, Any] = {
        "__doc__": described.description,
        "__module__": "stadium.sandboxed",
        "name": described.name,
        "version": described.version,
        "description": described.description,
        "isolation": "sandbox",
        "reset": reset,
        "step": step_timed if described.step_takes_timeout_s else step,
        "api_version": described.api_version,
        "untrusted": True,
    }
    if described.app is not None:
        namespace["openenv_app"] = described.app
    if described.tools:

        async def mcp_list_tools(self: Any) -> Any:  # never called
            raise TypeError(_STAND_IN)

        async def mcp_call_tool(self: Any, name: str, arguments: Any) -> Any:  # never called
            raise TypeError(_STAND_IN)

        namespace.update(mcp_list_tools=mcp_list_tools, mcp_call_tool=mcp_call_tool)
    cls: type[Environment[Any, Any, Any]] = type(
        "".join(c for c in described.name if c.isalnum()) or "SandboxedEnv",
        (Environment,), namespace,
    )  # fmt: skip
    return cls


def remote_spec(described: Description) -> EnvSpec:
    """The worker's :class:`EnvSpec` of an env it knows only by its description (see the
    module docstring); :func:`~.proxy.isolated_spec` then makes each call a request."""
    env_cls = stand_in(described)
    return EnvSpec(
        env_cls=env_cls,
        factory=env_cls,
        name=described.name,
        version=described.version,
        description=described.description,
        action=_codec("Action", described.action, action=True),
        observation_type=Any,
        state_type=Any,
        observation=_codec("Observation", described.observation),
        state=_codec("State", described.state),
        async_reset=True,
        reset_takes_episode_id=described.reset_takes_episode_id,
        async_step=True,
        async_close=True,
        has_close=True,
        blocking=False,
        create_mode=CallMode.INLINE,
        reset_mode=CallMode.TASK,
        step_mode=CallMode.TASK,
        close_mode=CallMode.TASK,
        json_encoder=msgspec.json.Encoder(enc_hook=enc_hook_default),
        msgpack_encoder=msgspec.msgpack.Encoder(enc_hook=msgpack_enc_hook),
        schema_extra=dict(described.schema_extra),
        info_key=described.info_key,
        step_before_reset=described.step_before_reset,
    )

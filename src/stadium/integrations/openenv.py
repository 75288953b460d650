"""Serve an OpenEnv ``Environment`` subclass on Stadium's runtime, unchanged.

``stadium serve my_pkg.server.env:MyEnvironment`` finds that the class is an
OpenEnv environment (``openenv.core.env_server.interfaces.Environment``) and
wraps it with :func:`openenv_environment`:

* actions are validated with the env's pydantic ``Action`` model
  (``model_validate``; an error names the field as ``$.field``), and
  ``GET /schema`` reports the models' ``model_json_schema()``;
* observations go on the wire as OpenEnv's ``serialize_observation`` puts them:
  the observation's fields without ``reward``/``done``, with ``reward`` and
  ``done`` beside it and ``metadata`` when non-empty;
* a sync ``reset``/``step`` runs on Stadium's bounded thread pool; an env that
  overrides ``reset_async``/``step_async`` has those awaited on the event loop.

An ``MCPEnvironment`` subclass (OpenEnv's tool environments, FastMCP tools) is
served with its tools: ``step`` takes OpenEnv's ``{"type": "list_tools"}`` and
``{"type": "call_tool", ...}`` actions (whatever the env's own action model), and
``POST /mcp`` and the ``"mcp"`` WebSocket message reach the session's own tools
through ``mcp_list_tools`` / ``mcp_call_tool``, which call the env's FastMCP
client directly, around ``step()``, as OpenEnv 0.10's server does (the env's step
counters and rewards do not move on a tool call; mode-specific tools are reached
through ``step`` actions only, as on OpenEnv), and map its errors to JSON-RPC
errors.

Sessions get Stadium's runtime: no thread per session, the server-wide session
limit and the admission queue. OpenEnv's own clients (``GenericEnvClient`` and
the typed ``EnvClient`` subclasses) see no difference.

Requires ``pip install 'stadium-rl[openenv]'``.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import random
import sys
import typing
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

from stadium._env.codecs import TypeCodec, register_codec_factory
from stadium._env.contract import Environment, StepResult
from stadium._env.tool_env import sample_arguments
from stadium._errors import ExecutionError, TargetError, ToolCallError

if TYPE_CHECKING:
    from stadium.integrations.openenv_app import OpenEnvApp

log = logging.getLogger("stadium.openenv")

_INTERFACES = "openenv.core.env_server.interfaces"
_MCP_ENVIRONMENT = "openenv.core.env_server.mcp_environment"


def is_mcp_environment(cls: Any) -> bool:
    """Whether ``cls`` is an OpenEnv ``MCPEnvironment`` subclass (never imports openenv)."""
    module = sys.modules.get(_MCP_ENVIRONMENT)
    return module is not None and isinstance(cls, type) and issubclass(cls, module.MCPEnvironment)


class McpActions:
    """The declared action type of an ``MCPEnvironment``: its own action model, or
    OpenEnv's ``ListToolsAction`` / ``CallToolAction`` (told apart by ``"type"``).

    Its schema (``/schema``'s ``action``) is the action model's alone, as OpenEnv 0.10
    publishes it: clients read its title (verifiers sends ``list_tools`` first to an env
    whose action is titled ``Action``, ``CallToolAction`` or ``ListToolsAction``)."""

    def __init__(self, action_cls: type[Any]) -> None:
        self.action_cls = action_cls
        self.__name__ = action_cls.__name__

    def codec(self) -> TypeCodec:
        from openenv.core.env_server.mcp_types import CallToolAction, ListToolsAction

        own = TypeCodec.of(self.action_cls)
        kinds = {
            "list_tools": TypeCodec.of(ListToolsAction),
            "call_tool": TypeCodec.of(CallToolAction),
        }

        def validate(value: Any, what: str) -> Any:
            if isinstance(value, ListToolsAction | CallToolAction):
                return value
            kind = kinds.get(str(value.get("type"))) if isinstance(value, dict) else None
            return (kind or own).convert(value, what)

        def describe() -> dict[str, Any]:
            return own.schema()

        def check(value: Any, what: str) -> None:
            validate(value, what)

        return TypeCodec.custom(self, validate, describe, check)


class McpObservations:
    """The declared observation type of an ``MCPEnvironment``: its own observation model,
    or OpenEnv's ``ListToolsObservation`` / ``CallToolObservation`` (what its ``step``
    returns for tool actions)."""

    def __init__(self, observation_cls: type[Any]) -> None:
        self.observation_cls = observation_cls
        self.__name__ = observation_cls.__name__

    def codec(self) -> TypeCodec:
        from openenv.core.env_server.mcp_types import CallToolObservation, ListToolsObservation

        codecs = [TypeCodec.of(tp) for tp in (self.observation_cls, ListToolsObservation,
                                               CallToolObservation)]  # fmt: skip

        def validate(value: Any, what: str) -> Any:
            first: Exception | None = None
            for codec in codecs:
                try:
                    return codec.convert(value, what)
                except Exception as exc:
                    first = first or exc
            assert first is not None
            raise first

        def describe() -> dict[str, Any]:
            return {"anyOf": [codec.schema() for codec in codecs]}

        def check(value: Any, what: str) -> None:
            validate(value, what)

        return TypeCodec.custom(self, validate, describe, check)


def _mcp_actions_codec(tp: Any) -> TypeCodec | None:
    return tp.codec() if isinstance(tp, McpActions | McpObservations) else None


register_codec_factory(_mcp_actions_codec)


def is_openenv_environment(obj: Any) -> bool:
    """Whether ``obj`` is an OpenEnv ``Environment`` subclass (never imports openenv)."""
    interfaces = sys.modules.get(_INTERFACES)
    return (
        interfaces is not None
        and isinstance(obj, type)
        and issubclass(obj, interfaces.Environment)
        and obj is not interfaces.Environment
    )


class OpenEnvAdapter(Environment[Any, Any, Any]):
    """Base of the Stadium classes made by :func:`openenv_environment`.

    One instance wraps one instance of ``openenv_class``, built with the
    server's ``--env-kwargs``. ``info_key = "metadata"`` asks the protocol to
    put an observation's metadata where OpenEnv's clients read it.
    """

    openenv_class: ClassVar[type[Any]]
    step_before_reset: ClassVar[bool] = True
    """OpenEnv steps the env built at connect: a ``step`` before any ``reset`` is the env's."""
    openenv_factory: ClassVar[Callable[..., Any]]
    """What builds the wrapped env: the class, or the factory given to ``create_app``."""
    openenv_app: ClassVar[OpenEnvApp | None] = None
    """What ``create_app`` was given, for an app target (``stadium serve pkg.server.app:app``)."""
    info_key: ClassVar[str] = "metadata"
    _reset_params: ClassVar[frozenset[str] | None]  # None: the env takes **kwargs
    _validate_action: ClassVar[Any]
    _step_takes_timeout_s: ClassVar[bool]
    """Whether the OpenEnv env's step takes ``timeout_s`` (a request's own time limit,
    passed on as OpenEnv's server does; Stadium also bounds the call by it)."""

    def __init__(self, **kwargs: Any) -> None:
        self.env = self.openenv_factory(**kwargs)

    def _reset_kwargs(
        self, seed: int | None, options: dict[str, Any] | None, episode_id: str | None = None
    ) -> dict[str, Any]:
        kwargs: dict[str, Any] = dict(options or {})
        if seed is not None:
            kwargs["seed"] = seed
        if episode_id is not None:
            kwargs["episode_id"] = episode_id
        params = self._reset_params
        if params is not None:  # drop what the signature cannot take, as OpenEnv does
            kwargs = {k: v for k, v in kwargs.items() if k in params}
        return kwargs

    def _action(self, action: Any) -> Any:
        # Actions from the WebSocket are validated already; POST /step passes a dict.
        return self._validate_action(action, "action")

    @property
    def state(self) -> Any:
        return self.env.state

    def close(self) -> None:
        close = getattr(self.env, "close", None)
        if callable(close):
            close()

    def restore(self, data: bytes) -> None:
        """The wrapped OpenEnv env as snapshotted (the default pickles it, where it pickles);
        the env the factory built is closed."""
        fresh = self.env
        super().restore(data)
        close = getattr(fresh, "close", None)
        if fresh is not self.env and callable(close):
            close()


class McpToolsAdapter(OpenEnvAdapter):
    """Base of the adapters of ``MCPEnvironment`` subclasses: the env's tools for ``mcp``.

    The env's FastMCP client session (``env.mcp_session()``) is opened at the first
    tool request and held until the session closes, as OpenEnv's server holds it (a
    session per call costs milliseconds; FastMCP's client is reentrant, so the env's
    own ``async with self.mcp_session()`` then costs nothing).
    """

    _mcp_stack: contextlib.AsyncExitStack | None = None

    def __getstate__(self) -> dict[str, Any]:
        # The open FastMCP client session is the process's, reopened on demand.
        state = dict(self.__dict__)
        state.pop("_mcp_stack", None)
        return state

    async def _mcp_open(self) -> None:
        if self._mcp_stack is not None:
            return
        session = getattr(self.env, "mcp_session", None)
        if not callable(session):
            return
        stack = contextlib.AsyncExitStack()
        await stack.enter_async_context(session())
        self._mcp_stack = stack

    async def close(self) -> None:  # type: ignore[override]
        stack, self._mcp_stack = self._mcp_stack, None
        try:
            if stack is not None:
                await stack.aclose()
        finally:
            close = getattr(self.env, "close", None)
            if callable(close):
                await asyncio.to_thread(close)  # may block, as the sync adapters' close

    def sample_action(self, rng: random.Random) -> Any:
        """``list_tools``, or a call of one of the env's FastMCP tools with random arguments
        of simple types (so ``stadium check`` exercises the tools)."""
        from openenv.core.env_server.mcp_environment import get_server_tools
        from openenv.core.env_server.mcp_types import CallToolAction, ListToolsAction

        calls = []
        try:
            tools = get_server_tools(self.env.mcp_server)
        except Exception:  # no tools to read: listing them is still a valid action
            tools = {}
        for name, server_tool in sorted(tools.items()):
            arguments = sample_arguments(getattr(server_tool, "parameters", None) or {}, rng)
            if arguments is not None:
                calls.append(CallToolAction(tool_name=name, arguments=arguments))
        if not calls or rng.random() < 1 / (len(calls) + 1):
            return ListToolsAction()
        return calls[rng.randrange(len(calls))]

    async def mcp_list_tools(self) -> list[dict[str, Any]]:
        """The tools of the env's MCP client, as OpenEnv 0.10's ``/mcp`` lists them:
        straight from the client, around ``step()`` (no step counted)."""
        client = getattr(self.env, "mcp_client", None)
        if client is None:
            raise ExecutionError("this environment's MCP client is closed", operation="tools/list")
        await self._mcp_open()
        return [_jsonable(tool) for tool in await client.list_tools()]

    async def mcp_call_tool(self, name: str, arguments: dict[str, Any]) -> Any:
        """Call a tool through the env's MCP client, as OpenEnv 0.10's ``/mcp`` does:
        around ``step()``, so the env's step counters and rewards do not move. An unknown
        tool or bad arguments are :class:`~stadium.ToolCallError` (``-32602``), a tool
        that raised an :class:`~stadium.ExecutionError` (``-32603``)."""
        client = getattr(self.env, "mcp_client", None)
        if client is None:
            raise ExecutionError("this environment's MCP client is closed", operation="tools/call")
        await self._mcp_open()
        try:
            result = await client.call_tool(name=name, arguments=arguments)
        except Exception as exc:
            message = str(exc)
            if message.startswith("Unknown tool") or "validation error for call[" in message:
                kind = "tool_not_found" if message.startswith("Unknown tool") else "invalid_args"
                raise ToolCallError(message, tool=name, error_type=kind) from None
            raise ExecutionError(
                f"tool {name!r} failed: {message}", operation="tools/call",
                error_type="execution_error",
            ) from None  # fmt: skip
        return _jsonable(result)


def _jsonable(value: Any) -> Any:
    """``value`` as JSON values, the way OpenEnv's server serializes MCP results:
    pydantic models dumped, other objects by their attributes."""
    if value is None or isinstance(value, str | int | float | bool):
        return value
    if isinstance(value, list | tuple):
        return [_jsonable(item) for item in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    dump = getattr(value, "model_dump", None)
    if callable(dump):
        return dump(mode="json")
    if hasattr(value, "__dict__"):
        return {k: _jsonable(v) for k, v in vars(value).items()}
    return str(value)


def serialize_observation(observation: Any) -> StepResult[dict[str, Any]]:
    """An OpenEnv observation as a :class:`~stadium.StepResult`, the way OpenEnv sends it."""
    reward = getattr(observation, "reward", None)
    done = bool(getattr(observation, "done", False))
    metadata = getattr(observation, "metadata", None)
    dump = getattr(observation, "model_dump", None)
    if callable(dump):
        data = dump(exclude={"reward", "done"})
    elif isinstance(observation, dict):
        data = {k: v for k, v in observation.items() if k not in ("reward", "done")}
    else:
        raise TypeError(
            f"an OpenEnv environment returned {type(observation).__name__}, not an Observation"
        )
    return StepResult(data, reward, done, info=metadata or None)


def _sync_reset(
    self: OpenEnvAdapter,
    *,
    seed: int | None = None,
    options: dict[str, Any] | None = None,
    episode_id: str | None = None,
) -> StepResult[dict[str, Any]]:
    return serialize_observation(self.env.reset(**self._reset_kwargs(seed, options, episode_id)))


async def _async_reset(
    self: OpenEnvAdapter,
    *,
    seed: int | None = None,
    options: dict[str, Any] | None = None,
    episode_id: str | None = None,
) -> StepResult[dict[str, Any]]:
    kwargs = self._reset_kwargs(seed, options, episode_id)
    return serialize_observation(await self.env.reset_async(**kwargs))


def _sync_step(
    self: OpenEnvAdapter, action: Any, timeout_s: float | None = None
) -> StepResult[dict[str, Any]]:
    if timeout_s is not None and self._step_takes_timeout_s:
        return serialize_observation(self.env.step(self._action(action), timeout_s=timeout_s))
    return serialize_observation(self.env.step(self._action(action)))


async def _mcp_async_step(
    self: McpToolsAdapter, action: Any, timeout_s: float | None = None
) -> StepResult[dict[str, Any]]:
    await self._mcp_open()
    return await _async_step(self, action, timeout_s)


async def _async_step(
    self: OpenEnvAdapter, action: Any, timeout_s: float | None = None
) -> StepResult[dict[str, Any]]:
    if timeout_s is not None and self._step_takes_timeout_s:
        observation = await self.env.step_async(self._action(action), timeout_s=timeout_s)
    else:
        observation = await self.env.step_async(self._action(action))
    return serialize_observation(observation)


def _model_types(cls: type[Any]) -> tuple[Any, Any, Any]:
    """The Action, Observation and State models of an OpenEnv env class.

    Taken from ``Environment[Act, Obs, State]`` in its bases, else from the
    annotations of ``step``'s action, ``reset``'s return and ``state``, else
    OpenEnv's base models.
    """
    from openenv.core.env_server.interfaces import Environment as OpenEnvEnvironment
    from openenv.core.env_server.types import Action, Observation, State

    found: list[Any] = [None, None, None]
    for klass in cls.__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            origin = typing.get_origin(base)
            args = typing.get_args(base)
            if (
                isinstance(origin, type)
                and issubclass(origin, OpenEnvEnvironment)
                and len(args) == 3
            ):
                for i, arg in enumerate(args):
                    if found[i] is None and isinstance(arg, type):
                        found[i] = arg
    hints: list[dict[str, Any]] = []
    for fn in (cls.step, cls.reset, getattr(cls.state, "fget", None)):
        try:
            hints.append(typing.get_type_hints(fn) if fn is not None else {})
        except Exception:  # unresolvable annotations: fall back to the base models
            hints.append({})
    from_hints = [hints[0].get("action"), hints[1].get("return"), hints[2].get("return")]
    bases = (Action, Observation, State)
    result = []
    for i, base in enumerate(bases):
        tp = found[i]
        if not (isinstance(tp, type) and issubclass(tp, base)):
            tp = from_hints[i]
        if not (isinstance(tp, type) and issubclass(tp, base)):
            tp = base
        result.append(tp)
    return result[0], result[1], result[2]


def _narrower(given: Any, declared: Any) -> Any:
    """``declared`` when it is a subclass of ``given`` (the class's ``CodeState`` over the
    ``State`` ``create_app`` defaults to), else ``given``."""
    if isinstance(given, type) and isinstance(declared, type) and issubclass(declared, given):
        return declared
    return given


def _reset_params(cls: type[Any], method: str) -> frozenset[str] | None:
    params = inspect.signature(getattr(cls, method)).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return frozenset(p.name for p in params if p.name != "self")


def _takes(cls: type[Any], method: str, name: str) -> bool:
    params = _reset_params(cls, method)
    return params is None or name in params


def openenv_environment(
    cls: type[Any],
    *,
    action: type[Any] | None = None,
    app: OpenEnvApp | None = None,
) -> type[OpenEnvAdapter]:
    """A Stadium environment class serving the OpenEnv environment class ``cls``.

    Args:
        cls: the OpenEnv ``Environment`` subclass.
        action: the action model (``--action-model``), over what ``app`` and ``cls``
            say. Else ``app.action_cls``, else the class's generic parameters or its
            ``step`` annotation (OpenEnv's base ``Action`` as the last resort).
        app: what ``create_app`` was given, for an app target: its models, factory,
            name and settings are used.

    Raises:
        TargetError: ``cls`` is not an OpenEnv ``Environment`` subclass, is abstract,
            or ``action`` is not an OpenEnv ``Action`` model.
    """
    if not is_openenv_environment(cls):
        raise TargetError(
            f"{cls!r} is not an OpenEnv Environment subclass "
            "(openenv.core.env_server.interfaces.Environment)",
            target=repr(cls),
        )
    if inspect.isabstract(cls):
        missing = ", ".join(sorted(getattr(cls, "__abstractmethods__", ())))
        raise TargetError(
            f"{cls.__name__} is abstract (it does not implement {missing}); serve a concrete "
            "OpenEnv environment",
            target=cls.__name__,
        )
    from openenv.core.env_server.interfaces import Environment as OpenEnvEnvironment
    from openenv.core.env_server.types import Action

    from stadium.integrations.openenv_app import OPENENV_API_VERSION, package_version

    if action is not None and not (isinstance(action, type) and issubclass(action, Action)):
        raise TargetError(
            f"the action model {action!r} is not an OpenEnv Action subclass "
            "(openenv.core.env_server.types.Action)",
            target=cls.__name__,
        )
    action_model, observation, state = _model_types(cls)
    if app is not None:  # what create_app was given, unless the class says more
        action_model = _narrower(app.action_cls, action_model)
        observation = _narrower(app.observation_cls, observation)
        state = _narrower(app.state_cls, state)
    action_model = action or action_model
    mcp = is_mcp_environment(cls)
    declared_action: Any = McpActions(action_model) if mcp else action_model
    async_reset = cls.reset_async is not OpenEnvEnvironment.reset_async
    async_step = cls.step_async is not OpenEnvEnvironment.step_async
    if not getattr(cls, "SUPPORTS_CONCURRENT_SESSIONS", False):
        log.warning(
            "%s does not set SUPPORTS_CONCURRENT_SESSIONS = True; Stadium gives every "
            "session its own instance, so make sure instances share no mutable state",
            cls.__name__,
        )
    if getattr(cls, "REQUIRES_SINGLE_THREAD_EXECUTOR", False):
        log.warning(
            "%s sets REQUIRES_SINGLE_THREAD_EXECUTOR; Stadium runs sync calls on a shared "
            "thread pool, not one thread per session",
            cls.__name__,
        )
    doc = (cls.__doc__ or "").strip().split("\n")[0]
    namespace: dict[str, Any] = {
        "__module__": cls.__module__,
        "__qualname__": cls.__qualname__,
        "__doc__": cls.__doc__,
        "name": cls.__name__,
        "version": package_version(cls) or OPENENV_API_VERSION,
        "api_version": OPENENV_API_VERSION,
        "description": doc or f"{cls.__name__} (OpenEnv environment)",
        "action_type": declared_action,
        "observation_type": McpObservations(observation) if mcp else observation,
        "state_type": state,
        "openenv_class": cls,
        "openenv_factory": staticmethod(app.factory) if app is not None else cls,
        "openenv_app": app,
        "blocking": True,
        "reset": _async_reset if async_reset else _sync_reset,
        "step": (_mcp_async_step if mcp else _async_step) if async_step else _sync_step,
        "_reset_params": _reset_params(cls, "reset_async" if async_reset else "reset"),
        "_validate_action": staticmethod(TypeCodec.of(declared_action).convert),
        "_step_takes_timeout_s": _takes(cls, "step_async" if async_step else "step", "timeout_s"),
    }
    return type(cls.__name__, (McpToolsAdapter if mcp else OpenEnvAdapter,), namespace)


__all__ = [
    "McpActions",
    "McpObservations",
    "McpToolsAdapter",
    "OpenEnvAdapter",
    "is_mcp_environment",
    "is_openenv_environment",
    "openenv_environment",
]

"""EnvSpec: everything the server needs to know about an environment class, computed once.

It holds the typed decoders and encoders of the action, observation and state
types (msgspec), the JSON Schemas for ``GET /schema``, and whether each method
is async. The protocol core and the session runner read it; nothing here does I/O.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
from collections.abc import Callable
from typing import Any

import msgspec

from stadium._env.codecs import EncHook, TypeCodec, enc_hook_default, msgpack_enc_hook
from stadium._env.contract import Environment, State, is_async
from stadium._errors import TargetError


class CallMode(enum.IntEnum):
    """Where one kind of environment call runs (carried out by ``invoke.Invoker``)."""

    INLINE = 0
    """A non-blocking sync method: called in place on the event loop."""
    TASK = 1
    """A coroutine function: an eager task on the event loop."""
    POOL = 2
    """A blocking sync method: the worker's thread pool."""
    STARTED = 3
    """A method that starts the call and returns it, to report its own outcome
    (``invoke.Started``: an isolated env's ``step``), or returns a coroutine (a ``TASK``)."""


def call_mode(*, is_async: bool, blocking: bool) -> CallMode:
    """The mode of a method that is (or is not) async, of an env that is (or is not) blocking."""
    if is_async:
        return CallMode.TASK
    return CallMode.POOL if blocking else CallMode.INLINE


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class EnvSpec:
    """The compiled description of an :class:`~stadium.Environment` subclass.

    ``action``, ``observation`` and ``state`` are the codecs of the declared
    types (msgspec types, pydantic models or Gymnasium spaces); ``schema_extra``
    (the class attribute of that name) adds keys to ``GET /schema``; ``info_key``
    (class attribute, default ``"info"``) is the reply key under which an
    observation's info travels (OpenEnv adapters set ``"metadata"``; the
    protocol honours it once ``protocol.observation_reply`` reads it).

    An action with a field its Struct type does not declare is a
    ``VALIDATION_ERROR`` naming the field (``$.extra``), unless the class sets
    ``allow_extra_fields = True`` (see :meth:`TypeCodec.of`'s ``strict``).
    """

    env_cls: type[Environment[Any, Any, Any]]
    factory: Callable[[], Environment[Any, Any, Any]]
    name: str
    version: str
    description: str
    action: TypeCodec
    observation_type: Any
    state_type: Any
    observation: TypeCodec
    state: TypeCodec
    async_reset: bool
    reset_takes_episode_id: bool
    async_step: bool
    async_close: bool
    has_close: bool
    blocking: bool
    create_mode: CallMode
    """How the env is built: on the pool when it is blocking and wholly sync, else inline."""
    reset_mode: CallMode
    step_mode: CallMode
    close_mode: CallMode
    json_encoder: msgspec.json.Encoder
    msgpack_encoder: msgspec.msgpack.Encoder
    schema_extra: dict[str, Any]
    info_key: str
    step_before_reset: bool = False
    """The class's ``step_before_reset``: a ``step`` before any ``reset`` steps the env
    as it was built (OpenEnv's behaviour) instead of being a ``SESSION_ERROR``."""

    @classmethod
    def of(
        cls,
        env_cls: type[Environment[Any, Any, Any]],
        *,
        factory: Callable[[], Environment[Any, Any, Any]] | None = None,
        enc_hook: EncHook | None = None,
    ) -> EnvSpec:
        """Compile ``env_cls``; raise :class:`~stadium.TargetError` if it breaks the contract."""
        if not (isinstance(env_cls, type) and issubclass(env_cls, Environment)):
            raise TargetError(
                f"{env_cls!r} is not a stadium.Environment subclass",
                target=repr(env_cls),
            )
        missing = [
            attr for attr in ("action_type", "observation_type") if not hasattr(env_cls, attr)
        ]
        if missing:
            raise TargetError(
                f"{env_cls.__name__} does not declare {' and '.join(missing)}: subclass "
                "Environment[Action, Observation, State] or set the class attributes",
                target=env_cls.__name__,
            )
        for method in ("reset", "step"):
            if getattr(env_cls, method) is getattr(Environment, method):
                raise TargetError(
                    f"{env_cls.__name__} does not implement {method}()",
                    target=env_cls.__name__,
                )
        _check_signatures(env_cls)
        state_type = getattr(env_cls, "state_type", State)
        schema_extra = getattr(env_cls, "schema_extra", None) or {}
        if not isinstance(schema_extra, dict):
            raise TargetError(
                f"{env_cls.__name__}.schema_extra must be a dict of extra GET /schema keys",
                target=env_cls.__name__,
            )
        blocking = bool(env_cls.blocking)
        async_reset, async_step = is_async(env_cls.reset), is_async(env_cls.step)
        async_close = is_async(env_cls.close)
        return cls(
            env_cls=env_cls,
            factory=factory or env_cls,
            name=env_cls.name or env_cls.__name__,
            version=env_cls.version,
            description=env_cls.description or (env_cls.__doc__ or "").strip().split("\n")[0],
            action=TypeCodec.of(
                env_cls.action_type, strict=not getattr(env_cls, "allow_extra_fields", False)
            ),
            observation_type=env_cls.observation_type,
            state_type=state_type,
            observation=TypeCodec.of(env_cls.observation_type, required=False),
            state=TypeCodec.of(state_type, required=False),
            async_reset=async_reset,
            reset_takes_episode_id="episode_id" in inspect.signature(env_cls.reset).parameters,
            async_step=async_step,
            async_close=async_close,
            has_close=env_cls.close is not Environment.close,
            blocking=blocking,
            create_mode=(
                CallMode.POOL if blocking and not (async_reset or async_step) else CallMode.INLINE
            ),
            reset_mode=call_mode(is_async=async_reset, blocking=blocking),
            step_mode=call_mode(is_async=async_step, blocking=blocking),
            close_mode=call_mode(is_async=async_close, blocking=blocking),
            json_encoder=msgspec.json.Encoder(enc_hook=enc_hook or enc_hook_default),
            msgpack_encoder=msgspec.msgpack.Encoder(enc_hook=enc_hook or msgpack_enc_hook),
            schema_extra=dict(schema_extra),
            info_key=str(getattr(env_cls, "info_key", "info")),
            step_before_reset=bool(getattr(env_cls, "step_before_reset", False)),
        )

    def schemas(self) -> dict[str, Any]:
        """The ``GET /schema`` body: action, observation and state JSON Schemas."""
        return {
            "action": self.action.schema(),
            "observation": self.observation.schema(),
            "state": self.state.schema(),
            **self.schema_extra,
        }


def _check_signatures(env_cls: type[Environment[Any, Any, Any]]) -> None:
    """Refuse a ``reset`` or ``step`` that cannot be called as the server calls them
    (``reset(seed=..., options=...)``, ``step(action)``), before any session does.

    Raises:
        TargetError: naming the method, why, and the signature to write.
    """
    calls: tuple[tuple[str, dict[str, None], tuple[None, ...], str], ...] = (
        (
            "reset",
            {"seed": None, "options": None},
            (),
            "def reset(self, *, seed=None, options=None)",
        ),
        ("step", {}, (None,), "def step(self, action)"),
    )
    for method, keywords, positional, wanted in calls:
        try:
            signature = inspect.signature(getattr(env_cls, method))
        except (TypeError, ValueError):  # no signature to read: calls will tell
            continue
        try:
            signature.bind(env_cls, *positional, **keywords)
        except TypeError as exc:
            raise TargetError(
                f"{env_cls.__name__}.{method}{bare(signature)} cannot be called as the server "
                f"calls it ({exc}); write it as {wanted}",
                target=env_cls.__name__,
            ) from None


def bare(signature: inspect.Signature) -> inspect.Signature:
    """``signature`` with its names and defaults only (annotations dropped), for messages."""
    return signature.replace(
        parameters=[
            p.replace(annotation=inspect.Parameter.empty) for p in signature.parameters.values()
        ],
        return_annotation=inspect.Signature.empty,
    )

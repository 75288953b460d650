"""EnvSpec: everything the server needs to know about an environment class, computed once.

It holds the typed decoders and encoders of the action, observation and state
types (msgspec), the JSON Schemas for ``GET /schema``, and whether each method
is async. The protocol core and the session runner read it; nothing here does I/O.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

import msgspec

from stadium._env import Environment, State, is_async
from stadium._errors import TargetError
from stadium._errors import ValidationError as StadiumValidationError

_PATH = re.compile(r" - at `(\$[^`]*)`$")

EncHook = Callable[[Any], Any]


def validation_error(err: msgspec.ValidationError, what: str) -> StadiumValidationError:
    """Turn msgspec's error into ours, naming the offending field as ``field``."""
    text = str(err)
    match = _PATH.search(text)
    field = match.group(1) if match else "$"
    detail = text[: match.start()] if match else text
    return StadiumValidationError(
        f"invalid {what} at {field}: {detail}; see GET /schema for the expected shape",
        field=field,
    )


def _default_enc_hook(value: Any) -> Any:
    """Encode what msgspec cannot natively: objects with ``tolist`` (numpy) or pydantic dumps."""
    tolist = getattr(value, "tolist", None)
    if callable(tolist):
        return tolist()
    dump = getattr(value, "model_dump", None)
    if callable(dump):
        return dump()
    raise NotImplementedError(f"cannot encode objects of type {type(value).__name__}")


def _schema(tp: Any) -> dict[str, Any]:
    try:
        schema: dict[str, Any] = msgspec.json.schema(tp)
    except (TypeError, NotImplementedError):
        return {"type": "object", "description": f"{getattr(tp, '__name__', tp)} (no schema)"}
    return schema


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class TypeCodec:
    """Validate and encode values of one type, as JSON or MessagePack."""

    tp: Any
    json_decoder: msgspec.json.Decoder[Any]
    msgpack_decoder: msgspec.msgpack.Decoder[Any]

    @classmethod
    def of(cls, tp: Any) -> TypeCodec:
        try:
            return cls(tp, msgspec.json.Decoder(tp), msgspec.msgpack.Decoder(tp))
        except TypeError as exc:
            raise TargetError(
                f"type {tp!r} cannot be validated: {exc}; use a msgspec.Struct, a "
                "dataclass, a TypedDict or dict",
                type=repr(tp),
            ) from exc

    def convert(self, value: Any, what: str) -> Any:
        """Validate an already-decoded value (a dict from JSON) into the type."""
        try:
            return msgspec.convert(value, self.tp, strict=False)
        except msgspec.ValidationError as exc:
            raise validation_error(exc, what) from None

    def schema(self) -> dict[str, Any]:
        return _schema(self.tp)


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class EnvSpec:
    """The compiled description of an :class:`~stadium.Environment` subclass."""

    env_cls: type[Environment[Any, Any, Any]]
    factory: Callable[[], Environment[Any, Any, Any]]
    name: str
    version: str
    description: str
    action: TypeCodec
    observation_type: Any
    state_type: Any
    async_reset: bool
    async_step: bool
    async_close: bool
    has_close: bool
    blocking: bool
    json_encoder: msgspec.json.Encoder
    msgpack_encoder: msgspec.msgpack.Encoder

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
        hook = enc_hook or _default_enc_hook
        return cls(
            env_cls=env_cls,
            factory=factory or env_cls,
            name=env_cls.name or env_cls.__name__,
            version=env_cls.version,
            description=env_cls.description or (env_cls.__doc__ or "").strip().split("\n")[0],
            action=TypeCodec.of(env_cls.action_type),
            observation_type=env_cls.observation_type,
            state_type=getattr(env_cls, "state_type", State),
            async_reset=is_async(env_cls.reset),
            async_step=is_async(env_cls.step),
            async_close=is_async(env_cls.close),
            has_close=env_cls.close is not Environment.close,
            blocking=env_cls.blocking,
            json_encoder=msgspec.json.Encoder(enc_hook=hook),
            msgpack_encoder=msgspec.msgpack.Encoder(enc_hook=hook),
        )

    def schemas(self) -> dict[str, Any]:
        """The ``GET /schema`` body: action, observation and state JSON Schemas."""
        return {
            "action": self.action.schema(),
            "observation": _schema(self.observation_type),
            "state": _schema(self.state_type),
        }

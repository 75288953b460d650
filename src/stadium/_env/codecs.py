"""Codecs: validate, describe and encode values of the types an environment declares.

A :class:`TypeCodec` compiles one declared type once: msgspec types (Struct,
dataclass, TypedDict, dict, ...) natively, pydantic models by duck typing, and
any other kind of declaration through a factory an integration registers
(:func:`register_codec_factory`; the Gymnasium integration registers one for
spaces when it is imported). Nothing here imports an integration or does I/O.
"""

from __future__ import annotations

import dataclasses
import operator
import re
import sys
from collections.abc import Callable
from typing import Any

import msgspec

from stadium._errors import TargetError, describe_exception
from stadium._errors import ValidationError as StadiumValidationError

_PATH = re.compile(r" - at `(\$[^`]*)`$")
_UNKNOWN = re.compile(r"^Object contains unknown field `([^`]*)`$")

EncHook = Callable[[Any], Any]


#: What msgspec raises on bytes it cannot read: ``DecodeError`` (not JSON/MessagePack),
#: ``UnicodeDecodeError`` (a string not UTF-8) and ``RecursionError`` (nested deeper than
#: it allows). Every decode of a peer's bytes catches all three.
UNREADABLE = (msgspec.DecodeError, UnicodeDecodeError, RecursionError)


def unreadable_detail(exc: BaseException) -> str:
    """What was wrong with bytes a decoder could not read, for an error a peer sees."""
    if isinstance(exc, RecursionError):
        return "values are nested more deeply than the decoder allows"
    if isinstance(exc, UnicodeDecodeError):
        return f"a string is not valid UTF-8 ({exc.reason} at byte {exc.start})"
    if isinstance(exc, msgspec.DecodeError):
        return str(exc)
    return describe_exception(exc)  # e.g. a validator that raised: no server paths


def validation_error(err: msgspec.ValidationError, what: str) -> StadiumValidationError:
    """Turn msgspec's error into ours, naming the offending field as ``field``."""
    text = str(err)
    match = _PATH.search(text)
    field = match.group(1) if match else "$"
    detail = text[: match.start()] if match else text
    unknown = _UNKNOWN.match(detail)
    if unknown:  # name the field itself: ``$.extra``, as pydantic's errors do
        field = f"{field}.{unknown.group(1)}"
        detail = f"unknown field {unknown.group(1)!r} (the env does not accept extra fields)"
    return invalid(what, field, detail)


def invalid(what: str, field: str, detail: str) -> StadiumValidationError:
    """The error for a value that does not match its type, naming ``field`` (a JSON path)."""
    return StadiumValidationError(
        f"invalid {what} at {field}: {detail}; see GET /schema for the expected shape",
        field=field,
    )


#: MessagePack extension type code of a numpy array (see docs/PROTOCOL.md, "Arrays").
NDARRAY_EXT = 1
_NUMERIC_KINDS = frozenset("biufc")


def enc_hook_default(value: Any) -> Any:
    """The one enc_hook: objects with ``tolist`` (numpy) or ``model_dump`` (pydantic)."""
    tolist = getattr(value, "tolist", None)
    if callable(tolist):
        return tolist()
    dump = getattr(value, "model_dump", None)
    if callable(dump):
        return dump()
    raise NotImplementedError(f"cannot encode objects of type {type(value).__name__}")


def ndarray_ext(value: Any) -> msgspec.msgpack.Ext | None:
    """A numeric numpy array as a MessagePack extension, else ``None``.

    The extension (type code :data:`NDARRAY_EXT`) holds the MessagePack array
    ``[dtype, shape, data]``: numpy's dtype string (``"<f4"``, ``"|u1"``), the
    shape as a list of ints, and the C-ordered bytes. numpy is never imported
    here: an ndarray can only exist if numpy is already loaded.
    """
    np = sys.modules.get("numpy")
    if np is None or not isinstance(value, np.ndarray) or value.dtype.kind not in _NUMERIC_KINDS:
        return None
    payload = msgspec.msgpack.encode([value.dtype.str, list(value.shape), value.tobytes()])
    return msgspec.msgpack.Ext(NDARRAY_EXT, payload)


def msgpack_enc_hook(value: Any) -> Any:
    """Like :func:`enc_hook_default`, but numeric numpy arrays become binary extensions."""
    ext = ndarray_ext(value)
    if ext is not None:
        return ext
    return enc_hook_default(value)


def _schema(tp: Any) -> dict[str, Any]:
    try:
        schema: dict[str, Any] = msgspec.json.schema(tp)
    except (TypeError, NotImplementedError):
        return {"type": "object", "description": f"{getattr(tp, '__name__', tp)} (no schema)"}
    return _inline_top_ref(schema)


def _inline_top_ref(schema: dict[str, Any]) -> dict[str, Any]:
    """The type's own definition at the top, as pydantic's ``model_json_schema`` gives it.

    msgspec answers ``{"$ref": "#/$defs/Guess", "$defs": {...}}``; clients read the top
    level's ``properties`` / ``required`` directly (verifiers' OpenEnv taskset turns a bare
    reply into ``{required[0]: reply}``), so the referenced definition is put in its place.
    Nested types stay in ``$defs``; a recursive one keeps its own entry there too.
    """
    ref = schema.get("$ref")
    defs = schema.get("$defs")
    if set(schema) != {"$ref", "$defs"} or not isinstance(ref, str) or not isinstance(defs, dict):
        return schema
    name = ref.removeprefix("#/$defs/")
    if name == ref or not isinstance(defs.get(name), dict):
        return schema
    top = dict(defs[name])
    rest = dict(defs)
    if f'"{ref}"' not in msgspec.json.encode(defs).decode():
        del rest[name]
    if rest:
        top["$defs"] = rest
    return top


def _is_pydantic_model(tp: Any) -> bool:
    return (
        isinstance(tp, type)
        and callable(getattr(tp, "model_validate", None))
        and callable(getattr(tp, "model_json_schema", None))
    )


def _is_gym_space(tp: Any) -> bool:
    gym = sys.modules.get("gymnasium")
    return gym is not None and isinstance(tp, gym.spaces.Space)


class ValidatingDecoder:
    """A decoder that parses without a type, then validates with a function.

    It offers ``decode(buf)`` like msgspec's typed decoders; ``validate(value, what)``
    raises :class:`~stadium.ValidationError` naming the field.
    """

    __slots__ = ("_decode", "_validate")

    def __init__(self, decode: Callable[[Any], Any], validate: Callable[[Any, str], Any]) -> None:
        self._decode = decode
        self._validate = validate

    def decode(self, buf: Any) -> Any:
        return self._validate(self._decode(buf), "action")


CodecFactory = Callable[[Any], "TypeCodec | None"]
"""Compiles a declared type it knows into a :class:`TypeCodec`, or returns ``None``."""

_FACTORIES: list[CodecFactory] = []


def register_codec_factory(factory: CodecFactory) -> None:
    """Let an integration compile the declarations it knows (tried before msgspec's types).

    The Gymnasium integration registers one for space instances when it is
    imported; registering the same factory twice has no effect.
    """
    if factory not in _FACTORIES:
        _FACTORIES.append(factory)


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class TypeCodec:
    """Validate, describe and check values of one declared type, as JSON or MessagePack.

    The declared type is a msgspec-compatible type (Struct, dataclass, TypedDict,
    dict, ...), a pydantic model class, or anything a registered factory compiles
    (a Gymnasium space *instance*). For the last two, ``tp`` is ``Any`` (msgspec
    cannot convert to them) and validation goes through ``validator``; use
    :meth:`convert` rather than ``msgspec.convert``.

    Attributes:
        tp: the type for msgspec (the declared type, or ``Any``).
        json_decoder, msgpack_decoder: ``decode(bytes)`` to a validated value;
            they raise ``msgspec.ValidationError`` or :class:`~stadium.ValidationError`.
        declared: what the environment declared.
        validator: ``(value, what) -> value`` for non-msgspec types.
        describe: returns the JSON Schema for non-msgspec types.
        checker: ``(value, what) -> None`` checks an *output* value (an observation).
    """

    tp: Any
    json_decoder: Any
    msgpack_decoder: Any
    declared: Any = None
    validator: Callable[[Any, str], Any] | None = None
    describe: Callable[[], dict[str, Any]] | None = None
    checker: Callable[[Any, str], None] | None = None

    @classmethod
    def of(cls, tp: Any, *, required: bool = True, strict: bool = False) -> TypeCodec:
        """The codec of ``tp``.

        ``strict``: a ``msgspec.Struct`` decodes into its :func:`strict_twin`, so that
        an unknown field is a validation error (checked by msgspec, in C, at no
        cost). Other types follow their own configuration: pydantic models their
        ``extra`` setting (OpenEnv's forbid extras), dataclasses and TypedDicts
        accept unknown fields.

        Raises:
            TargetError: ``tp`` cannot be validated (only when ``required``;
                otherwise values of ``tp`` are passed through unchecked).
        """
        if _is_pydantic_model(tp):
            return _pydantic_codec(tp)
        for factory in _FACTORIES:
            codec = factory(tp)
            if codec is not None:
                return codec
        if _is_gym_space(tp):
            raise TargetError(
                f"{tp!r} is a Gymnasium space: import stadium.integrations.gymnasium (or "
                "serve the env as gymnasium:ENV_ID) so that spaces can be validated",
                type=repr(tp),
            )
        declared = tp
        if strict:
            tp = strict_twin(tp)
        try:
            return cls(tp, msgspec.json.Decoder(tp), msgspec.msgpack.Decoder(tp), declared)
        except TypeError as exc:
            if not required:
                return cls(Any, msgspec.json.Decoder(), msgspec.msgpack.Decoder(), tp)
            raise TargetError(
                f"type {tp!r} cannot be validated: {exc}; use a msgspec.Struct, a "
                "dataclass, a TypedDict, dict, a pydantic model or a Gymnasium space",
                type=repr(tp),
            ) from exc

    @classmethod
    def custom(
        cls,
        declared: Any,
        validator: Callable[[Any, str], Any],
        describe: Callable[[], dict[str, Any]],
        checker: Callable[[Any, str], None],
        *,
        ext_hook: Callable[[int, memoryview], Any] | None = None,
    ) -> TypeCodec:
        """A codec that parses untyped JSON/MessagePack, then calls ``validator``."""
        return cls(
            Any,
            ValidatingDecoder(msgspec.json.Decoder().decode, validator),
            ValidatingDecoder(msgspec.msgpack.Decoder(ext_hook=ext_hook).decode, validator),
            declared,
            validator,
            describe,
            checker,
        )

    def convert(self, value: Any, what: str) -> Any:
        """Validate an already-decoded value (a dict from JSON) into the type."""
        if self.validator is not None:
            return self.validator(value, what)
        try:
            return msgspec.convert(value, self.tp, strict=False)
        except msgspec.ValidationError as exc:
            raise validation_error(exc, what) from None

    def check(self, value: Any, what: str) -> None:
        """Raise :class:`~stadium.ValidationError` unless ``value`` (an output) fits the type."""
        if self.checker is not None:
            self.checker(value, what)
            return
        try:
            msgspec.convert(
                msgspec.to_builtins(value, enc_hook=enc_hook_default), self.tp, strict=False
            )
        except msgspec.ValidationError as exc:
            raise validation_error(exc, what) from None

    def schema(self) -> dict[str, Any]:
        """The JSON Schema of the declared type."""
        if self.describe is not None:
            return self.describe()
        return _schema(self.declared if self.declared is not None else self.tp)

    @property
    def name(self) -> str:
        """A short name of the declared type, for messages."""
        declared = self.declared if self.declared is not None else self.tp
        name = getattr(declared, "__name__", None)
        return str(name) if name else type(declared).__name__


def strict_twin(tp: Any) -> Any:
    """A subclass of the Struct ``tp`` that forbids unknown fields; ``tp`` itself otherwise.

    ``tp`` is returned as is when it is not a ``msgspec.Struct`` or already forbids
    unknown fields. The twin (built once per class) has the same name, fields and
    configuration, and its instances are instances of ``tp``: ``isinstance`` works,
    they compare (``==``, and ``<`` with ``order=True``) and hash equal to ``tp``'s
    instances with the same fields (by identity with ``eq=False``, as ``tp``'s do),
    and pickle as ``tp``; only ``type(action) is tp`` tells them apart. Struct types
    nested inside follow their own ``forbid_unknown_fields``.
    """
    if not (isinstance(tp, type) and issubclass(tp, msgspec.Struct)):
        return tp
    if tp.__struct_config__.forbid_unknown_fields:
        return tp
    twin = _TWINS.get(tp)
    if twin is not None:
        return twin
    astuple = msgspec.structs.astuple

    def __eq__(self: Any, other: Any) -> Any:
        if type(other) is tp or type(other) is type(self):
            return astuple(self) == astuple(other)
        return NotImplemented

    def __ne__(self: Any, other: Any) -> Any:
        equal = __eq__(self, other)
        return equal if equal is NotImplemented else not equal

    def __reduce__(self: Any) -> Any:
        reduced: Any = tp.__reduce__(self)  # (tp, fields) or (rebuild, (tp, fields))
        fn, args, *rest = reduced
        swap = type(self)
        fn = tp if fn is swap else fn
        return (fn, tuple(tp if arg is swap else arg for arg in args), *rest)

    def __hash__(self: Any) -> int:
        fn, args, *_ = __reduce__(self)
        return hash(fn(*args))  # as the same value of tp hashes

    config = tp.__struct_config__
    namespace: dict[str, Any] = {
        "__module__": tp.__module__,
        "__qualname__": tp.__qualname__,
        "__doc__": tp.__doc__,
        "__reduce__": __reduce__,
    }
    if config.eq:  # else instances compare by identity, as tp's do
        namespace.update(__eq__=__eq__, __ne__=__ne__)
        namespace["__hash__"] = None if tp.__hash__ is None else __hash__
    if config.order:
        for name, op in (("__lt__", "lt"), ("__le__", "le"), ("__gt__", "gt"), ("__ge__", "ge")):
            namespace[name] = _ordering(tp, getattr(operator, op))
    meta: Any = type(tp)  # msgspec's StructMeta
    twin = meta(tp.__name__, (tp,), namespace, forbid_unknown_fields=True)
    _TWINS[tp] = twin
    return twin


_TWINS: dict[Any, Any] = {}
"""Struct class -> its strict twin (a twin keeps its class alive anyway: it is a subclass)."""


def _ordering(tp: Any, op: Callable[[Any, Any], bool]) -> Callable[[Any, Any], Any]:
    """An ordering method of a strict twin: by fields, against ``tp``'s instances too."""
    astuple = msgspec.structs.astuple

    def compare(self: Any, other: Any) -> Any:
        if type(other) is tp or type(other) is type(self):
            return op(astuple(self), astuple(other))
        return NotImplemented

    return compare


def _loc_path(loc: Any) -> str:
    path = "$"
    for part in loc or ():
        path += f"[{part}]" if isinstance(part, int) else f".{part}"
    return path


def _pydantic_codec(model: Any) -> TypeCodec:
    """A codec for a pydantic model class (pydantic is loaded: ``model`` is one)."""
    import pydantic

    def validate(value: Any, what: str) -> Any:
        if isinstance(value, model):
            return value
        try:
            return model.model_validate(value)
        except pydantic.ValidationError as exc:
            first = exc.errors()[0]
            raise invalid(what, _loc_path(first.get("loc")), str(first.get("msg"))) from None

    def check(value: Any, what: str) -> None:
        if not isinstance(value, model):
            validate(value, what)

    def describe() -> dict[str, Any]:
        schema: dict[str, Any] = model.model_json_schema()
        return schema

    return TypeCodec.custom(model, validate, describe, check)

"""Environment snapshots: the one home for turning an env the server holds into bytes and back.

``--durable`` sessions and ``fork`` keep an environment as bytes between calls.
Three functions are all the server uses:

* :func:`snapshot_env` ``(env) -> bytes``: the env's own ``snapshot()`` (every
  :class:`~stadium.Environment` has one, by default a pickle of its instance
  state), else a pickle of the whole object; wrapped in a small envelope that
  records the env class (``module:qualname``), its ``version`` and the format.
* :func:`restore_env` ``(factory, data) -> env``: a fresh instance from the
  env's factory with ``restore(payload)`` applied in place (or the unpickled
  object, for envs without ``restore``). A snapshot of another env class, or of
  another ``version`` of it, is refused with :class:`~stadium.SnapshotError`.
* :func:`why_not_durable` ``(env) -> str | None``: a probe: ``None`` when the env
  can be snapshotted and its snapshot read back, else one sentence saying why
  not, naming the offending attribute (``pickle failed: cannot pickle
  '_thread.lock' object (attribute 'conn._lock')``).

:class:`~stadium.Environment`'s default ``snapshot``/``restore`` are
:func:`pickle_state` and :func:`restore_state` here: a pickle (protocol 5) of
the instance state as Python's own ``__getstate__`` gives it (``__dict__``, slots
too; a class may define ``__getstate__`` to leave out what belongs to the
process), restored in place: the snapshot's attributes are set on the instance
the factory built; attributes it leaves out keep the factory's values.
References to the instance itself inside its state (a bound method, a child
holding its parent) come back as references to the restored instance.

Security: a snapshot is a pickle, and reading one runs code chosen by whoever
wrote it. A snapshot store must be trusted as much as the environment's code
(a directory only the server's user can write; never bytes from a client).
"""

from __future__ import annotations

import functools
import inspect
import io
import pickle
import struct
from collections.abc import Callable, Iterator
from typing import Any

import msgspec

from stadium._env.codecs import UNREADABLE, unreadable_detail
from stadium._errors import SnapshotError

#: The envelope's first bytes, then one format byte.
MAGIC = b"STADSNAP"
#: The envelope format this module writes and reads.
FORMAT = 1
_LENGTH = struct.Struct("<I")
_PROTOCOL = 5
#: The first bytes of :func:`pickle_state`'s payload (then a pickle).
STATE_PREFIX = b"STATE1"
_MAX_DEPTH = 8  # how deep the probe looks for the attribute that does not pickle
_MAX_TRIES = 400  # how many sub-objects it may try to pickle


class _Header(msgspec.Struct, array_like=True, frozen=True):
    kind: str  # "env": the env's snapshot()/restore(); "pickle": the whole object
    cls: str  # module:qualname of the env class
    version: str  # the env class's ``version``


def class_path(cls: type[Any]) -> str:
    """``module:qualname`` of a class: the identity a snapshot records."""
    return f"{cls.__module__}:{cls.__qualname__}"


# -- the default: an instance's state, pickled ----------------------------------------


class _StatePickler(pickle.Pickler):
    """Pickles an instance's state; the instance itself, met inside, becomes a marker."""

    def __init__(self, file: io.BytesIO, owner: object) -> None:
        super().__init__(file, protocol=_PROTOCOL)
        self._owner = owner

    def reducer_override(self, obj: Any) -> Any:
        if obj is self._owner:
            return _self_marker, ()
        return NotImplemented


def _self_marker() -> None:  # pragma: no cover - never called: the unpickler swaps it
    raise SnapshotError("a snapshot's self-reference was read without its instance")


class _StateUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, owner: object) -> None:
        super().__init__(file)
        self._owner = owner

    def find_class(self, module: str, name: str) -> Any:
        if module == __name__ and name == _self_marker.__name__:
            return lambda: self._owner
        return super().find_class(module, name)


def _dumps(value: Any, owner: object, prefix: bytes = b"") -> bytes:
    # Into a file: pickle writes a large bytes or buffer straight through, with no
    # growing output buffer, and the prefix costs no second copy of the payload.
    buffer = io.BytesIO()
    buffer.write(prefix)
    _StatePickler(buffer, owner).dump(value)
    return buffer.getvalue()


def _loads(data: bytes, owner: object, start: int = 0) -> Any:
    file = io.BytesIO(data)  # shares a bytes object's memory: no copy
    file.seek(start)
    return _StateUnpickler(file, owner).load()


def pickle_state(env: object, *, prefix: bytes = b"") -> bytes:
    """``Environment.snapshot``'s default: the instance state (``__getstate__``), pickled.

    ``prefix`` is written first, in the same buffer (:func:`snapshot_env` puts its
    envelope there, so a large state is not copied again).

    Raises:
        SnapshotError: some part of the state cannot be pickled; the message names it.
    """
    cls = type(env)
    try:
        return _dumps((class_path(cls), env.__getstate__()), env, prefix + STATE_PREFIX)
    except SnapshotError:
        raise
    except Exception as exc:
        raise snapshot_error(cls, _pickle_failure(env, exc)) from exc


def restore_state(env: object, data: bytes | memoryview) -> None:
    """``Environment.restore``'s default: set the pickled state on ``env`` in place.

    State as ``__getstate__`` returns it: a dict (set into ``__dict__``), a pair
    ``(dict or None, slots dict)`` (slots set with ``setattr``), or anything a
    class-defined ``__setstate__`` takes.

    Raises:
        SnapshotError: the snapshot is of another class, or cannot be read.
    """
    cls = type(env)
    try:
        if bytes(data[: len(STATE_PREFIX)]) != STATE_PREFIX:
            raise ValueError("not a snapshot of an instance's state (no state prefix)")
        recorded, state = _loads(bytes(data), env, len(STATE_PREFIX))
    except Exception as exc:
        raise SnapshotError(
            f"a snapshot cannot be restored into {cls.__qualname__}: reading it failed: "
            f"{type(exc).__name__}: {exc}",
            env=cls.__qualname__,
            reason=str(exc),
        ) from exc
    if recorded != class_path(cls):
        raise _wrong_class(recorded, cls)
    setstate = getattr(env, "__setstate__", None)
    if setstate is not None:
        setstate(state)
        return
    slots: dict[str, Any] | None = None
    if isinstance(state, tuple) and len(state) == 2:
        state, slots = state
    if state:
        env.__dict__.update(state)
    for name, value in (slots or {}).items():
        setattr(env, name, value)


# -- the envelope -------------------------------------------------------------------


def snapshot_env(env: Any) -> bytes:
    """The env as bytes: its ``snapshot()``, else a pickle of the object, in an envelope.

    Called right after an env call, on the thread that made it (see
    ``Environment.snapshot``). Never on an env that is running a call.

    Raises:
        SnapshotError: the env cannot be snapshotted; the message names the env
            class, why, and what to do.
    """
    cls = type(env)
    snapshot = getattr(env, "snapshot", None)
    if not callable(snapshot):
        snapshot = None
    envelope, default = _ENVELOPES.get((cls, snapshot is not None)) or _envelope(
        cls, snapshot is not None
    )
    try:
        if snapshot is None:
            return envelope + pickle.dumps(env, protocol=_PROTOCOL)
        if default:  # Environment's own: one buffer, the envelope first
            return pickle_state(env, prefix=envelope)
        payload = snapshot()
        if not isinstance(payload, bytes | bytearray | memoryview):
            raise TypeError(f"snapshot() returned {type(payload).__name__}, not bytes")
    except SnapshotError:
        raise
    except Exception as exc:
        raise snapshot_error(cls, _pickle_failure(env, exc)) from exc
    return b"".join((envelope, payload))


_ENVELOPES: dict[tuple[type[Any], bool], tuple[bytes, bool]] = {}


def _envelope(cls: type[Any], has_snapshot: bool) -> tuple[bytes, bool]:
    """A class's envelope (the same for every snapshot of it), and whether its ``snapshot``
    is ``Environment.snapshot`` (told by name: ``contract`` is the layer above); kept per class."""
    version = getattr(cls, "version", "")
    header = msgspec.msgpack.encode(
        _Header(
            "env" if has_snapshot else "pickle",
            class_path(cls),
            version if isinstance(version, str) else "",
        )
    )
    method = getattr(cls, "snapshot", None)
    default = (
        getattr(method, "__qualname__", None) == "Environment.snapshot"
        and getattr(method, "__module__", None) == "stadium._env.contract"
    )
    envelope = b"".join((MAGIC, bytes((FORMAT,)), _LENGTH.pack(len(header)), header))
    if len(_ENVELOPES) >= 256:  # bounded: classes made on the fly (tests, adapters)
        _ENVELOPES.clear()
    _ENVELOPES[cls, has_snapshot] = envelope, default
    return envelope, default


def _open(data: bytes) -> tuple[_Header, memoryview]:
    view = memoryview(data)
    start = len(MAGIC) + 1 + _LENGTH.size
    if len(view) < start or view[: len(MAGIC)] != MAGIC:
        raise SnapshotError(
            "these bytes are not a Stadium snapshot (no snapshot header); "
            "restore only what snapshot_env wrote",
            reason="not a snapshot",
        )
    if view[len(MAGIC)] != FORMAT:
        raise SnapshotError(
            f"a snapshot in format {view[len(MAGIC)]} cannot be read by this Stadium "
            f"(it reads format {FORMAT}); restore it with the Stadium version that wrote it",
            reason="unknown format",
        )
    (length,) = _LENGTH.unpack(view[len(MAGIC) + 1 : start])
    try:
        header = msgspec.msgpack.decode(view[start : start + length], type=_Header)
    except UNREADABLE as exc:
        raise SnapshotError(
            f"a snapshot's header is damaged: {unreadable_detail(exc)}", reason="damaged header"
        ) from exc
    return header, view[start + length :]


def snapshot_class(data: bytes) -> str:
    """The ``module:qualname`` of the env class a snapshot was taken of."""
    return _open(data)[0].cls


def _factory_class(factory: Callable[[], Any]) -> type[Any] | None:
    while isinstance(factory, functools.partial):
        factory = factory.func
    return factory if isinstance(factory, type) else None


def restore_env(factory: Callable[[], Any], data: bytes) -> Any:
    """A new env holding the snapshot ``data``: ``factory()`` then ``restore`` in place.

    An env snapshotted without a ``snapshot()`` method (a whole-object pickle) is
    unpickled instead; ``factory`` is then only used to check its class.

    Raises:
        SnapshotError: ``data`` is not a snapshot, is of another env class or
            ``version``, or the env's ``restore`` failed.
    """
    header, payload = _open(data)
    expected = _factory_class(factory)
    if expected is not None:
        _check(header, expected)
    if header.kind == "pickle":
        try:
            env = pickle.loads(payload)
        except Exception as exc:
            raise _restore_failed(header.cls, exc) from exc
        if expected is None:
            _check(header, type(env))
        return env
    env = factory()
    try:
        if expected is None:
            _check(header, type(env))
        env.restore(bytes(payload))
    except BaseException as exc:
        _discard(env)
        if isinstance(exc, SnapshotError):
            raise
        if isinstance(exc, Exception):
            raise _restore_failed(header.cls, exc) from exc
        raise
    return env


def _check(header: _Header, cls: type[Any]) -> None:
    version = getattr(cls, "version", "")
    version = version if isinstance(version, str) else ""
    if header.cls != class_path(cls):
        raise _wrong_class(header.cls, cls)
    if header.version != version:
        raise SnapshotError(
            f"a snapshot of {cls.__qualname__} version {header.version!r} cannot be restored "
            f"into version {version!r}: its state may not fit; finish those sessions on the "
            "old version, or start new ones",
            env=cls.__qualname__,
            reason="version mismatch",
            snapshot_version=header.version,
        )


def _wrong_class(recorded: str, cls: type[Any]) -> SnapshotError:
    return SnapshotError(
        f"a snapshot of {recorded} cannot be restored into {class_path(cls)}: "
        "restore a snapshot into the env class it was taken of",
        env=cls.__qualname__,
        reason="wrong class",
        snapshot_class=recorded,
    )


def _restore_failed(recorded: str, exc: BaseException) -> SnapshotError:
    return SnapshotError(
        f"restoring a snapshot of {recorded} failed: {type(exc).__name__}: {exc}",
        env=recorded.rpartition(":")[2],
        reason=str(exc),
    )


def _discard(env: Any) -> None:
    """Close an env the caller will not use (a sync close runs; an async one cannot here)."""
    close = getattr(env, "close", None)
    if not callable(close):
        return
    try:
        result = close()
        if inspect.iscoroutine(result):
            result.close()
    except Exception:  # closing a half-restored env is best effort
        pass


# -- the probe and the error ----------------------------------------------------------


def snapshot_error(cls: type[Any], why: str) -> SnapshotError:
    """The error of an env that cannot be snapshotted: the class, why, what to do."""
    return SnapshotError(
        f"{cls.__qualname__} cannot be snapshotted ({why}); implement snapshot() and restore() "
        "on it, or serve it without --durable",
        env=cls.__qualname__,
        reason=why,
    )


def why_not_durable(env: Any) -> str | None:
    """``None`` if ``env`` can be snapshotted and its snapshot read back, else why not.

    Probe an instance in the state to check (a fresh one at start-up; an env
    that opens connections or threads in ``reset`` should be probed after it).
    The answer is one sentence, e.g. ``"pickle failed: cannot pickle
    '_thread.lock' object (attribute 'conn._lock')"``.
    """
    try:
        data = snapshot_env(env)
        header, payload = _open(data)
        if header.kind == "pickle":
            pickle.loads(payload)
        elif payload[: len(STATE_PREFIX)] == STATE_PREFIX:  # pickle_state's: read it back
            _loads(bytes(payload), object(), len(STATE_PREFIX))
    except SnapshotError as exc:
        reason = exc.context.get("reason")
        return str(reason) if reason else exc.message
    except Exception as exc:
        return f"its snapshot cannot be read back: {type(exc).__name__}: {exc}"
    return None


def _pickle_failure(env: object, exc: BaseException) -> str:
    """``pickle failed: <error> (attribute '<path>')``: the deepest part that does not pickle."""
    found = None
    try:
        found = _find(env.__getstate__(), "", env, 0, [_MAX_TRIES])
    except Exception:  # the state itself cannot be read: report the first error
        found = None
    if found is None:
        return f"pickle failed: {type(exc).__name__}: {exc}"
    path, error = found
    return f"pickle failed: {error} (attribute {path!r})"


def _children(value: Any, path: str) -> Iterator[tuple[str, Any]]:
    if isinstance(value, dict):
        for key, item in list(value.items())[:200]:
            yield f"{path}[{key!r}]" if path else str(key), item
        return
    if isinstance(value, list | tuple):
        if path == "" and len(value) == 2 and (value[0] is None or isinstance(value[0], dict)):
            # (dict, slots): the default __getstate__ of a class with slots
            yield from _children(value[0] or {}, "")
            yield from _children(value[1], "")
            return
        for i, item in enumerate(value[:200]):
            yield f"{path}[{i}]", item
        return
    if isinstance(value, set | frozenset | type) or callable(value):
        return
    try:
        state = value.__getstate__()
    except Exception:
        return
    if isinstance(state, tuple) and len(state) == 2:
        for part in state:
            if isinstance(part, dict):
                for key, item in list(part.items())[:200]:
                    yield f"{path}.{key}", item
    elif isinstance(state, dict):
        for key, item in list(state.items())[:200]:
            yield f"{path}.{key}", item


def _find(
    value: Any, path: str, owner: object, depth: int, tries: list[int]
) -> tuple[str, str] | None:
    if tries[0] <= 0:
        return None
    tries[0] -= 1
    try:
        _dumps(value, owner)
        return None
    except Exception as exc:
        error = f"{exc}"
    if depth < _MAX_DEPTH:
        for sub_path, child in _children(value, path):
            found = _find(child, sub_path, owner, depth + 1, tries)
            if found is not None:
                return found
    return (path, error) if path else None


__all__ = [
    "FORMAT",
    "MAGIC",
    "STATE_PREFIX",
    "class_path",
    "pickle_state",
    "restore_env",
    "restore_state",
    "snapshot_class",
    "snapshot_env",
    "snapshot_error",
    "why_not_durable",
]

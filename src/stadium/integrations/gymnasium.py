"""Serve Gymnasium environments, and the space and array codecs both ends share.

``stadium serve gymnasium:CartPole-v1`` (any registered id, ``module:Id`` too,
with ``--env-kwargs`` passed to ``gymnasium.make``) or ``stadium serve
pkg.mod:MyGymEnv`` (a ``gymnasium.Env`` subclass) wraps the env with
:func:`gymnasium_environment`:

* ``GET /schema`` has the spaces as JSON Schemas (``action``, ``observation``)
  and, under ``"gymnasium"``, serialised so :mod:`stadium.gym` can rebuild them
  (:func:`space_to_dict` / :func:`space_from_dict`);
* ``reset(seed=...)`` is honoured; ``reset``'s info and ``step``'s
  ``terminated``/``truncated``/``info`` are carried (``done`` = either);
* actions arrive as JSON numbers/lists (or MessagePack arrays), are converted
  to the space's dtype and checked with ``space.contains``: anything else is a
  ``VALIDATION_ERROR`` naming the field;
* numpy observations go out as nested lists on JSON sessions and as binary
  array extensions on MessagePack sessions (docs/PROTOCOL.md, "Arrays").

Requires ``pip install 'stadium-rl[gym]'``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import Any, ClassVar

import gymnasium
import msgspec
import numpy as np
from gymnasium import spaces
from gymnasium.utils import EzPickle

from stadium._env.codecs import NDARRAY_EXT, TypeCodec, invalid, ndarray_ext, register_codec_factory
from stadium._env.contract import Environment, State, StepResult
from stadium._env.snapshot import snapshot_error
from stadium._errors import ConfigError, TargetError

# -- arrays on the wire -------------------------------------------------------


def ext_hook(code: int, data: memoryview) -> Any:
    """MessagePack ``ext_hook``: Stadium's array extension → a (writable) ``np.ndarray``."""
    if code != NDARRAY_EXT:
        return msgspec.msgpack.Ext(code, bytes(data))
    dtype, shape, raw = msgspec.msgpack.decode(data)
    return np.frombuffer(raw, dtype=np.dtype(dtype)).reshape(shape).copy()


def decode_arrays(value: Any) -> Any:
    """Replace array extensions (``msgspec.msgpack.Ext``) anywhere in ``value`` by arrays."""
    if isinstance(value, msgspec.msgpack.Ext):
        return ext_hook(value.code, memoryview(value.data))
    if isinstance(value, dict):
        return {k: decode_arrays(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [decode_arrays(v) for v in value]
    return value


def to_wire(value: Any) -> Any:
    """A space value as JSON-ready builtins: arrays → nested lists, numpy scalars → Python."""
    if isinstance(value, np.ndarray | np.generic):
        return value.tolist()
    if isinstance(value, dict):
        return {k: to_wire(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_wire(v) for v in value]
    return value


def to_msgpack_wire(value: Any) -> Any:
    """Like :func:`to_wire`, but numeric arrays stay binary (array extensions)."""
    ext = ndarray_ext(value)
    if ext is not None:
        return ext
    if isinstance(value, dict):
        return {k: to_msgpack_wire(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_msgpack_wire(v) for v in value]
    return to_wire(value)


# -- wire values → space values --------------------------------------------------


def from_wire(space: spaces.Space[Any], value: Any, what: str, *, check: bool = True) -> Any:
    """Convert a decoded wire value (lists, ints, arrays) into ``space``'s types.

    With ``check``, the result must also satisfy ``space.contains``.

    Raises:
        stadium.ValidationError: the value has the wrong shape, type or bounds;
            ``field`` is the JSON path of the offending part.
    """
    out = _convert(space, value, what, "$")
    if check and not space.contains(out):
        raise invalid(what, "$", f"{_short(value)} is not in {space}")
    return out


def _short(value: Any) -> str:
    text = repr(to_wire(value))
    return text if len(text) <= 80 else text[:77] + "..."


def _convert(space: spaces.Space[Any], value: Any, what: str, path: str) -> Any:
    if isinstance(space, spaces.Discrete):
        if isinstance(value, np.ndarray) and value.shape == ():
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, int | np.integer):
            raise invalid(what, path, f"expected an integer, got {_short(value)}")
        return np.int64(value)
    if isinstance(space, spaces.Box | spaces.MultiBinary | spaces.MultiDiscrete):
        return _array(space, value, what, path)
    if isinstance(space, spaces.Dict):
        if not isinstance(value, dict):
            raise invalid(what, path, f"expected an object, got {_short(value)}")
        missing = [k for k in space.spaces if k not in value]
        extra = [k for k in value if k not in space.spaces]
        if missing or extra:
            key = (missing or extra)[0]
            why = "is missing" if missing else "is not in the space"
            raise invalid(what, f"{path}.{key}", f"key {key!r} {why}")
        return {k: _convert(sub, value[k], what, f"{path}.{k}") for k, sub in space.spaces.items()}
    if isinstance(space, spaces.Tuple):
        if not isinstance(value, list | tuple) or len(value) != len(space.spaces):
            raise invalid(
                what, path, f"expected a list of {len(space.spaces)} items, got {_short(value)}"
            )
        return tuple(
            _convert(sub, v, what, f"{path}[{i}]")
            for i, (sub, v) in enumerate(zip(space.spaces, value, strict=True))
        )
    if isinstance(space, spaces.Text):
        if not isinstance(value, str):
            raise invalid(what, path, f"expected a string, got {_short(value)}")
        return value
    return value  # other spaces (Graph, Sequence, OneOf): passed as decoded


def _array(space: Any, value: Any, what: str, path: str) -> Any:
    try:
        arr = np.asarray(value)
    except (ValueError, TypeError) as exc:  # ragged lists
        raise invalid(what, path, f"not an array: {exc}") from None
    if arr.dtype.kind not in "biuf":
        raise invalid(what, path, f"expected numbers, got {_short(value)}")
    target = np.dtype(space.dtype)
    if target.kind in "biu" and arr.dtype.kind == "f" and not np.all(np.isfinite(arr)):
        raise invalid(what, path, "expected integers, got non-finite numbers")
    if target.kind in "biu" and arr.dtype.kind == "f" and not np.all(arr == np.round(arr)):
        raise invalid(what, path, f"expected integers, got {_short(value)}")
    if arr.shape != space.shape:
        raise invalid(what, path, f"expected shape {list(space.shape)}, got {list(arr.shape)}")
    return arr.astype(target, copy=False)


def space_codec(space: spaces.Space[Any]) -> TypeCodec:
    """The :class:`~stadium._env.codecs.TypeCodec` of a space (for actions and observations)."""

    def validate(value: Any, what: str) -> Any:
        return from_wire(space, value, what)

    def check(value: Any, what: str) -> None:
        if not space.contains(value):
            raise invalid(what, "$", f"{_short(value)} is not in {space}")

    return TypeCodec.custom(space, validate, lambda: space_schema(space), check, ext_hook=ext_hook)


def _space_codec_factory(declared: Any) -> TypeCodec | None:
    """Compile Gymnasium space instances (registered with the codecs at import)."""
    return space_codec(declared) if isinstance(declared, spaces.Space) else None


register_codec_factory(_space_codec_factory)


# -- spaces as JSON ---------------------------------------------------------------


def _number(x: float) -> float | str:
    if math.isfinite(x):
        return x
    return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")


def _bounds(arr: Any) -> Any:
    """Box bounds as JSON: a scalar when uniform, else nested lists; ±inf as strings."""
    flat = np.asarray(arr, dtype=np.float64).ravel()
    if flat.size and np.all(flat == flat[0]):
        return _number(float(flat[0]))
    nested: Any = np.vectorize(_number, otypes=[object])(np.asarray(arr, dtype=np.float64))
    return nested.tolist()


def _unbounds(value: Any, shape: tuple[int, ...]) -> Any:
    def num(x: Any) -> float:
        return float(x)

    if isinstance(value, list):
        return np.vectorize(num, otypes=[np.float64])(np.asarray(value, dtype=object))
    return np.full(shape, float(value))


def space_to_dict(space: spaces.Space[Any]) -> dict[str, Any]:
    """Serialise a space to JSON-ready builtins; :func:`space_from_dict` rebuilds it."""
    if isinstance(space, spaces.Box):
        return {
            "type": "Box",
            "shape": list(space.shape),
            "dtype": str(space.dtype),
            "low": _bounds(space.low),
            "high": _bounds(space.high),
        }
    if isinstance(space, spaces.Discrete):
        return {"type": "Discrete", "n": int(space.n), "start": int(space.start)}
    if isinstance(space, spaces.MultiDiscrete):
        return {
            "type": "MultiDiscrete",
            "nvec": space.nvec.tolist(),
            "start": space.start.tolist(),
            "dtype": str(space.dtype),
        }
    if isinstance(space, spaces.MultiBinary):
        n = space.n
        return {"type": "MultiBinary", "n": n if isinstance(n, int) else list(n)}
    if isinstance(space, spaces.Dict):
        return {"type": "Dict", "spaces": {k: space_to_dict(s) for k, s in space.spaces.items()}}
    if isinstance(space, spaces.Tuple):
        return {"type": "Tuple", "spaces": [space_to_dict(s) for s in space.spaces]}
    if isinstance(space, spaces.Text):
        return {
            "type": "Text",
            "min_length": space.min_length,
            "max_length": space.max_length,
            "charset": space.characters,
        }
    return {"type": type(space).__name__, "unsupported": True, "repr": str(space)}


def space_from_dict(data: dict[str, Any]) -> spaces.Space[Any]:
    """Rebuild a space serialised by :func:`space_to_dict`.

    Raises:
        ConfigError: the space type is not one Stadium can carry.
    """
    kind = data.get("type")
    if kind == "Box":
        shape = tuple(int(n) for n in data["shape"])
        dtype = np.dtype(data["dtype"])
        low = _unbounds(data["low"], shape)
        high = _unbounds(data["high"], shape)
        low, high = low.astype(dtype), high.astype(dtype)  # exact: they came from dtype
        return spaces.Box(low=low, high=high, shape=shape, dtype=dtype)
    if kind == "Discrete":
        return spaces.Discrete(int(data["n"]), start=int(data.get("start", 0)))
    if kind == "MultiDiscrete":
        return spaces.MultiDiscrete(
            np.asarray(data["nvec"]),
            dtype=np.dtype(data.get("dtype", "int64")),
            start=np.asarray(data.get("start", 0)),
        )
    if kind == "MultiBinary":
        return spaces.MultiBinary(data["n"])
    if kind == "Dict":
        return spaces.Dict({k: space_from_dict(v) for k, v in data["spaces"].items()})
    if kind == "Tuple":
        return spaces.Tuple([space_from_dict(v) for v in data["spaces"]])
    if kind == "Text":
        return spaces.Text(
            int(data["max_length"]), min_length=int(data["min_length"]), charset=data["charset"]
        )
    raise ConfigError(
        f"cannot rebuild a Gymnasium {kind} space from the server's schema; Stadium carries "
        "Box, Discrete, MultiDiscrete, MultiBinary, Dict, Tuple and Text spaces",
        space=kind,
    )


def space_schema(space: spaces.Space[Any]) -> dict[str, Any]:
    """A JSON Schema for the wire form of ``space``'s values."""
    if isinstance(space, spaces.Discrete):
        start = int(space.start)
        return {"type": "integer", "minimum": start, "maximum": start + int(space.n) - 1}
    if isinstance(space, spaces.Box | spaces.MultiBinary | spaces.MultiDiscrete):
        leaf: dict[str, Any] = {"type": "integer" if space.dtype.kind in "biu" else "number"}
        if isinstance(space, spaces.MultiBinary):
            leaf.update(minimum=0, maximum=1)
        elif isinstance(space, spaces.Box):
            low, high = _bounds(space.low), _bounds(space.high)
            if isinstance(low, float | int):
                leaf["minimum"] = low
            if isinstance(high, float | int):
                leaf["maximum"] = high
        schema = leaf
        for n in reversed(space.shape):
            schema = {"type": "array", "items": schema, "minItems": n, "maxItems": n}
        schema = dict(schema)
        schema["description"] = (
            f"{type(space).__name__} of {space.dtype}, shape {list(space.shape)}"
        )
        return schema
    if isinstance(space, spaces.Dict):
        return {
            "type": "object",
            "properties": {k: space_schema(s) for k, s in space.spaces.items()},
            "required": list(space.spaces),
            "additionalProperties": False,
        }
    if isinstance(space, spaces.Tuple):
        n = len(space.spaces)
        return {
            "type": "array",
            "prefixItems": [space_schema(s) for s in space.spaces],
            "minItems": n,
            "maxItems": n,
        }
    if isinstance(space, spaces.Text):
        return {"type": "string", "minLength": space.min_length, "maxLength": space.max_length}
    return {"description": str(space)}


# -- serving ------------------------------------------------------------------------


class GymnasiumAdapter(Environment[Any, Any, State]):
    """Base of the Stadium classes made by :func:`gymnasium_environment`.

    One instance wraps one Gymnasium env, built by ``make_env`` with the
    adapter's bound kwargs updated by the server's ``--env-kwargs``.
    """

    make_env: ClassVar[Callable[..., Any]]
    bound_kwargs: ClassVar[dict[str, Any]] = {}
    blocking = True

    def __init__(self, **kwargs: Any) -> None:
        env = type(self).make_env(**{**self.bound_kwargs, **kwargs})
        if kwargs and (
            env.observation_space != self.observation_type or env.action_space != self.action_type
        ):
            env.close()
            raise ConfigError(
                f"the env kwargs {kwargs!r} change the spaces of {self.name}; the server "
                "compiled the spaces without them, so pass the kwargs to the loader "
                "(load_target(target, env_kwargs=...))",
                target=self.name,
            )
        self.env = env
        self._started = False

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> StepResult[Any]:
        obs, info = self.env.reset(seed=seed, options=options)
        self._started = True
        return StepResult(obs, None, False, info=info or None)

    def step(self, action: Any) -> StepResult[Any]:
        if not isinstance(action, np.ndarray | np.generic):  # e.g. POST /step: not decoded yet
            action = from_wire(self.action_type, action, "action")
        if not self._started:  # OpenEnv's stateless POST /step: a fresh instance steps once
            self.reset()
        obs, reward, terminated, truncated, info = self.env.step(action)
        return StepResult.gym(obs, float(reward), bool(terminated), bool(truncated), info)

    def sample_action(self, rng: random.Random) -> Any:
        """A random action (for :func:`stadium.check_env`), seeded from ``rng``."""
        space: spaces.Space[Any] = self.action_type
        space.seed(rng.randrange(2**31))
        return space.sample()

    def close(self) -> None:
        self.env.close()

    def snapshot(self) -> bytes:
        """The wrapped env pickled with its wrappers (``np_random``, the time limit's
        step count and every attribute come along).

        Raises:
            stadium.SnapshotError: the env does not pickle (the attribute is named),
                or pickles by constructor arguments (``EzPickle``), which would
                restart the episode instead of continuing it.
        """
        layer: Any = self.env
        for _ in range(64):  # the wrapper chain, bounded
            if isinstance(layer, EzPickle):
                raise snapshot_error(
                    type(self),
                    f"{type(layer).__name__} pickles by its constructor arguments (EzPickle), "
                    "so a restored episode would start over instead of continuing",
                )
            layer = getattr(layer, "env", None)
            if layer is None:
                break
        return super().snapshot()

    def restore(self, data: bytes) -> None:
        fresh = self.env
        super().restore(data)
        if self.env is not fresh:
            fresh.close()  # the factory's env, replaced by the snapshot's


def gymnasium_environment(
    source: str | type[Any], env_kwargs: dict[str, Any] | None = None
) -> type[GymnasiumAdapter]:
    """A Stadium environment class serving a Gymnasium env.

    Args:
        source: a registered id (``"CartPole-v1"``, ``"my.module:MyEnv-v0"``) or a
            ``gymnasium.Env`` subclass.
        env_kwargs: arguments for ``gymnasium.make`` / the class; the spaces are
            read from a probe instance built with them.

    Raises:
        TargetError: the id is not registered, the env cannot be built, or its
            spaces are missing.
    """
    kwargs = dict(env_kwargs or {})
    if isinstance(source, str):
        env_id = source

        def make_env(**kw: Any) -> Any:
            return gymnasium.make(env_id, **kw)

        name = env_id
    elif isinstance(source, type) and issubclass(source, gymnasium.Env):
        make_env = source
        name = source.__name__
        env_id = f"{source.__module__}:{source.__qualname__}"
    else:
        raise TargetError(f"{source!r} is neither a Gymnasium id nor a gymnasium.Env subclass")
    try:
        probe = make_env(**kwargs)
    except gymnasium.error.Error as exc:
        raise TargetError(
            f"cannot make Gymnasium env {env_id!r}: {exc}; check the id "
            "(gymnasium.pprint_registry() lists them) or use module:Id so that the module "
            "registering it is imported first",
            target=env_id,
        ) from exc
    except Exception as exc:
        raise TargetError(
            f"building Gymnasium env {env_id!r} failed: {type(exc).__name__}: {exc}",
            target=env_id,
        ) from exc
    try:
        obs_space, act_space = probe.observation_space, probe.action_space
        spec = getattr(probe, "spec", None)
        metadata = dict(getattr(probe, "metadata", {}) or {})
    finally:
        probe.close()
    if not isinstance(obs_space, spaces.Space) or not isinstance(act_space, spaces.Space):
        raise TargetError(f"{env_id!r} does not define observation_space and action_space")
    gym_info: dict[str, Any] = {
        "id": env_id,
        "observation_space": space_to_dict(obs_space),
        "action_space": space_to_dict(act_space),
        "max_episode_steps": getattr(spec, "max_episode_steps", None),
        "render_fps": metadata.get("render_fps"),
    }
    namespace: dict[str, Any] = {
        "__module__": __name__,
        "__doc__": f"Gymnasium environment {env_id}, served by Stadium.",
        "name": name,
        "description": f"Gymnasium {env_id}",
        "version": gymnasium.__version__,
        "action_type": act_space,
        "observation_type": obs_space,
        "state_type": State,
        "make_env": staticmethod(make_env),
        "bound_kwargs": kwargs,
        "schema_extra": {"gymnasium": gym_info},
    }
    cls_name = "".join(c if c.isalnum() else "_" for c in name.rsplit(":", 1)[-1])
    return type(f"Gym_{cls_name}", (GymnasiumAdapter,), namespace)


__all__ = [
    "GymnasiumAdapter",
    "decode_arrays",
    "ext_hook",
    "from_wire",
    "gymnasium_environment",
    "space_codec",
    "space_from_dict",
    "space_schema",
    "space_to_dict",
    "to_msgpack_wire",
    "to_wire",
]

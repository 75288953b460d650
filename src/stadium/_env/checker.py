"""``check_env``: exercise an environment class against the contract, like Gymnasium's.

It lives beside the contract it checks (:mod:`stadium._env.contract`), as Gymnasium's
``env_checker`` does. Authors run it in their own tests (``stadium.check_env(MyEnv)``);
``stadium check TARGET`` (``stadium._cli.check``) runs it from the shell, or checks a
running server when TARGET is a URL.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import math
import random
import sysconfig
import traceback
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any

import msgspec

from stadium._env.codecs import enc_hook_default
from stadium._env.contract import Environment, StepResult
from stadium._env.spec import EnvSpec
from stadium._errors import EnvCheckError, StadiumError


async def _maybe_await(value: Any) -> Any:
    if inspect.isawaitable(value):
        return await value
    return value


def _sample_actions(
    env: Any, spec: EnvSpec, steps: int, seed: int, actions: Sequence[Any] | None
) -> list[Any]:
    if actions is not None:
        out = []
        for i, given in enumerate(actions, 1):
            try:
                builtins = msgspec.to_builtins(given, enc_hook=enc_hook_default)
                out.append(spec.action.convert(builtins, "action"))
            except (StadiumError, TypeError, NotImplementedError) as exc:
                raise EnvCheckError(
                    f"action #{i} given is not a valid {spec.action.name}: {exc}",
                    check="actions",
                ) from None
        return out
    rng = random.Random(f"stadium-check-actions-{seed}")  # not the env's own stream
    sampler = getattr(env, "sample_action", None)
    if callable(sampler):
        return [sampler(rng) for _ in range(steps)]
    return [schema_action(spec)] * steps


def schema_action(spec: EnvSpec) -> Any:
    """A valid action derived from the action type's JSON Schema (see :func:`sample_value`).

    Raises:
        EnvCheckError: the schema admits no value this can build (a ``pattern``,
            a custom validator); the message says how to pass actions instead.
    """
    schema = spec.action.schema()
    try:
        return spec.action.convert(sample_value(schema, schema), "action")
    except (StadiumError, ValueError, TypeError, RecursionError) as exc:
        raise EnvCheckError(
            f"cannot make an action for {spec.name} from its JSON Schema ({exc}). Pass "
            "actions=[...] to check_env (stadium check TARGET --action JSON), or define "
            "sample_action(self, rng) on the env",
            check="sample_action",
        ) from None


_JSON_TYPES = ("object", "array", "string", "integer", "number", "boolean", "null")


def sample_value(schema: Any, root: dict[str, Any], depth: int = 0) -> Any:
    """A small JSON value valid under ``schema`` (a JSON Schema), for trying an env.

    A schema walker, not a generator of test cases: it takes ``const``, the
    ``default``, an enum's first value, the first branch of ``anyOf``/``oneOf``
    that is not null, and for the rest the least value its keywords allow (numbers
    at their lower bound, strings and arrays of their minimum length, objects with
    only their required properties). ``$ref``s resolve against ``root``. It does
    not satisfy ``pattern`` or ``format`` (the conversion that follows says so).
    """
    if depth > 32:
        raise ValueError("the schema nests more than 32 levels deep")
    if not isinstance(schema, dict):
        return None
    ref = schema.get("$ref")
    if isinstance(ref, str):
        return sample_value(_resolve(ref, root), root, depth + 1)
    for key in ("const", "default"):
        if key in schema:
            return schema[key]
    if schema.get("enum"):
        return schema["enum"][0]
    for key in ("anyOf", "oneOf", "allOf"):
        branches = schema.get(key)
        if branches:
            usable = [b for b in branches if not (isinstance(b, dict) and b.get("type") == "null")]
            return sample_value((usable or branches)[0], root, depth + 1)
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind is None:
        kind = "object" if "properties" in schema else "null"
    if kind == "object":
        props = schema.get("properties") or {}
        return {
            name: sample_value(props.get(name, {}), root, depth + 1)
            for name in schema.get("required", ())
        }
    if kind == "array":
        prefix = list(schema.get("prefixItems") or ())
        count = max(int(schema.get("minItems", 0)), len(prefix))
        items = schema.get("items", {})
        return [
            sample_value(prefix[i] if i < len(prefix) else items, root, depth + 1)
            for i in range(count)
        ]
    if kind == "string":
        return "a" * int(schema.get("minLength", 0))
    if kind in ("integer", "number"):
        return _sample_number(schema, integer=kind == "integer")
    if kind == "boolean":
        return False
    if kind in _JSON_TYPES:
        return None
    raise ValueError(f"unknown JSON Schema type {kind!r}")


def _resolve(ref: str, root: dict[str, Any]) -> Any:
    if not ref.startswith("#/"):
        raise ValueError(f"cannot resolve $ref {ref!r} (only local references)")
    node: Any = root
    for part in ref[2:].split("/"):
        node = node[part.replace("~1", "/").replace("~0", "~")]
    return node


def _sample_number(schema: dict[str, Any], *, integer: bool) -> int | float:
    """The least number the bounds allow (0 when 0 is allowed), a multiple of multipleOf."""
    low: float | None = None
    if "minimum" in schema:
        low = schema["minimum"]
    if "exclusiveMinimum" in schema:
        bound = schema["exclusiveMinimum"]
        low = math.floor(bound) + 1 if integer else bound + (abs(bound) or 1) * 1e-6
    high = schema.get("maximum", schema.get("exclusiveMaximum"))
    value: float = 0 if low is None or low <= 0 else low
    if high is not None and value >= high:
        value = low if low is not None else high - 1
    step = schema.get("multipleOf")
    if step:
        value = math.ceil(value / step) * step
    return math.ceil(value) if integer else float(value)


def _check_obs(spec: EnvSpec, obs: Any, where: str) -> None:
    try:
        spec.observation.check(obs, "observation")
    except (StadiumError, TypeError) as exc:
        raise EnvCheckError(
            f"{where} returned an observation that is not a valid {spec.observation.name}: {exc}",
            check=where,
        ) from None
    try:
        spec.json_encoder.encode(obs)
    except (TypeError, NotImplementedError) as exc:
        raise EnvCheckError(
            f"{where} returned an observation that cannot be encoded: {exc}"
        ) from None


async def _episode(
    spec: EnvSpec, seed: int, steps: int, actions: Sequence[Any] | None, log: list[str]
) -> list[bytes]:
    """Run one episode on a fresh instance; return the encoded transcript."""
    env = spec.factory()
    transcript: list[bytes] = []
    try:
        first = await _maybe_await(env.reset(seed=seed, options=None))
        obs = first.observation if isinstance(first, StepResult) else first
        _check_obs(spec, obs, "reset()")
        transcript.append(spec.json_encoder.encode(obs))
        for i, action in enumerate(_sample_actions(env, spec, steps, seed, actions)):
            result = await _maybe_await(env.step(action))
            if not isinstance(result, StepResult):
                result = StepResult(result)
            _check_obs(spec, result.observation, "step()")
            if result.reward is not None and not isinstance(result.reward, int | float):
                raise EnvCheckError(
                    f"step() reward must be a number or None, got {result.reward!r}"
                )
            if not isinstance(result.done, bool):
                raise EnvCheckError(f"step() done must be a bool, got {result.done!r}")
            transcript.append(
                spec.json_encoder.encode([result.observation, result.reward, result.done])
            )
            if i == 0:
                log.append(f"step() returns a valid {spec.observation.name} with reward/done")
            if result.done:
                break
        state = env.state
        builtins = msgspec.to_builtins(state, enc_hook=enc_hook_default)
        if not isinstance(builtins, dict):
            raise EnvCheckError(f"state must encode to an object, got {builtins!r}")
    finally:
        await _maybe_await(env.close())
    return transcript


def check_env(
    env_cls: type[Environment[Any, Any, Any]],
    *,
    steps: int = 5,
    seed: int = 0,
    actions: Sequence[Any] | None = None,
) -> list[str]:
    """Check ``env_cls`` against the environment contract; return what was checked.

    Checks: the class compiles (types declared, reset/step implemented); action,
    observation and state JSON Schemas; reset and step return valid, encodable
    observations with numeric reward and boolean done; state encodes to an
    object; close works; the same seed and actions give the same episode.

    Actions come from ``actions``, else ``env.sample_action(rng)``, else the
    action type's defaults.

    Raises:
        EnvCheckError: the first violation found, with what to fix.
    """
    log: list[str] = []
    try:
        spec = EnvSpec.of(env_cls)
    except StadiumError as exc:
        raise EnvCheckError(str(exc), check="class") from exc
    log.append(f"{spec.name}: class declares action, observation and state types")
    schemas = spec.schemas()
    for key in ("action", "observation", "state"):
        if "no schema" in str(schemas[key].get("description", "")):
            raise EnvCheckError(f"no JSON Schema can be derived for the {key} type", check="schema")
    log.append("JSON Schemas derive for action, observation and state")

    async def run() -> None:
        first = await _episode(spec, seed, steps, actions, log)
        log.append("reset() returns a valid observation; state encodes; close() works")
        second = await _episode(spec, seed, steps, actions, [])
        if first != second:
            raise EnvCheckError(
                f"two episodes with seed={seed} and the same actions differ: the env is not "
                "deterministic under a seed (seed every random source from reset's seed)",
                check="determinism",
            )
        log.append(f"deterministic under seed={seed} ({len(first)} observations compared)")

    try:
        _run_sync(run)
    except EnvCheckError:
        raise
    except Exception as exc:
        call, where = _raised_where(spec.name, exc)
        raise EnvCheckError(
            f"{call} raised {type(exc).__name__}: {exc}{where}", check="run"
        ) from exc
    return log


def _raised_where(name: str, exc: BaseException) -> tuple[str, str]:
    """Which of the env's calls raised ``exc`` and where, from its traceback: the first
    frame outside Stadium and the standard library is the env's method (``Game.reset()``; ``Game()``
    for its constructor), the last one in that method's file the line that raised
    (`` (at game.py:12)``)."""
    ours = (Path(__file__).resolve().parents[1], Path(sysconfig.get_paths()["stdlib"]).resolve())
    frames = [
        frame
        for frame in traceback.extract_tb(exc.__traceback__)
        if not any(root in Path(frame.filename).resolve().parents for root in ours)
    ]
    if not frames:
        return name, ""
    call = "()" if frames[0].name == "__init__" else f".{frames[0].name}()"
    last = [f for f in frames if f.filename == frames[0].filename][-1]
    return f"{name}{call}", f" (at {Path(last.filename).name}:{last.lineno})"


def _run_sync(fn: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """Run a coroutine to completion, also from code already inside an event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        asyncio.run(fn())
        return
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, fn()).result()

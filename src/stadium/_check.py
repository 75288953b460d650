"""``check_env``: exercise an environment class against the contract, like Gymnasium's.

Authors run it in their own tests (``stadium.check_env(MyEnv)``); ``stadium check
TARGET`` runs it from the shell, or checks a running server when TARGET is a URL.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import os
import random
import urllib.request
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import msgspec

from stadium._codecs import enc_hook_default
from stadium._env import Environment, StepResult
from stadium._errors import EnvCheckError, StadiumError
from stadium._spec import EnvSpec


async def _maybe_await(value: Any) -> Any:
    if inspect.isawaitable(value):
        return await value
    return value


def _sample_actions(
    env: Any, spec: EnvSpec, steps: int, seed: int, actions: Sequence[Any] | None
) -> list[Any]:
    if actions is not None:
        return [
            spec.action.convert(msgspec.to_builtins(a, enc_hook=enc_hook_default), "action")
            for a in actions
        ]
    rng = random.Random(f"stadium-check-actions-{seed}")  # not the env's own stream
    sampler = getattr(env, "sample_action", None)
    if callable(sampler):
        return [sampler(rng) for _ in range(steps)]
    try:
        default = spec.action.convert({}, "action")
    except StadiumError:
        raise EnvCheckError(
            f"cannot make an action for {spec.name}: its action type has required fields. "
            "Pass actions=[...] to check_env, or define sample_action(self, rng) on the env",
            check="sample_action",
        ) from None
    return [default] * steps


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
        raise EnvCheckError(f"{spec.name} raised {type(exc).__name__}: {exc}", check="run") from exc
    return log


def _run_sync(fn: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """Run a coroutine to completion, also from code already inside an event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        asyncio.run(fn())
        return
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, fn()).result()


def check_server(url: str) -> list[str]:
    """Check a running server: HTTP endpoints, then a session's reset, state and close.

    A server started with ``--auth-token`` is checked with ``$STADIUM_AUTH_TOKEN``.
    """
    from stadium._client import TOKEN_ENV, Client, ws_url

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
            raise EnvCheckError(f"GET {base}{path} failed: {exc}", check=path) from None
        if not isinstance(body, dict):
            raise EnvCheckError(f"GET {path} did not return a JSON object", check=path)
        log.append(f"GET {path} answers a JSON object")
    session: Client[Any] = Client(url, max_retries=2)
    with session as client:
        client.reset(seed=0)
        log.append("a WebSocket session answers reset")
        state = client.state()
        if not isinstance(state, dict) or "step_count" not in state:
            raise EnvCheckError(f"state reply lacks step_count: {state!r}", check="state")
        log.append("state carries step_count")
    log.append("close ends the session")
    return log


def check_target(target: str, *, steps: int = 5, seed: int = 0) -> list[str]:
    """``stadium check``: a URL is checked as a server, anything else as an env class."""
    if target.startswith(("ws://", "wss://", "http://", "https://")):
        return check_server(target)
    from stadium._loader import load_target

    return check_env(load_target(target), steps=steps, seed=seed)

"""Gymnasium-style clients: a remote Stadium session as a ``gymnasium.Env`` or ``VectorEnv``.

For trainers written against Gymnasium's API::

    import stadium.gym

    env = stadium.gym.make("http://127.0.0.1:8000")           # one remote session
    obs, info = env.reset(seed=0)
    obs, reward, terminated, truncated, info = env.step(env.action_space.sample())
    env.close()

    envs = stadium.gym.make_vec("http://127.0.0.1:8000", num_envs=64)   # 64 sessions
    obs, infos = envs.reset(seed=0)                # seeds 0..63, like Gymnasium's vector envs
    obs, rewards, terminations, truncations, infos = envs.step(envs.action_space.sample())

``make_vec``'s sessions are a :class:`stadium.SessionPool`'s: against a Stadium server
they share a few batch connections, one batch frame per ``step`` (``batch=False``: one
connection per session, resumable). Where a URL goes, several nodes may go too — a
list of URLs, a deployment file, or a DNS name for many addresses (see
:class:`stadium.AsyncClient`): ``make_vec``'s sessions then spread over the nodes by
free capacity.

The server must serve a Gymnasium env (``stadium serve gymnasium:CartPole-v1``):
its ``GET /schema`` carries the spaces, which are rebuilt here, so observations
come back with the same dtypes and shapes as the local env's. With
``msgpack=True`` arrays travel as binary (image frames); the default is JSON.

Requires ``pip install 'stadium-rl[gym]'``.
"""

from __future__ import annotations

import asyncio
import time
import urllib.request
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

import gymnasium
import msgspec
import numpy as np
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.vector.utils import batch_space, concatenate, create_empty_array, iterate

from stadium._client.balance import EndpointSpec, is_url, static_urls
from stadium._client.batch_pool import BatchSession
from stadium._client.pool import SessionPool, run_sync
from stadium._client.session import AsyncClient, ws_url
from stadium._env.codecs import UNREADABLE, unreadable_detail
from stadium._env.contract import StepResult
from stadium._errors import ConfigError, ConnectError, SessionError
from stadium.integrations.gymnasium import (
    decode_arrays,
    from_wire,
    space_from_dict,
    to_msgpack_wire,
    to_wire,
)

T = TypeVar("T")


def _http_base(url: str) -> str:
    base = ws_url(url).replace("ws://", "http://", 1).replace("wss://", "https://", 1)
    return base.rsplit("/ws", 1)[0]


def fetch_spaces(url: EndpointSpec, timeout: float = 10.0) -> dict[str, Any]:
    """The server's Gymnasium description from ``GET /schema``: id and rebuilt spaces.

    With several nodes, the first that answers tells (they serve the same env).

    Raises:
        ConnectError: no server can be reached.
        ConfigError: the server does not serve a Gymnasium env.
    """
    urls = [url] if isinstance(url, str) and is_url(url) else static_urls(url)
    failure: ConnectError | None = None
    for node in urls:
        schema_url = _http_base(node) + "/schema"
        try:
            schema = msgspec.json.decode(_read_bounded(schema_url, timeout))
            break
        except (OSError, TimeoutError) as exc:
            failure = ConnectError(f"cannot read {schema_url}: {exc}", url=schema_url)
            failure.__cause__ = exc
        except UNREADABLE as exc:
            raise ConfigError(
                f"{schema_url} is not a schema: {unreadable_detail(exc)}", url=schema_url
            ) from exc
    else:
        assert failure is not None
        raise failure
    info = schema.get("gymnasium") if isinstance(schema, dict) else None
    if not isinstance(info, dict):
        raise ConfigError(
            f"{url} does not serve a Gymnasium env ({schema_url} has no 'gymnasium' key); "
            "serve one with `stadium serve gymnasium:ENV_ID`, or use stadium.Client",
            url=url,
        )
    try:
        observation_space = space_from_dict(info["observation_space"])
        action_space = space_from_dict(info["action_space"])
    except ConfigError:
        raise
    except (
        LookupError,
        TypeError,
        ValueError,
        AttributeError,
        ArithmeticError,  # OverflowError: a number past C's
        RecursionError,
        MemoryError,  # a Box of 728 TiB: numpy refuses it before allocating
    ) as exc:
        raise ConfigError(
            f"{schema_url} describes a space that cannot be rebuilt ({type(exc).__name__}: "
            f"{str(exc)[:200]}): an old, foreign or broken server?",
            url=schema_url,
        ) from exc
    return {**info, "observation_space": observation_space, "action_space": action_space}


#: The largest ``GET /schema`` answer read (a server's is a few KB).
MAX_SCHEMA_BYTES = 16 * 1024 * 1024


def _read_bounded(url: str, timeout: float) -> bytes:
    """``url``'s body: at most :data:`MAX_SCHEMA_BYTES`, within ``timeout`` seconds in all
    (a server trickling bytes cannot hold it longer, nor a huge body fill memory)."""
    deadline = time.monotonic() + timeout
    chunks: list[bytes] = []
    size = 0
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        while chunk := resp.read1(65536):
            size += len(chunk)
            if size > MAX_SCHEMA_BYTES:
                raise ConfigError(f"{url} answered over {MAX_SCHEMA_BYTES} bytes: not a schema")
            if time.monotonic() > deadline:
                raise TimeoutError(f"no whole answer within {timeout:g}s")
            chunks.append(chunk)
    return b"".join(chunks)


def _run(coro: Coroutine[Any, Any, T]) -> T:
    return run_sync(coro)


class _GymSession:
    """One remote session and the conversions between wire values and space values."""

    def __init__(
        self,
        client: AsyncClient[Any] | BatchSession[Any],
        info: dict[str, Any],
        msgpack: bool,
    ) -> None:
        self.client = client
        self.obs_space = info["observation_space"]
        self.act_space = info["action_space"]
        self.msgpack = msgpack

    async def reset(
        self, seed: int | None, options: dict[str, Any] | None
    ) -> tuple[Any, dict[str, Any]]:
        extra: dict[str, Any] = {"options": options} if options is not None else {}
        result = await self.client.reset(seed=seed, **extra)
        return self._obs(result), self._info(result)

    async def step(self, action: Any) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        result = await self.client.step(action)
        reward = float(result.reward) if result.reward is not None else 0.0
        return self._obs(result), reward, result.terminated, result.truncated, self._info(result)

    def _obs(self, result: StepResult[Any]) -> Any:
        return from_wire(
            self.obs_space, decode_arrays(result.observation), "observation", check=False
        )

    def _info(self, result: StepResult[Any]) -> dict[str, Any]:
        if not result.info:
            return {}
        if self.msgpack:
            return dict(decode_arrays(result.info))
        return _lists_to_arrays(result.info)


def _encoder(msgpack: bool) -> Any:
    return to_msgpack_wire if msgpack else to_wire


def _lists_to_arrays(info: dict[str, Any]) -> dict[str, Any]:
    """JSON cannot tell an array from a list: numeric lists in ``info`` become arrays.

    Gymnasium envs put numpy arrays in ``info`` (and vector envs stack them);
    a MessagePack session carries them exactly, dtype included.
    """
    out: dict[str, Any] = {}
    for key, value in info.items():
        if isinstance(value, dict):
            value = _lists_to_arrays(value)
        elif isinstance(value, list) and value:
            try:
                arr = np.asarray(value)
            except ValueError:  # ragged
                arr = None
            if arr is not None and arr.dtype.kind in "biuf":
                value = arr
        out[key] = value
    return out


class RemoteEnv(gymnasium.Env[Any, Any]):
    """A ``gymnasium.Env`` backed by one remote Stadium session.

    Reset, step and close go over one WebSocket; observations come back as the
    remote env's spaces describe them (dtype, shape), so a rollout is the same
    as the local env's for the same seed and actions. ``render`` is not supported.

    Args:
        url: the server (``http://host:port``), or several nodes (a list of URLs, a
            deployment file, a DNS name for many addresses): the session opens on the
            one with the most room.
        msgpack: MessagePack frames, arrays as binary (recommended for images).
        **client_kwargs: passed to :class:`stadium.AsyncClient` (timeouts, retries).
    """

    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(self, url: EndpointSpec, *, msgpack: bool = False, **client_kwargs: Any) -> None:
        info = fetch_spaces(url)
        self.url = url
        self.gym_id: str = str(info.get("id"))
        self.observation_space = info["observation_space"]
        self.action_space = info["action_space"]
        self.render_mode = None
        self.metadata = {"render_modes": [], "render_fps": info.get("render_fps")}
        # Actions go out as the space's wire form (arrays as binary extensions with
        # MessagePack), which msgspec.to_builtins, the client's default, cannot carry.
        client: AsyncClient[Any] = AsyncClient(
            url, msgpack=msgpack, action_encoder=_encoder(msgpack), **client_kwargs
        )
        self._session = _GymSession(client, info, msgpack)
        self._closed = False

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        super().reset(seed=seed)
        return _run(self._session.reset(seed, options))

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        return _run(self._session.step(action))

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            _run(self._session.client.close())

    def __repr__(self) -> str:
        return f"<RemoteEnv {self.gym_id} at {self.url}>"


class RemoteVectorEnv(VectorEnv[Any, Any, Any]):
    """A ``gymnasium.vector.VectorEnv`` over ``num_envs`` remote sessions, stepped concurrently.

    Autoreset follows Gymnasium's default (``AutoresetMode.NEXT_STEP``): after a
    sub-env terminates or truncates, the next ``step`` resets it (its action is
    ignored, reward 0, not terminated) and returns the new episode's first
    observation. ``reset(seed=s)`` seeds the sub-envs ``s, s+1, …``, as
    ``SyncVectorEnv`` does; ``options={"reset_mask": mask}`` resets some of them.
    The sessions are a :class:`stadium.SessionPool`'s: against a Stadium server they
    share a few batch connections and each ``reset``/``step`` is one batch frame per
    connection (``batch=False`` for one connection per session, e.g. resumable ones);
    against other servers one connection per session, all requests sent at once on the
    client's shared event loop. ``url`` may name several nodes (a list of URLs, a
    deployment file, a DNS name for many addresses): the sessions spread over them by
    free capacity. Keyword arguments go to :class:`stadium.SessionPool`.
    """

    def __init__(
        self, url: EndpointSpec, num_envs: int, *, msgpack: bool = False, **client_kwargs: Any
    ) -> None:
        if num_envs < 1:
            raise ConfigError(f"num_envs must be at least 1, got {num_envs}")
        info = fetch_spaces(url)
        self.url = url
        self.num_envs = num_envs
        self.single_observation_space = info["observation_space"]
        self.single_action_space = info["action_space"]
        self.observation_space = batch_space(self.single_observation_space, num_envs)
        self.action_space = batch_space(self.single_action_space, num_envs)
        self.metadata = {"autoreset_mode": AutoresetMode.NEXT_STEP, "render_modes": []}
        self.render_mode = None
        self._info, self._msgpack = info, msgpack
        self._pool: SessionPool[Any] = SessionPool(
            url, num_envs, msgpack=msgpack, action_encoder=_encoder(msgpack), **client_kwargs
        )
        self._open_sessions: list[_GymSession] | None = None
        self._autoreset = np.zeros(num_envs, dtype=np.bool_)
        self._obs: Any = create_empty_array(self.single_observation_space, num_envs)
        self._env_obs: list[Any] = [None] * num_envs

    @property
    def _sessions(self) -> list[_GymSession]:
        """The sessions, the pool opened on first use (it then chooses batching or not)."""
        if self._open_sessions is None:
            _run(self._pool.open())
            self._open_sessions = [
                _GymSession(c, self._info, self._msgpack) for c in self._pool.clients
            ]
        return self._open_sessions

    def reset(
        self,
        *,
        seed: int | Sequence[int | None] | None = None,
        options: dict[str, Any] | None = None,
    ) -> tuple[Any, dict[str, Any]]:
        n = self.num_envs
        if seed is None:
            seeds: list[int | None] = [None] * n
        elif isinstance(seed, int):
            seeds = [seed + i for i in range(n)]
        else:
            seeds = list(seed)
        if len(seeds) != n:
            raise ValueError(f"got {len(seeds)} seeds for num_envs={n}")
        options = dict(options) if options is not None else None
        mask = np.ones(n, dtype=np.bool_)
        if options is not None and "reset_mask" in options:
            mask = np.asarray(options.pop("reset_mask"), dtype=np.bool_)
            if mask.shape != (n,) or not mask.any():
                raise ValueError(f"options['reset_mask'] must be {n} booleans, at least one True")
        chosen = [i for i in range(n) if mask[i]]
        sessions = self._sessions  # here, not in the loop thread: it may open the pool
        results = _run(_gather([sessions[i].reset(seeds[i], options or None) for i in chosen]))
        infos: dict[str, Any] = {}
        for i, (obs, info) in zip(chosen, results, strict=True):
            self._env_obs[i] = obs
            self._autoreset[i] = False
            infos = self._add_info(infos, info, i)
        self._obs = concatenate(self.single_observation_space, self._env_obs, self._obs)
        return _copy(self._obs), infos

    def step(
        self, actions: Any
    ) -> tuple[
        Any, np.ndarray[Any, Any], np.ndarray[Any, Any], np.ndarray[Any, Any], dict[str, Any]
    ]:
        if any(obs is None for obs in self._env_obs):
            raise SessionError("reset the vector env before stepping it")
        acts = list(iterate(self.action_space, actions))
        if len(acts) != self.num_envs:
            raise ValueError(f"got {len(acts)} actions for num_envs={self.num_envs}")
        coros = [
            s.reset(None, None) if self._autoreset[i] else s.step(acts[i])
            for i, s in enumerate(self._sessions)
        ]
        results = _run(_gather(coros))
        rewards = np.zeros(self.num_envs, dtype=np.float64)
        terminations = np.zeros(self.num_envs, dtype=np.bool_)
        truncations = np.zeros(self.num_envs, dtype=np.bool_)
        infos: dict[str, Any] = {}
        for i, result in enumerate(results):
            if self._autoreset[i]:
                self._env_obs[i], info = result
            else:
                self._env_obs[i], rewards[i], terminations[i], truncations[i], info = result
            infos = self._add_info(infos, info, i)
        self._autoreset = np.logical_or(terminations, truncations)
        self._obs = concatenate(self.single_observation_space, self._env_obs, self._obs)
        return _copy(self._obs), rewards, terminations, truncations, infos

    def close_extras(self, **kwargs: Any) -> None:
        _run(self._pool.close())

    def __repr__(self) -> str:
        return f"<RemoteVectorEnv num_envs={self.num_envs} at {self.url}>"


async def _gather(coros: Any) -> list[Any]:
    return list(await asyncio.gather(*coros))


def _copy(obs: Any) -> Any:
    if isinstance(obs, np.ndarray):
        return obs.copy()
    if isinstance(obs, dict):
        return {k: _copy(v) for k, v in obs.items()}
    if isinstance(obs, tuple):
        return tuple(_copy(v) for v in obs)
    return obs


def make(url: EndpointSpec, *, msgpack: bool = False, **client_kwargs: Any) -> RemoteEnv:
    """A ``gymnasium.Env`` backed by one session of the Gymnasium env served at ``url``.

    Raises:
        ConnectError: the server cannot be reached.
        ConfigError: the server does not serve a Gymnasium env.
    """
    return RemoteEnv(url, msgpack=msgpack, **client_kwargs)


def make_vec(
    url: EndpointSpec, num_envs: int, *, msgpack: bool = False, **client_kwargs: Any
) -> RemoteVectorEnv:
    """A ``gymnasium.vector.VectorEnv`` over ``num_envs`` sessions at ``url``.

    Autoreset is Gymnasium's default, ``NEXT_STEP``; see :class:`RemoteVectorEnv`.
    """
    return RemoteVectorEnv(url, num_envs, msgpack=msgpack, **client_kwargs)


__all__ = ["RemoteEnv", "RemoteVectorEnv", "fetch_spaces", "make", "make_vec"]

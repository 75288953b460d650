"""Blocking clients and batches of sessions, over :class:`~stadium._client.AsyncClient`.

:class:`Client` is one session for synchronous code (every sync client of a process
shares one background event loop thread, :func:`run_sync`); :class:`SessionPool`
drives N sessions together, the way a trainer steps a batch of episodes.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Coroutine, Iterable, Sequence
from typing import Any, Generic, TypeVar

from stadium._balance import EndpointSpec
from stadium._client import AsyncClient
from stadium._env import StepResult

T = TypeVar("T")
ObsT = TypeVar("ObsT")


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` on the background loop every sync client shares; block for its result."""
    return _LoopThread.run(coro)


class _LoopThread:
    """One background event loop shared by every sync :class:`Client` in the process."""

    _lock = threading.Lock()
    _loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    def run(cls, coro: Coroutine[Any, Any, T]) -> T:
        with cls._lock:
            if cls._loop is None or cls._loop.is_closed():
                loop = asyncio.new_event_loop()
                threading.Thread(
                    target=loop.run_forever, name="stadium-client", daemon=True
                ).start()
                cls._loop = loop
            loop = cls._loop
        return asyncio.run_coroutine_threadsafe(coro, loop).result()


class Client(Generic[ObsT]):
    """A blocking session client; same arguments and methods as :class:`AsyncClient`.

    All sync clients of a process share one background event loop thread. ``url`` may
    name several nodes (a list, a deployment file, a DNS name for many addresses).
    """

    def __init__(self, url: EndpointSpec, **kwargs: Any) -> None:
        self._client: AsyncClient[ObsT] = AsyncClient(url, **kwargs)

    @property
    def url(self) -> str:
        """The session's URL (the node it landed on, once open)."""
        return self._client.url

    @property
    def endpoint(self) -> str | None:
        """The base URL of a balanced session's node (None for one plain URL)."""
        return self._client.endpoint

    def connect(self) -> Client[ObsT]:
        _LoopThread.run(self._client.connect())
        return self

    def close(self) -> None:
        _LoopThread.run(self._client.close())

    def __enter__(self) -> Client[ObsT]:
        return self.connect()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def reset(
        self, *, seed: int | None = None, episode_id: str | None = None, **options: Any
    ) -> StepResult[ObsT]:
        return _LoopThread.run(self._client.reset(seed=seed, episode_id=episode_id, **options))

    def step(self, action: Any) -> StepResult[ObsT]:
        return _LoopThread.run(self._client.step(action))

    def state(self) -> Any:
        return _LoopThread.run(self._client.state())


class SessionPool(Generic[ObsT]):
    """N sessions driven together, the way a trainer steps a batch of episodes.

    ``reset``/``step`` take one argument per session and return results in
    session order; a failed session raises unless ``return_exceptions=True``.

    At most ``connect_concurrency`` sessions connect at once: a server's accept
    queue is finite (``somaxconn``, 4,096 by default on Linux), and a burst
    beyond it loses SYNs that the kernel retries only after 1 s, then 3 s.

    ``url`` may name several nodes (a list of URLs, a deployment file, a DNS name for
    many addresses): the sessions spread over them by free capacity, all the pool's
    clients sharing one balancer.

    Example::

        async with SessionPool(url, size=256) as pool:
            firsts = await pool.reset(seeds=range(256))
            results = await pool.step([{"wait_seconds": 0.0}] * 256)
    """

    def __init__(
        self,
        url: EndpointSpec,
        size: int,
        *,
        connect_concurrency: int = 1024,
        **client_kwargs: Any,
    ) -> None:
        if size < 1:
            raise ValueError("a SessionPool needs at least one session")
        if connect_concurrency < 1:
            raise ValueError("connect_concurrency must be at least 1")
        self.connect_concurrency = connect_concurrency
        self.clients: list[AsyncClient[ObsT]] = [
            AsyncClient(url, **client_kwargs) for _ in range(size)
        ]

    def __len__(self) -> int:
        return len(self.clients)

    async def __aenter__(self) -> SessionPool[ObsT]:
        window = asyncio.Semaphore(self.connect_concurrency)

        async def connect(client: AsyncClient[ObsT]) -> None:
            async with window:
                await client.connect()

        await self._gather(connect(c) for c in self.clients)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self.clients), return_exceptions=True)

    async def reset(
        self,
        seeds: Iterable[int | None] | None = None,
        *,
        return_exceptions: bool = False,
        **options: Any,
    ) -> list[StepResult[ObsT]]:
        seed_list: Sequence[int | None] = list(seeds) if seeds is not None else [None] * len(self)
        if len(seed_list) != len(self):
            raise ValueError(f"got {len(seed_list)} seeds for {len(self)} sessions")
        return await self._gather(
            (c.reset(seed=s, **options) for c, s in zip(self.clients, seed_list, strict=True)),
            return_exceptions,
        )

    async def step(
        self, actions: Sequence[Any], *, return_exceptions: bool = False
    ) -> list[StepResult[ObsT]]:
        if len(actions) != len(self):
            raise ValueError(f"got {len(actions)} actions for {len(self)} sessions")
        return await self._gather(
            (c.step(a) for c, a in zip(self.clients, actions, strict=True)), return_exceptions
        )

    @staticmethod
    async def _gather(coros: Iterable[Awaitable[T]], return_exceptions: bool = False) -> list[T]:
        results = await asyncio.gather(*coros, return_exceptions=return_exceptions)
        return list(results)  # type: ignore[arg-type]


__all__ = ["Client", "SessionPool", "run_sync"]

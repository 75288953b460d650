"""Blocking clients and batches of sessions.

:class:`Client` is one session for synchronous code (every sync client of a process
shares one background event loop thread, :func:`run_sync`); :class:`SessionPool`
drives N sessions together, the way a trainer steps a batch of episodes: over a few
batch connections (:mod:`stadium._client.batch`) when the server speaks batches, else
one :class:`~stadium._client.session.AsyncClient` per session.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import threading
from collections.abc import Awaitable, Coroutine, Iterable, Sequence
from functools import partial
from typing import Any, Generic, TypeVar

from stadium._client.balance import EndpointSpec, balancer_for, is_plain, is_url
from stadium._client.batch import call, result_of
from stadium._client.batch_pool import BatchGroup, BatchSession
from stadium._client.options import ConnectOptions
from stadium._client.session import AsyncClient
from stadium._env.contract import StepResult
from stadium._errors import (
    ConfigError,
    ConnectError,
    SessionClosedError,
    SessionError,
    StadiumError,
)

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

    ``reset``/``step``/``state`` take one argument per session and return results in
    session order; a failed session raises unless ``return_exceptions=True``.

    **Batches.** Against a Stadium server the sessions share a few connections
    (``sessions_per_connection`` each, 256 by default) and each ``reset``/``step``/
    ``state``/``close`` of the pool is one batch frame per connection each way
    (docs/PROTOCOL.md, "Batches"); errors stay per session. The pool asks for it when
    it opens (``batch=None``, the default): a server that does not speak batches
    (OpenEnv's) gets one connection per session, as before. ``batch=False`` never
    batches, ``batch=True`` insists (:class:`ConnectError` if the server refuses).
    Batched sessions resume as :class:`AsyncClient`'s do (a lost connection's sessions
    are taken back together on a new one; against a server with ``--resume-grace 0`` a
    lost connection fails their calls with :class:`SessionClosedError` until a ``reset``
    starts anew on a new connection). Several nodes (a list of
    URLs, a deployment file, a DNS name with several addresses) always get one connection
    per session, spread over the nodes by free capacity, all the pool's clients sharing
    one balancer.

    :attr:`clients` are the sessions one by one (``await pool.clients[i].step(a)``);
    their calls made in the same event-loop iteration go out as one batch frame.

    **EnvPool-style asynchronous batching**: :meth:`send` steps some sessions and
    returns at once; :meth:`recv` returns the results that are ready first, as
    ``(session index, StepResult)`` pairs. EnvPool's ``send(action, env_id)`` /
    ``recv()`` with ``batch_size`` map to ``send(actions, ids)`` / ``recv()`` with
    ``SessionPool(..., batch_size=K)``: the server answers each batch as soon as ``K``
    of its results are ready (``first``) and streams the rest.

    At most ``connect_concurrency`` sessions connect at once (per-session mode): a
    server's accept queue is finite (``somaxconn``, 4,096 by default on Linux), and a
    burst beyond it loses SYNs that the kernel retries only after 1 s, then 3 s.

    Example::

        async with SessionPool(url, size=256) as pool:
            firsts = await pool.reset(seeds=range(256))
            results = await pool.step([{"wait_seconds": 0.0}] * 256)

            await pool.send([{"wait_seconds": 0.0}] * 256)    # all sessions
            for index, result in await pool.recv(64):        # the first 64 (or more) ready
                await pool.send([policy(result)], [index])
    """

    def __init__(
        self,
        url: EndpointSpec,
        size: int,
        *,
        connect_concurrency: int = 1024,
        batch: bool | None = None,
        sessions_per_connection: int = 256,
        batch_size: int | None = None,
        **client_kwargs: Any,
    ) -> None:
        if size < 1:
            raise ValueError("a SessionPool needs at least one session")
        if connect_concurrency < 1:
            raise ValueError("connect_concurrency must be at least 1")
        if sessions_per_connection < 1:
            raise ConfigError(
                f"sessions_per_connection must be at least 1, got {sessions_per_connection}"
            )
        if batch_size is not None and not 1 <= batch_size <= size:
            raise ConfigError(f"batch_size must be between 1 and the pool's size ({size})")
        one_url = is_url(url)  # a DNS name may still be several nodes: asked when opening
        if batch and not one_url:
            raise ConfigError(
                "batch=True needs one server URL (e.g. http://127.0.0.1:8000); several nodes "
                "(a list of URLs, a deployment file) get one connection per session: pass "
                "batch=None"
            )
        self.connect_concurrency = connect_concurrency
        self.url = url
        self.size = size
        self.batch = batch
        self.sessions_per_connection = sessions_per_connection
        self.batch_size = batch_size
        # The keywords are AsyncClient's (a batching pool takes the same): refused now, not
        # when the pool opens.
        inspect.signature(AsyncClient).bind(url, **client_kwargs)
        self.options: ConnectOptions
        """The connection options every session of the pool shares (one object)."""
        self.options, self._kwargs = ConnectOptions.split(client_kwargs)
        self._clients: list[AsyncClient[ObsT]] | None = None
        self._group: BatchGroup[ObsT] | None = None
        if batch is False or not one_url:
            self._clients = [self._client(url) for _ in range(size)]
        self._opening: asyncio.Future[None] | None = None
        self._opened = False
        # send/recv: the sessions with a step in flight, the results arrived
        self._inflight: set[int] = set()
        self._ready: collections.deque[tuple[int, Any]] = collections.deque()
        self._arrived: asyncio.Event | None = None
        self._tasks: list[asyncio.Task[Any]] = []  # per-session mode: the steps sent

    def __len__(self) -> int:
        return self.size

    def _client(self, url: EndpointSpec) -> AsyncClient[ObsT]:
        return AsyncClient(url, options=self.options, **self._kwargs)

    @property
    def batching(self) -> bool | None:
        """Whether the sessions share batch connections (None until the pool is open)."""
        if self._group is not None:
            return True
        return False if self._clients is not None else None

    @property
    def clients(self) -> Sequence[AsyncClient[ObsT] | BatchSession[ObsT]]:
        """The sessions one by one: :class:`AsyncClient`\\ s, or :class:`BatchSession`\\ s
        (same request methods) when batching.

        Raises:
            SessionError: the pool is not open yet and has not chosen.
        """
        if self._group is not None:
            return self._group.sessions
        if self._clients is None:
            raise SessionError(
                "the pool is not open yet (it decides then whether its sessions share batch "
                "connections): use `async with SessionPool(...)` or `await pool.open()`"
            )
        return self._clients

    async def open(self) -> SessionPool[ObsT]:
        """Open the pool: its batch connections, or every session's connection."""
        if self._opened:
            return self
        if self._opening is None:
            self._opening = asyncio.ensure_future(self._open())
        await asyncio.shield(self._opening)
        return self

    async def _open(self) -> None:
        try:
            if self._clients is None:
                url = self.url
                assert isinstance(url, str)
                group: BatchGroup[ObsT] | None = None
                if is_plain(url) or await balancer_for(url, ssl=self.options.ssl).direct():
                    group = await BatchGroup.open(
                        url,
                        self.size,
                        self.sessions_per_connection,
                        options=self.options,
                        **self._kwargs,
                    )
                elif self.batch:
                    raise ConfigError(
                        f"batch=True needs one server: {url} names several addresses (their "
                        "sessions spread over them one connection each): pass batch=None",
                        url=url,
                    )
                if group is None and self.batch:
                    raise ConnectError(
                        f"the server at {url} does not speak batches (the stadium.batch "
                        "subprotocol): it is not a Stadium server, or an older one; pass "
                        "batch=None to fall back to one connection per session",
                        url=url,
                    )
                if group is not None:
                    self._group = group
                    self._opened = True
                    return
                self._clients = [self._client(url) for _ in range(self.size)]
            window = asyncio.Semaphore(self.connect_concurrency)

            async def connect(client: AsyncClient[ObsT]) -> None:
                async with window:
                    await client.connect()

            await self._gather(connect(c) for c in self._clients)
            self._opened = True
        finally:
            self._opening = None

    async def _sessions(self) -> Sequence[AsyncClient[ObsT] | BatchSession[ObsT]]:
        if self._clients is None and self._group is None:
            await self.open()
        return self.clients

    async def __aenter__(self) -> SessionPool[ObsT]:
        return await self.open()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """End every session (batching: one ``close`` batch frame per connection)."""
        for task in self._tasks:
            task.cancel()
        if self._group is not None:
            await self._group.close()
        elif self._clients is not None:
            await asyncio.gather(*(c.close() for c in self._clients), return_exceptions=True)
        self._opened = False

    async def reset(
        self,
        seeds: Iterable[int | None] | None = None,
        *,
        return_exceptions: bool = False,
        **options: Any,
    ) -> list[StepResult[ObsT]]:
        """Reset every session (``seeds``: one per session, or None); a session refused
        admission (``CAPACITY_REACHED``) is retried with backoff up to ``max_retries``."""
        seed_list: Sequence[int | None] = list(seeds) if seeds is not None else [None] * len(self)
        if len(seed_list) != len(self):
            raise ValueError(f"got {len(seed_list)} seeds for {len(self)} sessions")
        sessions = await self._sessions()
        return await self._gather(
            (c.reset(seed=s, **options) for c, s in zip(sessions, seed_list, strict=True)),
            return_exceptions,
        )

    async def step(
        self, actions: Sequence[Any], *, return_exceptions: bool = False
    ) -> list[StepResult[ObsT]]:
        """Step every session, one action each."""
        if len(actions) != len(self):
            raise ValueError(f"got {len(actions)} actions for {len(self)} sessions")
        sessions = await self._sessions()
        group = self._group
        if group is not None:  # one frame per connection, no task per session
            futures = group.step_all(actions)
            if futures is not None:
                return await group.results(futures, return_exceptions)
        return await self._gather(
            (c.step(a) for c, a in zip(sessions, actions, strict=True)), return_exceptions
        )

    async def state(self, *, return_exceptions: bool = False) -> list[Any]:
        """Every session's state, in session order."""
        sessions = await self._sessions()
        return await self._gather((c.state() for c in sessions), return_exceptions)

    # -- EnvPool-style send / recv ------------------------------------------------

    async def send(self, actions: Sequence[Any], ids: Sequence[int] | None = None) -> None:
        """Step the sessions ``ids`` (default: all), ``actions[k]`` for ``ids[k]``, without
        waiting: :meth:`recv` returns the results as they are ready. EnvPool's
        ``send(action, env_id)``.

        Raises:
            SessionError: a session of ``ids`` has a step in flight (``recv`` it first).
        """
        id_list = list(range(len(self))) if ids is None else [int(i) for i in ids]
        if len(actions) != len(id_list):
            raise ValueError(f"got {len(actions)} actions for {len(id_list)} ids")
        if len(set(id_list)) != len(id_list):
            raise ValueError("each id may appear once in a send")
        for i in id_list:
            if not 0 <= i < len(self):
                raise ValueError(f"id {i} is not a session of this pool (0..{len(self) - 1})")
            if i in self._inflight:
                raise SessionError(f"session {i} already has a step in flight: recv it first")
        sessions = await self._sessions()
        if self._arrived is None:
            self._arrived = asyncio.Event()
        self._inflight.update(id_list)
        group = self._group
        if group is None:
            for i, action in zip(id_list, actions, strict=True):
                task = asyncio.ensure_future(sessions[i].step(action))
                self._tasks.append(task)
                task.add_done_callback(partial(self._task_done, i))
            return
        group.flush()  # calls made before this send go out before it
        per = self.sessions_per_connection
        by_conn: dict[int, list[tuple[int, Any]]] = {}
        for i, action in zip(id_list, actions, strict=True):
            session = group.sessions[i]
            if session.generation != session.coalescer.generation or session.coalescer.conn.closed:
                self._arrive(
                    i,
                    SessionClosedError(f"{session.lost or 'connection lost'}; reset to start anew"),
                )
                continue
            by_conn.setdefault(i // per, []).append((i, group.action_encoder(action)))
        for c, items in by_conn.items():
            ids_here = [i for i, _ in items]
            calls = [call(i, "step", data) for i, data in items]
            first = min(self.batch_size, len(calls)) if self.batch_size else 1
            sink = _Sink(self, ids_here, group.observation_type)
            try:
                group.conns[c].submit(calls, first, sink)
            except SessionClosedError as exc:
                sink.put_nowait((-1, exc))

    def _task_done(self, index: int, task: asyncio.Task[Any]) -> None:
        tasks = self._tasks
        if task in tasks:
            tasks.remove(task)
        if task.cancelled():
            self._inflight.discard(index)
            if self._arrived is not None:
                self._arrived.set()  # a recv waiting for it must not wait forever
            return
        exc = task.exception()
        self._arrive(index, exc if exc is not None else task.result())

    def _arrive(self, index: int, result: Any) -> None:
        if index in self._inflight:
            self._inflight.discard(index)
            self._ready.append((index, result))
            if self._arrived is not None:
                self._arrived.set()

    async def recv(
        self, n: int | None = None, *, return_exceptions: bool = False
    ) -> list[tuple[int, StepResult[ObsT]]]:
        """The results ready first: ``(session index, StepResult)`` pairs, at least ``n``
        of them (default: the pool's ``batch_size``, else every step in flight), and any
        others already arrived. EnvPool's ``recv()``.

        A session's error raises (the other results stay for the next ``recv``), or with
        ``return_exceptions`` comes as its exception in place of the result.

        Raises:
            SessionError: nothing was sent, or ``n`` is more than is in flight and ready.
        """
        pending = len(self._inflight) + len(self._ready)
        if n is None:
            n = self.batch_size if self.batch_size is not None else pending
            n = min(n, pending)
        if pending == 0:
            raise SessionError("no step in flight: send(actions, ids) first")
        if not 1 <= n <= pending:
            raise SessionError(f"recv({n}): only {pending} steps are in flight or ready")
        arrived = self._arrived
        assert arrived is not None
        while len(self._ready) < n:
            if len(self._ready) + len(self._inflight) < n:
                raise SessionClosedError("the steps in flight were abandoned: the pool closed")
            arrived.clear()
            await arrived.wait()
        out = list(self._ready)
        self._ready.clear()
        if not return_exceptions:
            for k, (_, result) in enumerate(out):
                if isinstance(result, BaseException):
                    self._ready.extendleft(reversed(out[:k] + out[k + 1 :]))
                    raise result
        return out

    @staticmethod
    async def _gather(coros: Iterable[Awaitable[T]], return_exceptions: bool = False) -> list[T]:
        results = await asyncio.gather(*coros, return_exceptions=return_exceptions)
        return list(results)  # type: ignore[arg-type]


class _Sink:
    """Where a sent batch's results stream to: into the pool's ready results, by session."""

    def __init__(self, pool: SessionPool[Any], ids: list[int], observation_type: Any) -> None:
        self.pool = pool
        self.ids = ids
        self.observation_type = observation_type

    def put_nowait(self, item: tuple[int, Any]) -> None:
        at, entry = item
        if at < 0:  # the whole batch failed (connection lost, frame refused)
            for i in self.ids:
                self.pool._arrive(i, entry)
            return
        try:
            result: Any = result_of(entry, self.observation_type)
        except StadiumError as exc:
            result = exc
        self.pool._arrive(self.ids[at], result)


__all__ = ["Client", "SessionPool", "run_sync"]

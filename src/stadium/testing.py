"""Test helpers: drive a server's sessions in memory, with no sockets.

A transport gives each :class:`~stadium._server.sessions.runner.Session` a channel with two
methods, ``send(frame)`` and ``close(code, reason)``. :class:`MemoryChannel` is
that channel in memory, so a test (or a benchmark that counts calls) can feed a
session frames and read its replies exactly as the picows and ASGI transports
do, without a socket or a clock::

    async with memory_runtime("echo") as runtime:
        session, channel = open_session(runtime)
        reply = await channel.request(session, b'{"type": "reset"}')

Used by ``tests/`` (the ``memory_runtime`` fixture) and by ``stadium bench ops``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from stadium._core.protocol import Encoding
from stadium._env.contract import Environment
from stadium._server.config import ServerConfig
from stadium._server.processes.worker import Worker
from stadium._server.runtime import Runtime
from stadium._server.sessions.runner import Session


class MemoryChannel:
    """A session's channel in memory: counts (and optionally keeps) frames, records the close.

    Args:
        keep_frames: keep every frame in :attr:`frames` (off when only counting,
            so that a long run allocates nothing per frame).

    Attributes:
        frames: the frames sent, oldest first (unread ones; see :meth:`next_frame`).
        replies, bytes: how many frames and bytes were sent in all.
        closed: ``(code, reason)`` once the session closed the connection.
    """

    __slots__ = ("_waiter", "bytes", "closed", "frames", "keep_frames", "replies")

    def __init__(self, *, keep_frames: bool = True) -> None:
        self.keep_frames = keep_frames
        self.frames: collections.deque[bytes] = collections.deque()
        self.replies = 0
        self.bytes = 0
        self.closed: tuple[int, str] | None = None
        self._waiter: asyncio.Future[None] | None = None

    # -- the Channel protocol (what the session calls) ------------------------------

    def send(self, data: bytes) -> None:
        self.replies += 1
        self.bytes += len(data)
        if self.keep_frames:
            self.frames.append(data)
        self._wake()

    def close(self, code: int, reason: str) -> None:
        self.closed = (code, reason)
        self._wake()

    # -- for tests --------------------------------------------------------------------

    def sent(self) -> asyncio.Future[None]:
        """A future resolved by the next ``send`` or ``close``."""
        self._waiter = asyncio.get_running_loop().create_future()
        return self._waiter

    async def next_frame(self, limit_s: float = 5.0) -> bytes:
        """The oldest unread frame, waiting up to ``limit_s`` s for one.

        Raises:
            ConnectionError: the session closed the connection with no frame left.
            TimeoutError: nothing came in time.
        """
        async with asyncio.timeout(limit_s):
            while not self.frames:
                if self.closed is not None:
                    raise ConnectionError(f"the session closed the connection: {self.closed}")
                await self.sent()
        return self.frames.popleft()

    async def request(self, session: Session, frame: bytes | str, limit_s: float = 5.0) -> bytes:
        """Feed ``frame`` to ``session`` and return the next frame it sends."""
        session.feed(frame)
        return await self.next_frame(limit_s)

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)


def open_session(
    runtime: Runtime, encoding: Encoding = Encoding.JSON, *, keep_frames: bool = True
) -> tuple[Session, MemoryChannel]:
    """A started session of ``runtime`` on a new :class:`MemoryChannel` (call in a loop)."""
    channel = MemoryChannel(keep_frames=keep_frames)
    session = Session(runtime, channel, encoding)
    session.start()
    return session, channel


@contextlib.asynccontextmanager
async def memory_runtime(
    target: str | type[Environment[Any, Any, Any]], **config: Any
) -> AsyncIterator[Runtime]:
    """The runtime a worker serving ``target`` would have; ``config``: ServerConfig fields.

    Its sessions are ended and its thread pool stopped on exit.
    """
    env_cls = None if isinstance(target, str) else target
    name = target if isinstance(target, str) else target.__qualname__
    worker = Worker.build(ServerConfig(target=name, **config), env_cls)
    runtime = worker.runtime
    try:
        yield runtime
    finally:
        for session in list(runtime.sessions):
            session.connection_lost()
        runtime.shutdown()


__all__ = ["MemoryChannel", "memory_runtime", "open_session"]

"""A TCP relay a test controls, for fault injection between a client and a server.

Every connection accepted on ``relay.url`` is piped to the upstream address. The
test can cut all open connections (:meth:`Relay.cut`), drop the bytes going one
way while keeping the connection up (``drop_up`` / ``drop_down``: client to
server, server to client), and refuse new connections for a while
(``refusing``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


class Relay:
    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.drop_up = False
        self.drop_down = False
        self.refusing = False
        self.accepted = 0
        self._server: asyncio.Server | None = None
        self._pipes: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def port(self) -> int:
        assert self._server is not None
        return int(self._server.sockets[0].getsockname()[1])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.refusing:
            writer.transport.abort()
            return
        self.accepted += 1
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            writer.transport.abort()
            return
        pair = (writer, up_writer)
        self._pipes.add(pair)
        for task in (
            asyncio.create_task(self._pipe(reader, up_writer, up=True)),
            asyncio.create_task(self._pipe(up_reader, writer, up=False)),
        ):
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pipe(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, up: bool
    ) -> None:
        with contextlib.suppress(OSError, asyncio.CancelledError):
            while data := await reader.read(65536):
                if self.drop_up if up else self.drop_down:
                    continue
                writer.write(data)
                await writer.drain()
        writer.transport.abort()

    def cut(self) -> int:
        """Abort every open connection, both sides (the server sees a reset); return how many."""
        n = len(self._pipes)
        for client, upstream in self._pipes:
            client.transport.abort()
            upstream.transport.abort()
        self._pipes.clear()
        return n

    async def close(self) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


@contextlib.asynccontextmanager
async def relay_to(url: str) -> AsyncIterator[Relay]:
    """A relay in front of the server at ``url`` (``http://host:port``)."""
    host, port = url.rsplit("//", 1)[1].rsplit(":", 1)
    relay = Relay(host, int(port))
    await relay.start()
    try:
        yield relay
    finally:
        await relay.close()

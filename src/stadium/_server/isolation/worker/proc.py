"""One isolated env process as the worker holds it: its socket (non-blocking, read by the
event loop), its key, uid, cgroups and network, and the request/reply exchange over it.

Nothing read from the socket is trusted (:mod:`.wire`): a reply frame over the session's
limit is refused by its header, before its body is read; a large frame is read straight
into a buffer of its size and checked and decoded in a thread (the loop never waits on
it); a frame the worker did not ask for, or one that breaks a limit, ends the exchange
with :class:`~stadium.EnvProtocolError` (the caller kills the process). No read ever
blocks: a reply that never ends is the call's timer's to stop.

**Who waits for a reply** (:attr:`EnvProcess.waiter`) is anything with a future's
``done()``, ``set_result()`` and ``set_exception()`` (:class:`Waiter`): an
:class:`asyncio.Future` (awaited by a coroutine: the ``hello``, ``reset``, ``fork``...), or
the proxy's :class:`~stadium._server.isolation.worker.proxy.StepCall`, which completes a
session's step from the reader callback itself (no task, no future, no extra loop turn).
A waiter is handed its reply once the read that completed it is done: a frame that came
after it in the same read is refused (unexpected) first, as with a future.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Awaitable
from typing import Any, Protocol

import msgspec

from stadium._errors import EnvProtocolError, ToolCallError, error_from_wire
from stadium._server.isolation import wire
from stadium._server.isolation.worker.netns import SessionNet
from stadium._server.isolation.worker.reaper import Reaper

#: Bytes read from a session's socket at a time (a reply this size or less: one read).
READ_BYTES = 1 << 16
_HEADER = wire.HEADER
_SIZE = _HEADER.unpack_from
_PACK = _HEADER.pack
_DIRECT = wire.DIRECT_BYTES


class Waiter(Protocol):
    """What waits for a reply: an :class:`asyncio.Future`, or a callback's own object."""

    def done(self) -> bool: ...
    def set_result(self, result: Any, /) -> None: ...
    def set_exception(self, exception: BaseException, /) -> None: ...


class Gone(Exception):
    """The session's process closed its socket (it died), or its call was stopped."""


class WireStats:
    """What the worker's env processes sent it (``/metrics``: stadium_isolated_reply_*)."""

    __slots__ = ("held", "received", "refused")

    def __init__(self) -> None:
        self.received = 0
        """Bytes read from env processes' sockets."""
        self.held = 0
        """Bytes of reply buffers held now (large frames being read or decoded)."""
        self.refused = 0
        """Replies refused (a limit broken, malformed, unexpected): ENV_PROTOCOL."""


class EnvProcess:
    """One env process: its socket (non-blocking, read by the loop), pid and cgroups.

    ``pid`` is the process's key: its pid (``process``), or ``family << 22 | its pid in
    its family's pid namespace`` (``sandbox``; see :mod:`.child`), as the template's and
    the families' exit reports name it (never as the process says).
    """

    __slots__ = (
        "_body",
        "_got",
        "_head",
        "_ready",
        "baseline",
        "broken",
        "cgroups",
        "decoder",
        "episode_over",
        "expired",
        "fd",
        "final",
        "image",
        "limits",
        "loop",
        "net",
        "pid",
        "pidfd",
        "released",
        "sock",
        "stats",
        "uid",
        "waiter",
        "want_fds",
    )

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        sock: socket.socket,
        limits: wire.WireLimits,
        stats: WireStats,
    ) -> None:
        self.loop = loop
        self.sock = sock
        self.limits = limits
        self.stats = stats
        self.pid = 0
        self.pidfd = -1
        self.uid = 0
        self.cgroups: list[str] = []
        self.baseline: dict[str, int] = {}
        self.final: dict[str, int] | None = None
        """The cgroup's counters when the process ended (read before the cgroup is removed)."""
        self.net: SessionNet | None = None
        self.image: str | None = None
        """The task image it runs in (its ``REF``), or ``None``."""
        self.expired = False
        self.episode_over = False
        """Killed at the end of its episode's time (``--episode-timeout``)."""
        self.released = False
        """Its session let it go (:meth:`Isolation.release`): nobody asks why it ended."""
        self.broken: EnvProtocolError | None = None
        """What it sent that was refused: it is never asked anything again."""
        self.waiter: Waiter | None = None
        self.decoder: msgspec.msgpack.Decoder[Any] = wire.HELLO_REPLY
        """The type the awaited reply must have."""
        self.want_fds = False
        self.fd = -1
        """A descriptor that came with the awaited reply (``fork``), until taken."""
        self._head = b""
        """Bytes of a header or small frame read so far."""
        self._body: bytearray | None = None
        """A large frame's buffer (its size), being filled; ``_got`` bytes so far."""
        self._got = 0
        self._ready: tuple[Waiter, Any] | None = None
        """A small reply decoded by :meth:`_frames`, handed over once its read is done."""
        sock.setblocking(False)
        loop.add_reader(sock.fileno(), self._readable)

    # -- reading (event loop callbacks) ------------------------------------------------

    def _readable(self) -> None:
        if self._body is not None:
            self._fill(self._body)
            return
        try:
            if self.want_fds:  # ``fork``: the new process's socket comes with the reply
                data, fds, _flags, _addr = socket.recv_fds(self.sock, READ_BYTES, 1)
                for fd in fds:
                    if self.fd < 0:
                        self.fd = fd
                    else:
                        os.close(fd)
            else:  # (descriptors sent with anything else are closed by the kernel)
                data = self.sock.recv(READ_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._ended(Gone())
            return
        size = len(data)
        self.stats.received += size
        if self._head:
            data = self._head + data
            self._head = b""
        elif (
            size > 4
            and _SIZE(data)[0] == size - 4 <= _DIRECT
            and (waiter := self.waiter) is not None
            and not waiter.done()
        ):  # the usual: one whole small reply, awaited
            try:
                reply = self.decoder.decode(memoryview(data)[4:])
            except Exception:  # said by the checked path below
                pass
            else:
                self.waiter = None
                waiter.set_result(reply)
                return
        self._frames(data)

    def _frames(self, data: bytes) -> None:
        self._split(data)
        ready, self._ready = self._ready, None
        if ready is not None:  # after the whole read: what came after it was refused first
            ready[0].set_result(ready[1])

    def _split(self, data: bytes) -> None:
        start, end = 0, len(data)
        header = wire.HEADER
        while end - start >= header.size:
            (size,) = header.unpack_from(data, start)
            if size > self.limits.frame_bytes:  # refused by its header: its body never read
                self._refuse(wire.frame_over(size, self.limits.frame_bytes))
                return
            begin = start + header.size
            if end - begin < size:
                if size > wire.DIRECT_BYTES:  # read on straight into a buffer of its size
                    body = self._body = bytearray(size)
                    self.stats.held += size
                    self._got = end - begin
                    body[: self._got] = memoryview(data)[begin:end]
                    return
                break
            if not self._reply(memoryview(data)[begin : begin + size]):
                return
            start = begin + size
        self._head = data[start:] if start < end else b""

    def _fill(self, body: bytearray) -> None:
        try:
            n = self.sock.recv_into(memoryview(body)[self._got :])
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            n = 0
        if n == 0:
            self._ended(Gone())
            return
        self.stats.received += n
        self._got += n
        if self._got == len(body):
            self._body = None
            if not self._reply(body, held=len(body)):
                return

    def _reply(self, body: memoryview | bytearray, held: int = 0) -> bool:
        """A whole frame: the awaited reply (``True``: read on), or a refusal."""
        waiter, self.waiter = self.waiter, None
        if waiter is None or waiter.done():
            self.stats.held -= held
            self._refuse(
                EnvProtocolError(
                    "a frame the worker did not ask for (unexpected)", limit="unexpected", value=0
                )
            )
            return False
        if held == 0:  # small: decoded at once (no scan needed), handed over by _frames
            try:
                self._ready = (waiter, self.limits.decode(self.decoder, body))
            except EnvProtocolError as err:
                self._refuse(err, waiter)
                return False
            return True
        # Large: checked and decoded in a thread; the loop goes on meanwhile.
        decoded = self.loop.run_in_executor(None, self.limits.decode, self.decoder, body)
        decoded.add_done_callback(lambda done: self._decoded(done, waiter, held))
        return True

    def _decoded(self, done: asyncio.Future[Any], waiter: Waiter, held: int) -> None:
        self.stats.held -= held
        exc = done.exception()
        if isinstance(exc, EnvProtocolError):
            self._refuse(exc, waiter)
        elif not waiter.done():
            if exc is not None:
                waiter.set_exception(exc)
            else:
                waiter.set_result(done.result())

    def _refuse(self, err: EnvProtocolError, waiter: Waiter | None = None) -> None:
        """Stop reading: the process sent what is refused; whoever waits gets ``err``."""
        self.stats.refused += 1
        self.broken = err
        self._ended(err, waiter)

    def _ended(self, err: BaseException, waiter: Waiter | None = None) -> None:
        self._detach()
        if self._body is not None:
            self.stats.held -= len(self._body)
            self._body = None
        self._head = b""
        if waiter is None:
            waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(err)

    def abort(self) -> None:
        """Stop the exchange in flight (its process was killed at a limit): its caller gets
        :class:`Gone` now, whether or not the socket ever reads as closed."""
        self._ended(Gone())

    def _detach(self) -> None:
        if self.sock.fileno() >= 0:
            self.loop.remove_reader(self.sock.fileno())

    # -- requests ----------------------------------------------------------------------

    def expect(self, decoder: msgspec.msgpack.Decoder[Any]) -> asyncio.Future[Any]:
        """The next frame, once it comes, as ``decoder``'s type (the ``hello``)."""
        self.decoder = decoder
        waiter = self.waiter = self.loop.create_future()
        return waiter

    def request(self, body: bytes, decoder: msgspec.msgpack.Decoder[Any]) -> Awaitable[Any]:
        """Send one request; an awaitable of its reply, as ``decoder``'s type: the reply's
        future itself when the whole frame was sent at once (the usual: no coroutine).

        Raises (now, or when awaited):
            Gone: the process died (or was stopped).
            EnvProtocolError: it sent what is refused (now or before).
        """
        waiter = self.loop.create_future()
        rest = self.send(body, decoder, waiter)
        if rest is not None:
            return self._send_rest(rest, waiter)
        return waiter

    def send(
        self, body: bytes, decoder: msgspec.msgpack.Decoder[Any], waiter: Waiter
    ) -> memoryview | None:
        """Send one request, whose reply (as ``decoder``'s type) goes to ``waiter``: as much
        of the frame as the socket takes now; the rest, if any, is returned (the caller
        sends it: :meth:`send_rest`).

        Raises:
            Gone: the process died (or was stopped).
            EnvProtocolError: it sent what is refused before.
        """
        if self.broken is not None:
            raise self.broken
        if self.sock.fileno() < 0:
            raise Gone()
        self.decoder = decoder
        self.waiter = waiter
        data = _PACK(len(body)) + body
        try:  # the usual: the whole frame fits the socket's buffer (no loop's send coroutine)
            sent = self.sock.send(data)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            raise Gone() from None
        return memoryview(data)[sent:] if sent < len(data) else None

    async def send_rest(self, rest: memoryview) -> None:
        """The rest of a request's frame that :meth:`send` could not send at once.

        Raises:
            Gone: the process died (or was stopped).
        """
        try:
            await self.loop.sock_sendall(self.sock, rest)
        except OSError:
            raise Gone() from None

    async def _send_rest(self, rest: memoryview, waiter: asyncio.Future[Any]) -> Any:
        await self.send_rest(rest)
        return await waiter

    async def request_fds(self, body: bytes, decoder: msgspec.msgpack.Decoder[Any]) -> Any:
        """:meth:`request`, whose reply may come with a descriptor (``fork``), left in
        :attr:`fd` (:meth:`take_fd`)."""
        self.want_fds = True
        try:
            return await self.request(body, decoder)
        finally:
            self.want_fds = False

    def take_fd(self) -> int:
        """The descriptor that came with the last reply (-1: none); the caller's now."""
        fd, self.fd = self.fd, -1
        return fd

    def close(self, reaper: Reaper | None = None) -> None:
        """Close the socket (idempotent): now, or by ``reaper`` off the loop (the socket
        reads as closed at once either way)."""
        if self.fd >= 0:
            os.close(self.take_fd())
        if self.sock.fileno() >= 0:
            self._detach()
            if reaper is None:
                self.sock.close()
            else:
                reaper.close_fd(self.sock.detach())


_FOREIGN: dict[str, type[Exception]] = {}


def foreign_error(reply: wire.Raised) -> Exception:
    """The exception an env process reported, raised again in the worker: a Stadium error
    as itself (code, context), any other as an exception of the same type name and message
    (so that error replies read as in-process)."""
    name, message, data = reply.exception, reply.said, reply.data
    if data is not None:
        context = {k: v for k, v in data.items() if k not in ("message", "code")}
        if name == "ToolCallError":
            return ToolCallError(message, **context)
        return error_from_wire(data)
    cls = _FOREIGN.get(name)
    if cls is None:
        if len(_FOREIGN) >= 256:
            _FOREIGN.clear()
        cls = _FOREIGN[name] = type(name, (Exception,), {"__module__": "stadium.isolated"})
    return cls(message)


def forged(why: str) -> EnvProtocolError:
    """A fork whose copy cannot be told apart from the kernel's word (its process is
    stopped by the caller)."""
    return EnvProtocolError(
        f"a fork's reply the worker cannot trust: {why} (fork)", limit="fork", value=0
    )


def ns_pids(pid: int) -> list[int]:
    """``pid``'s pids in each pid namespace it is in, outermost first (``NSpid``)."""
    try:
        with open(f"/proc/{pid}/status", "rb") as status:
            for line in status.read(1 << 16).splitlines():
                if line.startswith(b"NSpid:"):
                    return [int(x) for x in line.split()[1:]]
    except (OSError, ValueError):
        pass
    return []


def ns_depth() -> int:
    """How many pid namespaces the worker is in (1: the host's)."""
    return len(ns_pids(os.getpid())) or 1

"""The sessions of the load: connect → reset → steps × (think, step) → close, timed.

:func:`run_session` is the one skeleton every session follows, whatever its
transport: it waits for the connect window, times each phase into the
session's :class:`~stadium.bench.results.SessionRecord`, sleeps the think time
before each step, and classifies any failure as an
:class:`~stadium.bench.stats.ErrorKind`. The transport is a
:class:`Connection`:

* WebSocket (``mode="ws"``, :func:`ws_connection_class`): a picows client on
  the running (uvloop) loop, replies matched by one future per session with a
  timer, no task per request — ~0.19 ms of client CPU per session lifecycle;
* HTTP (``mode="http"``, :class:`HttpConnection`): ``POST /reset`` and
  ``POST /step`` on one keep-alive connection, responses parsed by h11
  (``Content-Length``, chunked or read-until-close bodies).

:func:`run_sessions` runs many sessions from one start instant on the current
event loop; the worker processes of :mod:`stadium.bench.loadgen` call it.
"""

from __future__ import annotations

import asyncio
import collections
import errno
import functools
import os
import socket
import time
import urllib.parse
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import h11
import msgspec

from stadium._core.frames import Request
from stadium._env.codecs import UNREADABLE, unreadable_detail
from stadium.bench.loadspec import LoadSpec, source_address
from stadium.bench.results import SessionResult
from stadium.bench.stats import ErrorKind

_AUTH: dict[str, str] = (
    {"Authorization": f"Bearer {os.environ['STADIUM_AUTH_TOKEN']}"}
    if os.environ.get("STADIUM_AUTH_TOKEN")
    else {}
)
"""Sent with every connection when ``STADIUM_AUTH_TOKEN`` is set (a server run with a token)."""

_CLIENT_ERRNOS = {errno.EADDRNOTAVAIL, errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}
_DECODER = msgspec.json.Decoder()
_READ_SIZE = 1 << 16


class Fail(Exception):
    """A session failed for a known reason: ``kind`` (the ``error`` column) and ``detail``."""

    def __init__(self, kind: ErrorKind, detail: str) -> None:
        super().__init__(detail)
        self.kind = kind
        self.detail = detail


class Connection(Protocol):
    """One session's transport, as :func:`run_session` drives it.

    Every method raises :class:`Fail` (or ``OSError``) on failure; ``abort`` never raises.
    """

    async def connect(self, limit: float) -> None:
        """Open the connection (TCP, and the WebSocket handshake) within ``limit`` s."""

    async def request(self, kind: str, body: bytes, limit: float) -> dict[str, Any]:
        """Send ``body`` (a ``reset`` or ``step``); return the reply's data (with its
        ``observation``) within ``limit`` s."""

    def close(self) -> None:
        """Say goodbye (the session has then succeeded)."""

    async def closed(self, limit: float) -> str:
        """Wait up to ``limit`` s for the connection to close; a note ('' if clean)."""

    def abort(self) -> None:
        """Drop the connection if it is still open (always called last)."""


@dataclass(frozen=True, slots=True)
class Plan:
    """What every session of one process shares: the load, the start instant ``t0``
    (monotonic clock), the encoded reset and step messages, and the connect window."""

    spec: LoadSpec
    t0: float
    reset: bytes
    step: bytes
    window: asyncio.Semaphore | None = None

    @classmethod
    def of(cls, spec: LoadSpec, t0: float) -> Plan:
        """The plan of ``spec`` starting at ``t0``; the connect window is split over
        the load's processes."""
        reset, step = messages(spec)
        window = None
        if spec.connect_window > 0:
            window = asyncio.Semaphore(max(1, spec.connect_window // spec.n_procs()))
        return cls(spec, t0, reset, step, window)


def messages(spec: LoadSpec) -> tuple[bytes, bytes]:
    """The reset and step bodies of ``spec``'s mode (WebSocket frames or HTTP bodies)."""
    reset_data: dict[str, Any] = {}
    if spec.state_kb:
        reset_data["state_kb"] = spec.state_kb
    if spec.mode == "http":
        return (
            msgspec.json.encode(reset_data),
            msgspec.json.encode({"action": {"wait_seconds": spec.wait_s}}),
        )
    return (
        msgspec.json.encode(Request("reset", reset_data)),
        msgspec.json.encode(Request("step", {"wait_seconds": spec.wait_s})),
    )


#: The ``close`` frame (no reply: the server closes with 1000), encoded once.
CLOSE = msgspec.json.encode(Request("close"))


# ----------------------------------------------------------------- the skeleton


async def run_session(rec: SessionResult, conn: Connection, plan: Plan) -> None:
    """Run one session over ``conn`` and record it in ``rec``; never raises but on cancel.

    On success ``rec.ok`` is set and every phase's latency recorded; on failure
    ``rec.error`` and ``rec.detail`` say why, and the phases reached are recorded.
    ``rec.start`` and ``rec.end`` are relative to ``plan.t0``.
    """
    now = time.monotonic
    spec = plan.spec
    t0 = plan.t0
    start = now()
    rec.start = start - t0
    try:
        if plan.window is None:
            await conn.connect(spec.connect_timeout)
        else:
            async with plan.window:
                await conn.connect(spec.connect_timeout)
        t = now()
        rec.connect_s = t - start
        _observe(rec, await conn.request("reset", plan.reset, spec.request_timeout))
        rec.reset_s = now() - t
        think = spec.think.seconds
        step_body = plan.step
        step_timeout = spec.wait_s + spec.request_timeout
        step_s = rec.step_s
        for _ in range(spec.steps):
            if think > 0:
                await asyncio.sleep(think)
            t = now()
            _observe(rec, await conn.request("step", step_body, step_timeout))
            step_s.append(now() - t)
        t = now()
        conn.close()
        rec.ok = True
        rec.detail = await conn.closed(spec.close_timeout)
        end = now()
        rec.close_s = end - t
        rec.total_s = end - start
        rec.end = end - t0
    except Fail as exc:
        rec.error, rec.detail = exc.kind.value, exc.detail
    except OSError as exc:
        f = _classify_oserror(exc)
        rec.error, rec.detail = f.kind.value, f.detail
    except Exception as exc:  # a bug in a reply's handling must not kill the point
        rec.error = ErrorKind.PROTOCOL.value
        rec.detail = f"{type(exc).__name__}: {exc}"[:200]
    finally:
        if rec.end is None:
            rec.end = now() - t0
        conn.abort()


def _classify_oserror(exc: OSError) -> Fail:
    if isinstance(exc, TimeoutError):
        return Fail(ErrorKind.TIMEOUT, f"{type(exc).__name__}: {exc}")
    if isinstance(exc, ConnectionRefusedError | ConnectionResetError):
        return Fail(ErrorKind.REFUSED, f"{type(exc).__name__}: {exc}"[:200])
    if exc.errno in _CLIENT_ERRNOS:
        return Fail(ErrorKind.CLIENT, f"{type(exc).__name__}: {exc.strerror}")
    return Fail(ErrorKind.REFUSED, f"{type(exc).__name__}: {exc}")


def _observe(rec: SessionResult, data: dict[str, Any]) -> None:
    """Copy the server's ``pid``, ``host`` and ``session_hash`` from an observation."""
    obs = data.get("observation")
    if isinstance(obs, dict):
        pid = obs.get("pid")
        if isinstance(pid, int):
            rec.pid = pid
        host = obs.get("host")
        if isinstance(host, str):
            rec.host = host
        h = obs.get("session_hash")
        if isinstance(h, str):
            rec.session_hash = h


def bound_socket(source: str) -> socket.socket:
    """An unconnected TCP socket bound to ``source``; its port is chosen at connect
    (``IP_BIND_ADDRESS_NO_PORT``)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.IPPROTO_IP, getattr(socket, "IP_BIND_ADDRESS_NO_PORT", 24), 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(False)
        sock.bind((source, 0))
    except OSError:
        sock.close()
        raise
    return sock


# -------------------------------------------------------------------- WebSocket


def _check_reply(payload: bytes) -> dict[str, Any]:
    """The ``data`` of a WebSocket observation reply, or raise :class:`Fail`."""
    try:
        msg = _DECODER.decode(payload)
    except UNREADABLE as exc:
        raise Fail(ErrorKind.PROTOCOL, f"reply is not JSON: {unreadable_detail(exc)}") from None
    if not isinstance(msg, dict):
        raise Fail(ErrorKind.PROTOCOL, "reply is not an object")
    kind = msg.get("type")
    data = msg.get("data")
    if kind == "observation" and isinstance(data, dict):
        return data
    if kind == "error" and isinstance(data, dict):
        code = str(data.get("code", ""))
        text = f"{code}: {data.get('message', '')}"[:200]
        if code == "CAPACITY_REACHED":
            raise Fail(ErrorKind.CAPACITY, text)
        raise Fail(ErrorKind.PROTOCOL, text)
    if isinstance(data, dict) and "observation" in data:
        return data
    raise Fail(ErrorKind.PROTOCOL, f"unexpected reply type {kind!r}")


def _expire(waiter: asyncio.Future[bytes]) -> None:
    if not waiter.done():
        waiter.set_exception(Fail(ErrorKind.TIMEOUT, "reply timed out"))


def _handshake_failure(exc: Exception) -> Fail:
    status = getattr(getattr(exc, "response", None), "status", None)
    code = int(status) if status is not None else 0
    if code in (429, 503):
        return Fail(ErrorKind.CAPACITY, f"handshake HTTP {code}")
    if code:
        return Fail(ErrorKind.PROTOCOL, f"handshake HTTP {code}")
    return Fail(ErrorKind.REFUSED, f"handshake failed: {exc}")


@functools.cache
@functools.cache
def ws_connection_class() -> type[Any]:
    """The WebSocket :class:`Connection` class, ``cls(url, source)`` (imports picows once).

    The connection is its own picows listener: one object per session, one
    outstanding request at a time, a reply resolving the request's future. A subclass
    may offer a subprotocol (``subprotocol``; the batched load, ``bench/batch``).
    """
    import picows

    text, binary, close = picows.WSMsgType.TEXT, picows.WSMsgType.BINARY, picows.WSMsgType.CLOSE
    monotonic = time.monotonic

    class WsConnection(picows.WSListener):
        __slots__ = (
            "close_code", "disconnected", "inbox", "loop", "replied_at", "source", "transport",
            "url", "waiter",
        )  # fmt: skip

        def __init__(self, url: str, source: str | None) -> None:
            self.loop = asyncio.get_running_loop()
            self.url = url
            self.source = source
            self.transport: Any = None
            self.waiter: asyncio.Future[bytes] | None = None
            self.inbox: collections.deque[bytes] = collections.deque()
            self.close_code: int | None = None
            self.disconnected = False
            # time.monotonic() when the last reply's frame came off the socket (in the
            # transport's callback, before the waiting task resumes)
            self.replied_at = 0.0

        subprotocol: str | None = None

        def _listener(self, request: object = None, response: object = None) -> WsConnection:
            return self  # picows's listener factory: this very object

        async def connect(self, limit: float) -> None:
            kwargs: dict[str, Any] = {}
            source = self.source
            if source is not None:
                kwargs["socket_factory"] = lambda _url: bound_socket(source)
            headers = dict(_AUTH)
            if self.subprotocol is not None:
                headers["Sec-WebSocket-Protocol"] = self.subprotocol
            if headers:
                kwargs["extra_headers"] = headers
            try:
                self.transport, listener = await asyncio.wait_for(
                    picows.ws_connect(
                        self._listener,
                        self.url,
                        websocket_handshake_timeout=limit,
                        max_redirects=0,
                        use_aiofastnet=False,
                        **kwargs,
                    ),
                    limit,
                )
            except TimeoutError:
                raise Fail(ErrorKind.TIMEOUT, "connect timed out") from None
            except picows.WSHandshakeError as exc:
                raise _handshake_failure(exc) from None
            if listener is None:
                raise Fail(ErrorKind.DISCONNECTED, "closed during the handshake")

        async def request(self, kind: str, body: bytes, limit: float) -> dict[str, Any]:
            self.transport.send(text, body)
            if self.inbox:
                return _check_reply(self.inbox.popleft())
            if self.disconnected:
                raise self._gone()
            w: asyncio.Future[bytes] = self.loop.create_future()
            self.waiter = w
            handle = self.loop.call_later(limit, _expire, w)
            try:
                payload = await w
            finally:
                handle.cancel()
                self.waiter = None
            return _check_reply(payload)

        def close(self) -> None:
            self.transport.send(text, CLOSE)

        async def closed(self, limit: float) -> str:
            if self.disconnected:
                return ""
            self.transport.send_close(picows.WSCloseCode.OK)
            try:
                await asyncio.wait_for(self.transport.wait_disconnected(), limit)
            except TimeoutError:
                return "close timed out"
            return ""

        def abort(self) -> None:
            transport = self.transport
            if transport is not None and not transport.is_disconnected:
                transport.disconnect(False)

        # picows callbacks
        def on_ws_frame(self, transport: Any, frame: Any) -> None:
            mt = frame.msg_type
            if mt is text or mt is binary:
                self.replied_at = monotonic()
                payload = frame.get_payload_as_bytes()
                w = self.waiter
                if w is not None and not w.done():
                    w.set_result(payload)
                else:
                    self.inbox.append(payload)
            elif mt is close:
                self.close_code = frame.get_close_code().value
                transport.send_close(frame.get_close_code())
                transport.disconnect()

        def on_ws_disconnected(self, transport: Any) -> None:
            self.disconnected = True
            w = self.waiter
            if w is not None and not w.done():
                w.set_exception(self._gone())

        def _gone(self) -> Fail:
            if self.close_code == 1013:
                return Fail(ErrorKind.CAPACITY, "closed with 1013")
            return Fail(ErrorKind.DISCONNECTED, f"closed by server (code {self.close_code})")

    return WsConnection


# ------------------------------------------------------------------------- HTTP


class HttpConnection:
    """HTTP mode: ``POST {base}/reset`` and ``POST {base}/step`` on one keep-alive
    connection, where ``base`` is the URL's path without its ``/ws``.

    Responses are parsed by h11: 200 with a JSON object is a reply; 429 and 503
    are ``capacity``; any other status, or a malformed response, is ``protocol``;
    the connection closing mid-response is ``disconnected``.
    """

    __slots__ = ("_h11", "_reader", "_writer", "host", "netloc", "paths", "port", "source")

    def __init__(self, url: str, source: str | None) -> None:
        parsed = urllib.parse.urlsplit(url)
        self.host = parsed.hostname or "127.0.0.1"
        self.port = parsed.port or 80
        self.netloc = parsed.netloc
        base = parsed.path.rstrip("/").removesuffix("/ws")
        self.paths = {"reset": base + "/reset", "step": base + "/step"}
        self.source = source
        self._h11 = h11.Connection(h11.CLIENT)
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def connect(self, limit: float) -> None:
        try:
            async with asyncio.timeout(limit):
                self._reader, self._writer = await self._open()
        except TimeoutError:
            raise Fail(ErrorKind.TIMEOUT, "connect timed out") from None

    async def _open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self.source is None:
            return await asyncio.open_connection(self.host, self.port)
        sock = bound_socket(self.source)  # the same source spreading as the WebSocket mode
        try:
            await asyncio.get_running_loop().sock_connect(sock, (self.host, self.port))
        except BaseException:
            sock.close()
            raise
        return await asyncio.open_connection(sock=sock)

    async def request(self, kind: str, body: bytes, limit: float) -> dict[str, Any]:
        path = self.paths[kind]
        assert self._writer is not None
        if self._h11.our_state is not h11.IDLE:  # the last response ended the connection
            raise Fail(ErrorKind.DISCONNECTED, f"{path}: the server closed the connection")
        self._writer.write(self._encode(path, body))
        try:
            async with asyncio.timeout(limit):
                status, payload = await self._response(path)
        except TimeoutError:
            raise Fail(ErrorKind.TIMEOUT, f"{path} timed out") from None
        if status in (429, 503):
            raise Fail(ErrorKind.CAPACITY, f"{path}: HTTP {status}")
        if status != 200:
            raise Fail(ErrorKind.PROTOCOL, f"{path}: HTTP {status}: {payload[:120]!r}")
        data = _DECODER.decode(payload)
        if not isinstance(data, dict):
            raise Fail(ErrorKind.PROTOCOL, f"{path}: reply is not an object")
        return data

    def _encode(self, path: str, body: bytes) -> bytes:
        headers = [
            ("Host", self.netloc),
            ("Content-Type", "application/json"),
            ("Content-Length", str(len(body))),
            *_AUTH.items(),
        ]
        conn = self._h11
        parts = (
            conn.send(h11.Request(method="POST", target=path, headers=headers)),
            conn.send(h11.Data(data=body)),
            conn.send(h11.EndOfMessage()),
        )
        return b"".join(p for p in parts if p is not None)

    async def _response(self, path: str) -> tuple[int, bytes]:
        """Read one response: (status, body). Ready for the next request after it."""
        assert self._reader is not None
        conn = self._h11
        status = 0
        chunks: list[bytes] = []
        eof = False
        try:
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    data = await self._reader.read(_READ_SIZE)
                    eof = not data
                    conn.receive_data(data)
                elif isinstance(event, h11.Response):
                    status = event.status_code
                elif isinstance(event, h11.Data):
                    chunks.append(bytes(event.data))
                elif isinstance(event, h11.EndOfMessage):
                    break
                elif isinstance(event, h11.ConnectionClosed):
                    raise Fail(ErrorKind.DISCONNECTED, f"{path}: connection closed")
        except h11.RemoteProtocolError as exc:
            kind = ErrorKind.DISCONNECTED if eof else ErrorKind.PROTOCOL
            raise Fail(kind, f"{path}: {exc}"[:200]) from None
        if conn.our_state is h11.DONE and conn.their_state is h11.DONE:
            conn.start_next_cycle()
        return status, b"".join(chunks)

    def close(self) -> None:
        assert self._writer is not None
        self._writer.close()

    async def closed(self, limit: float) -> str:
        return ""

    def abort(self) -> None:
        if self._writer is not None and not self._writer.is_closing():
            self._writer.close()


def connection_class(mode: str) -> Callable[[str, str | None], Connection]:
    """The :class:`Connection` class of a mode: ``ws`` or ``http``."""
    if mode == "ws":
        return ws_connection_class()
    if mode == "http":
        return HttpConnection
    raise ValueError(f"unknown mode {mode!r}: ws or http")


# ------------------------------------------------------------------------- soak


class SoakTally(msgspec.Struct, kw_only=True):
    """What the sessions of a soak did: cumulative counts, and a sample of the step
    latencies since the last report (seconds; at most :data:`SOAK_SAMPLE` of them)."""

    sessions_ok: int = 0
    sessions_failed: int = 0
    steps_ok: int = 0
    steps_failed: int = 0
    errors: dict[str, int] = msgspec.field(default_factory=dict)
    step_s: list[float] = msgspec.field(default_factory=list)

    def add(self, rec: SessionResult, steps: int) -> None:
        """Fold in one finished session of ``steps`` steps."""
        self.steps_ok += len(rec.step_s)
        if len(self.step_s) < SOAK_SAMPLE:
            self.step_s.extend(rec.step_s)
        if rec.ok:
            self.sessions_ok += 1
            return
        self.sessions_failed += 1
        self.errors[rec.error] = self.errors.get(rec.error, 0) + 1
        if rec.reset_s is not None and len(rec.step_s) < steps:
            self.steps_failed += 1  # the step in flight when it failed

    def take_sample(self) -> list[float]:
        """The latencies sampled since the last call (then forgotten)."""
        sample, self.step_s = self.step_s, []
        return sample


SOAK_SAMPLE = 20_000
"""Most step latencies a soak worker keeps between two reports."""


async def soak_sessions(
    spec: LoadSpec, indices: Sequence[int], t0: float, tally: SoakTally, *, worker: int = 0
) -> None:
    """Keep ``len(indices)`` sessions going from ``t0`` for ``spec.duration_s``: each
    slot opens a session, runs it (:func:`run_session`), folds it into ``tally``
    and opens the next. A slot whose session failed waits 0.1 s before the next
    (a server that refuses is not hammered). Sessions running at the end finish.
    """
    plan = Plan.of(spec, t0)
    connection = connection_class(spec.mode)
    end = t0 + spec.duration_s
    delay = t0 - time.monotonic()
    if delay > 0:
        await asyncio.sleep(delay)

    async def slot(index: int) -> None:
        source = source_address(index, spec.sessions)
        while time.monotonic() < end:
            rec = SessionResult(index=index, worker=worker, source=source)
            await run_session(rec, connection(spec.url, source), plan)
            tally.add(rec, spec.steps)
            if not rec.ok:
                await asyncio.sleep(0.1)

    tasks = [asyncio.ensure_future(slot(i)) for i in indices]
    if tasks:
        remaining = t0 + spec.deadline() - time.monotonic()
        _, pending = await asyncio.wait(tasks, timeout=max(0.0, remaining))
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending, timeout=5.0)


# ------------------------------------------------------------------ many at once


async def run_sessions(
    spec: LoadSpec,
    indices: Sequence[int],
    t0: float,
    *,
    worker: int = 0,
    on_done: Callable[[], None] | None = None,
) -> list[SessionResult]:
    """Run the sessions ``indices`` of ``spec`` starting at monotonic time ``t0``.

    Session ``i`` connects to ``spec.endpoint(i)`` (several endpoints: a static,
    weighted spread). Returns one record per index, in order. Sessions still running at
    ``t0 + spec.deadline()`` are cancelled and recorded as ``deadline``.
    ``on_done()`` is called as each session ends. Runs on the current event
    loop; :func:`stadium.bench.loadgen.run_load` calls it in each worker.
    """
    records = [SessionResult(index=i, worker=worker, source=spec.source(i)) for i in indices]
    plan = Plan.of(spec, t0)
    connection = connection_class(spec.mode)
    delay = t0 - time.monotonic()
    if delay > 0:
        await asyncio.sleep(delay)

    async def one(rec: SessionResult) -> None:
        await run_session(rec, connection(spec.endpoint(rec.index), rec.source), plan)
        if on_done is not None:
            on_done()

    return await until_deadline([one(r) for r in records], records, spec, t0)


async def until_deadline(
    runs: Sequence[Coroutine[Any, Any, None]],
    records: list[SessionResult],
    spec: LoadSpec,
    t0: float,
) -> list[SessionResult]:
    """Run ``runs`` until they end or the point's deadline passes (the rest cancelled);
    ``records`` not finished by then are marked ``deadline``."""
    tasks = [asyncio.ensure_future(run) for run in runs]
    remaining = t0 + spec.deadline() - time.monotonic()
    if tasks:
        _, pending = await asyncio.wait(tasks, timeout=max(0.0, remaining))
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending, timeout=5.0)
    for rec in records:
        if not rec.ok and not rec.error:
            rec.error = ErrorKind.DEADLINE.value
            rec.detail = "point deadline passed"
    return records

"""The load generator: bursts of sessions from several processes, cheaply.

Each point is run by ``procs`` worker processes (``python -m
stadium.bench.loadgen``, talking length-prefixed MessagePack frames over
their stdin and stdout), each on its own
uvloop event loop with picows clients (~0.14 ms of client CPU per session
lifecycle, an eighth of the ``websockets`` client's). The workers report
ready, the parent hands them one start instant on the system-wide monotonic
clock, and every session of every worker starts then (a coordinated burst).

Limits it respects by construction:

* at most :data:`MAX_SESSIONS_PER_PROC` sessions per process (the machine's
  open-file limit is 20,000 per process), so ``procs >= ceil(N / that)``;
* past :data:`PORTS_PER_SOURCE` sessions, sessions are spread round-robin
  over source addresses 127.0.0.2, 127.0.0.3, ..., at most that many each
  (about 28k ephemeral ports exist per source address and destination, and
  the kernel's search for a free one slows down as they fill: with 25,000 on
  one address, a burst of 32,768 spent most of its CPU in the kernel); the
  port is picked at ``connect`` (``IP_BIND_ADDRESS_NO_PORT``), not at ``bind``;
* every phase has a timeout, the point a deadline after which the sessions
  still running are cancelled and recorded as ``deadline``; the parent kills
  a worker that does not report within the deadline plus a grace period.

Workers can be pinned to CPUs (``cpus``) to keep the load off the server's
cores.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import gc
import math
import os
import socket
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from stadium.bench.metrics import ErrorKind
from stadium.bench.results import SessionRecord

MAX_SESSIONS_PER_PROC = 15_000
"""Sessions per worker process: under the 20,000 open-file limit with margin."""

PORTS_PER_SOURCE = 8_192
"""Most sessions per source address (under a third of the ~28k ephemeral ports)."""

_CLIENT_ERRNOS = {errno.EADDRNOTAVAIL, errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}


@dataclass(frozen=True, slots=True)
class ThinkModel:
    """Think time before each step: an LLM producing the next action.

    ``ttft_ms + tokens * token_ms`` milliseconds, deterministic so that the
    ideal latency of a session is known exactly. ``--think-ms X`` is
    ``ThinkModel(ttft_ms=X)``.
    """

    ttft_ms: float = 0.0
    tokens: int = 0
    token_ms: float = 0.0

    @property
    def seconds(self) -> float:
        """Think time per step, in seconds."""
        return (self.ttft_ms + self.tokens * self.token_ms) / 1000.0


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """One point's load: N sessions, each connect → reset → steps → close.

    Timeouts are in seconds; a step's timeout is ``wait_s + think + request_timeout``.
    ``procs`` 0 means as few as the file limit allows (at least one per load CPU
    when ``cpus`` is given). ``deadline_s`` 0 means derived: the ideal session
    time plus every phase's timeout plus 30 s. ``connect_window`` K > 0 lets at
    most K sessions of the point be connecting (TCP + handshake) at once, split
    over the processes; the others wait their turn, and that wait counts in
    their connect and total latency (0: every session connects at the burst's
    instant, as the OpenEnv study did).
    """

    url: str
    sessions: int
    wait_s: float = 1.0
    steps: int = 1
    think: ThinkModel = field(default_factory=ThinkModel)
    state_kb: int = 0
    mode: str = "ws"
    connect_timeout: float = 30.0
    request_timeout: float = 30.0
    close_timeout: float = 5.0
    procs: int = 0
    cpus: tuple[int, ...] | None = None
    deadline_s: float = 0.0
    connect_window: int = 0

    def n_procs(self) -> int:
        """The number of worker processes this load uses."""
        need = max(1, math.ceil(self.sessions / MAX_SESSIONS_PER_PROC))
        want = self.procs or (len(self.cpus) if self.cpus else 1)
        return max(need, min(want, max(1, self.sessions)))

    def deadline(self) -> float:
        """Seconds after the start by which every session must have finished."""
        if self.deadline_s > 0:
            return self.deadline_s
        per_step = self.wait_s + self.think.seconds + self.request_timeout
        return (
            self.connect_timeout
            + self.request_timeout
            + per_step * self.steps
            + self.close_timeout
            + 30.0
        )


def source_address(index: int, sessions: int) -> str | None:
    """The source address of session ``index`` of a point of ``sessions``.

    ``None`` (the kernel's choice, 127.0.0.1) up to :data:`PORTS_PER_SOURCE`
    sessions; past that ``k = ceil(sessions / PORTS_PER_SOURCE)`` addresses
    127.0.0.2 ... 127.0.0.(k+1), round-robin.

    >>> source_address(0, 100) is None
    True
    >>> [source_address(i, 20_000) for i in range(4)]
    ['127.0.0.2', '127.0.0.3', '127.0.0.4', '127.0.0.2']
    """
    if sessions <= PORTS_PER_SOURCE:
        return None
    k = math.ceil(sessions / PORTS_PER_SOURCE)
    if k > 250:
        raise ValueError("too many sessions for 127.0.0.0/24 source addresses")
    return f"127.0.0.{2 + index % k}"


def _bound_socket(source: str) -> socket.socket:
    """An unconnected TCP socket bound to ``source``; its port is chosen at connect."""
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


class _Fail(Exception):
    def __init__(self, kind: ErrorKind, detail: str) -> None:
        super().__init__(detail)
        self.kind = kind
        self.detail = detail


_DECODER = msgspec.json.Decoder()


def _check_reply(payload: bytes) -> dict[str, Any]:
    """The ``data`` of an observation reply, or raise :class:`_Fail`."""
    try:
        msg = _DECODER.decode(payload)
    except msgspec.DecodeError as exc:
        raise _Fail(ErrorKind.PROTOCOL, f"reply is not JSON: {exc}") from None
    if not isinstance(msg, dict):
        raise _Fail(ErrorKind.PROTOCOL, "reply is not an object")
    kind = msg.get("type")
    data = msg.get("data")
    if kind == "observation" and isinstance(data, dict):
        return data
    if kind == "error" and isinstance(data, dict):
        code = str(data.get("code", ""))
        text = f"{code}: {data.get('message', '')}"[:200]
        if code == "CAPACITY_REACHED":
            raise _Fail(ErrorKind.CAPACITY, text)
        raise _Fail(ErrorKind.PROTOCOL, text)
    if isinstance(data, dict) and "observation" in data:
        return data
    raise _Fail(ErrorKind.PROTOCOL, f"unexpected reply type {kind!r}")


def _classify_oserror(exc: OSError) -> _Fail:
    if isinstance(exc, ConnectionRefusedError | ConnectionResetError):
        return _Fail(ErrorKind.REFUSED, type(exc).__name__)
    if exc.errno in _CLIENT_ERRNOS:
        return _Fail(ErrorKind.CLIENT, f"{type(exc).__name__}: {exc.strerror}")
    return _Fail(ErrorKind.REFUSED, f"{type(exc).__name__}: {exc}")


def _observe(rec: SessionRecord, data: dict[str, Any]) -> None:
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


# --------------------------------------------------------------------------- ws


def _make_client_class() -> type[Any]:
    import picows

    class Client(picows.WSListener):
        """Receives replies; one outstanding request at a time."""

        __slots__ = ("close_code", "disconnected", "inbox", "loop", "waiter")

        def __init__(self) -> None:
            self.loop = asyncio.get_running_loop()
            self.waiter: asyncio.Future[bytes] | None = None
            self.inbox: collections.deque[bytes] = collections.deque()
            self.close_code: int | None = None
            self.disconnected = False

        def on_ws_frame(self, transport: Any, frame: Any) -> None:
            mt = frame.msg_type
            if mt is picows.WSMsgType.TEXT or mt is picows.WSMsgType.BINARY:
                payload = frame.get_payload_as_bytes()
                w = self.waiter
                if w is not None and not w.done():
                    w.set_result(payload)
                else:
                    self.inbox.append(payload)
            elif mt is picows.WSMsgType.CLOSE:
                self.close_code = frame.get_close_code().value
                transport.send_close(frame.get_close_code())
                transport.disconnect()

        def on_ws_disconnected(self, transport: Any) -> None:
            self.disconnected = True
            w = self.waiter
            if w is not None and not w.done():
                w.set_exception(self._gone())

        def _gone(self) -> _Fail:
            if self.close_code == 1013:
                return _Fail(ErrorKind.CAPACITY, "closed with 1013")
            return _Fail(ErrorKind.DISCONNECTED, f"closed by server (code {self.close_code})")

        async def recv(self, limit: float) -> bytes:
            if self.inbox:
                return self.inbox.popleft()
            if self.disconnected:
                raise self._gone()
            w: asyncio.Future[bytes] = self.loop.create_future()
            self.waiter = w

            def expire() -> None:
                if not w.done():
                    w.set_exception(_Fail(ErrorKind.TIMEOUT, "reply timed out"))

            handle = self.loop.call_later(limit, expire)
            try:
                return await w
            finally:
                handle.cancel()
                self.waiter = None

    return Client


async def _ws_connect(
    spec: LoadSpec, client_cls: type[Any], window: asyncio.Semaphore | None, **kwargs: Any
) -> tuple[Any, Any]:
    import picows

    async with window if window is not None else contextlib.nullcontext():
        return await asyncio.wait_for(
            picows.ws_connect(
                client_cls,
                spec.url,
                websocket_handshake_timeout=spec.connect_timeout,
                max_redirects=0,
                use_aiofastnet=False,
                **kwargs,
            ),
            spec.connect_timeout,
        )


async def _ws_session(
    rec: SessionRecord,
    spec: LoadSpec,
    t0: float,
    client_cls: type[Any],
    reset_msg: bytes,
    step_msg: bytes,
    window: asyncio.Semaphore | None = None,
) -> None:
    import picows

    loop_time = time.monotonic
    start = loop_time()
    rec.start = start - t0
    kwargs: dict[str, Any] = {}
    source = rec.source
    if source is not None:
        kwargs["socket_factory"] = lambda _url: _bound_socket(source)
    transport: Any = None
    try:
        try:
            transport, client_obj = await _ws_connect(spec, client_cls, window, **kwargs)
        except TimeoutError:
            raise _Fail(ErrorKind.TIMEOUT, "connect timed out") from None
        except picows.WSHandshakeError as exc:
            status = getattr(exc.response, "status", None)
            code = int(status) if status is not None else 0
            if code in (429, 503):
                raise _Fail(ErrorKind.CAPACITY, f"handshake HTTP {code}") from None
            if code:
                raise _Fail(ErrorKind.PROTOCOL, f"handshake HTTP {code}") from None
            raise _Fail(ErrorKind.REFUSED, f"handshake failed: {exc}") from None
        except OSError as exc:
            raise _classify_oserror(exc) from None
        client: Any = client_obj
        if client is None:
            raise _Fail(ErrorKind.DISCONNECTED, "closed during the handshake")
        t = loop_time()
        rec.connect_s = t - start

        transport.send(picows.WSMsgType.TEXT, reset_msg)
        _observe(rec, _check_reply(await client.recv(spec.request_timeout)))
        t2 = loop_time()
        rec.reset_s = t2 - t
        think = spec.think.seconds
        step_timeout = spec.wait_s + spec.request_timeout
        for _ in range(spec.steps):
            if think > 0:
                await asyncio.sleep(think)
            t = loop_time()
            transport.send(picows.WSMsgType.TEXT, step_msg)
            _observe(rec, _check_reply(await client.recv(step_timeout)))
            rec.step_s.append(loop_time() - t)
        t = loop_time()
        transport.send(picows.WSMsgType.TEXT, b'{"type":"close"}')
        rec.ok = True
        if not client.disconnected:
            transport.send_close(picows.WSCloseCode.OK)
            try:
                await asyncio.wait_for(transport.wait_disconnected(), spec.close_timeout)
            except TimeoutError:
                rec.detail = "close timed out"
        end = loop_time()
        rec.close_s = end - t
        rec.total_s = end - start
        rec.end = end - t0
    except _Fail as exc:
        rec.error = exc.kind.value
        rec.detail = exc.detail
    except OSError as exc:
        f = _classify_oserror(exc)
        rec.error, rec.detail = f.kind.value, f.detail
    except Exception as exc:  # a bug in a reply's handling must not kill the point
        rec.error = ErrorKind.PROTOCOL.value
        rec.detail = f"{type(exc).__name__}: {exc}"[:200]
    finally:
        if rec.end is None:
            rec.end = loop_time() - t0
        if transport is not None and not transport.is_disconnected:
            transport.disconnect(False)


# ------------------------------------------------------------------------- http


async def _http_call(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    host: str,
    path: str,
    body: bytes,
    limit: float,
) -> dict[str, Any]:
    writer.write(
        b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (path.encode(), host.encode(), len(body), body)
    )
    try:
        async with asyncio.timeout(limit):
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            status = int(lines[0].split()[1])
            length = 0
            for line in lines[1:]:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value.strip())
            payload = await reader.readexactly(length)
    except TimeoutError:
        raise _Fail(ErrorKind.TIMEOUT, f"{path} timed out") from None
    except (asyncio.IncompleteReadError, ValueError, IndexError) as exc:
        raise _Fail(ErrorKind.DISCONNECTED, f"{path}: {type(exc).__name__}") from None
    if status in (429, 503):
        raise _Fail(ErrorKind.CAPACITY, f"{path}: HTTP {status}")
    if status != 200:
        raise _Fail(ErrorKind.PROTOCOL, f"{path}: HTTP {status}: {payload[:120]!r}")
    data = _DECODER.decode(payload)
    if not isinstance(data, dict):
        raise _Fail(ErrorKind.PROTOCOL, f"{path}: reply is not an object")
    return data


async def _http_session(
    rec: SessionRecord, spec: LoadSpec, t0: float, reset_body: bytes, step_body: bytes
) -> None:
    """HTTP mode: POST /reset then POST /step on one keep-alive connection."""
    parsed = urllib.parse.urlsplit(spec.url)
    host = parsed.hostname or "127.0.0.1"
    port = parsed.port or 80
    base = parsed.path.rstrip("/")
    if base.endswith("/ws"):
        base = base[:-3]
    start = time.monotonic()
    rec.start = start - t0
    writer: asyncio.StreamWriter | None = None
    try:
        try:
            async with asyncio.timeout(spec.connect_timeout):
                if rec.source is None:
                    reader, writer = await asyncio.open_connection(host, port)
                else:  # the same source spreading as the WebSocket mode
                    sock = _bound_socket(rec.source)
                    try:
                        await asyncio.get_running_loop().sock_connect(sock, (host, port))
                    except BaseException:
                        sock.close()
                        raise
                    reader, writer = await asyncio.open_connection(sock=sock)
        except TimeoutError:
            raise _Fail(ErrorKind.TIMEOUT, "connect timed out") from None
        except OSError as exc:
            raise _classify_oserror(exc) from None
        assert writer is not None
        t = time.monotonic()
        rec.connect_s = t - start
        netloc = parsed.netloc
        _observe(
            rec,
            await _http_call(
                reader, writer, netloc, base + "/reset", reset_body, spec.request_timeout
            ),
        )
        t2 = time.monotonic()
        rec.reset_s = t2 - t
        for _ in range(spec.steps):
            if spec.think.seconds > 0:
                await asyncio.sleep(spec.think.seconds)
            t = time.monotonic()
            _observe(
                rec,
                await _http_call(
                    reader,
                    writer,
                    netloc,
                    base + "/step",
                    step_body,
                    spec.wait_s + spec.request_timeout,
                ),
            )
            rec.step_s.append(time.monotonic() - t)
        rec.ok = True
        t = time.monotonic()
        writer.close()
        end = time.monotonic()
        rec.close_s = end - t
        rec.total_s = end - start
        rec.end = end - t0
    except _Fail as exc:
        rec.error, rec.detail = exc.kind.value, exc.detail
    except OSError as exc:
        f = _classify_oserror(exc)
        rec.error, rec.detail = f.kind.value, f.detail
    except Exception as exc:
        rec.error = ErrorKind.PROTOCOL.value
        rec.detail = f"{type(exc).__name__}: {exc}"[:200]
    finally:
        if rec.end is None:
            rec.end = time.monotonic() - t0
        if writer is not None and not writer.is_closing():
            writer.close()


# ---------------------------------------------------------------------- workers


def _messages(spec: LoadSpec) -> tuple[bytes, bytes]:
    reset_data: dict[str, Any] = {}
    if spec.state_kb:
        reset_data["state_kb"] = spec.state_kb
    if spec.mode == "http":
        return (
            msgspec.json.encode(reset_data),
            msgspec.json.encode({"action": {"wait_seconds": spec.wait_s}}),
        )
    return (
        msgspec.json.encode({"type": "reset", "data": reset_data}),
        msgspec.json.encode({"type": "step", "data": {"wait_seconds": spec.wait_s}}),
    )


async def run_sessions(
    spec: LoadSpec,
    indices: Sequence[int],
    t0: float,
    *,
    worker: int = 0,
    on_done: Callable[[], None] | None = None,
) -> list[SessionRecord]:
    """Run the sessions ``indices`` of ``spec`` starting at monotonic time ``t0``.

    Returns one record per index, in order. Sessions still running at
    ``t0 + spec.deadline()`` are cancelled and recorded as ``deadline``.
    Runs on the current event loop; :func:`run_load` calls it in each worker.
    """
    records = [
        SessionRecord(index=i, worker=worker, source=source_address(i, spec.sessions))
        for i in indices
    ]
    reset_msg, step_msg = _messages(spec)
    delay = t0 - time.monotonic()
    if delay > 0:
        await asyncio.sleep(delay)
    client_cls = _make_client_class() if spec.mode == "ws" else None
    window: asyncio.Semaphore | None = None
    if spec.connect_window > 0:
        window = asyncio.Semaphore(max(1, spec.connect_window // spec.n_procs()))

    async def one(rec: SessionRecord) -> None:
        if client_cls is not None:
            await _ws_session(rec, spec, t0, client_cls, reset_msg, step_msg, window)
        else:
            await _http_session(rec, spec, t0, reset_msg, step_msg)
        if on_done is not None:
            on_done()

    tasks = [asyncio.ensure_future(one(r)) for r in records]
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


def _raise_nofile() -> None:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


# Worker <-> parent frames: 4-byte big-endian length + MessagePack of a list
# whose first item is the tag: ["job", spec, indices, worker], ["ready"],
# ["start", t0], ["progress", done], ["records", [...]], ["error", text].
_ENC = msgspec.msgpack.Encoder()


def _frame(obj: Any) -> bytes:
    body = _ENC.encode(obj)
    return len(body).to_bytes(4, "big") + body


def _read_frame(stream: Any) -> Any:
    head = stream.read(4)
    if len(head) < 4:
        raise EOFError
    body = stream.read(int.from_bytes(head, "big"))
    return msgspec.msgpack.decode(body)


class _Job(msgspec.Struct, array_like=True):
    tag: str
    spec: LoadSpec
    indices: list[int]
    worker: int


def worker_main() -> int:
    """A worker process (``python -m stadium.bench.loadgen``): job → ready → start → records.

    Reads frames on stdin, writes frames on stdout; never prints anything else.
    """
    out = sys.stdout.buffer
    inp = sys.stdin.buffer
    try:
        head = inp.read(4)
        job = msgspec.msgpack.decode(inp.read(int.from_bytes(head, "big")), type=_Job)
        spec = job.spec
        if spec.cpus:
            os.sched_setaffinity(0, spec.cpus)
        _raise_nofile()
        try:
            import uvloop

            loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
        except ImportError:  # pragma: no cover
            loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        _make_client_class()  # import picows before the start instant
        # A worker lives for one point and its sessions' objects die with it:
        # the cyclic collector would only re-scan them, ~40 % of the client's CPU
        # in a burst of 8,192 (measured). Reference counting still frees them.
        gc.disable()
        out.write(_frame(["ready", None]))
        out.flush()
        msg = _read_frame(inp)
        if msg[0] != "start":
            return 1
        t0 = float(msg[1])
        done = [0]

        def tick() -> None:
            done[0] += 1

        async def report() -> None:
            while True:
                await asyncio.sleep(0.1)
                out.write(_frame(["progress", done[0]]))
                out.flush()

        async def main() -> list[SessionRecord]:
            reporter = asyncio.ensure_future(report())
            try:
                return await run_sessions(spec, job.indices, t0, worker=job.worker, on_done=tick)
            finally:
                reporter.cancel()

        records = loop.run_until_complete(main())
        out.write(_frame(["records", records]))
        out.flush()
        return 0
    except BaseException as exc:  # report instead of dying silently
        with contextlib.suppress(OSError):
            out.write(_frame(["error", f"{type(exc).__name__}: {exc}"]))
            out.flush()
        return 1


class _Worker:
    """The parent's handle on one worker process and its frame buffer."""

    def __init__(self, index: int, spec: LoadSpec, indices: list[int]) -> None:

        self.index = index
        self.indices = indices
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "stadium.bench.loadgen"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        self.stdin = self.proc.stdin
        self.fd = self.proc.stdout.fileno()
        os.set_blocking(self.fd, False)
        self.buf = bytearray()
        self.eof = False
        self.done = 0
        self.ready = False
        self.records: list[SessionRecord] | None = None
        self.error = ""
        self.send(_ENC.encode(_Job("job", spec, indices, index)))

    def send(self, body: bytes) -> None:
        self.stdin.write(len(body).to_bytes(4, "big") + body)
        self.stdin.flush()

    def pump(self) -> None:
        """Read what is available and handle every complete frame."""
        while True:
            try:
                chunk = os.read(self.fd, 1 << 20)
            except BlockingIOError:
                break
            if not chunk:
                self.eof = True
                break
            self.buf += chunk
        while len(self.buf) >= 4:
            size = int.from_bytes(self.buf[:4], "big")
            if len(self.buf) < 4 + size:
                break
            body = bytes(self.buf[4 : 4 + size])
            del self.buf[: 4 + size]
            tag, payload = _TAGGED.decode(body)
            if tag == "ready":
                self.ready = True
            elif tag == "progress":
                self.done = msgspec.msgpack.decode(payload, type=int)
            elif tag == "records":
                self.records = _RECORDS.decode(payload)
                self.done = len(self.records)
            elif tag == "error":
                self.error = msgspec.msgpack.decode(payload, type=str)

    @property
    def finished(self) -> bool:
        return self.records is not None or bool(self.error) or self.eof

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self.stdin.close()
        try:
            self.proc.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5.0)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


_TAGGED = msgspec.msgpack.Decoder(tuple[str, msgspec.Raw])
_RECORDS = msgspec.msgpack.Decoder(list[SessionRecord])


def run_load(
    spec: LoadSpec,
    *,
    progress: Callable[[int], None] | None = None,
    start_delay: float = 0.3,
) -> tuple[list[SessionRecord], int]:
    """Run one point's load from worker processes; return (records, processes used).

    ``progress(done)`` is called about ten times a second with the number of
    sessions finished so far. Always returns within the point's deadline plus
    ~30 s: workers that do not report are killed and their sessions recorded as
    ``deadline`` (or ``client`` if the worker failed).
    """
    import select

    nprocs = spec.n_procs()
    shares: list[list[int]] = [list(range(w, spec.sessions, nprocs)) for w in range(nprocs)]
    workers: list[_Worker] = []
    try:
        workers = [_Worker(w, spec, shares[w]) for w in range(nprocs)]
        ready_by = time.monotonic() + 60.0
        while time.monotonic() < ready_by and not all(w.ready or w.finished for w in workers):
            select.select([w.fd for w in workers if not w.finished], [], [], 0.1)
            for w in workers:
                w.pump()
        t0 = time.monotonic() + start_delay
        for w in workers:
            if w.ready and not w.finished:
                w.send(_ENC.encode(["start", t0]))
            elif not w.error:
                w.error = "worker did not start"
        finish_by = t0 + spec.deadline() + 30.0
        last = 0.0
        while time.monotonic() < finish_by and not all(w.finished for w in workers):
            select.select([w.fd for w in workers if not w.finished], [], [], 0.1)
            for w in workers:
                if not w.finished:
                    w.pump()
            now = time.monotonic()
            if progress is not None and now - last >= 0.1:
                last = now
                progress(sum(w.done for w in workers))
        for w in workers:
            if not w.finished:
                w.error = "worker missed the deadline"
                w.proc.kill()
        if progress is not None:
            progress(sum(w.done for w in workers))
    finally:
        for w in workers:
            w.stop()
    records: list[SessionRecord] = []
    for w in workers:
        if w.records is not None:
            records.extend(w.records)
        else:
            detail = w.error or "worker exited without results"
            kind = ErrorKind.DEADLINE if "deadline" in detail else ErrorKind.CLIENT
            records.extend(
                SessionRecord(index=i, worker=w.index, error=kind.value, detail=detail)
                for i in w.indices
            )
    records.sort(key=lambda r: r.index)
    return records, nprocs


if __name__ == "__main__":
    sys.exit(worker_main())

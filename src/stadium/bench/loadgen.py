"""The load generator's processes: one point's sessions, from several workers at one instant.

:func:`run_load` runs a :class:`~stadium.bench.loadspec.LoadSpec` from
``spec.n_procs()`` worker processes (``python -m stadium.bench.loadgen``),
each on its own uvloop event loop running
:func:`~stadium.bench.sessions.run_sessions` (a batched load:
:func:`~stadium.bench.batched.run_batch_sessions`) for its share of the sessions.
The workers report ready, the parent hands them one start instant on the
system-wide monotonic clock, and every session of every worker starts then
(a coordinated burst).

Parent and worker talk over the worker's stdin and stdout in frames: a
4-byte big-endian length, then MessagePack of a list whose first item is the
tag — ``["job", spec, indices, worker]`` and ``["start", t0]`` to the worker;
``["ready", None]``, ``["progress", done]``, ``["cpu", seconds]`` (the
worker's own CPU time over its sessions: the client's cost), ``["records",
[...]]`` and ``["error", text]`` back; a soak's workers (``spec.duration_s > 0``) send
``["tally", SoakTally]`` instead of progress, and no records. :func:`frame`
writes one; :class:`FrameDecoder` reads them, incrementally (the parent's
non-blocking pipes) or blocking (:func:`read_frame`, the worker's stdin).

Every phase of a session has a timeout and the point a deadline after which
the sessions still running are cancelled and recorded as ``deadline``; the
parent kills a worker that does not report within the deadline plus a grace
period. Workers can be pinned to CPUs (``spec.cpus``) to keep the load off the
server's cores.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import select
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Any

import msgspec

from stadium._util.process import new_event_loop, raise_nofile_limit
from stadium.bench.batched import batch_connection_class, run_batch_sessions
from stadium.bench.loadspec import LoadSpec
from stadium.bench.results import SessionResult
from stadium.bench.sessions import SoakTally, run_sessions, soak_sessions, ws_connection_class
from stadium.bench.stats import ErrorKind

_HEADER = 4
"""Bytes of a frame's length prefix (big-endian)."""

_ENC = msgspec.msgpack.Encoder()
_TAGGED = msgspec.msgpack.Decoder(tuple[str, msgspec.Raw])
_RECORDS = msgspec.msgpack.Decoder(list[SessionResult])
_TALLY = msgspec.msgpack.Decoder(SoakTally)

REPORT_S = 0.1
"""How often a worker reports progress (a soak's worker: its tally, every 5 reports)."""


# ----------------------------------------------------------------------- frames


def frame(obj: Any) -> bytes:
    """``obj`` as one frame: its MessagePack encoding behind a 4-byte length."""
    body = _ENC.encode(obj)
    return len(body).to_bytes(_HEADER, "big") + body


class FrameDecoder:
    """Splits a byte stream into frame bodies, however the bytes arrive."""

    __slots__ = ("_buf",)

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> None:
        """Add bytes read from the stream."""
        self._buf += data

    def next(self) -> bytes | None:
        """The next complete frame's body (consumed), or ``None`` if it is incomplete."""
        buf = self._buf
        if len(buf) < _HEADER:
            return None
        end = _HEADER + int.from_bytes(buf[:_HEADER], "big")
        if len(buf) < end:
            return None
        body = bytes(buf[_HEADER:end])
        del buf[:end]
        return body

    def missing(self) -> int:
        """Bytes still needed to complete the next frame (at least 1 when :meth:`next`
        would return ``None``): reading exactly that many never reads past it."""
        buf = self._buf
        if len(buf) < _HEADER:
            return _HEADER - len(buf)
        return _HEADER + int.from_bytes(buf[:_HEADER], "big") - len(buf)


def read_frame(stream: IO[bytes]) -> bytes:
    """Block until one whole frame is read from ``stream``; its body. ``EOFError`` at the end."""
    decoder = FrameDecoder()
    while (body := decoder.next()) is None:
        chunk = stream.read(decoder.missing())
        if not chunk:
            raise EOFError
        decoder.feed(chunk)
    return body


def _send(stream: IO[bytes], obj: Any) -> None:
    stream.write(frame(obj))
    stream.flush()


# ---------------------------------------------------------------------- workers


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
        job = msgspec.msgpack.decode(read_frame(inp), type=_Job)
        spec = job.spec
        if spec.cpus:
            os.sched_setaffinity(0, spec.cpus)
        raise_nofile_limit()
        loop = new_event_loop()
        asyncio.set_event_loop(loop)
        ws_connection_class()  # import picows before the start instant
        batch_connection_class()
        # A worker lives for one point and its sessions' objects die with it:
        # the cyclic collector would only re-scan them, ~40 % of the client's CPU
        # in a burst of 8,192 (measured). Reference counting still frees them.
        gc.disable()
        _send(out, ["ready", None])
        msg = msgspec.msgpack.decode(read_frame(inp))
        if msg[0] != "start":
            return 1
        cpu = os.times()
        records = loop.run_until_complete(_work(job, float(msg[1]), out))
        after = os.times()
        _send(out, ["cpu", after.user - cpu.user + after.system - cpu.system])
        _send(out, ["records", records])
        return 0
    except BaseException as exc:  # report instead of dying silently
        with contextlib.suppress(OSError):
            _send(out, ["error", f"{type(exc).__name__}: {exc}"])
        return 1


async def _work(job: _Job, t0: float, out: IO[bytes]) -> list[SessionResult]:
    """Run the job's sessions from ``t0``, reporting progress every 0.1 s."""
    if job.spec.duration_s > 0:
        await _soak(job, t0, out)
        return []
    done = 0

    def tick() -> None:
        nonlocal done
        done += 1

    async def report() -> None:
        while True:
            await asyncio.sleep(REPORT_S)
            _send(out, ["progress", done])

    reporter = asyncio.ensure_future(report())
    sessions = run_batch_sessions if job.spec.batch else run_sessions
    try:
        return await sessions(job.spec, job.indices, t0, worker=job.worker, on_done=tick)
    finally:
        reporter.cancel()


async def _soak(job: _Job, t0: float, out: IO[bytes]) -> None:
    """Run the job's soak from ``t0``, sending its tally (and latency sample) every 0.5 s."""
    tally = SoakTally()

    def report() -> None:
        _send(out, ["tally", tally])
        tally.take_sample()

    async def reporter() -> None:
        while True:
            await asyncio.sleep(5 * REPORT_S)
            report()

    task = asyncio.ensure_future(reporter())
    try:
        await soak_sessions(job.spec, job.indices, t0, tally, worker=job.worker)
    finally:
        task.cancel()
    report()


class LoadWorker:
    """The parent's handle on one worker process: its pipes, frames and results."""

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
        self.frames = FrameDecoder()
        self.eof = False
        self.done = 0
        self.ready = False
        self.records: list[SessionResult] | None = None
        self.cpu_s: float | None = None
        self.tally = SoakTally()
        self.samples: list[float] = []
        self.error = ""
        self.send(_Job("job", spec, indices, index))

    def send(self, obj: Any) -> None:
        """Write one frame to the worker."""
        _send(self.stdin, obj)

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
            self.frames.feed(chunk)
        while (body := self.frames.next()) is not None:
            self._handle(body)

    def _handle(self, body: bytes) -> None:
        tag, payload = _TAGGED.decode(body)
        if tag == "ready":
            self.ready = True
        elif tag == "progress":
            self.done = msgspec.msgpack.decode(payload, type=int)
        elif tag == "cpu":
            self.cpu_s = msgspec.msgpack.decode(payload, type=float)
        elif tag == "records":
            self.records = _RECORDS.decode(payload)
            self.done = len(self.records)
        elif tag == "tally":
            self.tally = _TALLY.decode(payload)
            self.samples.extend(self.tally.take_sample())
        elif tag == "error":
            self.error = msgspec.msgpack.decode(payload, type=str)

    @property
    def finished(self) -> bool:
        return self.records is not None or bool(self.error) or self.eof

    def results(self) -> list[SessionResult]:
        """Its records, or one failed record per session it was given."""
        if self.records is not None:
            return self.records
        detail = self.error or "worker exited without results"
        kind = ErrorKind.DEADLINE if "deadline" in detail else ErrorKind.CLIENT
        return [
            SessionResult(index=i, worker=self.index, error=kind.value, detail=detail)
            for i in self.indices
        ]

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


def pump_until(
    workers: list[LoadWorker],
    done: Callable[[LoadWorker], bool],
    until: float,
    tick: Callable[[], None],
) -> None:
    """Handle the workers' frames until every worker is ``done`` or the clock passes ``until``."""
    while time.monotonic() < until and not all(done(w) for w in workers):
        select.select([w.fd for w in workers if not w.finished], [], [], 0.1)
        for w in workers:
            if not w.finished:
                w.pump()
        tick()


@dataclass(slots=True)
class LoadResult:
    """What one point's load did: a record per session (in index order), the worker
    processes used, and their CPU seconds over the sessions (``None`` unless every
    worker reported it)."""

    records: list[SessionResult]
    procs: int
    cpu_s: float | None = None


def run_load(
    spec: LoadSpec,
    *,
    progress: Callable[[int], None] | None = None,
    start_delay: float = 0.3,
) -> tuple[list[SessionResult], int]:
    """Run one point's load from worker processes; return (records, processes used).

    ``progress(done)`` is called about ten times a second with the number of
    sessions finished so far. Always returns within the point's deadline plus
    ~30 s: workers that do not report are killed and their sessions recorded as
    ``deadline`` (or ``client`` if the worker failed). :func:`load` also says
    the load's own CPU time.
    """
    result = load(spec, progress=progress, start_delay=start_delay)
    return result.records, result.procs


def load(
    spec: LoadSpec,
    *,
    progress: Callable[[int], None] | None = None,
    start_delay: float = 0.3,
) -> LoadResult:
    """:func:`run_load`, with the workers' CPU time (:class:`LoadResult`)."""
    workers: list[LoadWorker] = []
    last = [0.0]

    def report(final: bool = False) -> None:
        now = time.monotonic()
        if progress is not None and (final or now - last[0] >= 0.1):
            last[0] = now
            progress(sum(w.done for w in workers))

    try:
        t0 = start_workers(spec, workers, start_delay)
        pump_until(workers, lambda w: w.finished, t0 + spec.deadline() + 30.0, report)
        report(final=True)
    finally:
        stop_workers(workers)
    records = [r for w in workers for r in w.results()]
    records.sort(key=lambda r: r.index)
    cpus = [w.cpu_s for w in workers]
    cpu_s = None if any(c is None for c in cpus) else sum(c for c in cpus if c is not None)
    return LoadResult(records, len(workers), cpu_s)


def start_workers(spec: LoadSpec, workers: list[LoadWorker], start_delay: float) -> float:
    """Start ``spec``'s worker processes (appended to ``workers``, for the caller to
    stop), wait until they are ready and give them one start instant; return it."""
    nprocs = spec.n_procs()
    for i in range(nprocs):
        workers.append(LoadWorker(i, spec, list(range(i, spec.sessions, nprocs))))
    pump_until(workers, lambda w: w.ready or w.finished, time.monotonic() + 60.0, lambda: None)
    t0 = time.monotonic() + start_delay
    for w in workers:
        if w.ready and not w.finished:
            w.send(["start", t0])
        elif not w.error:
            w.error = "worker did not start"
    return t0


def stop_workers(workers: list[LoadWorker]) -> None:
    """Kill the workers that have not finished (recording why), then reap them all."""
    for w in workers:
        if not w.finished:
            w.error = w.error or "worker missed the deadline"
            w.proc.kill()
    for w in workers:
        w.stop()


if __name__ == "__main__":
    sys.exit(worker_main())

"""``stadium serve --record DIR``: every episode (or a sample, or those a filter keeps) written
as Parquet shards by a writer process of the worker's own (:mod:`.writer`).

**Path of an episode.** On the event loop, a recorded episode's reset reply, then per step
its request frame as it came, its reply frame (or the error's text) and its time, then its
end (how, and its :class:`~stadium._env.cost.EpisodeCost`) are copied into one buffer as
small messages (:mod:`.pipe`: a fixed header and the raw bytes; no Python object kept per
step, nothing for the cyclic collector): a :mod:`.buffer` ``StepBuffer``, native when built, so
that a usual step is copied in one C call (``Recorder.step`` is the buffer's own method; its
other cases come back to :meth:`Recorder._step`). The buffer is written to a pipe (non-blocking,
one ``os.write`` of everything buffered, :data:`FLUSH_S` after its first unsent byte or at
once past :data:`FLUSH_BYTES`) read by the worker's writer process, which decodes the
frames, builds the columns and writes the shards: none of that work, nor its garbage, is
the worker's. The buffer holds at most :attr:`RecordConfig.queue_bytes`: a step that does
not fit drops its episode (counted, ``stadium_record_dropped_episodes_total``), never waits.

**The writer process** (native, ``native/stadium-record-writer``, or
``python -m stadium._server.ledger.writer``: :mod:`.writers` chooses) is started when the
worker starts (:meth:`Recorder.start`; else at the first recorded episode), and dies
with the worker (``PR_SET_PDEATHSIG``): on the worker's end, a SIGKILL included, it reads
what is left in the pipe, writes its last shard and exits. It runs the
``--record-redact`` hook (the operator's code: in that process, not the worker). Its
counts reach the worker's metrics row through a few bytes of shared memory the loop reads
every :data:`IDLE_S` at most.

**Shards.** Each worker's writer writes its own files (no cross-process lock), named
``episodes-<env>-<worker pid>-<start ms>-<n>.parquet``. A shard is written whole, to a
``.tmp`` name, then renamed: a file with the final name is always a complete Parquet file
(its footer written). Parquet cannot be appended to (the footer is at the end), so to
lose at most ~:attr:`RecordConfig.flush_s` (+ :data:`WAKE_S`) of episodes when a worker is
killed (SIGKILL), the writer closes a shard as soon as its first row is that old, or once its
rows reach :attr:`RecordConfig.shard_bytes`: a busy worker writes one shard a second. What a
SIGKILL loses: the episodes still running (their ends never come), and what the writer
could not read or write before it was killed itself. No ``fsync``: a killed process's
written pages are in the kernel's cache; a machine crash may lose more.

**Failures.** A shard write that fails (a full disk, a read-only directory) is logged (at
most every :data:`PAUSE_S`), counted (``stadium_record_write_errors_total``), its rows
dropped and counted, and recording pauses for :data:`PAUSE_S` (episodes ended meanwhile
are dropped and counted, ``stadium_recording`` reads 0); then it tries again. A writer
process that cannot start or dies stops the recording (logged; episodes dropped and
counted). A step never fails or waits because of the recording. docs/RECORDING.md has the
schema.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import fcntl
import glob
import importlib
import logging
import mmap
import operator
import os
import random
import re
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import msgspec

from stadium._env.cost import EpisodeCost
from stadium._errors import ConfigError
from stadium._server.ledger import pipe
from stadium._server.ledger.buffer import NATIVE, StepBuffer, StepBufferType
from stadium._server.ledger.episode import EndReason
from stadium._server.ledger.rows import Summary, write_shard
from stadium._server.ledger.writers import writer_command
from stadium._util.throttle import Throttle

log = logging.getLogger("stadium.record")

#: Seconds recording pauses after a failed shard write (then it tries again).
PAUSE_S = 10.0
#: The writer process takes what it read this often at most (it wakes on data sooner).
WAKE_S = 0.2
#: The writer turns ended episodes into columns this many at a time.
CHUNK_STEPS = 256
#: The gathered steps become an Arrow record batch every this many, and at the shard's end.
SEAL_STEPS = 4096
#: Fields of the ``counts`` row the recorder writes: recorded, dropped, write errors, on.
RECORDED, DROPPED, WRITE_ERRORS, RECORDING = range(4)


@dataclasses.dataclass(frozen=True, slots=True)
class RecordConfig:
    """What ``--record`` and its companions ask for.

    Attributes:
        directory: where the shards go (made if missing).
        sample: the fraction of episodes recorded, chosen at reset (1: all).
        filter: an expression an episode must match to be written
            (:func:`parse_filter`), e.g. ``reward>0.9`` or ``error``; empty: all.
        redact: ``module:function`` called with each episode's record (a dict, in the
            writer process: the operator's code runs there) before it is stored; it
            returns the record to store (changed as it likes) or ``None`` to store nothing.
        flush_s: the oldest row an open shard holds before it is written and closed.
        shard_bytes: a shard is closed once its episodes' frames reach this size.
        queue_bytes: bytes waiting for the writer in the worker's buffer, at most (more
            are dropped; the writer process reads ahead as much again).
        episode_bytes: one episode's frames kept, at most (later steps are not kept:
            the row says ``clipped``).
    """

    directory: str
    sample: float = 1.0
    filter: str = ""
    redact: str = ""
    flush_s: float = 1.0
    shard_bytes: int = 64 << 20
    queue_bytes: int = 64 << 20
    episode_bytes: int = 16 << 20

    def __post_init__(self) -> None:
        if not 0.0 < self.sample <= 1.0:
            raise ConfigError("--record-sample must be a fraction in (0, 1]", value=self.sample)
        if self.flush_s <= 0:
            raise ConfigError("the recording's flush interval must be > 0 seconds")
        parse_filter(self.filter)


# -- the filter ------------------------------------------------------------------------------

_FIELDS = ("reward", "steps", "wall_s", "cpu_s", "bytes_in", "bytes_out")
_FLAGS = ("error", "done", "truncated", "clipped")
_OPS: dict[str, Callable[[float, float], bool]] = {
    ">=": operator.ge, "<=": operator.le, "==": operator.eq, "!=": operator.ne,
    ">": operator.gt, "<": operator.lt,
}  # fmt: skip
_TERM = re.compile(r"^\s*(not\s+)?([a-z_]+)\s*(?:(>=|<=|==|!=|>|<)\s*(-?[0-9.eE+-]+|inf))?\s*$")


def parse_filter(text: str) -> Callable[[Summary], bool] | None:
    """The predicate of a ``--record-filter`` expression (``None`` for an empty one).

    Terms joined by ``or`` (any) and ``and`` (all; binds tighter); a term is a flag
    (``error``, ``done``, ``truncated``, ``clipped``, optionally ``not``) or a comparison
    ``FIELD OP NUMBER`` with FIELD one of ``reward`` (the episode's total), ``steps``,
    ``wall_s``, ``cpu_s``, ``bytes_in``, ``bytes_out`` and OP one of ``> >= < <= == !=``.

    Raises:
        ConfigError: naming the term that cannot be read.
    """
    if not text.strip():
        return None
    alternatives: list[list[Callable[[Summary], bool]]] = []
    for part in re.split(r"\s+or\s+", text.strip()):
        terms = []
        for raw in re.split(r"\s+and\s+", part):
            terms.append(_term(raw, text))
        alternatives.append(terms)

    def matches(summary: Summary) -> bool:
        return any(all(t(summary) for t in terms) for terms in alternatives)

    return matches


def _term(raw: str, text: str) -> Callable[[Summary], bool]:
    m = _TERM.match(raw)
    hint = (
        f"--record-filter {text!r}: cannot read {raw.strip()!r}; write terms such as "
        f"'reward>0.9', 'steps>=100', 'error', 'not done', joined by 'and' / 'or' "
        f"(fields: {', '.join(_FIELDS)}; flags: {', '.join(_FLAGS)})"
    )
    if m is None:
        raise ConfigError(hint)
    negate, name, op, number = m.groups()
    if op is None:
        if name not in _FLAGS:
            raise ConfigError(hint)
        return (lambda s: not s[name]) if negate else (lambda s: bool(s[name]))
    if negate or name not in _FIELDS:
        raise ConfigError(hint)
    try:
        value = float(number)
    except ValueError:
        raise ConfigError(hint) from None
    compare = _OPS[op]
    return lambda s: compare(float(s[name]), value)


def load_redactor(spec: str) -> Callable[[dict[str, Any]], dict[str, Any] | None] | None:
    """The function ``--record-redact module:function`` names (``None`` for an empty one).

    Raises:
        ConfigError: it cannot be imported or is not callable.
    """
    if not spec:
        return None
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ConfigError(
            f"--record-redact {spec!r}: give module:function, e.g. mypkg.privacy:redact"
        )
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"--record-redact {spec!r}: cannot import it ({exc})") from None
    if not callable(fn):
        raise ConfigError(f"--record-redact {spec!r} is not a function")
    return fn  # type: ignore[no-any-return]


# -- the recorder --------------------------------------------------------------------------


class RecorderState(enum.Enum):
    """The recorder's lifecycle (the worker's side; ``PAUSED`` is its writer process's)."""

    IDLE = "idle"
    """No episode recorded yet: no writer process, no file."""
    RECORDING = "recording"
    PAUSED = "paused"
    """A shard write failed: episodes are dropped (and counted) until :data:`PAUSE_S` passed
    (the writer process's state)."""
    LOST = "lost"
    """The writer process could not be started or died: episodes are dropped and counted."""
    CLOSED = "closed"


_META = msgspec.msgpack.Encoder()
_END_FLAGS = {reason: i for i, reason in enumerate(pipe.END_REASONS)}
_HEAD = pipe.HEAD
_HEAD_SIZE = pipe.HEAD.size
_STEP = pipe.STEP
#: The loop writes its buffer to the pipe this long after its first unsent byte (a timer),
#: or at once past :data:`FLUSH_BYTES`; with nothing to send, it looks at the writer's
#: counts every :data:`IDLE_S`.
FLUSH_S = 0.01
FLUSH_BYTES = 256 << 10
IDLE_S = 0.5
#: The pipe's size asked for (``F_SETPIPE_SZ``; Linux's default bound is 1 MiB).
PIPE_BYTES = 1 << 20
_F_SETPIPE_SZ = 1031
_said_buffer = False
#: At the close, the writer is given this long to end on the pipe's EOF before a SIGTERM.
CLOSE_GRACE_S = 2.0


class Recorder:
    """One worker's recording, the loop's side (module doc): the buffer, the pipe, the
    writer process (:mod:`stadium._server.ledger.writer`).

    Args:
        config: what ``--record`` asked for.
        env: the env's name and version (columns of every row).
        info_key: the key of a reply's ``info`` (the env's ``info_key``).
        counts: four float fields of the worker's metrics row: episodes recorded,
            dropped, write failures, and 1 while recording.
    """

    def __init__(
        self,
        config: RecordConfig,
        env: tuple[str, str],
        info_key: str,
        counts: Any,
    ) -> None:
        self.config = config
        self.env_name, self.env_version = env
        self.info_key = info_key
        self.counts = counts
        self.state = RecorderState.IDLE
        self._limit = config.queue_bytes
        self._fd = -1
        self._proc: subprocess.Popen[bytes] | None = None
        self._shared: Any = None  # the writer's four counts (shared memory)
        self._dropped = 0  # episodes the loop could not hand over
        self._broken: set[int] = set()  # recorded episodes a step of which was dropped
        # A step's two frames fit the buffer's usual case below this many bytes in all,
        # buffer included (its ``room``: 0 while an episode is broken or no flush is due).
        self._free = min(FLUSH_BYTES, self._limit + 1) - _HEAD_SIZE
        self._buf: StepBufferType = StepBuffer(0, self._step)
        self.step = self._buf.step
        """A step of a recorded episode: ``step(rid, request, reply, took)``, its request
        frame as it came, its reply frame, its seconds; copied into the buffer (or, when it
        is full, the episode dropped). The buffer's own method (:mod:`.buffer`)."""
        self._next = 0
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sample = config.sample
        self._random = random.random
        self._stem = ""
        self._log = Throttle(PAUSE_S)

    @property
    def written(self) -> list[str]:
        """Paths of the shards this worker's writer wrote (read from the directory: for
        tests and benchmarks)."""
        if not self._stem:
            return []
        return sorted(
            glob.glob(os.path.join(glob.escape(self.config.directory), self._stem + "-*.parquet"))
        )

    def wants(self) -> bool:
        """Whether to keep the episode a reset begins (``--record-sample``), on the loop."""
        return self._sample >= 1.0 or self._random() < self._sample

    # -- on the loop: an episode's messages -------------------------------------------------

    def begin(
        self,
        episode_id: str | None,
        seed: int | None,
        options: dict[str, Any] | None,
        frame: bytes,
        json: bool,
    ) -> int | None:
        """A recorded episode begins (its reset's reply ``frame``): its recording id, or
        ``None`` when it cannot be recorded (counted dropped)."""
        if self.state is not RecorderState.RECORDING:
            if self.state is RecorderState.IDLE:
                self._start()
            if self.state is not RecorderState.RECORDING:  # type: ignore[comparison-overlap]
                self._drop()
                return None
        self._next = rid = (self._next + 1) % pipe.ID_LIMIT
        try:
            meta = _META.encode((episode_id, seed, options))
        except (TypeError, ValueError, OverflowError):
            self._drop()
            return None
        buf = self._buf
        if len(buf) + _HEAD_SIZE + len(meta) + len(frame) > self._limit:
            self._drop()
            return None
        buf += _HEAD.pack(pipe.BEGIN, rid, json, time.time(), len(meta), len(frame))
        buf += meta
        buf += frame
        self._due()
        return rid

    def step_failed(self, rid: int, request: bytes | str, error: str, took: float) -> None:
        """A step of recorded episode ``rid`` that failed: its request frame, the error's
        text, its seconds (as :meth:`step`)."""
        self._step(rid, request, error, took)

    def _step(self, rid: int, request: bytes | str, reply: bytes | str, took: float) -> None:
        """A step the buffer's usual case did not take (:attr:`step`)."""
        broken = self._broken
        if broken and rid in broken:
            return
        failed = isinstance(reply, str)
        body = reply.encode() if isinstance(reply, str) else reply
        if isinstance(request, str):
            request = request.encode()
        buf = self._buf
        size = len(buf) + _HEAD_SIZE + len(request) + len(body)
        if size > self._limit:
            broken.add(rid)
            buf.room = 0
            return
        buf += _HEAD.pack(_STEP, rid, failed, took, len(request), len(body))
        buf += request
        buf += body
        if size >= FLUSH_BYTES:
            self._flush()
        elif self._timer is None:
            self._due()

    def end(self, rid: int, end: EndReason, cost: EpisodeCost | None, clipped: bool) -> None:
        """Recorded episode ``rid`` ended (a small message, sent even past the bound);
        ``cost`` ``None``: it is not to be recorded after all (counted dropped)."""
        flag = _END_FLAGS[end] | (pipe.CLIPPED if clipped else 0)
        if cost is None or (self._broken and rid in self._broken):
            self._broken.discard(rid)
            self._open()
            flag |= pipe.DROPPED
            body = b""
        else:
            body = _META.encode(cost)
        self._buf += _HEAD.pack(pipe.END, rid, flag, 0.0, len(body), 0)
        self._buf += body
        self._due()

    def _drop(self) -> None:
        self._dropped += 1
        self.counts[DROPPED] += 1

    # -- on the loop: the pipe --------------------------------------------------------------

    def _open(self) -> None:
        """Let steps take the buffer's usual case while a flush is due (a timer set: the
        usual case sets none) and no episode is broken."""
        self._buf.room = self._free if self._timer is not None and not self._broken else 0

    def _due(self) -> None:
        if self._timer is None and self._loop is not None:
            self._timer = self._loop.call_later(FLUSH_S, self._tick)
            self._open()
        elif self._loop is None and len(self._buf) >= FLUSH_BYTES:
            self._flush()

    def _tick(self) -> None:
        self._timer = None
        self._flush()
        self._read_counts()
        if self.state is RecorderState.RECORDING and self._loop is not None:
            self._timer = self._loop.call_later(FLUSH_S if self._buf else IDLE_S, self._tick)
        self._open()

    def _flush(self) -> None:
        """Write what the buffer holds to the pipe, as much as it takes (never waits)."""
        if not self._buf or self._fd < 0:
            return
        try:
            self._buf.write(self._fd)
        except BlockingIOError:
            return
        except OSError as exc:  # the writer process is gone
            self._lose(f"its pipe failed ({exc.strerror or exc})")

    def _read_counts(self) -> None:
        shared = self._shared
        if shared is None:
            return
        counts = self.counts
        counts[RECORDED] = shared[RECORDED]
        counts[DROPPED] = shared[DROPPED] + self._dropped
        counts[WRITE_ERRORS] = shared[WRITE_ERRORS]
        counts[RECORDING] = shared[RECORDING] if self.state is RecorderState.RECORDING else 0
        proc = self._proc
        if proc is not None and self.state is RecorderState.RECORDING and proc.poll() is not None:
            self._lose(f"it exited with status {proc.returncode}")

    def _lose(self, why: str) -> None:
        if self.state is RecorderState.RECORDING:
            self.state = RecorderState.LOST
            self.counts[RECORDING] = 0
            log.error("--record: the writer process is lost (%s): not recording", why)
        self._buf.clear()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def start(self) -> None:
        """Start the writer process now (the worker's start, on its loop), not at the first
        recorded episode: its start-up (an interpreter importing pyarrow) is then no
        episode's."""
        if self.state is RecorderState.IDLE:
            self._start()

    def _start(self) -> None:
        """Start the writer process (on the loop)."""
        with contextlib.suppress(RuntimeError):
            self._loop = asyncio.get_running_loop()
        pid = os.getpid()
        self._stem = f"episodes-{_safe(self.env_name)}-{pid}-{int(time.time() * 1000)}"
        read_fd = memfd = -1
        try:
            read_fd, self._fd = os.pipe()
            with contextlib.suppress(OSError):
                fcntl.fcntl(self._fd, _F_SETPIPE_SZ, PIPE_BYTES)
            os.set_blocking(self._fd, False)
            memfd = os.memfd_create("stadium-record-counts")
            os.ftruncate(memfd, 4 * 8)
            self._shared = memoryview(mmap.mmap(memfd, 4 * 8)).cast("d")
            settings = {
                "config": dataclasses.asdict(self.config),
                "env": self.env_name, "version": self.env_version, "info_key": self.info_key,
                "worker": pid, "stem": self._stem,
            }  # fmt: skip
            paths = [p or os.getcwd() for p in sys.path]
            environ = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
            self._proc = subprocess.Popen(
                writer_command(read_fd, memfd, settings),
                pass_fds=(read_fd, memfd), stdin=subprocess.DEVNULL, env=environ,
            )  # fmt: skip
        except OSError as exc:
            self.state = RecorderState.LOST
            log.error("--record: cannot start the writer process (%s): not recording", exc)
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
            return
        finally:
            for fd in (read_fd, memfd):
                if fd >= 0:
                    os.close(fd)
        self.state = RecorderState.RECORDING
        self.counts[RECORDING] = 1
        global _said_buffer
        if not NATIVE and not _said_buffer:
            _said_buffer = True
            log.warning(
                "--record: the native step buffer is missing (`make record-deps` builds it): "
                "each recorded step costs the event loop ~0.25 µs more"
            )

    def close(self, timeout: float = 5.0) -> None:
        """Hand the writer what is buffered, let it write its last shard and exit (waits up
        to ``timeout``)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
            self._open()
        proc = self._proc
        if self.state is RecorderState.RECORDING and self._fd >= 0:
            deadline = time.monotonic() + timeout
            while self._buf and self._fd >= 0 and time.monotonic() < deadline:
                self._flush()
                if self._buf and self._fd >= 0:
                    select.select([], [self._fd], [], 0.05)
        self.state = RecorderState.CLOSED
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if proc is not None:  # the pipe's EOF ends it; a SIGTERM if a forked child holds
            # the pipe open (not at once: before its handler is set, SIGTERM kills it)
            deadline = time.monotonic() + timeout
            try:
                proc.wait(min(CLOSE_GRACE_S, timeout))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        self._read_counts()
        self.counts[RECORDING] = 0

    def _warn(self, msg: str, *args: object) -> None:
        held = self._log.report(time.monotonic())
        if held is not None:
            log.warning(msg + (f" ({held} more since the last report)" if held else ""), *args)


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)[:64] or "env"


__all__ = [
    "PAUSE_S",
    "RecordConfig",
    "Recorder",
    "RecorderState",
    "load_redactor",
    "parse_filter",
    "write_shard",
]

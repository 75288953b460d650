"""``stadium serve --record DIR``: every episode (or a sample, or those a filter keeps) written
as Parquet shards, off the event loop.

**Path of an episode.** The session keeps its episode's reset reply, and per step the
request frame as it came, the reply frame (or the error's text) and the step's time, by
reference (no encoding on the event loop, nothing the cyclic collector tracks), up to
:attr:`RecordConfig.episode_bytes`. When the episode ends, :meth:`Recorder.submit` puts
it on a deque bounded in bytes (:attr:`RecordConfig.queue_bytes`; no lock: the loop
appends, the writer pops, each byte counter written by one thread): when the queue is
full the episode is dropped and counted (``stadium_record_dropped_episodes_total``),
never waited for. The writer thread takes the queue every :data:`WAKE_S`, in chunks of
:data:`CHUNK_STEPS` steps, each turned into columns (:mod:`.rows`: the redaction hook,
the filter) then a pause of :data:`YIELD_S` with the GIL let go; every
:data:`SEAL_STEPS` steps the columns become an Arrow record batch.

**Shards.** Each worker writes its own files (no cross-process lock), named
``episodes-<env>-<pid>-<start ms>-<n>.parquet``. A shard is written whole, to a
``.tmp`` name, then renamed: a file with the final name is always a complete Parquet file
(its footer written). Parquet cannot be appended to (the footer is at the end), so to
lose at most ~:attr:`RecordConfig.flush_s` (+ :data:`WAKE_S`) of episodes when a worker is
killed (SIGKILL), the writer closes a shard as soon as its first row is that old, or once its
rows reach :attr:`RecordConfig.shard_bytes`: a busy worker writes one shard a second. What a
SIGKILL loses: the rows gathered for the open shard (≤ ``flush_s``), the episodes on the
queue, and the episodes still running. No ``fsync``: a killed process's written pages are
in the kernel's cache; a machine crash may lose more.

**Failures.** A shard write that fails (a full disk, a read-only directory) is logged (at
most every :data:`PAUSE_S`), counted (``stadium_record_write_errors_total``), its rows
dropped and counted, and recording pauses for :data:`PAUSE_S` (episodes ended meanwhile
are dropped and counted, ``stadium_recording`` reads 0); then it tries again. A step
never fails or waits because of the recording. docs/RECORDING.md has the schema.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import enum
import importlib
import logging
import operator
import os
import random
import re
import threading
import time
from collections.abc import Callable
from typing import Any

from stadium._errors import ConfigError
from stadium._server.ledger.episode import Episode
from stadium._server.ledger.rows import Rows, Shard, Summary, write_shard
from stadium._util.throttle import Throttle

log = logging.getLogger("stadium.record")

#: Seconds recording pauses after a failed shard write (then it tries again).
PAUSE_S = 10.0
#: The writer thread takes what is queued this often (not at each episode: a wake-up and the
#: GIL passed back and forth per episode cost the loop more than the writing itself).
WAKE_S = 0.2
#: The writer reads the queue in chunks of about this many steps (a few ms of work at
#: most, the GIL held), then sleeps :data:`YIELD_S`: a loop waiting for the GIL takes it
#: then, not after the interpreter's 5 ms switch interval.
CHUNK_STEPS = 256
YIELD_S = 0.0005
#: The gathered steps become an Arrow record batch every this many (a few ms of work, in
#: C calls the interpreter can switch between), and at the shard's end: few batches a
#: shard (each one a few objects the cyclic collector tracks until the shard is written).
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
            writer thread) before it is stored; it returns the record to store (changed
            as it likes) or ``None`` to store nothing.
        flush_s: the oldest row an open shard holds before it is written and closed.
        shard_bytes: a shard is closed once its episodes' frames reach this size.
        queue_bytes: episodes waiting for the writer, at most (more are dropped).
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
    """The recorder's lifecycle."""

    IDLE = "idle"
    """No episode submitted yet: no thread, no file."""
    RECORDING = "recording"
    PAUSED = "paused"
    """A shard write failed: episodes are dropped (and counted) until :data:`PAUSE_S` passed."""
    CLOSED = "closed"


class Recorder:
    """One worker's recording: the queue, the writer thread, the shards (module doc).

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
        self._rows = Rows(env, info_key, parse_filter(config.filter), load_redactor(config.redact))
        self.state = RecorderState.IDLE
        self._lock = threading.Lock()  # the lifecycle's changes
        self._wake = threading.Event()
        # The queue: appended on the loop, taken by the writer (a deque's append and
        # popleft are atomic); its bytes are what the loop put minus what the writer took,
        # each counter written by one thread only: no lock per episode.
        self._queue: collections.deque[tuple[Episode, int]] = collections.deque()
        self._put = 0
        self._taken = 0
        self._thread: threading.Thread | None = None
        self._paused_until = 0.0
        self._log = Throttle(PAUSE_S)
        self._sample = config.sample
        self._random = random.random
        self._shards = 0
        self._stem = ""
        self.written: list[str] = []
        """Paths of the shards written (the last few hundred), for tests and logs."""

    def wants(self) -> bool:
        """Whether to keep the episode a reset begins (``--record-sample``), on the loop."""
        return self._sample >= 1.0 or self._random() < self._sample

    def submit(self, episode: Episode, size: int) -> None:
        """Hand an ended episode (its frames ``size`` bytes) to the writer, on the loop;
        never blocks: dropped and counted when the queue is full, recording is paused or
        closed."""
        state = self.state
        if state is not RecorderState.RECORDING:
            if state is RecorderState.IDLE:
                self._start()
            elif not self._resume():
                self.counts[DROPPED] += 1
                return
        queued = self._put - self._taken
        limit = self.config.queue_bytes
        if queued + size > limit and queued:
            self.counts[DROPPED] += 1
            return
        self._queue.append((episode, size))
        self._put += size
        if queued + size > limit // 2:  # else it wakes on its own
            self._wake.set()

    def close(self, timeout: float = 5.0) -> None:
        """Write what is queued and gathered, then stop the thread (waits up to ``timeout``)."""
        with self._lock:
            thread = self._thread
            self.state = RecorderState.CLOSED
        self._wake.set()
        if thread is not None:
            thread.join(timeout)
        self.counts[RECORDING] = 0

    def _resume(self) -> bool:
        with self._lock:
            if self.state is RecorderState.PAUSED and time.monotonic() >= self._paused_until:
                self.state = RecorderState.RECORDING
                self.counts[RECORDING] = 1
                return True
        return False

    def _start(self) -> None:  # in the worker (after any fork)
        with self._lock:
            if self.state is not RecorderState.IDLE:
                return
            self._stem = f"episodes-{_safe(self.env_name)}-{os.getpid()}-{int(time.time() * 1000)}"
            self.state = RecorderState.RECORDING
            self.counts[RECORDING] = 1
            self._thread = threading.Thread(target=self._run, name="stadium-record", daemon=True)
            self._thread.start()

    # -- the writer thread ----------------------------------------------------------

    def _run(self) -> None:
        shard = Shard()
        size = 0
        first = 0.0
        flush_s = self.config.flush_s
        queue = self._queue
        while True:  # woken by a close or a half-full queue, else every WAKE_S
            if self.state is not RecorderState.CLOSED:
                self._wake.wait(WAKE_S)
            self._wake.clear()
            closing = self.state is RecorderState.CLOSED
            batch: list[Episode] = []
            steps = taken = 0
            while queue:
                episode, weight = queue.popleft()
                batch.append(episode)
                taken += weight
                steps += len(episode.steps)
                if steps >= CHUNK_STEPS * 3 or not queue:  # a chunk: then the loop's turn
                    if not shard:
                        first = time.monotonic()
                    self._gather(batch, shard)
                    self._taken += taken
                    size += taken
                    batch, steps, taken = [], 0, 0
                    time.sleep(YIELD_S)
            if shard and (closing or size >= self.config.shard_bytes
                          or time.monotonic() - first >= flush_s):  # fmt: skip
                self._write(shard)
                shard, size = Shard(), 0
            if closing:
                return

    def _gather(self, batch: list[Episode], shard: Shard) -> None:
        """Add a chunk of the queue to ``shard``, as an Arrow batch of its own."""
        try:
            _added, failed = self._rows.add(batch, shard)
            if len(shard.step_s) >= SEAL_STEPS:
                shard.seal(YIELD_S)
        except Exception as exc:  # a bug: the chunk is lost, the recording goes on
            failed = [f"{len(batch)} episode(s): {exc!r}"]
            shard._open()
        if failed:
            self.counts[DROPPED] += len(failed)
            self._warn("--record: %d episode(s) could not be recorded: %s", len(failed), failed[0])

    def _write(self, shard: Shard) -> None:
        """One shard: written to a ``.tmp`` name, renamed when complete."""
        directory = self.config.directory
        self._shards += 1
        path = os.path.join(directory, f"{self._stem}-{self._shards:06d}.parquet")
        tmp = path + ".tmp"
        try:
            os.makedirs(directory, exist_ok=True)
            write_shard(shard, tmp)
            os.replace(tmp, path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            counts = self.counts
            counts[WRITE_ERRORS] += 1
            counts[DROPPED] += len(shard)
            counts[RECORDING] = 0
            with self._lock:
                self._paused_until = time.monotonic() + PAUSE_S
                if self.state is RecorderState.RECORDING:
                    self.state = RecorderState.PAUSED
            self._warn(
                "--record: writing %s failed (%s): %d episode(s) dropped; not recording for "
                "%gs, then trying again",
                path, exc.strerror or exc, len(shard), PAUSE_S,
            )  # fmt: skip
            return
        self.counts[RECORDED] += len(shard)
        self.written.append(path)
        del self.written[:-256]

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

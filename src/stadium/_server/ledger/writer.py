"""The Python ``--record`` writer process: one per recording worker, started by the worker's
:class:`~stadium._server.ledger.record.Recorder` when the worker starts (or at its first
recorded episode)
(``python -m stadium._server.ledger.writer``), fed through a pipe (:mod:`.pipe`).

A reader thread drains the pipe into a queue bounded in bytes (past
:attr:`~.record.RecordConfig.queue_bytes` it stops reading: the pipe fills, then the
worker's own buffer, then the worker drops episodes and counts them); the main thread
parses the messages, puts each episode's steps together, and when it ends turns it into
columns (:mod:`.rows`: the ``--record-redact`` hook, which is the operator's code and runs
here, and the filter) then writes the shards as the worker's thread did before (same
names, the worker's pid in them and in the ``worker`` column; written to ``.tmp`` and
renamed; closed once their first row is :attr:`~.record.RecordConfig.flush_s` old).

**Its end.** The worker closing the pipe (EOF) or a ``SIGTERM`` (the worker's
:meth:`~.record.Recorder.close`, or the kernel's when the worker dies:
:func:`~stadium._util.libc.die_with_parent`, so a worker killed by ``SIGKILL`` still has
its last second written) makes it read what is left in the pipe, write its last shard
and exit. It runs at a lower priority (:data:`NICE`), on any core: a worker pinned to a
core (``taskset``, a CPU set) does not pin its writer there too (its CPU affinity is
widened to every core the kernel allows it), so the writer takes an idle core's time
rather than its loop's. ``SIGINT`` is ignored (a
terminal's Ctrl-C reaches the worker, which closes it). Its counts (episodes recorded,
dropped, write failures, 1 while recording) go to a small shared memory (a ``memfd``
the worker maps too and copies into its metrics row).

**Its native twin.** ``native/stadium-record-writer`` (Rust) does the same work from the same
stream and writes the same shards; it is the default, this module serves ``--record-redact``
(the hook is Python), ``STADIUM_RECORD_WRITER=python`` and a missing binary (:mod:`.writers`).
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import mmap
import os
import select
import signal
import sys
import threading
import time
from typing import Any

import msgspec

from stadium._env.cost import EpisodeCost
from stadium._server.ledger import pipe
from stadium._server.ledger.episode import Episode
from stadium._server.ledger.record import (
    CHUNK_STEPS,
    DROPPED,
    PAUSE_S,
    RECORDED,
    RECORDING,
    SEAL_STEPS,
    WAKE_S,
    WRITE_ERRORS,
    RecordConfig,
    RecorderState,
    load_redactor,
    parse_filter,
)
from stadium._server.ledger.rows import Rows, Shard, write_shard
from stadium._util.libc import die_with_parent
from stadium._util.throttle import Throttle

log = logging.getLogger("stadium.record")

_HEAD = pipe.HEAD
_HEAD_SIZE = _HEAD.size
_META = msgspec.msgpack.Decoder(tuple[str | None, int | None, dict[str, Any] | None])
_COST = msgspec.msgpack.Decoder(EpisodeCost)
_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
#: The writer's niceness (added to the worker's): on a busy machine the worker's event loop
#: gets the core first; the writer catches up in the gaps, or the worker's buffer fills and
#: episodes are dropped (counted), never the loop delayed.
NICE = 10
#: The most one read of the pipe takes.
READ_BYTES = 1 << 20


class Reader:
    """The pipe drained by a thread into a queue of chunks, bounded in bytes."""

    def __init__(self, fd: int, limit: int) -> None:
        self.fd = fd
        self.limit = limit
        self.cond = threading.Condition()
        self.chunks: collections.deque[bytes] = collections.deque()
        self.queued = 0
        self.closing = False
        """Read what is left, then stop (no more is coming)."""
        self.done = False
        os.set_blocking(fd, False)
        self.thread = threading.Thread(target=self._run, name="stadium-record-read", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        fd = self.fd
        try:
            while True:
                if self.queued > self.limit and not self.closing:
                    time.sleep(0.01)  # the pipe fills meanwhile: the worker drops
                    continue
                readable, _, _ = select.select([fd], [], [], 0.1)
                if not readable:
                    if self.closing:
                        return
                    continue
                try:
                    chunk = os.read(fd, READ_BYTES)
                except BlockingIOError:
                    continue
                if not chunk:  # EOF: the worker closed the pipe
                    return
                with self.cond:
                    self.chunks.append(chunk)
                    self.queued += len(chunk)
                    self.cond.notify()
        finally:
            with self.cond:
                self.done = True
                self.cond.notify()

    def take(self, timeout: float) -> tuple[bytes, bool]:
        """What was read (waits up to ``timeout`` for some), and whether that was all."""
        with self.cond:
            if not self.chunks and not self.done:
                self.cond.wait(timeout)
            data = b"".join(self.chunks)
            self.chunks.clear()
            self.queued = 0
            return data, self.done


class Writer:
    """The writer process's work (module doc)."""

    def __init__(
        self,
        config: RecordConfig,
        env: tuple[str, str],
        info_key: str,
        worker: int,
        stem: str,
        counts: Any,
    ) -> None:
        self.config = config
        self.counts = counts
        keep, redact = parse_filter(config.filter), load_redactor(config.redact)
        self._rows = Rows(env, info_key, keep, redact, worker=worker)
        self._stem = stem
        self.state = RecorderState.RECORDING
        self._paused_until = 0.0
        self._log = Throttle(PAUSE_S)
        self._shards = 0
        self._rest = b""
        self._open: dict[int, tuple[Episode, list[Any]]] = {}
        self._ready: list[Episode] = []
        self._ready_steps = 0
        self._ready_bytes = 0
        counts[RECORDING] = 1

    def feed(self, data: bytes) -> None:
        """Parse ``data`` (the stream's next bytes), keeping a message cut at its end."""
        if self._rest:
            data = self._rest + data
        end = len(data)
        pos = 0
        unpack = _HEAD.unpack_from
        opened = self._open
        while end - pos >= _HEAD_SIZE:
            kind, rid, flag, number, a, b = unpack(data, pos)
            start = pos + _HEAD_SIZE
            stop = start + a + b
            if stop > end:
                break
            first = data[start : start + a]
            second = data[start + a : stop]
            pos = stop
            if kind == pipe.STEP:
                held = opened.get(rid)
                if held is not None:
                    held[1].extend(
                        (first, second.decode("utf-8", "replace") if flag else second, number)
                    )
            elif kind == pipe.BEGIN:
                episode_id, seed, options = _META.decode(first)
                opened[rid] = (
                    Episode(episode_id, number, seed, options, second, json=bool(flag)),
                    [],
                )
            elif kind == pipe.END:
                self._ended(opened.pop(rid, None), flag, first)
        self._rest = data[pos:]

    def _ended(self, held: tuple[Episode, list[Any]] | None, flag: int, cost: bytes) -> None:
        if held is None:
            return
        if flag & pipe.DROPPED or not self._recording():
            self.counts[DROPPED] += 1
            return
        episode, steps = held
        episode.steps = tuple(steps)
        episode.end = pipe.END_REASONS[flag & 7]
        episode.cost = _COST.decode(cost)
        episode.clipped = bool(flag & pipe.CLIPPED)
        self._ready.append(episode)
        self._ready_steps += len(steps) // 3
        self._ready_bytes += episode.cost.bytes_in + episode.cost.bytes_out

    def _recording(self) -> bool:
        if self.state is RecorderState.PAUSED and time.monotonic() >= self._paused_until:
            self.state = RecorderState.RECORDING
            self.counts[RECORDING] = 1
        return self.state is RecorderState.RECORDING

    def run(self, reader: Reader) -> None:
        """Until the reader is done: parse, gather, write (module doc)."""
        shard = Shard()
        size = 0
        first = 0.0
        flush_s = self.config.flush_s
        while True:
            data, done = reader.take(WAKE_S)
            if data:
                self.feed(data)
            if self._ready:
                if not shard:
                    first = time.monotonic()
                ready, self._ready = self._ready, []
                for i in range(0, len(ready), CHUNK_STEPS):
                    self._gather(ready[i : i + CHUNK_STEPS], shard)
                size += self._ready_bytes
                self._ready_steps = self._ready_bytes = 0
            if shard and (done or size >= self.config.shard_bytes
                          or time.monotonic() - first >= flush_s):  # fmt: skip
                self._write(shard)
                shard, size = Shard(), 0
            if done:
                self.counts[RECORDING] = 0
                return

    def _gather(self, batch: list[Episode], shard: Shard) -> None:
        try:
            _added, failed = self._rows.add(batch, shard)
            if len(shard.step_s) >= SEAL_STEPS:
                shard.seal()
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
            self._paused_until = time.monotonic() + PAUSE_S
            self.state = RecorderState.PAUSED
            self._warn(
                "--record: writing %s failed (%s): %d episode(s) dropped; not recording for "
                "%gs, then trying again",
                path, exc.strerror or exc, len(shard), PAUSE_S,
            )  # fmt: skip
            return
        self.counts[RECORDED] += len(shard)

    def _warn(self, msg: str, *args: object) -> None:
        held = self._log.report(time.monotonic())
        if held is not None:
            log.warning(msg + (f" ({held} more since the last report)" if held else ""), *args)


def main(argv: list[str]) -> None:
    """``python -m stadium._server.ledger.writer PIPE_FD COUNTS_FD SETTINGS_JSON``."""
    fd, counts_fd = int(argv[0]), int(argv[1])
    settings = json.loads(argv[2])
    reader: Reader | None = None

    def finish(_signum: int, _frame: object) -> None:
        if reader is not None:
            reader.closing = True

    signal.signal(signal.SIGTERM, finish)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent(signal.SIGTERM)
    with contextlib.suppress(OSError):  # the loop first when they want the same core
        os.nice(NICE)
    with contextlib.suppress(OSError):  # any core, not only its worker's (module doc)
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
    logging.basicConfig(
        level=logging.WARNING,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    shared = mmap.mmap(counts_fd, 4 * 8)
    counts = memoryview(shared).cast("d")
    config = RecordConfig(**settings["config"])
    writer = Writer(
        config,
        (settings["env"], settings["version"]),
        settings["info_key"],
        settings["worker"],
        settings["stem"],
        counts,
    )
    import pyarrow.parquet  # noqa: F401 (imported now, not at the first shard)

    reader = Reader(fd, config.queue_bytes)
    if os.getppid() != settings["worker"]:  # the worker died before die_with_parent
        reader.closing = True
    writer.run(reader)


if __name__ == "__main__":
    main(sys.argv[1:])


__all__ = ["Reader", "Writer", "main"]

"""The ``--record`` writer process: one per recording worker, started by the worker's
:class:`~stadium._server.ledger.record.Recorder` when the worker starts (or at its first
recorded episode)
(``python -m stadium._server.ledger.writer``), fed through a pipe (:mod:`.wire`).

A reader thread drains the pipe into a queue bounded in bytes (past
:attr:`~.record.RecordConfig.queue_bytes` it stops reading: the pipe fills, then the
worker's own buffer, then the worker drops episodes and counts them); the main thread
takes the stream's blocks in bulk (:mod:`.bulk`: the steps decoded as columns and held
until their episodes end; no Python code per step). With a ``--record-redact`` hook (the
operator's code, run here) it parses the messages one by one instead, puts each episode's
steps together and, when it ends, turns it into columns (:mod:`.rows`: the hook, then the
filter). It writes the shards as the worker's thread did before (same
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
from collections.abc import Sequence
from itertools import compress
from typing import Any

import msgspec

from stadium._env.cost import EpisodeCost
from stadium._server.ledger import wire
from stadium._server.ledger.bulk import Pending, offsets
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

_HEAD = wire.HEAD
_BLOCK = wire.BLOCK
_BLOCK_SIZE = _BLOCK.size
_IS_STEP = wire.STEP.__eq__
_NOT_STEP = wire.STEP.__ne__
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
        # the bulk path (no redaction hook: module .bulk): steps held as columns
        self._bulk = None if config.redact else Pending(self._rows)
        self._errors: dict[int, str] = {}  # an open episode's first failed step's error
        self._gone: list[int] = []  # ended (or dropped) since the last gathering
        self._ended: list[tuple[int, Episode, str | None]] = []  # of those, to record
        self._gathered = 0.0
        counts[RECORDING] = 1

    def feed(self, data: bytes) -> None:
        """Parse ``data`` (the stream's next bytes), keeping a block cut at its end."""
        if self._rest:
            data = self._rest + data
        end = len(data)
        pos = 0
        while end - pos >= _BLOCK_SIZE:
            heads, size = _BLOCK.unpack_from(data, pos)
            start = pos + _BLOCK_SIZE
            stop = start + heads + size
            if stop > end:
                break
            self._block(data[start : start + heads], data[start + heads : stop])
            pos = stop
        self._rest = data[pos:]

    def _block(self, heads: bytes, body: bytes) -> None:
        """One block of the stream (:mod:`.wire`)."""
        if not heads:
            return
        kinds, rids, flags, numbers, firsts, seconds = zip(*_HEAD.iter_unpack(heads), strict=True)
        at = offsets(firsts, seconds)
        if at[-1] != len(body):
            raise ValueError("--record: the stream is corrupt (a block's lengths)")
        if self._bulk is None:
            self._classic(kinds, rids, flags, numbers, at, body)
            return
        n = len(kinds)
        steps = kinds.count(wire.STEP)
        control = [] if steps == n else list(compress(range(n), map(_NOT_STEP, kinds)))
        for i in control:  # an episode's steps come after its BEGIN, before its END
            if kinds[i] == wire.BEGIN:
                self._begin(rids[i], flags[i], numbers[i], body[at[2 * i] : at[2 * i + 1]],
                            body[at[2 * i + 1] : at[2 * i + 2]])  # fmt: skip
        if steps:
            index = range(n) if steps == n else compress(range(n), map(_IS_STEP, kinds))
            self._steps(list(index), rids, flags, numbers, at, body)
        for i in control:
            if kinds[i] == wire.END:
                self._end_bulk(rids[i], flags[i], body[at[2 * i] : at[2 * i + 1]])

    def _steps(self, index: list[int], rids: Sequence[int], flags: Sequence[int],
               numbers: Sequence[float], at: list[int], body: bytes) -> None:  # fmt: skip
        """A block's steps, in bulk: grouped by encoding (and failure), decoded by group."""
        opened = self._open
        ids = list(map(rids.__getitem__, index))
        if not opened.keys() >= set(ids):  # steps of episodes not recorded (dropped)
            known = list(map(opened.__contains__, ids))
            index, ids = list(compress(index, known)), list(compress(ids, known))
        failed = 1 in map(flags.__getitem__, index)
        mixed = any(not opened[rid][0].json for rid in set(ids))
        groups: dict[bool, list[int]] = {True: [], False: []}
        if not failed and not mixed:
            groups[True] = index
        else:  # per step (MessagePack sessions open, or a failed step in the block)
            for i, rid in zip(index, ids, strict=True):
                json = opened[rid][0].json
                if flags[i]:  # the steps before it first: each episode's in their order
                    self._decode(groups, rids, numbers, at, body)
                    error = body[at[2 * i + 1] : at[2 * i + 2]].decode("utf-8", "replace")
                    self._errors.setdefault(rid, error)
                    self._failed(json, rid, body[at[2 * i] : at[2 * i + 1]], error, numbers[i])
                else:
                    groups[json].append(i)
        self._decode(groups, rids, numbers, at, body)

    def _decode(self, groups: dict[bool, list[int]], rids: Sequence[int],
                numbers: Sequence[float], at: list[int], body: bytes) -> None:  # fmt: skip
        """Steps grouped by encoding (message indexes), each group decoded in bulk; the
        groups emptied."""
        bulk = self._bulk
        assert bulk is not None
        starts, middles, ends = at[0::2], at[1::2], at[2::2]
        for encoding, group in groups.items():
            if not group:
                continue
            cut = body.__getitem__
            if len(group) == len(rids):  # every message of the block (the usual block)
                group_ids, took = rids, numbers
                requests = list(map(cut, map(slice, starts, middles)))
                replies = list(map(cut, map(slice, middles, ends)))
            else:
                group_ids = list(map(rids.__getitem__, group))
                middle = list(map(middles.__getitem__, group))
                requests = list(map(cut, map(slice, map(starts.__getitem__, group), middle)))
                replies = list(map(cut, map(slice, middle, map(ends.__getitem__, group))))
                took = list(map(numbers.__getitem__, group))
            groups[encoding] = []
            try:
                bulk.add(encoding, group_ids, requests, replies, took)
            except (msgspec.DecodeError, ValueError, TypeError, OverflowError):
                for one in zip(group_ids, requests, replies, took, strict=True):
                    self._one(encoding, *one)

    def _one(self, json: bool, rid: int, request: bytes, reply: bytes, took: float) -> None:
        """A step the group's decoding failed on, on its own (its episode lost if it fails)."""
        assert self._bulk is not None
        try:
            self._bulk.add(json, [rid], [request], [reply], [took])
        except (msgspec.DecodeError, ValueError, TypeError, OverflowError) as exc:
            if self._open.pop(rid, None) is not None:
                self._gone.append(rid)
                self.counts[DROPPED] += 1
                self._warn("--record: an episode could not be recorded: %r", exc)

    def _failed(self, json: bool, rid: int, request: bytes, error: str, took: float) -> None:
        assert self._bulk is not None
        try:
            self._bulk.add_failed(json, rid, request, error, took)
        except (msgspec.DecodeError, ValueError, TypeError, OverflowError) as exc:
            if self._open.pop(rid, None) is not None:
                self._gone.append(rid)
                self.counts[DROPPED] += 1
                self._warn("--record: an episode could not be recorded: %r", exc)

    def _begin(self, rid: int, flag: int, number: float, meta: bytes, frame: bytes) -> None:
        episode_id, seed, options = _META.decode(meta)
        self._open[rid] = (Episode(episode_id, number, seed, options, frame, json=bool(flag)), [])

    def _end_bulk(self, rid: int, flag: int, cost: bytes) -> None:
        held = self._open.pop(rid, None)
        error = self._errors.pop(rid, None)
        if held is None:
            return
        self._gone.append(rid)
        if flag & wire.DROPPED or not self._recording():
            self.counts[DROPPED] += 1
            return
        episode = held[0]
        episode.end = wire.END_REASONS[flag & 7]
        episode.cost = _COST.decode(cost)
        episode.clipped = bool(flag & wire.CLIPPED)
        self._ended.append((rid, episode, error))
        self._ready_bytes += episode.cost.bytes_in + episode.cost.bytes_out

    def _classic(self, kinds: Sequence[int], rids: Sequence[int], flags: Sequence[int],
                 numbers: Sequence[float], at: list[int], body: bytes) -> None:  # fmt: skip
        """A block, message by message (with a redaction hook: it reads whole episodes)."""
        opened = self._open
        messages = zip(kinds, rids, flags, numbers, strict=True)
        for i, (kind, rid, flag, number) in enumerate(messages):
            first = body[at[2 * i] : at[2 * i + 1]]
            second = body[at[2 * i + 1] : at[2 * i + 2]]
            if kind == wire.STEP:
                held = opened.get(rid)
                if held is not None:
                    held[1].extend(
                        (first, second.decode("utf-8", "replace") if flag else second, number)
                    )
            elif kind == wire.BEGIN:
                self._begin(rid, flag, number, first, second)
            elif kind == wire.END:
                self._end(opened.pop(rid, None), flag, first)

    def _end(self, held: tuple[Episode, list[Any]] | None, flag: int, cost: bytes) -> None:
        if held is None:
            return
        if flag & wire.DROPPED or not self._recording():
            self.counts[DROPPED] += 1
            return
        episode, steps = held
        episode.steps = tuple(steps)
        episode.end = wire.END_REASONS[flag & 7]
        episode.cost = _COST.decode(cost)
        episode.clipped = bool(flag & wire.CLIPPED)
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
            if self._gone and (done or time.monotonic() - self._gathered >= WAKE_S):
                if self._ended and not shard:
                    first = time.monotonic()
                self._take(shard)
                size += self._ready_bytes
                self._ready_bytes = 0
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

    def _take(self, shard: Shard) -> None:
        """The bulk path's ended episodes into ``shard`` (:meth:`.bulk.Pending.take`)."""
        assert self._bulk is not None
        gone, ended = self._gone, self._ended
        self._gone, self._ended = [], []
        self._gathered = time.monotonic()
        if ended and not self._recording():  # a write failed meanwhile
            self.counts[DROPPED] += len(ended)
            ended = []
        try:
            self._bulk.take(gone, ended, shard)
        except Exception as exc:  # a bug: those episodes are lost, the recording goes on
            self.counts[DROPPED] += len(ended)
            self._warn("--record: %d episode(s) could not be recorded: %r", len(ended), exc)

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

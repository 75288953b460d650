"""Prometheus metrics summed over forked workers, at a clock read, a bisect and two adds per step.

A :class:`MetricsBoard` is shared memory created before the fork, with one row of
float64 counts per worker process that may be alive at once. Each worker counts
straight into its own row: only that worker writes it, so there is no lock (as
:class:`~stadium._server.admission.slots.SharedSlots`), and a write is a store into a
``memoryview`` (no call): the per-step path adds to a :class:`Histogram` bucket
found with one ``bisect`` and to its sum (the step count is its count). Error codes and session
outcomes count through :class:`RowCounter`, a ``Counter`` that writes its row too.
The gauges (sessions, queue, memory, CPU, connections, bytes) are copied into the
row every :data:`FLUSH_INTERVAL_S`, right before the worker answers a scrape, and
when it stops. When the supervisor reaps a dead worker it adds the row's counters
into a *retired* row and zeroes the row (:meth:`MetricsBoard.retire`), so counters
never go down when a worker dies or is recycled, and a scrape always sees every
count of every worker, dead or alive, exactly.

Whichever worker answers ``GET /metrics`` reads every row with
:class:`StadiumCollector`, a prometheus-client collector, and the text format
comes from :func:`prometheus_client.exposition.generate_latest`. docs/METRICS.md
lists the metrics.
"""

from __future__ import annotations

import array
import collections
import multiprocessing.sharedctypes
import os
import resource
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import cast

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector, CollectorRegistry

from stadium._errors import ErrorCode

__all__ = [
    "CONTENT_TYPE_LATEST",
    "DOORS",
    "ERROR_CODES",
    "OUTCOMES",
    "Histogram",
    "MetricsBoard",
    "RowCounter",
    "StadiumCollector",
    "WorkerCounts",
    "registry_for",
]

FLUSH_INTERVAL_S = 0.5
"""How often a worker writes its counts into its shared row."""

OUTCOMES = (
    "completed",
    "refused",
    "errored",
    "reaped",
    "expired",
    "resumed",
    "restored",
    "forked",
)
"""``stadium_sessions_total`` outcomes: how sessions ended (``expired``: a lost session not
resumed within ``--resume-grace``); ``resumed`` counts resumes and ``restored`` the
resumes of durable sessions from the store, ``forked`` the sessions started by a fork
(a session may resume several times, and ends later with one of the others)."""

DOORS = ("websocket", "batch", "http", "fork", "mcp_create", "mcp_attach", "restore")
"""``stadium_sessions_opened_total`` doors: how sessions came into being (the values of
:class:`stadium._server.admission.doorway.Door`; ``http``: a request that builds an env for its
duration; ``mcp_attach``: a WebSocket attached to an MCP session, on that session's env)."""

_WIRE_CODES = list(ErrorCode)[: list(ErrorCode).index(ErrorCode.CONNECT_ERROR)]
ERROR_CODES: tuple[str, ...] = (*(str(c) for c in _WIRE_CODES), "other")
"""``stadium_errors_total`` codes: those sent on the wire; anything else counts as ``other``."""

STEP_BUCKETS = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip
"""Upper bounds (seconds) of the step and reset duration histograms (then +Inf)."""
WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0)
"""Upper bounds (seconds) of the admission wait histogram (then +Inf)."""


class Histogram:
    """A fixed-bucket histogram in a worker's row: ``counts[bisect_left(bounds, v)] += 1``
    and ``counts[-1] += v``.

    ``counts`` (a ``memoryview`` of float64) has the per-bucket counts (not
    cumulative; one more than ``bounds``: the +Inf bucket), then the sum of the
    values. The hot path updates it inline.
    """

    __slots__ = ("bounds", "counts")

    def __init__(self, bounds: Sequence[float], counts: memoryview[float] | None = None) -> None:
        self.bounds = tuple(bounds)
        self.counts: memoryview[float] = (
            counts if counts is not None else _zeros(len(self.bounds) + 2)
        )

    @property
    def count(self) -> int:
        return int(sum(self.counts[:-1]))

    @property
    def sum(self) -> float:
        return float(self.counts[-1])


def _zeros(n: int) -> memoryview[float]:
    return memoryview(array.array("d", bytes(8 * n))).cast("B").cast("d")


class RowCounter(collections.Counter[str]):
    """A ``Counter`` of names (error codes, outcomes) that also adds into a worker's row.

    Each name has a field (``fields``); a name without one counts in ``fields[""]``.
    """

    def __init__(self, row: memoryview[float], fields: Mapping[str, int]) -> None:
        super().__init__()
        self._row = row
        self._fields = fields

    def __setitem__(self, key: str, value: int) -> None:
        fields = self._fields
        self._row[fields.get(key, fields[""])] += value - self.get(key, 0)
        super().__setitem__(key, value)


# Row layout: scalar fields, the outcomes, the error codes, the doors, then the histograms.
# The step count is the step duration histogram's count (one write less per step).
_PID, _ACTIVE, _QUEUE, _RSS, _CPU, _CONNS, _BYTES_IN, _BYTES_OUT = range(8)
_OUTCOMES = 8
_ERRORS = _OUTCOMES + len(OUTCOMES)
_DOORS = _ERRORS + len(ERROR_CODES)
_STEP_H = _DOORS + len(DOORS)
_RESET_H = _STEP_H + len(STEP_BUCKETS) + 2  # counts (+Inf included), then the sum
_WAIT_H = _RESET_H + len(STEP_BUCKETS) + 2
_ISO_LIVE = _WAIT_H + len(WAIT_BUCKETS) + 2
_ISO_STARTS, _ISO_CRASHES, _ISO_LIMITS = _ISO_LIVE + 1, _ISO_LIVE + 2, _ISO_LIVE + 3
# What env processes sent: bytes, replies refused (counters); reply buffers, spilled (gauges).
_ISO_REPLY_BYTES, _ISO_REFUSED, _ISO_HELD, _ISO_SPILLED = range(_ISO_LIVE + 4, _ISO_LIVE + 8)
# The env thread pool: threads, busy ones, calls waiting, stuck threads (gauges), full (counter).
_THREADS, _BUSY, _WAITING_CALLS, _STUCK, _POOL_FULL = range(_ISO_LIVE + 8, _ISO_LIVE + 13)
_HANDOFF_REFUSED = _ISO_LIVE + 13  # connection hand-offs refused (counter)
# Episodes ended, then their cost summed (``ledger``): wall s, CPU s, steps, bytes in, out.
_EPISODES = _ISO_LIVE + 14
_EPISODE_FIELDS = 6
# The recording (``--record``): episodes written, dropped, write failures (counters), on (gauge).
_RECORDED = _EPISODES + _EPISODE_FIELDS
_RECORD_FIELDS = 4
_RECORDING = _RECORDED + 3
# Task images (``--image``, ``--images``): per image slot, warm processes (gauge), then starts.
IMAGE_SLOTS = 16
"""Images counted apart in ``stadium_image_*``: the server's named ones (``--image`` first,
then an ``--images`` file's, sorted), the rest together as ``other`` (the last slot)."""
_IMAGES = _RECORDED + _RECORD_FIELDS
WIDTH = _IMAGES + 2 * IMAGE_SLOTS
"""Float64 fields in one worker's row."""
_GAUGES = (
    _PID, _ACTIVE, _QUEUE, _RSS, _CPU, _CONNS, _BYTES_IN, _BYTES_OUT, _ISO_LIVE,
    _ISO_HELD, _ISO_SPILLED, _THREADS, _BUSY, _WAITING_CALLS, _STUCK, _RECORDING,
    *range(_IMAGES, _IMAGES + IMAGE_SLOTS),
)  # fmt: skip
"""Fields not carried into the retired row (per-worker values; CPU and bytes are per worker)."""


class MetricsBoard:
    """One row of counts per worker process in shared memory, plus the retired row.

    Create it before forking (``rows``: processes alive at once); each worker
    :meth:`bind` s the row no other live process uses and counts into it
    (:class:`WorkerCounts`); the supervisor :meth:`retire` s a dead worker's row. A
    one-worker server uses a board of one row in its own memory. The retired row is
    guarded by a sequence number (odd while the supervisor moves a row into it), so
    a reader does not count a retiring worker twice or not at all. There is no
    memory fence: x86-64 keeps stores in order; elsewhere a scrape racing a
    retirement may be off for that one scrape (monitoring, not admission).
    """

    def __init__(self, rows: int = 1) -> None:
        shared = multiprocessing.sharedctypes.RawArray("d", (rows + 1) * WIDTH + 1)
        self._data: memoryview[float] = memoryview(shared).cast("B").cast("d")
        self.rows = rows
        self._row = 0

    def bind(self, row: int) -> None:
        """Make this process write row ``row``."""
        self._row = row

    def row(self) -> memoryview[float]:
        """This process's row (only this process writes it), its pid set: counted as live."""
        start = self._row * WIDTH
        row = self._data[start : start + WIDTH]
        row[_PID] = os.getpid()
        return row

    def retire(self, row: int) -> None:
        """Add dead worker ``row``'s counters into the retired row and zero it (supervisor)."""
        data = self._data
        seq = len(data) - 1
        data[seq] += 1
        base, retired = row * WIDTH, self.rows * WIDTH
        for i in range(WIDTH):
            if i not in _GAUGES:
                data[retired + i] += data[base + i]
            data[base + i] = 0.0
        data[seq] += 1

    def read(self) -> tuple[list[list[float]], list[float]]:
        """The live rows (pid set) and the retired row, as one consistent copy."""
        data = self._data
        seq = len(data) - 1
        copy: list[float] = []
        for _ in range(1000):
            before = data[seq]
            if before % 2 == 0:
                copy = cast(list[float], data.tolist())
                if data[seq] == before:
                    break
        else:  # the supervisor died mid-move: take what is there
            copy = cast(list[float], data.tolist())
        rows = [copy[i * WIDTH : (i + 1) * WIDTH] for i in range(self.rows)]
        return [r for r in rows if r[_PID]], copy[self.rows * WIDTH : (self.rows + 1) * WIDTH]


class WorkerCounts:
    """One worker's counts, in its row of ``board`` (bound to this process's row)."""

    __slots__ = (
        "admission_wait",
        "episodes",
        "errors",
        "opened",
        "outcomes",
        "recording",
        "reset_seconds",
        "row",
        "step_seconds",
    )

    def __init__(self, board: MetricsBoard) -> None:
        self.row = row = board.row()
        self.step_seconds = Histogram(STEP_BUCKETS, row[_STEP_H:_RESET_H])
        self.reset_seconds = Histogram(STEP_BUCKETS, row[_RESET_H:_WAIT_H])
        self.admission_wait = Histogram(WAIT_BUCKETS, row[_WAIT_H:_ISO_LIVE])
        self.errors = RowCounter(row, _ERROR_FIELDS)
        """Error replies by code (``Runtime.errors_total``)."""
        self.outcomes = RowCounter(row, _OUTCOME_FIELDS)
        """Sessions ended by outcome (``Runtime.outcomes``)."""
        self.opened = row[_DOORS:_STEP_H]
        """Sessions opened, one count per door of :data:`DOORS` (``Doorway.open``)."""
        self.episodes = row[_EPISODES:_RECORDED]
        """Episodes ended, then their wall s, CPU s, steps, bytes in, bytes out, summed
        (``ledger.Ledger``)."""
        self.recording = row[_RECORDED:WIDTH]
        """Episodes recorded, dropped, write failures, and 1 while recording (``ledger``)."""

    @property
    def steps(self) -> int:
        return self.step_seconds.count

    def publish(
        self,
        *,
        active: int,
        queue: int,
        connections: int,
        isolated: tuple[int, ...] = (0,) * 8,
        pool: PoolStats = (0, 0, 0, 0, 0),
        handoff_refused: int = 0,
        images: tuple[Sequence[int], Sequence[int]] = ((), ()),
    ) -> None:
        """Copy the gauges into the row, with this process's memory, CPU time and I/O;
        ``isolated``: env processes alive, started, crashed, stopped at a limit, the bytes
        they sent, their replies refused, reply buffers held, spilled snapshots; ``pool``:
        the env thread pool's live threads, busy ones, calls waiting for one, threads
        written off as stuck, calls that found it full (a counter); ``handoff_refused``:
        connection hand-offs this worker refused (``Handoff.refused``); ``images``: warm
        processes and starts per image slot (:data:`IMAGE_SLOTS`)."""
        row = self.row
        for base, values in zip((_IMAGES, _IMAGES + IMAGE_SLOTS), images, strict=True):
            for i, value in enumerate(values[:IMAGE_SLOTS]):
                row[base + i] = value
        for i, value in enumerate(isolated):
            row[_ISO_LIVE + i] = value
        row[_ACTIVE] = active
        row[_QUEUE] = queue
        row[_CONNS] = connections
        row[_THREADS], row[_BUSY], row[_WAITING_CALLS], row[_STUCK], row[_POOL_FULL] = pool
        row[_HANDOFF_REFUSED] = handoff_refused
        usage = resource.getrusage(resource.RUSAGE_SELF)
        row[_CPU] = usage.ru_utime + usage.ru_stime
        row[_RSS] = _resident_bytes()
        row[_BYTES_IN], row[_BYTES_OUT] = _io_bytes()


PoolStats = tuple[int, int, int, int, int]
"""The env thread pool's threads, busy threads, waiting calls, stuck threads, full count."""

_ERROR_FIELDS = {code: _ERRORS + i for i, code in enumerate(ERROR_CODES)}
_ERROR_FIELDS[""] = _ERROR_FIELDS["other"]
_OUTCOME_FIELDS = {outcome: _OUTCOMES + i for i, outcome in enumerate(OUTCOMES)}
_OUTCOME_FIELDS[""] = _OUTCOME_FIELDS["completed"]


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _resident_bytes() -> float:
    try:
        with open("/proc/self/statm", "rb") as f:
            return float(int(f.read().split()[1]) * _PAGE)
    except (OSError, ValueError, IndexError):  # not Linux: the peak instead
        return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)


def _io_bytes() -> tuple[float, float]:
    """Bytes this process read and wrote through system calls (``/proc/self/io`` rchar,
    wchar): its sockets, and any pipe or file I/O; 0, 0 where unavailable."""
    try:
        with open("/proc/self/io", "rb") as f:
            fields = dict(line.split(b":", 1) for line in f.read().splitlines() if b":" in line)
        return float(fields[b"rchar"]), float(fields[b"wchar"])
    except (OSError, ValueError, KeyError):
        return 0.0, 0.0


class StadiumCollector(Collector):
    """Yields the ``stadium_*`` metrics summed over the board's rows (and the retired row).

    ``flush`` writes this worker's own row first, so its part of a scrape is current.
    """

    def __init__(
        self, board: MetricsBoard, flush: Callable[[], None], env: str = "",
        images: Sequence[str] = (),
    ) -> None:  # fmt: skip
        self.board = board
        self.flush = flush
        self.env = env
        """The env's name: the ``env`` label of the episode metrics."""
        self.images = list(images)[:IMAGE_SLOTS]
        """The ``image`` labels of the task image slots (none: no task images)."""

    def collect(self) -> Iterator[Metric]:
        self.flush()
        rows, retired = self.board.read()
        every = [*rows, retired]

        def total(i: int) -> float:
            return sum(r[i] for r in every)

        yield _gauge("stadium_sessions_active", "Sessions open (admitted).", total(_ACTIVE))
        sessions = CounterMetricFamily(
            "stadium_sessions_total",
            "Sessions ended (WebSocket and HTTP MCP), by outcome.",
            labels=["outcome"],
        )
        for i, outcome in enumerate(OUTCOMES):
            sessions.add_metric([outcome], total(_OUTCOMES + i))
        yield sessions
        opened = CounterMetricFamily(
            "stadium_sessions_opened",
            "Sessions opened (admitted: a slot and, but for mcp_attach, an env), by door.",
            labels=["door"],
        )
        for i, door in enumerate(DOORS):
            opened.add_metric([door], total(_DOORS + i))
        yield opened
        yield _gauge("stadium_admission_queue", "Sessions waiting for a free slot.", total(_QUEUE))
        yield _histogram(
            "stadium_admission_wait_seconds",
            "Time sessions waited for a slot (0 when admitted at once).",
            WAIT_BUCKETS, every, _WAIT_H,
        )  # fmt: skip
        step_count = sum(total(_STEP_H + i) for i in range(len(STEP_BUCKETS) + 1))
        yield CounterMetricFamily("stadium_steps_total", "Steps answered.", step_count)
        yield _histogram(
            "stadium_step_duration_seconds",
            "Step time as the server sees it: request arrival to reply.",
            STEP_BUCKETS, every, _STEP_H,
        )  # fmt: skip
        yield _histogram(
            "stadium_reset_duration_seconds",
            "Reset time as the server sees it: request arrival to reply.",
            STEP_BUCKETS, every, _RESET_H,
        )  # fmt: skip
        errors = CounterMetricFamily(
            "stadium_errors_total", "Error replies sent, by protocol error code.", labels=["code"]
        )
        for i, code in enumerate(ERROR_CODES):
            errors.add_metric([code], total(_ERRORS + i))
        yield errors
        yield _gauge(
            "stadium_isolated_processes",
            "Isolated sessions' env processes alive (warm pool included).",
            total(_ISO_LIVE),
        )
        for name, doc, field in (
            ("stadium_isolated_starts_total", "Isolated env processes started.", _ISO_STARTS),
            ("stadium_isolated_crashes_total", "Isolated env processes that died (a signal, "
             "an exit): ENV_CRASHED.", _ISO_CRASHES),
            ("stadium_isolated_limit_kills_total", "Isolated env calls stopped at a limit "
             "(memory, processes, wall time per call or episode): LIMIT_EXCEEDED.", _ISO_LIMITS),
            ("stadium_isolated_reply_bytes_total", "Bytes isolated env processes sent their "
             "worker.", _ISO_REPLY_BYTES),
            ("stadium_isolated_protocol_errors_total", "Replies of isolated env processes "
             "refused (over --sandbox-reply-mib, malformed, unexpected): ENV_PROTOCOL.",
             _ISO_REFUSED),
        ):  # fmt: skip
            yield CounterMetricFamily(name, doc, total(field))
        yield _gauge(
            "stadium_isolated_reply_buffer_bytes",
            "Bytes of large replies of isolated env processes being read or decoded now.",
            total(_ISO_HELD),
        )
        yield _gauge(
            "stadium_isolated_spilled_bytes",
            "Bytes of durable isolated sessions' snapshots in spill files, not in memory.",
            total(_ISO_SPILLED),
        )
        per_worker: list[tuple[str, str, int, type[GaugeMetricFamily | CounterMetricFamily]]] = [
            ("stadium_worker_resident_memory_bytes", "Resident memory.", _RSS, GaugeMetricFamily),
            ("stadium_worker_cpu_seconds", "CPU time (user+system).", _CPU, CounterMetricFamily),
            ("stadium_worker_open_connections", "Open connections.", _CONNS, GaugeMetricFamily),
            ("stadium_bytes_received", "Bytes read (syscalls).", _BYTES_IN, CounterMetricFamily),
            ("stadium_bytes_sent", "Bytes written (syscalls).", _BYTES_OUT, CounterMetricFamily),
        ]
        yield _gauge(
            "stadium_executor_threads",
            "Env threads alive for blocking sync calls (stuck ones not counted).",
            total(_THREADS),
        )
        yield _gauge("stadium_executor_busy_threads", "Env threads running a call.", total(_BUSY))
        yield _gauge(
            "stadium_executor_queued_calls",
            "Blocking env calls waiting for a thread (every thread busy).",
            total(_WAITING_CALLS),
        )
        yield _gauge(
            "stadium_executor_stuck_threads",
            "Env threads written off: still running an abandoned call.",
            total(_STUCK),
        )
        yield CounterMetricFamily(
            "stadium_executor_saturated",
            "Blocking env calls that found every env thread (--executor-threads) busy.",
            total(_POOL_FULL),
        )
        yield CounterMetricFamily(
            "stadium_handoff_refused_total",
            "Connection hand-offs refused: a sender not a sibling worker of the same user, "
            "a descriptor that is not a connected TCP socket, a bad message, too many pending.",
            total(_HANDOFF_REFUSED),
        )
        yield from _episode_metrics(self.env, total)
        yield from _image_metrics(self.images, total)
        for name, doc, field, kind in per_worker:
            family = kind(name, f"{doc} Per worker (label: its pid).", labels=["worker"])
            for r in rows:
                family.add_metric([str(int(r[_PID]))], r[field])
            yield family


_EPISODE_METRICS = (
    ("stadium_episodes", "Episodes ended (done, truncated, reset again, or their session "
     "closed).", _EPISODES),
    ("stadium_episode_wall_seconds", "Episodes' wall time: reset's arrival to the last reply "
     "(docs/PROTOCOL.md, Episode cost).", _EPISODES + 1),
    ("stadium_episode_cpu_seconds", "Env CPU seconds spent in episodes' reset and steps "
     "(docs/PROTOCOL.md, Episode cost).", _EPISODES + 2),
    ("stadium_episode_steps", "Steps answered in ended episodes.", _EPISODES + 3),
    ("stadium_episode_received_bytes", "Bytes of ended episodes' request frames.",
     _EPISODES + 4),
    ("stadium_episode_sent_bytes", "Bytes of ended episodes' reply frames.", _EPISODES + 5),
    ("stadium_recorded_episodes", "Episodes written to --record shards.", _RECORDED),
    ("stadium_record_dropped_episodes", "Episodes --record chose but did not write (queue "
     "full, disk full, an episode over its bound).", _RECORDED + 1),
    ("stadium_record_write_errors", "Shard writes that failed (full disk, ...): "
     "recording paused.", _RECORDED + 2),
)  # fmt: skip


def _episode_metrics(env: str, total: Callable[[int], float]) -> Iterator[Metric]:
    """The episode ledger's metrics, labelled with the env's name."""
    for name, doc, field in _EPISODE_METRICS:
        family = CounterMetricFamily(name, doc, labels=["env"])
        family.add_metric([env], total(field))
        yield family
    recording = GaugeMetricFamily(
        "stadium_recording", "Workers writing --record shards now (0: off or paused).",
        labels=["env"],
    )  # fmt: skip
    recording.add_metric([env], total(_RECORDING))
    yield recording


def _image_metrics(images: list[str], total: Callable[[int], float]) -> Iterator[Metric]:
    """Warm processes and starts per task image (none without task images)."""
    if not images:
        return
    warm = GaugeMetricFamily(
        "stadium_image_warm_processes", "Warm env processes per task image.", labels=["image"]
    )
    starts = CounterMetricFamily(
        "stadium_image_starts_total", "Env processes started per task image.", labels=["image"]
    )
    for i, image in enumerate(images):
        warm.add_metric([image], total(_IMAGES + i))
        starts.add_metric([image], total(_IMAGES + IMAGE_SLOTS + i))
    yield warm
    yield starts


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _histogram(
    name: str, doc: str, bounds: Sequence[float], rows: Sequence[Sequence[float]], start: int
) -> HistogramMetricFamily:
    n = len(bounds) + 1
    counts = [sum(r[start + i] for r in rows) for i in range(n)]
    total = sum(r[start + n] for r in rows)
    cumulative, buckets = 0.0, []
    for bound, count in zip([*(repr(float(b)) for b in bounds), "+Inf"], counts, strict=True):
        cumulative += count
        buckets.append((bound, cumulative))
    return HistogramMetricFamily(name, doc, buckets=buckets, sum_value=total)


def registry_for(collector: StadiumCollector) -> CollectorRegistry:
    """A registry holding only ``collector`` (no process or platform collectors: those
    would describe the one worker that answers, not the server)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry


def exposition(registry: CollectorRegistry) -> bytes:
    """The Prometheus text format of ``registry``."""
    return generate_latest(registry)

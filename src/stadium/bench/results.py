"""What a benchmark run records: one :class:`SessionResult` per session (a row of
``raw.jsonl``) and one :class:`PointSummary` per point (a row of ``summary.csv``).

A *point* is one (arm, N, wait, rep): a burst of N sessions against a server,
each connect → reset → ``steps`` x (think, step) → close.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from stadium.bench import stats
from stadium.bench.stats import ERROR_KINDS, ErrorKind


class SessionResult(msgspec.Struct, kw_only=True):
    """One session, as measured by the load generator. Times in seconds.

    ``start`` and ``end`` are relative to the point's coordinated start; the
    phase latencies are ``None`` for phases the session did not reach.
    ``step_s`` holds one latency per step answered.
    """

    index: int
    worker: int = 0
    ok: bool = False
    error: str = ""
    detail: str = ""
    start: float = 0.0
    end: float | None = None
    connect_s: float | None = None
    reset_s: float | None = None
    step_s: list[float] = msgspec.field(default_factory=list)
    close_s: float | None = None
    total_s: float | None = None
    pid: int | None = None
    host: str | None = None
    session_hash: str | None = None
    source: str | None = None


@dataclass(frozen=True, slots=True)
class PointKey:
    """Identifies a point of the grid."""

    arm: str
    n: int
    wait_s: float
    rep: int


@dataclass(slots=True)
class ServerStats:
    """Server-side figures of one point, from /proc (``None`` when unknown)."""

    idle_rss_mb: float | None = None
    peak_rss_mb: float | None = None
    peak_threads: int | None = None
    peak_procs: int | None = None
    cpu_s: float | None = None
    oom: bool = False
    exit_code: int | None = None


@dataclass(slots=True)
class PointSummary:
    """One row of ``summary.csv``: every figure of one point.

    Latencies are in milliseconds, memory in MiB (``*_mb``) or KiB (``*_kb``),
    server CPU in ms per session and µs per step. Columns are the field names,
    in this order (:func:`columns`). The ``err_*`` fields are the
    :data:`~stadium.bench.stats.ERROR_KINDS`, in their order (checked at import:
    add a kind there and here together).
    """

    arm: str
    n: int
    wait_s: float
    rep: int
    steps: int
    think_ms: float
    state_kb: int
    mode: str
    batch: int = 0
    """Sessions per connection, stepped with one batch frame per round; 0: one
    connection and one frame per session and step."""
    attempted: int = 0
    ok: int = 0
    success_rate: float = 0.0
    err_refused: int = 0
    err_timeout: int = 0
    err_capacity: int = 0
    err_protocol: int = 0
    err_disconnected: int = 0
    err_client: int = 0
    err_deadline: int = 0
    connect_p50_ms: float | None = None
    connect_p90_ms: float | None = None
    connect_p99_ms: float | None = None
    connect_max_ms: float | None = None
    reset_p50_ms: float | None = None
    reset_p90_ms: float | None = None
    reset_p99_ms: float | None = None
    reset_max_ms: float | None = None
    step_p50_ms: float | None = None
    step_p90_ms: float | None = None
    step_p99_ms: float | None = None
    step_max_ms: float | None = None
    total_p50_ms: float | None = None
    total_p90_ms: float | None = None
    total_p99_ms: float | None = None
    total_max_ms: float | None = None
    ideal_ms: float = 0.0
    inflation_p50: float | None = None
    inflation_p99: float | None = None
    makespan_s: float = 0.0
    sessions_per_s: float = 0.0
    rps: float = 0.0
    effective_concurrency: float = 0.0
    peak_open: int = 0
    unique_pids: int = 0
    unique_hosts: int = 0
    sessions_per_host: str = ""
    """JSON object ``{host: sessions}`` over the sessions whose host is known."""
    server_idle_rss_mb: float | None = None
    server_peak_rss_mb: float | None = None
    rss_per_session_kb: float | None = None
    server_peak_threads: int | None = None
    server_peak_procs: int | None = None
    server_cpu_ms_per_session: float | None = None
    server_cpu_us_per_step: float | None = None
    client_cpu_us_per_step: float | None = None
    """The load generator's CPU (its worker processes, over the sessions) / steps."""
    steps_per_s: float = 0.0
    """Steps answered / makespan."""
    steps_per_s_per_core: float | None = None
    """Steps answered / server CPU seconds: what one busy server core serves per second."""
    server_cores: float | None = None
    oom: bool = False
    deadline_hit: bool = False
    collapsed: bool = False
    load_procs: int = 1
    failures: str = ""
    """The most common failures with an example detail (:func:`failure_text`); '' if none."""
    note: str = ""

    def as_row(self) -> dict[str, Any]:
        """The row as a dict (column → value), in column order."""
        return dataclasses.asdict(self)


def error_column(kind: ErrorKind) -> str:
    """The ``summary.csv`` column counting the sessions that failed with ``kind``."""
    return f"err_{kind.value}"


def _check_error_columns() -> None:
    """``PointSummary``'s ``err_*`` fields are exactly :data:`ERROR_KINDS`, in order."""
    have = [f.name for f in dataclasses.fields(PointSummary) if f.name.startswith("err_")]
    want = [error_column(k) for k in ERROR_KINDS]
    if have != want:
        raise TypeError(f"PointSummary's error columns {have} are not ErrorKind's {want}")


_check_error_columns()


def failure_text(records: Sequence[SessionResult], top: int = 3) -> str:
    """The share of failed sessions and the ``top`` most common error kinds, each
    with its count and the detail of its first session: ``"100 % failed:
    refused (64): ConnectionRefusedError; ..."``; '' when none failed.
    """
    failed = [r for r in records if not r.ok]
    if not failed:
        return ""
    kinds = Counter(r.error or "unknown" for r in failed)
    first: dict[str, str] = {}
    for r in failed:
        first.setdefault(r.error or "unknown", r.detail)
    share = 100.0 * len(failed) / len(records)
    parts = [
        f"{kind} ({count}): {first[kind] or 'no detail'}"[:240]
        for kind, count in kinds.most_common(top)
    ]
    more = len(kinds) - top
    tail = f"; {more} more kind(s)" if more > 0 else ""
    return f"{share:.3g} % failed: " + "; ".join(parts) + tail


def columns() -> list[str]:
    """The columns of ``summary.csv``, in order."""
    return [f.name for f in dataclasses.fields(PointSummary)]


def _ms(q: float | None) -> float | None:
    return None if q is None else q * 1000.0


@dataclass(slots=True)
class PointSettings:
    """How the point was run (copied into its summary)."""

    steps: int = 1
    think_s: float = 0.0
    state_kb: int = 0
    mode: str = "ws"
    batch: int = 0
    server_cores: float | None = None
    load_procs: int = 1
    client_cpu_s: float | None = None
    """CPU seconds the load generator spent on the point (``None``: unknown)."""
    extra: dict[str, Any] = field(default_factory=dict)


def summarize(
    key: PointKey,
    records: Sequence[SessionResult],
    settings: PointSettings,
    server: ServerStats | None = None,
    *,
    deadline_hit: bool = False,
    note: str = "",
) -> PointSummary:
    """Reduce the sessions of one point to its summary row (pure; no I/O)."""
    s = PointSummary(
        arm=key.arm,
        n=key.n,
        wait_s=key.wait_s,
        rep=key.rep,
        steps=settings.steps,
        think_ms=settings.think_s * 1000.0,
        state_kb=settings.state_kb,
        mode=settings.mode,
        batch=settings.batch,
        server_cores=settings.server_cores,
        load_procs=settings.load_procs,
        note=note,
    )
    s.attempted = len(records)
    s.ok = sum(1 for r in records if r.ok)
    s.success_rate = stats.success_rate(s.ok, s.attempted)
    kinds = Counter(r.error for r in records if not r.ok)
    for kind in ERROR_KINDS:
        setattr(s, error_column(kind), kinds.get(kind.value, 0))

    ok = [r for r in records if r.ok]
    phases: dict[str, list[float]] = {
        "connect": [r.connect_s for r in records if r.connect_s is not None],
        "reset": [r.reset_s for r in records if r.reset_s is not None],
        "step": [x for r in records for x in r.step_s],
        "total": [r.total_s for r in ok if r.total_s is not None],
    }
    for phase, values in phases.items():
        q = stats.Quantiles.of(values)
        setattr(s, f"{phase}_p50_ms", _ms(q.p50))
        setattr(s, f"{phase}_p90_ms", _ms(q.p90))
        setattr(s, f"{phase}_p99_ms", _ms(q.p99))
        setattr(s, f"{phase}_max_ms", _ms(q.max))
    ideal = stats.ideal_total(key.wait_s, settings.steps, settings.think_s)
    s.ideal_ms = ideal * 1000.0
    totals = phases["total"]
    s.inflation_p50 = stats.inflation(stats.percentile(totals, 50) if totals else None, ideal)
    s.inflation_p99 = stats.inflation(stats.percentile(totals, 99) if totals else None, ideal)

    intervals = [(r.start, r.end) for r in records if r.end is not None]
    if intervals:
        s.makespan_s = max(e for _, e in intervals) - min(b for b, _ in intervals)
    s.effective_concurrency = stats.effective_concurrency(intervals)
    s.peak_open = stats.peak_open(intervals)
    requests = sum((1 if r.reset_s is not None else 0) + len(r.step_s) for r in records)
    steps_done = sum(len(r.step_s) for r in records)
    if s.makespan_s > 0:
        s.sessions_per_s = s.ok / s.makespan_s
        s.rps = requests / s.makespan_s
        s.steps_per_s = steps_done / s.makespan_s
    s.client_cpu_us_per_step = stats.per_unit(settings.client_cpu_s, steps_done, 1e6)
    s.unique_pids = len({r.pid for r in records if r.pid is not None})
    hosts = Counter(r.host for r in records if r.host is not None)
    s.unique_hosts = len(hosts)
    s.sessions_per_host = json.dumps(dict(sorted(hosts.items()))) if hosts else ""
    s.failures = failure_text(records)

    if server is not None:
        s.server_idle_rss_mb = server.idle_rss_mb
        s.server_peak_rss_mb = server.peak_rss_mb
        s.server_peak_threads = server.peak_threads
        s.server_peak_procs = server.peak_procs
        s.oom = server.oom
        if server.peak_rss_mb is not None and server.idle_rss_mb is not None and s.attempted:
            s.rss_per_session_kb = (server.peak_rss_mb - server.idle_rss_mb) * 1024.0 / s.attempted
        s.server_cpu_ms_per_session = stats.per_unit(server.cpu_s, s.ok, 1000.0)
        s.server_cpu_us_per_step = stats.per_unit(server.cpu_s, steps_done, 1e6)
        if server.cpu_s:
            s.steps_per_s_per_core = steps_done / server.cpu_s
    s.deadline_hit = deadline_hit or s.err_deadline > 0
    s.collapsed = stats.collapsed(s.success_rate, oom=s.oom, deadline_hit=s.deadline_hit)
    return s

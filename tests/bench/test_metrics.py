"""The benchmark's arithmetic: percentiles, the max-batch rule, inflation, summaries."""

from __future__ import annotations

import math
import socket
from collections import Counter

import pytest

from stadium._errors import ConfigError
from stadium.bench import report, stats
from stadium.bench.arms import Arm, parse_cpus, parse_size
from stadium.bench.loadspec import PORTS_PER_SOURCE, LoadSpec, ThinkModel, source_address
from stadium.bench.results import (
    PointKey,
    PointSettings,
    ServerStats,
    SessionResult,
    columns,
    error_column,
    summarize,
)
from stadium.bench.sessions import bound_socket
from stadium.bench.stats import ErrorKind


@pytest.mark.parametrize(
    ("values", "p", "expected"),
    [
        ([1.0, 2.0, 3.0, 4.0], 50, 2.0),
        ([1.0, 2.0, 3.0, 4.0], 75, 3.0),
        ([1.0, 2.0, 3.0, 4.0], 76, 4.0),
        ([1.0, 2.0, 3.0, 4.0], 100, 4.0),
        ([1.0, 2.0, 3.0, 4.0], 0, 1.0),
        ([5.0], 99, 5.0),
        ([3.0, 1.0, 2.0], 50, 2.0),  # unsorted input
        ([float(i) for i in range(1, 101)], 99, 99.0),
        ([float(i) for i in range(1, 1001)], 99, 990.0),
    ],
)
def test_percentile_is_nearest_rank(values: list[float], p: float, expected: float) -> None:
    assert stats.percentile(values, p) == expected


def test_percentile_edges() -> None:
    assert stats.percentile([], 50) is None
    with pytest.raises(ValueError, match="percentile"):
        stats.percentile([1.0], 101)
    q = stats.Quantiles.of([4.0, 1.0, 3.0, 2.0])
    assert (q.p50, q.p90, q.p99, q.max) == (2.0, 4.0, 4.0, 4.0)
    assert stats.Quantiles.of([]).max is None


def test_max_batch_needs_every_rep_at_95_percent() -> None:
    rates = {32: [1.0, 1.0, 1.0], 128: [0.95, 1.0, 0.99], 512: [1.0, 0.94, 1.0], 2048: [0.2]}
    assert stats.max_batch(rates) == 128
    assert stats.max_batch({32: [0.5]}) == 0
    assert stats.max_batch({}) == 0
    assert stats.max_batch({64: []}) == 0
    # the study's rule is "largest N that holds", not "last N before the first failure"
    assert stats.max_batch({32: [0.9], 64: [1.0]}) == 64


def test_holds_threshold_is_inclusive() -> None:
    assert stats.holds(0.95)
    assert stats.holds(19 / 20)
    assert not stats.holds(0.9499)
    assert stats.collapsed(0.94)
    assert not stats.collapsed(1.0)
    assert stats.collapsed(1.0, oom=True)
    assert stats.collapsed(1.0, deadline_hit=True)


def test_inflation_and_ideal() -> None:
    assert stats.ideal_total(1.0, 3, 0.5) == 4.5
    assert stats.inflation(9.0, 4.5) == 2.0
    assert stats.inflation(1.0, 0.0) is None
    assert stats.inflation(None, 1.0) is None


def test_concurrency_and_rates() -> None:
    iv = [(0.0, 1.0), (0.0, 1.0), (0.5, 1.0)]
    assert stats.effective_concurrency(iv) == 2.5
    assert stats.effective_concurrency([]) == 0.0
    assert stats.peak_open(iv) == 3
    assert stats.peak_open([(0.0, 1.0), (1.0, 2.0)]) == 1  # back to back: one slot
    assert stats.batch_per_core(512, 2.0) == 256.0
    with pytest.raises(ValueError, match="cores"):
        stats.batch_per_core(1, 0)
    assert stats.per_unit(0.5, 1000, 1e6) == 500.0
    assert stats.per_unit(None, 10) is None
    assert stats.per_unit(1.0, 0) is None
    assert stats.ratio(2.0, 4.0) == 0.5
    assert stats.ratio(1.0, 0.0) is None
    assert stats.success_rate(0, 0) == 0.0


def test_think_model_and_deadline() -> None:
    think = ThinkModel(ttft_ms=200, tokens=100, token_ms=10)
    assert think.seconds == pytest.approx(1.2)
    spec = LoadSpec(url="ws://x/ws", sessions=10, wait_s=1.0, steps=2, think=think)
    assert spec.deadline() > (1.0 + 1.2) * 2
    assert LoadSpec(url="", sessions=10, deadline_s=5.0).deadline() == 5.0


def test_processes_and_source_addresses_respect_machine_limits() -> None:
    assert LoadSpec(url="", sessions=100).n_procs() == 1
    assert LoadSpec(url="", sessions=40_000).n_procs() == 3  # <= 15,000 per process
    assert LoadSpec(url="", sessions=100, procs=4).n_procs() == 4
    assert LoadSpec(url="", sessions=2, procs=4).n_procs() == 2
    assert LoadSpec(url="", sessions=100, cpus=(1, 2)).n_procs() == 2
    assert source_address(8_191, PORTS_PER_SOURCE) is None
    per_source = Counter(source_address(i, 60_000) for i in range(60_000))
    assert sorted(per_source) == [f"127.0.0.{k}" for k in range(2, 10)]
    assert max(per_source.values()) <= PORTS_PER_SOURCE
    with pytest.raises(ValueError, match="too many sessions"):
        source_address(0, 251 * PORTS_PER_SOURCE)


def test_bound_socket_connects_from_its_source_address() -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        sock = bound_socket("127.0.0.3")
        with sock:
            assert sock.getsockname() == ("127.0.0.3", 0)  # the port is picked at connect
            sock.setblocking(True)
            sock.connect(listener.getsockname())
            conn, peer = listener.accept()
            conn.close()
            assert peer[0] == "127.0.0.3"
            assert sock.getsockname()[1] != 0


def test_parsers() -> None:
    assert parse_size("2G") == 2 << 30
    assert parse_size("512m") == 512 << 20
    assert parse_size("1024") == 1024
    with pytest.raises(ConfigError):
        parse_size("lots")
    assert parse_cpus("0-2,5") == (0, 1, 2, 5)
    with pytest.raises(ConfigError):
        parse_cpus("a")
    assert Arm.parse("stadium@HEAD~1") == Arm("stadium@HEAD~1", "stadium", git_ref="HEAD~1")
    assert Arm.parse("url", url="ws://h/ws").url == "ws://h/ws"
    with pytest.raises(ConfigError):
        Arm.parse("nginx")
    with pytest.raises(ConfigError):
        Arm.parse("url")


def _ok(i: int, total: float, steps: list[float], pid: int = 1) -> SessionResult:
    return SessionResult(
        index=i, ok=True, start=0.0, end=total, connect_s=0.01, reset_s=0.001,
        step_s=steps, close_s=0.001, total_s=total, pid=pid, host="h",
    )  # fmt: skip


def test_summarize_counts_errors_and_latencies() -> None:
    records = [_ok(i, 1.0 + i / 100, [1.0, 1.0], pid=100 + i % 2) for i in range(18)]
    records.append(SessionResult(index=18, error=ErrorKind.TIMEOUT.value, start=0.0, end=2.0))
    records.append(SessionResult(index=19, error=ErrorKind.CAPACITY.value, start=0.0, end=0.1))
    s = summarize(
        PointKey("floor", 20, 0.5, 0),
        records,
        PointSettings(steps=2, think_s=0.0, server_cores=2.0),
        ServerStats(idle_rss_mb=10.0, peak_rss_mb=20.0, peak_threads=3, cpu_s=0.036),
    )
    assert s.attempted == 20
    assert s.ok == 18
    assert s.success_rate == 0.9
    assert (s.err_timeout, s.err_capacity, s.err_refused, s.err_protocol) == (1, 1, 0, 0)
    assert s.collapsed
    assert s.step_p50_ms == 1000.0
    assert s.total_p50_ms == pytest.approx(1080.0)  # rank ceil(0.5 * 18) = 9: 1.08 s
    assert s.total_max_ms == pytest.approx(1170.0)
    assert s.ideal_ms == 1000.0
    assert s.inflation_p50 == pytest.approx(1.08)
    assert s.unique_pids == 2
    assert s.unique_hosts == 1
    assert s.rss_per_session_kb == pytest.approx(10.0 * 1024 / 20)
    assert s.server_cpu_ms_per_session == pytest.approx(2.0)  # 36 ms / 18 sessions
    assert s.server_cpu_us_per_step == pytest.approx(1000.0)  # 36 ms / 36 steps
    assert s.makespan_s == pytest.approx(2.0)
    assert s.rps == pytest.approx((18 * 3) / 2.0)
    assert list(s.as_row()) == columns()


def test_summarize_empty_point() -> None:
    s = summarize(PointKey("x", 4, 1.0, 0), [], PointSettings())
    assert s.success_rate == 0.0
    assert s.collapsed
    assert s.total_p99_ms is None
    assert not math.isnan(s.effective_concurrency)


def test_error_columns_are_the_error_kinds() -> None:
    """ErrorKind is the one list of failure kinds: summary.csv and the report follow it."""
    kinds = [k for k in ErrorKind if k is not ErrorKind.NONE]
    assert list(stats.ERROR_KINDS) == kinds
    assert [c for c in columns() if c.startswith("err_")] == [f"err_{k.value}" for k in kinds]
    records = [SessionResult(index=i, error=k.value) for i, k in enumerate(kinds)]
    row = summarize(PointKey("x", len(kinds), 0.0, 0), records, PointSettings()).as_row()
    assert all(row[error_column(k)] == 1 for k in kinds)
    assert report.errors_text([row, row]) == " ".join(f"{k.value}:2" for k in kinds)

"""`stadium bench` across endpoints: URL forms, several endpoints, loud failures, hosts.

Real `stadium serve benchmark` servers on loopback, tiny points (a few dozen sessions,
W = 0); only counts, shapes and exit codes are checked, never timings.
"""

from __future__ import annotations

import contextlib
import csv
import json
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from stadium._core.urls import ws_url
from stadium._errors import ConfigError
from stadium.bench import report
from stadium.bench.arms import Arm, CpuCap, endpoint_weights, spawn_server
from stadium.bench.bench_commands import bench
from stadium.bench.grid import BenchConfig, run
from stadium.bench.loadspec import LoadSpec, spread, ws_urls
from stadium.bench.results import PointKey, PointSettings, SessionResult, summarize
from stadium.deploy.deployment import Deployment
from tests.conftest import UNIT

#: Process-level: servers, tools or interpreters in subprocesses (`make check` skips it).
pytestmark = pytest.mark.slow

TINY = ["--wait-grid", "0", "--reps", "1", "--no-progress"]


CAPS: dict[str, int] = {}
"""Each test server's session capacity, by base URL."""


@pytest.fixture(scope="module")
def servers() -> Iterator[list[tuple[int, str]]]:
    """Three benchmark servers: (pid, base URL); capacities 30, 30 and 10 sessions."""
    with contextlib.ExitStack() as stack:
        out = []
        for cap in (30, 30, 10):
            proc, url = stack.enter_context(
                spawn_server("benchmark", "--max-sessions", str(cap), "--log-level", "warning")
            )
            CAPS[url] = cap
            out.append((proc.pid, url))
        yield out


def _rows(out: Path) -> list[dict[str, str]]:
    return list(csv.DictReader((out / "summary.csv").read_text().splitlines()))


def _raw(out: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in (out / "raw.jsonl").read_text().splitlines()]


# ------------------------------------------------------------------ URL forms


@pytest.mark.parametrize(
    ("given", "want"),
    [
        ("http://127.0.0.1:8000", "ws://127.0.0.1:8000/ws"),
        ("http://127.0.0.1:8000/", "ws://127.0.0.1:8000/ws"),
        ("https://example.org:8443", "wss://example.org:8443/ws"),
        ("ws://10.0.0.1:8000", "ws://10.0.0.1:8000/ws"),
        ("ws://10.0.0.1:8000/ws", "ws://10.0.0.1:8000/ws"),
        ("wss://example.org/ws", "wss://example.org/ws"),
        ("10.0.0.1:8000", "ws://10.0.0.1:8000/ws"),
        ("localhost:8000", "ws://localhost:8000/ws"),
        ("http://h:1/env", "ws://h:1/env/ws"),
        ("http://h:1/?stadium_node=node2", "ws://h:1/ws?stadium_node=node2"),
    ],
)
def test_every_url_form_becomes_the_sessions_ws_url(given: str, want: str) -> None:
    assert ws_url(given) == want


@pytest.mark.parametrize(
    "bad",
    [
        "ftp://h:1",
        "http://:80",
        "h:port",
        "",
        "ws://u:p@h:1/ws",
        "h\nx:1",
        "http://h:1/a\tb",
        "h :1",
    ],
)
def test_a_bad_url_is_a_config_error_saying_what_is_expected(bad: str) -> None:
    with pytest.raises(ConfigError, match="HOST:PORT"):
        ws_url(bad)


def test_several_endpoints_from_commas_repeats_and_a_deployment_file(tmp_path: Path) -> None:
    file = tmp_path / "deploy.json"
    Deployment.of(["http://10.0.0.1:8000", "http://10.0.0.2:8000"]).write(file)
    assert ws_urls(["h:1,h:2", "ws://h:3/ws", str(file)]) == (
        "ws://h:1/ws", "ws://h:2/ws", "ws://h:3/ws", "ws://10.0.0.1:8000/ws",
        "ws://10.0.0.2:8000/ws",
    )  # fmt: skip
    arm = Arm.remote(["h:1", "h:2"], [7, 8])
    assert (arm.url, arm.urls, arm.server_pid, arm.server_pids) == (
        "ws://h:1/ws", ("ws://h:1/ws", "ws://h:2/ws"), 7, (7, 8),
    )  # fmt: skip
    assert Arm.parse("url", url="http://h:1").url == "ws://h:1/ws"  # the ramp's url arm


def test_url_forms_each_run_a_point(tmp_path: Path, servers: list[tuple[int, str]]) -> None:
    """The study's own command form, `--url http://HOST:PORT`, and `ws://HOST:PORT`
    (no `/ws`) serve; every other form is the same URL (the unit test above)."""
    pid, base = servers[0]
    hostport = base.removeprefix("http://")
    for i, url in enumerate([base, f"ws://{hostport}"]):  # the two that failed before
        out = tmp_path / str(i)
        args = ["--url", url, "--server-pid", str(pid), "--requests-grid", "6", *TINY]
        result = CliRunner().invoke(bench, [*args, "--output-dir", str(out)])
        assert result.exit_code == 0, (url, result.output)
        (row,) = _rows(out)
        assert (row["ok"], row["failures"], row["unique_pids"]) == ("6", "", "1"), url


def test_a_bad_url_is_a_usage_error_before_any_point(tmp_path: Path) -> None:
    out = tmp_path / "bad"
    result = CliRunner().invoke(bench, ["--url", "ftp://h:1", *TINY, "--output-dir", str(out)])
    assert result.exit_code == 2
    assert "--url" in result.output
    assert "HOST:PORT" in result.output
    assert not out.exists()


# ------------------------------------------------------------- loud failures


def test_a_dead_url_prints_the_cause_and_exits_non_zero(tmp_path: Path) -> None:
    from stadium.bench.arms import free_port

    out = tmp_path / "dead"
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    result = CliRunner().invoke(
        bench, ["--url", url, "--requests-grid", "5", *TINY, "--output-dir", str(out)]
    )
    assert result.exit_code == 1, result.output
    assert "100 % failed: refused (5): ConnectionRefusedError" in result.output
    assert "max batch 0" in result.output
    (row,) = _rows(out)  # the report is written all the same
    assert row["failures"].startswith("100 % failed: refused (5)")
    md = (out / "report.md").read_text()
    assert "## Failures" in md
    assert "ConnectionRefusedError" in md


def test_failure_text_names_the_commonest_kinds_with_an_example() -> None:
    recs = [SessionResult(index=i, ok=True) for i in range(2)]
    recs += [SessionResult(index=2 + i, error="timeout", detail=f"t{i}") for i in range(3)]
    recs += [SessionResult(index=9, error="capacity", detail="CAPACITY_REACHED: full")]
    s = summarize(PointKey("a", 6, 0.0, 0), recs, PointSettings())
    assert s.failures == "66.7 % failed: timeout (3): t0; capacity (1): CAPACITY_REACHED: full"
    assert summarize(PointKey("a", 2, 0.0, 0), recs[:2], PointSettings()).failures == ""


# -------------------------------------------------------- several endpoints


def test_spread_is_proportional_interleaved_and_deterministic() -> None:
    assert Counter(spread((1, 1), 21)) == {0: 11, 1: 10}
    assert Counter(spread((10, 30), 20)) == {0: 5, 1: 15}
    assert Counter(spread((0, 4), 5)) == {1: 5}
    assert Counter(spread((0, 0), 4)) == {0: 2, 1: 2}  # nothing known: equal
    three = spread((1, 1, 1), 300)
    assert all(abs(three[:k].count(0) - k / 3) <= 1 for k in range(1, 301))  # every prefix
    assert spread((3, 5, 1), 100) == spread((3, 5, 1), 100)
    spec = LoadSpec(url="", sessions=4, urls=("ws://a/ws", "ws://127.0.0.1:1/ws"), weights=(1, 1))
    assert [spec.endpoint(i) for i in range(4)] == ["ws://a/ws", "ws://127.0.0.1:1/ws"] * 2
    assert spec.source(0) is None  # not loopback: the kernel picks the source address


def _idle(*bases: str) -> None:
    """Wait until each server reports no active session (the last test's have closed)."""
    deadline = time.monotonic() + 10 * UNIT
    while endpoint_weights([ws_url(b) for b in bases]) != tuple(CAPS[b] for b in bases):
        if time.monotonic() > deadline:
            pytest.fail(f"sessions still active on {bases}")
        time.sleep(0.05)


def _run_spread(tmp_path: Path, bases: list[tuple[int, str]], n: int) -> list[dict[str, object]]:
    _idle(*(u for _, u in bases))
    arm = Arm.remote([u for _, u in bases], [p for p, _ in bases])
    cfg = BenchConfig(
        arms=[arm], requests_grid=[n], wait_grid=[0.0], output_dir=tmp_path,
        progress=False, settle_s=0.0, deadline_s=120.0,
    )  # fmt: skip
    run(cfg)
    raw = _raw(tmp_path)
    assert all(r["ok"] for r in raw), [r["detail"] for r in raw if not r["ok"]]
    return raw


def test_two_endpoints_of_equal_capacity_split_evenly(
    tmp_path: Path, servers: list[tuple[int, str]]
) -> None:
    (pid_a, a), (pid_b, b), _ = servers
    raw = _run_spread(tmp_path, [(pid_a, a), (pid_b, b)], 21)
    assert Counter(r["pid"] for r in raw) == {pid_a: 11, pid_b: 10}
    # session i went to endpoint i % 2 (equal weights interleave exactly)
    assert {r["pid"] for r in raw if r["index"] % 2 == 0} == {pid_a}  # type: ignore[operator]


def test_two_endpoints_split_by_free_capacity(
    tmp_path: Path, servers: list[tuple[int, str]]
) -> None:
    (pid_a, a), _, (pid_c, c) = servers
    raw = _run_spread(tmp_path, [(pid_c, c), (pid_a, a)], 20)  # capacities 10 and 30
    assert Counter(r["pid"] for r in raw) == {pid_c: 5, pid_a: 15}
    (row,) = report.read_summary(tmp_path / "summary.csv")
    assert row["unique_pids"] == 2
    assert row["server_peak_procs"] == 2  # both servers sampled (--server-pid twice)
    assert row["unique_hosts"] == 1
    assert json.loads(row["sessions_per_host"]) == {raw[0]["host"]: 20}
    assert "weights: free capacity" in (tmp_path / "report.md").read_text()


def test_the_cli_takes_several_urls(tmp_path: Path, servers: list[tuple[int, str]]) -> None:
    (pid_a, a), (pid_b, b), _ = servers
    _idle(a, b)
    args = ["--url", f"{a},{b.removeprefix('http://')}", "--requests-grid", "8", *TINY]
    result = CliRunner().invoke(bench, [*args, "--output-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert Counter(r["pid"] for r in _raw(tmp_path)) == {pid_a: 4, pid_b: 4}


def test_unknown_capacity_means_equal_weights() -> None:
    assert endpoint_weights(["ws://127.0.0.1:1/ws", "ws://127.0.0.1:2/ws"], timeout=0.5) == (1, 1)


# ----------------------------------------------------------- sessions per host


def test_sessions_per_host_in_the_summary_report_and_table(tmp_path: Path) -> None:
    recs = [SessionResult(index=i, ok=True, host=f"node{1 + i % 3}") for i in range(7)]
    recs.append(SessionResult(index=7, error="refused", detail="x"))
    s = summarize(PointKey("url", 8, 1.0, 0), recs, PointSettings())
    assert s.unique_hosts == 3
    assert json.loads(s.sessions_per_host) == {"node1": 3, "node2": 2, "node3": 2}
    report.write_summary(tmp_path / "summary.csv", [s])
    (row,) = report.read_summary(tmp_path / "summary.csv")
    assert json.loads(row["sessions_per_host"]) == {"node1": 3, "node2": 2, "node3": 2}
    md = report.write_report(tmp_path, [row], command="x", settings={}, figures=[], machine={})
    text = md.read_text()
    assert '| url | 1 | 8 | 1 | 3 | {"node1": 3, "node2": 2, "node3": 2} |' in text
    assert "| hosts |" in text
    assert "unique_hosts" in report.TERMINAL_COLUMNS


# ------------------------------------------------------------------ CPU caps


def test_cpu_cap_puts_a_process_tree_under_a_quota() -> None:
    """`CpuCap`: the cgroup the scale-out measurement caps each node with."""
    cap = CpuCap(0.25, shares=2048)
    try:
        method = cap.create()
    except ConfigError as exc:
        pytest.skip(f"no writable cpu cgroup here: {exc.message}")
    assert cap.cgroup is not None
    d = cap.cgroup
    proc = subprocess.Popen(["sleep", "60"])
    try:
        cap.add(proc.pid)
        assert str(proc.pid) in cap.procs_file.read_text().split()
        assert "0.25 CPU" in method
        if cap.version == "v1":
            assert (d / "cpu.cfs_quota_us").read_text().strip() == "25000"
            assert (d / "cpu.shares").read_text().strip() == "2048"
        else:
            assert (d / "cpu.max").read_text().split() == ["25000", "100000"]
        assert "nr_throttled" in cap.stat()
        cap.remove()  # with the process still inside: moved back to the parent first
        assert cap.cgroup is None
        assert not d.exists()
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()
        cap.remove()

"""Tiny real runs on loopback: the floor server, the load generator, every output file.

No timing thresholds: only counts, shapes and the files written.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from stadium.bench import report, run_ramp
from stadium.bench.arms import FLOOR_SCRIPT, free_port, wait_healthy
from stadium.bench.compare import compare, compare_arms
from stadium.bench.loadgen import run_load
from stadium.bench.loadspec import LoadSpec, ThinkModel
from stadium.bench.results import columns
from stadium.bench.sessions import run_sessions

#: Process-level: servers, tools or interpreters in subprocesses (`make check` skips it).
pytestmark = pytest.mark.slow

WAIT = 0.05
TINY = {"deadline_s": 120.0, "progress": False, "settle_s": 0.0}


@pytest.fixture(scope="module")
def floor_server() -> Iterator[tuple[str, int]]:
    """A floor server with 64 session slots, past which it answers CAPACITY_REACHED."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, str(FLOOR_SCRIPT), "--port", str(port), "--max-sessions", "64"],
        stdout=subprocess.DEVNULL,
    )
    try:
        wait_healthy(port, proc, 30.0)
        yield f"ws://127.0.0.1:{port}/ws", proc.pid
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0


@pytest.fixture
def floor(floor_server: tuple[str, int]) -> str:
    return floor_server[0]


def test_load_against_floor(floor: str) -> None:
    spec = LoadSpec(url=floor, sessions=12, wait_s=WAIT, steps=3, state_kb=4, procs=2,
                    think=ThinkModel(ttft_ms=1.0))  # fmt: skip
    seen: list[int] = []
    records, nprocs = run_load(spec, progress=seen.append)
    assert nprocs == 2
    assert [r.index for r in records] == list(range(12))
    assert all(r.ok for r in records), [r.detail for r in records if not r.ok]
    assert {r.worker for r in records} == {0, 1}
    assert all(len(r.step_s) == 3 for r in records)
    assert all(r.connect_s is not None and r.reset_s is not None for r in records)
    assert len({r.session_hash for r in records}) == 12
    assert len({r.pid for r in records}) == 1
    assert seen[-1] == 12


def test_connect_window_bounds_connects_in_flight(
    floor: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import asyncio

    import picows

    real = picows.ws_connect
    state = {"now": 0, "most": 0, "calls": 0}

    async def counting(*args: Any, **kwargs: Any) -> Any:
        state["now"] += 1
        state["calls"] += 1
        state["most"] = max(state["most"], state["now"])
        try:
            await asyncio.sleep(0.01)  # let every other session reach its connect
            return await real(*args, **kwargs)
        finally:
            state["now"] -= 1

    monkeypatch.setattr(picows, "ws_connect", counting)
    spec = LoadSpec(url=floor, sessions=20, wait_s=0.0, connect_window=3)
    records = asyncio.run(run_sessions(spec, range(20), time.monotonic()))
    assert all(r.ok for r in records), [r.detail for r in records if not r.ok]
    assert state == {"now": 0, "most": 3, "calls": 20}
    # without a window every session connects at the burst's instant
    state.update(most=0, calls=0)
    spec = LoadSpec(url=floor, sessions=20, wait_s=0.0)
    records = asyncio.run(run_sessions(spec, range(20), time.monotonic()))
    assert all(r.ok for r in records)
    assert state["most"] == 20


async def test_http_mode_from_the_default_and_a_chosen_source_address() -> None:
    from stadium.bench.arms import spawn_server
    from stadium.bench.results import SessionResult
    from stadium.bench.sessions import HttpConnection, Plan, run_session

    with spawn_server("benchmark", "--log-level", "warning") as (_, url):
        spec = LoadSpec(url=url.replace("http", "ws") + "/ws", sessions=2,
                        wait_s=0.0, steps=2, mode="http")  # fmt: skip
        plan = Plan.of(spec, time.monotonic())
        records = [SessionResult(index=0), SessionResult(index=1, source="127.0.0.3")]
        for rec in records:
            await run_session(rec, HttpConnection(spec.url, rec.source), plan)
    assert all(r.ok for r in records), [r.detail for r in records]
    assert all(r.reset_s is not None and len(r.step_s) == 2 for r in records)


def test_errors_are_classified(floor: str) -> None:
    # nothing listens on this port: refused
    dead = f"ws://127.0.0.1:{free_port()}/ws"
    records, _ = run_load(LoadSpec(url=dead, sessions=3, wait_s=0.0))
    assert {r.error for r in records} == {"refused"}
    # past the floor's 64 slots: capacity
    records, _ = run_load(LoadSpec(url=floor, sessions=80, wait_s=0.5))
    kinds = {r.error for r in records}
    assert kinds == {"", "capacity"}
    assert sum(r.ok for r in records) == 64
    # a listener that never answers the handshake: timeout
    with socket.create_server(("127.0.0.1", 0)) as silent:
        url = f"ws://127.0.0.1:{silent.getsockname()[1]}/ws"
        records, _ = run_load(LoadSpec(url=url, sessions=2, connect_timeout=0.2))
    assert {r.error for r in records} == {"timeout"}
    # a wrong path: the handshake is answered 404, a protocol error
    records, _ = run_load(LoadSpec(url=floor.replace("/ws", "/nope"), sessions=1, wait_s=0.0))
    assert {r.error for r in records} == {"protocol"}


def test_ramp_writes_every_output(tmp_path: Path) -> None:
    md = run_ramp(["floor"], [4, 16], [WAIT], reps=2, output_dir=tmp_path, **TINY)
    assert md == tmp_path / "report.md"
    text = md.read_text()
    assert "Max batch" in text
    assert "| floor | 0.05 | 16 |" in text
    with (tmp_path / "summary.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert list(rows[0]) == columns()
    assert [(r["n"], r["rep"]) for r in rows] == [("4", "0"), ("4", "1"), ("16", "0"), ("16", "1")]
    assert all(r["success_rate"] == "1.0" for r in rows)
    assert all(r["server_peak_rss_mb"] and r["server_peak_threads"] == "1" for r in rows)
    raw = [json.loads(line) for line in (tmp_path / "raw.jsonl").read_text().splitlines()]
    assert len(raw) == (4 + 16) * 2
    assert {"arm", "n", "wait_s", "rep", "ok", "error", "connect_s", "step_s", "total_s"} <= set(
        raw[0]
    )
    for name in report.FIGURES:
        png = tmp_path / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    assert (tmp_path / "logs").is_dir()


def test_ramp_stops_at_collapse(tmp_path: Path, floor: str) -> None:
    # the floor fixture holds 64 sessions: N = 100 collapses (64 %), N = 200 is not run
    md = run_ramp([f"url={floor}"], [2, 100, 200], [0.2], reps=1, output_dir=tmp_path, **TINY)
    rows = report.read_summary(tmp_path / "summary.csv")
    assert [r["n"] for r in rows] == [2, 100]
    assert rows[1]["collapsed"] is True
    assert rows[1]["err_capacity"] == 36
    assert "| url | 0.2 | 2 |" in md.read_text()  # max batch 2


def test_compare_two_result_sets(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    run_ramp(["floor"], [4], [WAIT], reps=1, output_dir=a, **TINY)
    run_ramp(["floor"], [4], [WAIT], reps=1, output_dir=b, steps=2, **TINY)
    md = compare(a, b, tmp_path / "cmp", echo=False)
    assert md.exists()
    assert (tmp_path / "cmp" / "compare.png").read_bytes()[:4] == b"\x89PNG"
    with (tmp_path / "cmp" / "compare.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert rows[0]["arm"] == "floor"
    assert float(rows[0]["success_rate_ratio"]) == 1.0
    assert float(rows[0]["total_p50_ms_ratio"]) > 1.0  # two steps of W take longer than one
    assert rows[-1]["n"] == "max batch"


def test_cli(tmp_path: Path) -> None:
    from stadium.bench.bench_commands import bench

    runner = CliRunner()
    result = runner.invoke(bench, ["--help"])
    assert result.exit_code == 0
    assert "ramp" in result.output
    assert "compare" in result.output
    out = tmp_path / "cli"
    result = runner.invoke(
        bench,
        ["ramp", "--arm", "floor", "--requests-grid", "3", "--wait-grid", "0", "--reps", "1",
         "--output-dir", str(out), "--no-progress", "--think-ms", "1"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert f"report: {out / 'report.md'}" in result.output
    result = runner.invoke(bench, ["compare", str(out), str(out)])
    assert result.exit_code == 0, result.output
    result = runner.invoke(bench, ["--requests-grid", "x"])
    assert result.exit_code == 2


def test_compare_against_a_git_ref(tmp_path: Path) -> None:
    """``compare --git-ref``: Stadium from a temporary worktree of HEAD against the tree."""
    from stadium.bench.bench_commands import bench

    out = tmp_path / "ref"
    result = CliRunner().invoke(
        bench,
        ["compare", "--git-ref", "HEAD", "--requests-grid", "4", "--wait-grid", "0",
         "--reps", "1", "--output-dir", str(out), "--no-progress"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    rows = list(csv.DictReader((out / "summary.csv").read_text().splitlines()))
    assert sorted(r["arm"] for r in rows) == ["stadium", "stadium@HEAD"]
    assert all(r["success_rate"] == "1.0" for r in rows)
    md = (out / "compare.md").read_text()
    assert "A = `stadium@HEAD`, B = `stadium`" in md
    assert (out / "compare.csv").exists()


def test_url_arm_with_server_pid(tmp_path: Path, floor_server: tuple[str, int]) -> None:
    from stadium.bench.arms import Arm
    from stadium.bench.grid import BenchConfig, run

    floor, pid = floor_server
    cfg = BenchConfig(
        arms=[Arm("url", "url", url=floor, server_pid=pid)],
        requests_grid=[5], wait_grid=[0.0], output_dir=tmp_path, **TINY,
    )  # fmt: skip
    run(cfg)
    (row,) = report.read_summary(tmp_path / "summary.csv")
    assert row["ok"] == 5
    assert row["server_peak_threads"] == 1
    assert row["server_cores"] is None


def test_stadium_arm(tmp_path: Path) -> None:
    md = run_ramp(["stadium", "floor"], [4], [WAIT], reps=1, output_dir=tmp_path, **TINY)
    rows = report.read_summary(tmp_path / "summary.csv")
    assert {r["arm"] for r in rows} == {"stadium", "floor"}
    logs = "\n".join(p.read_text() for p in (tmp_path / "logs").iterdir())
    assert all(r["success_rate"] == 1.0 for r in rows), logs[-2000:]
    assert compare_arms(md.parent, "floor", "stadium", echo=False).exists()


@pytest.mark.skipif(
    importlib.util.find_spec("openenv") is None
    and not (Path.home() / ".cache/stadium-bench/openenv-0.10.0/bin/python").exists(),
    reason="openenv is not installed (the tests never install it)",
)
def test_openenv_arm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # OpenEnv's server without its web UI (restored after: Stadium's /web reads it too).
    monkeypatch.setenv("ENABLE_WEB_INTERFACE", "false")
    run_ramp(["openenv"], [4], [WAIT], reps=1, output_dir=tmp_path, **TINY)
    (row,) = report.read_summary(tmp_path / "summary.csv")
    logs = "\n".join(p.read_text() for p in (tmp_path / "logs").iterdir())
    assert row["success_rate"] == 1.0, logs[-2000:]
    assert row["unique_pids"] == 1


def test_run_deadline_skips_the_remaining_points(tmp_path: Path) -> None:
    md = run_ramp(["floor"], [2, 4], [WAIT], reps=1, output_dir=tmp_path,
                  **{**TINY, "deadline_s": 1e-9})  # fmt: skip
    text = md.read_text()
    assert "the run's deadline passed; later points skipped" in text
    assert not (tmp_path / "summary.csv").exists()  # no point was started
    assert (tmp_path / "raw.jsonl").read_bytes() == b""

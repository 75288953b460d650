"""Batched loads (``--batch``, ``stadium+batchB``): parsing, plumbing into the summary
and the goals table, and small real runs (the floor refuses batches; Stadium serves them).

No timing thresholds: only counts, shapes and classifications.
"""

from __future__ import annotations

import csv
import importlib.util
import json
from pathlib import Path

import msgspec
import pytest
from click.testing import CliRunner

from stadium._errors import ConfigError
from stadium.bench import report, run_ramp
from stadium.bench.arms import FLOOR_SCRIPT, Arm, free_port, spawn_server, wait_healthy
from stadium.bench.batched import _BatchResult, _check_reply, _entry_failure, batch_body
from stadium.bench.bench_commands import bench, ramp
from stadium.bench.bench_options import GridOptions, RampOptions
from stadium.bench.goals import GOALS, Ramp, run_goals
from stadium.bench.loadgen import load
from stadium.bench.loadspec import LoadSpec
from stadium.bench.results import (
    PointKey,
    PointSettings,
    ServerStats,
    SessionResult,
    columns,
    summarize,
)
from stadium.bench.sessions import Fail
from stadium.bench.stats import ErrorKind

TINY = {"deadline_s": 120.0, "progress": False, "settle_s": 0.0}


# ------------------------------------------------------------------ options


def test_batched_arms_parse() -> None:
    arm = Arm.parse("stadium+batch64")
    assert (arm.name, arm.kind, arm.batch, arm.git_ref) == ("stadium+batch64", "stadium", 64, None)
    ref = Arm.parse("stadium@HEAD~1+batch8")
    assert (ref.name, ref.git_ref, ref.batch) == ("stadium@HEAD~1+batch8", "HEAD~1", 8)
    url = Arm.parse("url+batch4", url="http://127.0.0.1:9")
    assert (url.kind, url.batch, url.url) == ("url", 4, "ws://127.0.0.1:9/ws")
    assert Arm.parse("stadium").batch == 0
    bad_arms = {"floor+batch64": "no batches", "openenv+batch2": "no batches",
                "stadium+batchx": "not a batch size", "stadium+batch0": "positive"}  # fmt: skip
    for bad, why in bad_arms.items():
        with pytest.raises(ConfigError, match=why):
            Arm.parse(bad)


def test_batch_option_adds_a_batched_arm_after_each_stadium_arm() -> None:
    options = GridOptions(batch=(64, 256))
    config = options.bench_config([Arm.parse("stadium"), Arm.parse("floor")], True)
    arms = config.arm_list()
    assert [(a.name, a.kind, a.batch) for a in arms] == [
        ("stadium", "stadium", 0),
        ("stadium+batch64", "stadium", 64),
        ("stadium+batch256", "stadium", 256),
        ("floor", "floor", 0),
    ]
    assert GridOptions().bench_config([Arm.parse("stadium")], True).arm_list() == [
        Arm.parse("stadium")
    ]


def test_batch_on_the_command_line() -> None:
    ctx = ramp.make_context("ramp", ["--arm", "stadium", "--arm", "floor", "--batch", "64,256"])
    options = RampOptions.from_cli(**ctx.params)
    assert options.batch == (64, 256)
    assert options.argv()[-2:] == ["--batch", "64,256"]
    assert RampOptions.from_cli(**ramp.make_context("ramp", []).params).batch == ()
    result = CliRunner().invoke(bench, ["ramp", "--batch", "0"])
    assert result.exit_code == 2
    assert "positive" in result.output


def test_load_spec_limits() -> None:
    spec = LoadSpec(url="ws://x/ws", sessions=300, batch=64, procs=8)
    assert spec.connections() == 5
    assert spec.n_procs() == 5  # never more processes than connections
    assert LoadSpec(url="ws://x/ws", sessions=300).connections() == 300
    for kwargs, why in (({"batch": 5000}, "out of range"), ({"batch": 4, "mode": "http"}, "ws"),
                        ({"batch": 4, "duration_s": 1.0}, "soak")):  # fmt: skip
        with pytest.raises(ConfigError, match=why):
            LoadSpec(url="ws://x/ws", sessions=8, **kwargs)  # type: ignore[arg-type]


def test_batched_arms_need_websocket_mode(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--mode ws"):
        run_ramp(["stadium+batch4"], [4], [0.0], output_dir=tmp_path, mode="http", **TINY)


# ------------------------------------------------------------- the protocol


def test_batch_frames() -> None:
    body = msgspec.json.decode(batch_body("step", [0, 2], {"wait_seconds": 0.0}))
    assert body == {
        "type": "batch",
        "id": "step",
        "calls": [
            {"session": 0, "type": "step", "data": {"wait_seconds": 0.0}},
            {"session": 2, "type": "step", "data": {"wait_seconds": 0.0}},
        ],
    }
    reply = {"type": "batch", "id": "step", "results": [
        {"type": "observation", "data": {"observation": {}, "reward": 0, "done": False}},
        {"type": "error", "data": {"code": "CAPACITY_REACHED", "message": "full"}},
        {"type": "error", "data": {"code": "INVALID_ACTION", "message": "no"}},
        {"type": "closed", "data": {"code": 1001, "reason": "draining"}},
        {"type": "state", "data": {}},
    ]}  # fmt: skip
    entries = _check_reply(msgspec.json.encode(reply), 5)
    failures = [_entry_failure(e) for e in entries]
    assert failures[0] is None
    kinds = [f.kind if f else None for f in failures]
    assert kinds == [None, ErrorKind.CAPACITY, ErrorKind.PROTOCOL, ErrorKind.DISCONNECTED,
                     ErrorKind.PROTOCOL]  # fmt: skip
    assert failures[3] is not None
    assert "draining" in failures[3].detail
    with pytest.raises(Fail, match="batch of 4 results"):
        _check_reply(msgspec.json.encode(reply), 4)
    refused = {"type": "error", "data": {"code": "INVALID_MESSAGE", "message": "no calls"}}
    with pytest.raises(Fail, match="batch refused"):
        _check_reply(msgspec.json.encode(refused), 1)
    with pytest.raises(Fail, match="unreadable"):
        _check_reply(b"{", 1)
    assert _entry_failure(_BatchResult("observation")) is None


# ------------------------------------------------------- summary and goals


def test_summary_of_a_batched_point() -> None:
    records = [
        SessionResult(index=i, ok=True, start=0.0, end=2.0, reset_s=0.01, step_s=[0.001] * 10,
                      total_s=2.0)
        for i in range(8)
    ]  # fmt: skip
    settings = PointSettings(steps=10, batch=4, client_cpu_s=0.004, server_cores=1.0)
    stats = ServerStats(idle_rss_mb=10.0, peak_rss_mb=11.0, cpu_s=0.008)
    s = summarize(PointKey("stadium+batch4", 8, 0.0, 0), records, settings, stats)
    assert s.batch == 4
    assert s.server_cpu_us_per_step == pytest.approx(100.0)  # 8 ms / 80 steps
    assert s.client_cpu_us_per_step == pytest.approx(50.0)
    assert s.steps_per_s == pytest.approx(40.0)  # 80 steps / 2 s
    assert s.steps_per_s_per_core == pytest.approx(10_000.0)  # 80 steps / 8 ms
    unknown = summarize(PointKey("floor", 8, 0.0, 0), records, PointSettings(steps=10))
    assert (unknown.batch, unknown.client_cpu_us_per_step, unknown.steps_per_s_per_core) == (
        0, None, None)  # fmt: skip
    for col in ("batch", "client_cpu_us_per_step", "steps_per_s", "steps_per_s_per_core"):
        assert col in columns()


def _write(out: Path, rows: list[dict[str, object]]) -> None:
    out.mkdir(parents=True)
    with (out / "summary.csv").open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=columns())
        w.writeheader()
        w.writerows(rows)


def test_goals_read_the_batched_arm_beside_one_frame_and_the_floor(tmp_path: Path) -> None:
    figures = {  # arm -> (server µs/step, client µs/step, RSS KiB/session)
        "stadium": (13.0, 9.0, 10.0),
        "stadium+batch64": (3.0, 1.5, 4.0),
        "stadium+batch256": (2.0, 1.0, 3.0),
        "floor": (14.0, 9.5, 28.0),
        "openenv": (40.0, 20.0, 55.0),
    }

    def fake(ramp: Ramp, out: Path) -> None:
        arms = [a.name for a in ramp.options.config().arm_list()]
        if ramp.name == "batch":
            assert arms == ["stadium", "stadium+batch64", "stadium+batch256", "floor"]
        n = ramp.options.requests_grid[-1]
        _write(out, [{"arm": a, "n": n, "wait_s": 0.0, "rep": 0,
                      "server_cpu_us_per_step": figures[a][0],
                      "client_cpu_us_per_step": figures[a][1],
                      "rss_per_session_kb": figures[a][2], "success_rate": 1.0}
                     for a in arms])  # fmt: skip

    run_goals(tmp_path, only=["batch", "idle_rss"], run_ramp=fake)
    results = {r["key"]: r for r in json.loads((tmp_path / "goals.json").read_text())}
    step = results["batch_step"]
    assert step["values"] == {"stadium": 3.0, "floor": 14.0, "openenv": None}
    assert step["baseline"] == {"stadium": 13.0}
    assert step["met"] is True  # 3 <= 0.25 x 14
    assert results["batch256_step"]["values"]["stadium"] == 2.0
    assert results["batch_client"]["values"]["stadium"] == 1.5
    assert results["batch_client"]["met"] is None
    rss = results["batch_rss"]
    assert rss["values"]["stadium"] == pytest.approx(4.0 * 1.024)
    assert rss["baseline"]["stadium"] == pytest.approx(10.0 * 1.024)
    assert rss["met"] is True
    assert results["idle_rss"]["values"]["stadium"] == pytest.approx(10.0 * 1.024)  # one frame
    text = (tmp_path / "goals.md").read_text()
    assert "| 3 (13 one frame) | 14 | — | 0.21 | — | yes |" in text
    assert "--batch 64,256" in text
    assert [g.key for g in GOALS if g.ramps == ("batch",)] == [
        "batch_step", "batch256_step", "batch_client"]  # fmt: skip


def test_goal_missed_when_the_batch_costs_more_than_a_quarter(tmp_path: Path) -> None:
    def fake(ramp: Ramp, out: Path) -> None:
        rows = [("stadium", 13.0), ("stadium+batch64", 5.0), ("stadium+batch256", 4.0),
                ("floor", 14.0)]  # fmt: skip
        _write(out, [{"arm": a, "n": 256, "wait_s": 0.0, "rep": 0,
                      "server_cpu_us_per_step": v} for a, v in rows])  # fmt: skip

    run_goals(tmp_path, only=["batch"], arms=["stadium", "floor"], run_ramp=fake)
    results = {r["key"]: r for r in json.loads((tmp_path / "goals.json").read_text())}
    assert results["batch_step"]["met"] is False  # 5 > 3.5
    assert results["batch256_step"]["met"] is False  # 4 > 3.5
    assert "**no**" in (tmp_path / "goals.md").read_text()


# ------------------------------------------------------------------ real runs


@pytest.mark.slow
def test_the_floor_refuses_batches(tmp_path: Path) -> None:
    import signal
    import subprocess
    import sys

    port = free_port()
    proc = subprocess.Popen([sys.executable, str(FLOOR_SCRIPT), "--port", str(port)],
                            stdout=subprocess.DEVNULL)  # fmt: skip
    try:
        wait_healthy(port, proc, 30.0)
        result = load(LoadSpec(url=f"ws://127.0.0.1:{port}/ws", sessions=6, batch=4, wait_s=0.0))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=10)
    assert [r.index for r in result.records] == list(range(6))
    assert {r.error for r in result.records} == {ErrorKind.PROTOCOL.value}
    assert all("did not pick the stadium.batch" in r.detail for r in result.records)
    assert result.cpu_s is not None


def _serves_batches() -> bool:
    return importlib.util.find_spec("stadium._server.http.batch_socket") is not None


@pytest.mark.slow
@pytest.mark.skipif(not _serves_batches(), reason="this server has no batch connections yet")
def test_batched_load_against_stadium() -> None:
    with spawn_server("benchmark", "--log-level", "warning") as (_, url):
        ws = url.replace("http://", "ws://") + "/ws"
        spec = LoadSpec(url=ws, sessions=10, batch=4, steps=30, wait_s=0.0, state_kb=1)
        result = load(spec)
    records = result.records
    assert [r.index for r in records] == list(range(10))
    assert all(r.ok for r in records), [r.detail for r in records if not r.ok]
    assert all(len(r.step_s) == 30 for r in records)  # 3 connections: 4 + 4 + 2 sessions
    assert all(r.connect_s is not None and r.reset_s is not None for r in records)
    assert len({r.session_hash for r in records}) == 10  # a session, an env each
    assert result.procs == 1
    assert result.cpu_s is not None  # measured (10 ms ticks: a load this short may read 0)


@pytest.mark.slow
@pytest.mark.skipif(not _serves_batches(), reason="this server has no batch connections yet")
def test_batched_arm_side_by_side(tmp_path: Path) -> None:
    run_ramp(["stadium", "stadium+batch8", "floor"], [16], [0.0], reps=1, output_dir=tmp_path,
             steps=20, **TINY)  # fmt: skip
    rows = {r["arm"]: r for r in report.read_summary(tmp_path / "summary.csv")}
    assert set(rows) == {"stadium", "stadium+batch8", "floor"}
    for arm, row in rows.items():
        assert row["success_rate"] == 1.0, (arm, row["failures"])
        assert row["steps_per_s"] > 0
        assert row["server_cpu_us_per_step"] is not None
        assert row["client_cpu_us_per_step"] is not None
    assert (rows["stadium+batch8"]["batch"], rows["stadium"]["batch"]) == (8, 0)
    raw = [json.loads(x) for x in (tmp_path / "raw.jsonl").read_text().splitlines()]
    batched = [r for r in raw if r["arm"] == "stadium+batch8"]
    assert len(batched) == 16
    assert sum(len(r["step_s"]) for r in batched) == 16 * 20
    assert "stadium+batch8: 8" in (tmp_path / "report.md").read_text()

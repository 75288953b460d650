"""The goals table: evaluated from ramp summaries (written here by a fake runner)."""

from __future__ import annotations

import csv
import json
import shlex
from pathlib import Path

import pytest
from click.testing import CliRunner

from stadium.bench.bench_commands import bench
from stadium.bench.goals import GOALS, RAMPS, Ramp, run_goals
from stadium.bench.results import columns

# arm -> (cpu us/step, cpu ms/session, total p99 ms, rss KiB/session, threads, success)
FIGURES = {
    "stadium": (9.0, 0.15, 2400.0, 12.0, 1, 1.0),
    "floor": (11.0, 0.14, 2300.0, 28.0, 1, 1.0),
    "openenv": (40.0, 1.2, 24000.0, 55.0, 8200, 0.99),
}


def _fake_ramp(ramp: Ramp, out: Path) -> None:
    """Write the summary.csv the ramp would: one row per arm and N of its grid."""
    arms, grid = ramp.options.arms, ramp.options.requests_grid
    out.mkdir(parents=True)
    with (out / "summary.csv").open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=columns())
        w.writeheader()
        for arm in arms:
            step, sess, p99, rss, threads, ok = FIGURES[arm]
            for n in grid:
                w.writerow({
                    "arm": arm, "n": n, "wait_s": 1.0, "rep": 0,
                    "server_cpu_us_per_step": step, "server_cpu_ms_per_session": sess,
                    "total_p99_ms": p99, "rss_per_session_kb": rss,
                    "server_peak_threads": threads if arm != "openenv" else min(n, threads),
                    "success_rate": ok,
                })  # fmt: skip


def test_goals_table_from_summaries(tmp_path: Path) -> None:
    seen: list[str] = []

    def runner(ramp: Ramp, out: Path) -> None:
        seen.append(ramp.name)
        _fake_ramp(ramp, out)

    md = run_goals(tmp_path, run_ramp=runner)
    assert seen == list(RAMPS)
    text = md.read_text()
    results = {r["key"]: r for r in json.loads((tmp_path / "goals.json").read_text())}
    assert [g.key for g in GOALS] == list(results)
    assert results["per_step"]["values"] == {"stadium": 9.0, "floor": 11.0, "openenv": 40.0}
    assert results["per_step"]["met"] is True  # 9 <= 20 and 9 <= 1.5 * 11
    assert results["lifecycle"]["met"] is True
    assert results["p99_8192"]["values"]["stadium"] == 2.4
    assert results["p99_8192"]["met"] is True
    assert results["idle_rss"]["values"]["stadium"] == pytest.approx(12.0 * 1.024)
    # the burst rows read OpenEnv from its own ramp at N = 8,192
    assert results["burst_p99"]["n"] == {"stadium": 32768, "floor": 32768, "openenv": 8192}
    assert results["burst_success"]["met"] is True
    assert results["threads"]["met"] is True  # 1 thread at 512 and at 8,192
    assert results["threads"]["baseline"] == {"stadium": 1.0, "floor": 1.0, "openenv": 512.0}
    assert "| 9 | 11 | 40 | 0.82 | 4.44 | yes |" in text
    assert "(N = 8,192)" in text
    # every command in the report is a runnable ramp command
    for name in RAMPS:
        line = next(x for x in text.splitlines() if x.startswith(f"- `{name}`"))
        cmd = shlex.split(line.split("`: `")[1].rstrip("`"))
        assert cmd[:3] == ["stadium", "bench", "ramp"]
        assert cmd[-2:] == ["--output-dir", str(tmp_path / name)]


def test_goal_missed_and_arms_dropped(tmp_path: Path) -> None:
    def slow(ramp: Ramp, out: Path) -> None:
        _fake_ramp(ramp, out)
        rows = list(csv.DictReader((out / "summary.csv").read_text().splitlines()))
        for r in rows:
            if r["arm"] == "stadium":
                r["server_cpu_us_per_step"] = "17.0"  # <= 20 us but > 1.5 x floor
                if r["n"] == "8192":
                    r["server_peak_threads"] = "9"  # 1 at N = 512: not flat
        with (out / "summary.csv").open("w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=columns())
            w.writeheader()
            w.writerows(rows)

    run_goals(tmp_path, only=["per_step", "p99_8192"], arms=["stadium", "floor"], run_ramp=slow)
    results = {r["key"]: r for r in json.loads((tmp_path / "goals.json").read_text())}
    assert results["per_step"]["met"] is False
    assert results["threads"]["met"] is False
    assert results["per_step"]["values"]["openenv"] is None
    assert results["lifecycle"]["met"] is None  # not run
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["p99_8192", "per_step"]
    assert "**no**" in (tmp_path / "goals.md").read_text()


def test_cli_rejects_unknown_ramp(tmp_path: Path) -> None:
    result = CliRunner().invoke(bench, ["goals", "--only", "nope", "--output-dir", str(tmp_path)])
    assert result.exit_code == 2
    assert "unknown ramp 'nope'" in result.output
    assert "per_step" in result.output

"""``stadium bench soak``: a short real soak of a Stadium server, and the tally's arithmetic.

No timing thresholds: counts, the rows' shape and the files written.
"""

from __future__ import annotations

import csv
import itertools
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from stadium.bench.bench_commands import bench
from stadium.bench.procstat import count_fds, tree_figures
from stadium.bench.results import SessionResult
from stadium.bench.sessions import SoakTally
from stadium.bench.soak import SoakRow, summarize

#: Process-level: servers, tools or interpreters in subprocesses (`make check` skips it).
pytestmark = pytest.mark.slow


def test_tally_counts_failed_steps_not_failed_connects() -> None:
    tally = SoakTally()
    tally.add(SessionResult(index=0, ok=True, reset_s=0.1, step_s=[0.1, 0.2]), 2)
    tally.add(SessionResult(index=1, error="refused"), 2)  # never got a session
    tally.add(SessionResult(index=2, error="disconnected", reset_s=0.1, step_s=[0.1]), 2)
    tally.add(SessionResult(index=3, error="timeout", reset_s=0.1, step_s=[0.1, 0.1]), 2)  # close
    assert (tally.sessions_ok, tally.sessions_failed) == (1, 3)
    assert (tally.steps_ok, tally.steps_failed) == (5, 1)
    assert tally.errors == {"refused": 1, "disconnected": 1, "timeout": 1}
    assert len(tally.take_sample()) == 5
    assert tally.take_sample() == []


def test_summary_compares_the_first_row_under_load_with_the_last() -> None:
    def row(t: float, rss: float, fds: int, steps: int) -> SoakRow:
        return SoakRow(t, rss, fds, 1, 1, 0.0, 0, 0, steps, 0, None, None, {})

    summary = summarize([row(0, 30.0, 10, 0), row(1, 40.0, 50, 100), row(2, 41.5, 50, 200)])
    assert summary["rss_growth_mib"] == 1.5
    assert summary["fds_growth"] == 0
    assert summary["steps_ok"] == 200


def test_tree_figures_of_this_process() -> None:
    import os

    figures = tree_figures(os.getpid())
    assert figures.procs >= 1
    assert figures.fds == count_fds(os.getpid()) or figures.procs > 1
    assert figures.rss_bytes > 0
    assert figures.threads >= 1


def test_soak_command_against_a_started_server(tmp_path: Path) -> None:
    out = tmp_path / "soak"
    result = CliRunner().invoke(
        bench,
        ["soak", "--sessions", "8", "--duration", "2", "--interval", "0.5", "--steps", "5",
         "--output-dir", str(out)],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    doc = json.loads((out / "soak.json").read_text())
    rows = doc["rows"]
    assert len(rows) >= 4  # before the load, every 0.5 s, and at the end
    assert all(r["rss_mib"] > 0 and r["fds"] > 0 and r["threads"] >= 1 for r in rows)
    last = rows[-1]
    assert last["steps_failed"] == 0
    assert last["sessions_failed"] == 0
    assert last["steps_ok"] == 5 * last["sessions_ok"] > 0
    # Counts never go down from one row to the next.
    assert all(a["steps_ok"] <= b["steps_ok"] for a, b in itertools.pairwise(rows))
    assert doc["summary"]["steps_ok"] == last["steps_ok"]
    with (out / "soak.csv").open() as f:
        assert len(list(csv.DictReader(f))) == len(rows)
    assert (out / "soak.png").stat().st_size > 0
    assert "failed steps=0" in result.output


def test_soak_exits_nonzero_when_steps_fail(tmp_path: Path) -> None:
    # Nothing listens there: every session fails to connect.
    result = CliRunner().invoke(
        bench,
        ["soak", "--url", "http://127.0.0.1:9", "--sessions", "2", "--duration", "1",
         "--interval", "0.5", "--output-dir", str(tmp_path)],
    )  # fmt: skip
    assert result.exit_code != 0
    summary = json.loads((tmp_path / "soak.json").read_text())["summary"]
    assert summary["sessions_failed"] > 0
    assert summary["sessions_ok"] == 0
    assert summary["errors"].get("refused", 0) > 0


def test_soak_of_a_server_that_requires_a_token(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The started server reads the token from the same variable the load generator sends.
    monkeypatch.setenv("STADIUM_AUTH_TOKEN", "soak-token-0123456789abcdef")
    result = CliRunner().invoke(
        bench,
        ["soak", "--sessions", "2", "--duration", "1", "--interval", "0.5", "--steps", "3",
         "--mode", "http", "--output-dir", str(tmp_path)],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "soak.json").read_text())["summary"]
    assert summary["sessions_ok"] > 0
    assert summary["sessions_failed"] == 0

"""``stadium bench start``: a short real run (in-process and process isolation, warm and
cold), its files and table; an unknown isolation level is a usage error.

No timing thresholds: the rows, their patterns and the files written.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from stadium.bench.bench_commands import bench
from stadium.bench.start import PATTERNS

#: Process-level: servers in subprocesses (`make check` skips it).
pytestmark = pytest.mark.slow


def test_start_times_each_level_and_pattern(tmp_path: Path) -> None:
    out = tmp_path / "start"
    result = CliRunner().invoke(
        bench,
        ["start", "echo", "--isolation", "none,process", "--warm-pool", "2", "--sessions", "3",
         "--rate", "100", "--output-dir", str(out)],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    data = json.loads((out / "start.json").read_text())
    rows = [(r["isolation"], r["warm_pool"]) for r in data["rows"]]
    assert rows == [("none", 0), ("process", 2), ("process", 0)]
    for row in data["rows"]:
        for pattern in PATTERNS:
            figures = row[pattern]
            assert 0 < figures["p50_ms"] <= figures["p99_ms"] <= figures["max_ms"]
    table = (out / "start.md").read_text()
    assert "| process | warm (pool 2) |" in table
    assert "| process | cold |" in table
    assert table in result.output


def test_an_unknown_isolation_level_is_a_usage_error(tmp_path: Path) -> None:
    result = CliRunner().invoke(bench, ["start", "--isolation", "gvisor", "--output-dir",
                                        str(tmp_path)])  # fmt: skip
    assert result.exit_code == 2
    assert "use none, process or sandbox" in result.output
    assert not (tmp_path / "start.json").exists()

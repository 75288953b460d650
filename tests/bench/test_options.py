"""Typed ramp options: rendered to a command line, parsed back by the click command."""

from __future__ import annotations

import ast
import csv
import dataclasses
import shlex
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from stadium.bench import grid
from stadium.bench.bench_commands import bench, ramp
from stadium.bench.bench_options import RampOptions
from stadium.bench.goals import RAMPS, run_goals
from stadium.bench.results import columns

EVERYTHING = RampOptions(
    arms=("url", "floor", "openenv"), url="ws://127.0.0.1:9/ws", server_pid=42,
    git_ref="HEAD~1", no_stop=True, requests_grid=(3, 1_000_000),
    wait_grid=(0.0, 0.25, 1e-7, 10.0), steps=7, think_ms=1.5, think_tokens=3,
    think_token_ms=0.1, state_kb=64, reps=2, mode="http", batch=(64, 256), cpus=(0, 1),
    load_cpus=(1,),
    pin=True, mem=3 << 30, load_procs=2, connect_window=5, server_workers=2,
    max_sessions=99, serve_args=("--tenants=/tmp/t.toml", "--log-level", "info"),
    timeout=0.5, deadline=60.0, cache_dir=Path("/tmp/cache"),
    progress=False, output_dir=Path("/tmp/out"),
)  # fmt: skip
"""Every option away from its default."""

SAMPLES = {"defaults": RampOptions(), "everything": EVERYTHING}
SAMPLES.update({f"goal {name}": r.options for name, r in RAMPS.items()})


def _parse(argv: list[str]) -> RampOptions:
    """What ``stadium bench ramp ARGV`` parses to (nothing runs)."""
    ctx = ramp.make_context("ramp", list(argv))
    return RampOptions.from_cli(**ctx.params)


def test_the_sample_sets_every_option() -> None:
    for f in dataclasses.fields(RampOptions):
        assert getattr(EVERYTHING, f.name) != f.default, f.name


@pytest.mark.parametrize("options", SAMPLES.values(), ids=SAMPLES.keys())
def test_argv_parses_back_to_the_same_options(options: RampOptions) -> None:
    assert _parse(options.argv()) == options
    cmd = shlex.split(options.command())
    assert cmd[:3] == ["stadium", "bench", "ramp"]
    assert _parse(cmd[3:]) == options


def test_defaults_are_left_out_but_for_what_defines_the_points() -> None:
    points = ["--arm", "stadium", "--arm", "floor", "--requests-grid", "32,128,512,2048",
              "--wait-grid", "1", "--steps", "1", "--reps", "3"]  # fmt: skip
    assert RampOptions().argv() == points
    assert RampOptions(progress=False, mem=1 << 30).argv() == [
        *points,
        "--mem",
        "1073741824",
        "--no-progress",
    ]


@pytest.mark.parametrize("options", SAMPLES.values(), ids=SAMPLES.keys())
def test_the_ramp_command_runs_the_config_of_its_options(
    options: RampOptions, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    options = dataclasses.replace(options, output_dir=tmp_path)
    seen: list[grid.BenchConfig] = []

    def fake_run(config: grid.BenchConfig) -> Path:
        seen.append(config)
        return tmp_path / "report.md"

    monkeypatch.setattr(grid, "run", fake_run)
    result = CliRunner().invoke(bench, ["ramp", *options.argv()])
    assert result.exit_code == 0, result.output
    assert seen == [options.config()]


def test_goals_run_each_ramp_in_process_with_its_command(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    seen: list[grid.BenchConfig] = []

    def fake_run(config: grid.BenchConfig) -> Path:
        seen.append(config)
        config.output_dir.mkdir(parents=True)
        with (config.output_dir / "summary.csv").open("w", newline="") as fh:
            csv.DictWriter(fh, fieldnames=columns()).writeheader()
        return config.output_dir / "report.md"

    monkeypatch.setattr(grid, "run", fake_run)
    run_goals(tmp_path, only=["per_step", "burst_openenv"], arms=["stadium", "openenv"])
    per_step = dataclasses.replace(
        RAMPS["per_step"].options, arms=("stadium", "openenv"), output_dir=tmp_path / "per_step"
    )
    burst = dataclasses.replace(
        RAMPS["burst_openenv"].options, output_dir=tmp_path / "burst_openenv"
    )
    expected: list[Any] = []
    for options in (per_step, burst):
        config = options.config()
        config.command = options.command()
        expected.append(config)
    assert seen == expected
    md = (tmp_path / "goals.md").read_text()
    assert f"`{per_step.command()}`" in md


def test_goals_command_runs_the_ramps_it_is_given(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    seen: list[list[str]] = []

    def fake_run(config: grid.BenchConfig) -> Path:
        seen.append([a.name for a in config.arm_list()])
        config.output_dir.mkdir(parents=True)
        with (config.output_dir / "summary.csv").open("w", newline="") as fh:
            csv.DictWriter(fh, fieldnames=columns()).writeheader()
        return config.output_dir / "report.md"

    monkeypatch.setattr(grid, "run", fake_run)
    args = ["goals", "--only", "per_step", "--only", "burst_32768", "--arm", "floor",
            "--output-dir", str(tmp_path)]  # fmt: skip
    result = CliRunner().invoke(bench, args)
    assert result.exit_code == 0, result.output
    assert seen == [["floor"], ["floor"]]
    assert f"report: {tmp_path / 'per_step' / 'report.md'}" in result.output
    assert f"goals: {tmp_path / 'goals.md'}" in result.output
    assert "# Stadium performance goals" in result.output


def test_no_bench_module_imports_the_command_line() -> None:
    """The command line imports the harness, never the other way round."""
    bench_dir = Path(grid.__file__).parent
    for path in bench_dir.glob("*.py"):
        if path.name == "bench_commands.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.ImportFrom):
                names = [f"{node.module}.{a.name}" for a in node.names] + [str(node.module)]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            assert not any(n.startswith("stadium.bench.bench_commands") for n in names), path.name


def test_serve_args_reach_each_stadium_server_and_tenants_take_no_server_token() -> None:
    from stadium.bench.arms import Arm, ServerSettings, server_command

    settings = ServerSettings(serve_args=("--tenants=/tmp/t.toml",))
    cmd, env = server_command(Arm.parse("stadium"), 9, settings)
    assert cmd[-1] == "--tenants=/tmp/t.toml"
    assert env["STADIUM_AUTH_TOKEN"] == ""  # unset: the token is the clients'
    cmd, env = server_command(Arm.parse("stadium"), 9, ServerSettings(serve_args=("-v",)))
    assert cmd[-1] == "-v"
    assert "STADIUM_AUTH_TOKEN" not in env
    floor, _ = server_command(Arm.parse("floor"), 9, settings)
    assert "--tenants=/tmp/t.toml" not in floor

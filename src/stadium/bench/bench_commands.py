"""``stadium bench``: the command line of the benchmark harness.

* ``stadium bench --url http://HOST:PORT [--url ...] [grid options]`` — the
  OpenEnv scaling study against a running server (or several endpoints, the
  sessions spread over them): every point of the grid. A bad URL is a usage
  error before any point runs; a run where no point held exits non-zero.
* ``stadium bench ramp --arm stadium --arm floor [--arm openenv ...]`` — start
  each arm's server per point, ramp N until each arm collapses.
* ``stadium bench compare DIR_A DIR_B`` — two result sets side by side;
  ``stadium bench compare --git-ref REF [grid options]`` benches Stadium at
  REF (a temporary worktree) against the working tree and compares them.
* ``stadium bench goals [--only RAMP] [--arm ARM]`` — every performance goal,
  one ramp each, tabled in ``goals.md`` (:mod:`stadium.bench.goals`).
* ``stadium bench soak [TARGET] --sessions N --duration S`` — hold a load, watch
  RSS, fds, threads and failed steps over time (:mod:`stadium.bench.soak`).
* ``stadium bench rl [--preset openenv-stress] --arm stadium --arm floor --arm openenv``
  — one RL step of agent episodes (bounded concurrent resets, seeded random turns and
  think times), per-turn server overhead side by side (:mod:`stadium.bench.rl`).
* ``stadium bench start [TARGET] [--isolation none,process,sandbox]`` — time to first
  observation (connect → first ``reset`` observation), warm pool and cold, sequential,
  staggered and burst, p50/p99 (:mod:`stadium.bench.start`).
* ``stadium bench ops [--target benchmark] [--steps N]`` — calls per step and
  per session lifecycle, counted in-process (deterministic; the CI check).

The options shared by the grid commands, and their defaults, are typed values
of :mod:`stadium.bench.bench_options`; each command builds one from what it parsed.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from stadium._errors import ConfigError
from stadium.bench.arms import Arm
from stadium.bench.bench_options import GridOptions, RampOptions
from stadium.bench.goals import ARMS as GOAL_ARMS
from stadium.bench.goals import RAMPS, Ramp, run_goals, run_in_process

if TYPE_CHECKING:
    from stadium.bench.grid import BenchConfig

_D = RampOptions()
"""Every option's default (one home: :mod:`stadium.bench.bench_options`)."""


def _ints(ctx: click.Context, param: click.Parameter, value: str) -> list[int]:
    try:
        out = [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"expected integers separated by commas: {value!r}") from None
    if not out or any(x <= 0 for x in out):
        raise click.BadParameter("expected positive integers")
    return out


def _sizes(ctx: click.Context, param: click.Parameter, value: str) -> list[int]:
    """Like ``_ints``, but empty is allowed (none)."""
    return _ints(ctx, param, value) if value.strip() else []


def _floats(ctx: click.Context, param: click.Parameter, value: str) -> list[float]:
    try:
        out = [float(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"expected numbers separated by commas: {value!r}") from None
    if not out or any(x < 0 for x in out):
        raise click.BadParameter("expected non-negative numbers")
    return out


_OPTIONS: list[Callable[[Any], Any]] = [
    click.option(
        "--requests-grid",
        default=",".join(map(str, _D.requests_grid)),
        show_default=True,
        callback=_ints,
        help="Batch sizes N (concurrent sessions per burst).",
    ),
    click.option(
        "--wait-grid",
        default=",".join(map(str, _D.wait_grid)),
        show_default=True,
        callback=_floats,
        help="Seconds each step waits on the server (W).",
    ),
    click.option(
        "--reps",
        default=_D.reps,
        show_default=True,
        type=click.IntRange(1, 100),
        help="Repetitions of each point.",
    ),
    click.option(
        "--mode",
        type=click.Choice(["ws", "http"]),
        default=_D.mode,
        show_default=True,
        help="WebSocket sessions, or HTTP POST /reset + /step.",
    ),
    click.option(
        "--batch",
        default="",
        callback=_sizes,
        help="Also run each stadium (and url) arm with this many sessions per connection, "
        "stepped with one batch frame per round (e.g. 64,256: arms stadium+batch64, "
        "stadium+batch256). Stadium servers only.",
    ),
    click.option(
        "--output-dir",
        type=click.Path(path_type=Path),
        default=None,
        help="Where results go [default: bench-results/<timestamp>].",
    ),
    click.option(
        "--steps",
        default=_D.steps,
        show_default=True,
        type=click.IntRange(1, 100_000),
        help="Steps per session.",
    ),
    click.option(
        "--think-ms",
        default=_D.think_ms,
        show_default=True,
        type=click.FloatRange(0),
        help="Think time before each step (the LLM's time to first token), ms.",
    ),
    click.option(
        "--think-tokens",
        default=_D.think_tokens,
        show_default=True,
        type=click.IntRange(0),
        help="Tokens the agent generates before each step.",
    ),
    click.option(
        "--think-token-ms",
        default=_D.think_token_ms,
        show_default=True,
        type=click.FloatRange(0),
        help="Milliseconds per generated token.",
    ),
    click.option(
        "--state-kb",
        default=_D.state_kb,
        show_default=True,
        type=click.IntRange(0),
        help="Per-session state the benchmark env holds (reset option state_kb).",
    ),
    click.option("--cpus", default=None, help="Server CPUs, e.g. 0 or 0-1 (sched_setaffinity)."),
    click.option("--load-cpus", default=None, help="Load generator CPUs, e.g. 1."),
    click.option(
        "--pin", is_flag=True, help="Server on the first half of the CPUs, load on the rest."
    ),
    click.option("--mem", default=None, help="Server memory cap, e.g. 2G (cgroup, else rlimit)."),
    click.option(
        "--load-procs",
        default=_D.load_procs,
        show_default=True,
        type=click.IntRange(0),
        help="Load generator processes (0: automatic).",
    ),
    click.option(
        "--connect-window",
        default=_D.connect_window,
        show_default=True,
        type=click.IntRange(0),
        help="At most this many sessions connecting at once (0: all at the burst's "
        "instant). Waiting for the window counts in connect and total latency.",
    ),
    click.option(
        "--server-workers",
        default=_D.server_workers,
        show_default=True,
        type=click.IntRange(1),
        help="Worker processes of each started server.",
    ),
    click.option(
        "--max-sessions",
        default=_D.max_sessions,
        type=click.IntRange(0),
        help="Server session cap (0: twice the largest N, at least 100,000).",
    ),
    click.option(
        "--serve-arg",
        "serve_args",
        multiple=True,
        metavar="ARG",
        help="An extra argument of each started Stadium server (repeat it), e.g. "
        "--serve-arg=--tenants=FILE. Clients send STADIUM_AUTH_TOKEN as their bearer token; "
        "with --tenants among these the servers do not take it as theirs.",
    ),
    click.option(
        "--timeout",
        default=_D.timeout,
        show_default=True,
        type=click.FloatRange(0.1),
        help="Timeout of each phase beyond the step's wait, seconds.",
    ),
    click.option(
        "--deadline",
        default=_D.deadline,
        show_default=True,
        type=click.FloatRange(1),
        help="Hard deadline of the whole run, seconds.",
    ),
    click.option(
        "--cache-dir",
        type=click.Path(path_type=Path),
        default=None,
        help="Cache for the openenv venv and worktrees [~/.cache/stadium-bench].",
    ),
    click.option("--progress/--no-progress", default=_D.progress, help="Live progress and tables."),
]


def _grid_options(fn: Any) -> Any:
    for opt in reversed(_OPTIONS):
        fn = opt(fn)
    return fn


def _run(config: BenchConfig) -> Path:
    """Run ``config``; print the report's path. Exits non-zero (after writing the
    report) when every arm's max batch is 0: the run served nothing."""
    from stadium.bench import report
    from stadium.bench.grid import run

    path = run(config)
    click.echo(f"report: {path}")
    summary = path.parent / "summary.csv"
    rows = report.read_summary(summary) if summary.exists() else []
    if rows and not any(report.max_batches(rows).values()):
        raise click.ClickException(
            "no arm held any batch (max batch 0 everywhere): "
            + "; ".join(report.failure_lines(rows))
            + f" — see {summary.parent / 'raw.jsonl'}"
        )
    return path


@click.group(invoke_without_command=True)
@click.option("--url", "urls", multiple=True, metavar="URL",
              help="A running server: http://HOST:PORT, ws://HOST:PORT[/ws], HOST:PORT, "
              "https/wss. Repeat it (or separate by commas), or give a deployment file, "
              "to spread each point's sessions over several endpoints.")  # fmt: skip
@click.option("--server-pid", "server_pids", multiple=True, type=int,
              help="PID of that server, for server-side figures from /proc "
              "(repeatable: one per endpoint).")  # fmt: skip
@click.option("--stop-at-collapse", is_flag=True, help="Stop at the first N below 95 %.")
@_grid_options
@click.pass_context
def bench(
    ctx: click.Context,
    /,
    urls: tuple[str, ...],
    server_pids: tuple[int, ...],
    stop_at_collapse: bool,
    **o: Any,
) -> None:
    """Benchmark an environment server: bursts of N sessions (connect, reset,
    steps that wait W seconds, close) over a grid of N and W.

    Without a subcommand, runs the grid against --url (several: the sessions
    are spread over them by their free capacity). Exits non-zero when no point
    held (max batch 0). See `ramp` to start and compare servers (stadium,
    floor, openenv), `compare` for two result sets.
    """
    if ctx.invoked_subcommand is not None:
        return
    if not urls:
        click.echo(ctx.get_help())
        raise click.UsageError("give --url http://HOST:PORT, or a subcommand (ramp, compare)")
    try:
        arm = Arm.remote(urls, server_pids)
    except ConfigError as exc:
        raise click.BadParameter(exc.message, param_hint="--url") from None
    _run(GridOptions.from_cli(**o).bench_config([arm], stop_at_collapse))


@bench.command()
@click.option("--arm", "arms", multiple=True, default=_D.arms, show_default=True,
              help="stadium, stadium@REF, floor, openenv, url (repeatable); "
              "stadium+batchB, url+batchB: B sessions per connection.")  # fmt: skip
@click.option("--url", default=None,
              help="For the url arm: http://HOST:PORT or ws://HOST:PORT/ws "
              "(commas: several).")  # fmt: skip
@click.option("--server-pid", default=None, type=int, help="For the url arm: its PID.")
@click.option("--git-ref", default=None, help="Also bench Stadium at this git ref.")
@click.option("--no-stop", is_flag=True, help="Run the whole grid even past a collapse.")
@_grid_options
def ramp(**o: Any) -> None:
    """Start each arm's server (fresh per point, capped) and ramp N until it collapses.

    Prints the knee (max batch) per arm and writes raw.jsonl, summary.csv,
    figures and report.md to --output-dir.
    """
    _run(RampOptions.from_cli(**o).config())


@bench.command(name="compare")
@click.argument("dirs", nargs=-1, type=click.Path(exists=True, path_type=Path))
@click.option("--git-ref", default=None,
              help="Bench Stadium at REF against the working tree, then compare.")  # fmt: skip
@_grid_options
def compare_cmd(dirs: tuple[Path, ...], git_ref: str | None, **o: Any) -> None:
    """Compare two result directories DIR_A DIR_B (ratios B/A), or --git-ref REF."""
    from stadium.bench.compare import compare, compare_arms

    if git_ref:
        if dirs:
            raise click.UsageError("give either DIR_A DIR_B or --git-ref, not both")
        arms = [Arm.parse(f"stadium@{git_ref}"), Arm.parse("stadium")]
        path = _run(GridOptions.from_cli(**o).bench_config(arms, True))
        md = compare_arms(path.parent, f"stadium@{git_ref}", "stadium")
    else:
        if len(dirs) != 2:
            raise click.UsageError("compare needs two result directories: DIR_A DIR_B")
        md = compare(dirs[0], dirs[1])
    click.echo(f"comparison: {md}")


@bench.command()
@click.option("--output-dir", type=click.Path(path_type=Path), default=None,
              help="Where results go [default: bench-results/goals-<timestamp>].")  # fmt: skip
@click.option("--only", multiple=True, metavar="RAMP",
              help=f"Run only this ramp (repeatable): {', '.join(RAMPS)}.")  # fmt: skip
@click.option("--arm", "arm_names", multiple=True, default=GOAL_ARMS,
              show_default=True, help="Arms to keep in every ramp.")  # fmt: skip
def goals(output_dir: Path | None, only: tuple[str, ...], arm_names: tuple[str, ...]) -> None:
    """Measure every performance goal with stadium, floor and openenv side by side.

    Runs one `stadium bench ramp` per goal (~10 minutes on 2 cores), then
    writes goals.md: each goal, the three arms side by side, their ratios,
    met or not, and the command that reproduces each row.
    """
    unknown = [o for o in only if o not in RAMPS]
    if unknown:
        raise click.BadParameter(
            f"unknown ramp {unknown[0]!r}; choose from {', '.join(RAMPS)}", param_hint="--only"
        )
    out = output_dir or Path("bench-results") / time.strftime("goals-%Y%m%d-%H%M%S")

    def run_ramp(ramp: Ramp, ramp_dir: Path) -> None:
        click.echo(f"report: {run_in_process(ramp, ramp_dir)}")

    path = run_goals(out, only=only, arms=arm_names, run_ramp=run_ramp)
    click.echo(path.read_text())
    click.echo(f"goals: {path}")


@bench.command()
@click.option("--target", default="benchmark", show_default=True, help="Environment to serve.")
@click.option("--steps", default=1000, show_default=True, type=click.IntRange(1, 1_000_000),
              help="Steady-state steps to count.")  # fmt: skip
@click.option("--sessions", default=4, show_default=True, type=click.IntRange(1, 10_000),
              help="Sessions open (steps go round-robin); also lifecycles counted.")  # fmt: skip
@click.option("--action", default=None,
              help='Step data as JSON [benchmark: {"wait_seconds":0}, else {}].')  # fmt: skip
def ops(target: str, steps: int, sessions: int, action: str | None) -> None:
    """Count Python and C calls per step and per session lifecycle, without sockets.

    Deterministic (no clocks): the regression check CI runs. See BENCHMARKS.md.
    """
    from stadium.bench.opcount import count_ops

    try:
        data = json.loads(action) if action is not None else None
    except json.JSONDecodeError as exc:
        raise click.BadParameter(f"not JSON: {exc}", param_hint="--action") from None
    if data is not None and not isinstance(data, dict):
        raise click.BadParameter("expected a JSON object", param_hint="--action")
    result = count_ops(target, steps, sessions, action=data)
    for line in result.lines():
        click.echo(line)
    if result.errors or result.replies < steps:
        raise click.ClickException("some requests failed: the counts are not of the normal path")


@bench.command()
@click.argument("target", default="benchmark")
@click.option("--url", default=None, help="Soak a running server instead: ws://HOST:PORT/ws.")
@click.option("--server-pid", default=None, type=int,
              help="PID of that server, for RSS/fds/threads from /proc.")  # fmt: skip
@click.option("--server-workers", default=1, show_default=True, type=click.IntRange(1, 256),
              help="Worker processes of the server started for TARGET.")  # fmt: skip
@click.option("--sessions", default=100, show_default=True, type=click.IntRange(1, 100_000),
              help="Session slots kept busy (each opens sessions one after another).")  # fmt: skip
@click.option("--duration", default=60.0, show_default=True, type=click.FloatRange(1),
              help="Seconds to hold the load.")  # fmt: skip
@click.option("--interval", default=5.0, show_default=True, type=click.FloatRange(0.2),
              help="Seconds between two rows.")  # fmt: skip
@click.option("--steps", default=100, show_default=True, type=click.IntRange(1, 1_000_000),
              help="Steps per session.")  # fmt: skip
@click.option("--wait", default=0.0, show_default=True, type=click.FloatRange(0),
              help="Seconds each step waits on the server (benchmark env).")  # fmt: skip
@click.option("--mode", type=click.Choice(["ws", "http"]), default="ws", show_default=True,
              help="WebSocket sessions, or HTTP POST /reset + /step.")  # fmt: skip
@click.option("--load-procs", default=0, show_default=True, type=click.IntRange(0),
              help="Load generator processes (0: automatic).")  # fmt: skip
@click.option("--output-dir", type=click.Path(path_type=Path), default=None,
              help="Where results go [default: bench-results/soak-<timestamp>].")  # fmt: skip
def soak(target: str, url: str | None, server_pid: int | None, server_workers: int,
         sessions: int, duration: float, interval: float, steps: int, wait: float, mode: str,
         load_procs: int, output_dir: Path | None) -> None:  # fmt: skip
    """Hold a load for --duration seconds; report the server's RSS, open fds, threads
    and the failed steps every --interval seconds (soak.csv, soak.json, soak.png).

    Starts `stadium serve TARGET` (default: the benchmark env), or soaks --url.
    Exits 1 if any step or session failed.
    """
    from stadium.bench.soak import SoakOptions, run_soak

    opts = SoakOptions(
        target=target,
        url=url,
        server_pid=server_pid,
        server_workers=server_workers,
        sessions=sessions,
        duration_s=duration,
        interval_s=interval,
        steps=steps,
        wait_s=wait,
        mode=mode,
        load_procs=load_procs,
        output_dir=output_dir or Path("bench-results") / time.strftime("soak-%Y%m%d-%H%M%S"),
    )
    path, summary = run_soak(opts, echo=click.echo)
    click.echo(json.dumps(summary))
    click.echo(f"soak: {path}")
    if summary.get("steps_failed") or summary.get("sessions_failed") or "load_errors" in summary:
        raise click.ClickException("some steps or sessions failed during the soak (see above)")


@bench.command()
@click.argument("target", default="benchmark")
@click.option("--isolation", default="none,process,sandbox", show_default=True,
              help="Isolation levels, comma-separated (sandbox: skipped with the reason "
              "where it cannot run).")  # fmt: skip
@click.option("--warm-pool", default=64, show_default=True, type=click.IntRange(1, 4096),
              help="The warm pool of the warm rows (the cold rows have none).")  # fmt: skip
@click.option("--sessions", default=50, show_default=True, type=click.IntRange(1, 10_000),
              help="Sessions per pattern.")  # fmt: skip
@click.option("--rate", default=50.0, show_default=True, type=click.FloatRange(0.1, 10_000),
              help="Sessions opened per second in the staggered pattern.")  # fmt: skip
@click.option("--output-dir", type=click.Path(path_type=Path), default=None,
              help="Where start.json and start.md go [bench-results/start-<time>].")  # fmt: skip
def start(target: str, isolation: str, warm_pool: int, sessions: int, rate: float,
          output_dir: Path | None) -> None:  # fmt: skip
    """Time to first observation: connect -> first reset observation, per isolation level,
    warm pool and cold, in three patterns (sequential, staggered at --rate, a burst of
    --sessions), p50/p99 side by side in one run, as sandbox providers are compared."""
    import asyncio

    from stadium.bench.start import StartOptions, run_start

    levels = tuple(x.strip() for x in isolation.split(",") if x.strip())
    unknown = [x for x in levels if x not in ("none", "process", "sandbox")]
    if unknown or not levels:
        raise click.BadParameter(f"use none, process or sandbox (got {isolation!r})")
    opts = StartOptions(
        target=target, isolation=levels, warm_pool=warm_pool, sessions=sessions, rate=rate,
        output_dir=output_dir or Path("bench-results") / time.strftime("start-%Y%m%d-%H%M%S"),
    )  # fmt: skip
    asyncio.run(run_start(opts, echo=click.echo))
    click.echo((opts.output_dir / "start.md").read_text())
    click.echo(f"start: {opts.output_dir}")


@bench.command()
@click.option("--preset", type=click.Choice(["openenv-stress", "short"]), default="openenv-stress",
              show_default=True,
              help="The workload: openenv-stress is OpenEnv's stress test's defaults "
              "(2000 sessions, 256 concurrent resets, 3-20 turns, 1-20 s think); "
              "the options below override it.")  # fmt: skip
@click.option("--sessions", type=click.IntRange(1, 100_000), default=None, help="Sessions (envs).")
@click.option("--concurrent-resets", type=click.IntRange(1), default=None,
              help="Sessions connecting and resetting at once.")  # fmt: skip
@click.option("--turns", default=None, metavar="LOW-HIGH", help="Turns per episode (uniform).")
@click.option("--think", default=None, metavar="LOW-HIGH",
              help="Seconds of think time before each turn (uniform).")  # fmt: skip
@click.option("--tool-ms", type=click.FloatRange(0), default=None,
              help="The env's own time per turn (the benchmark env's wait), ms [0].")  # fmt: skip
@click.option("--seed", type=int, default=None, help="Seed of the turns and think times [0].")
@click.option("--arm", "arms", multiple=True, default=("stadium", "floor", "openenv"),
              show_default=True, help="Servers to run it against, in turn.")  # fmt: skip
@click.option("--url", default=None, help="For the url arm: a running server.")
@click.option("--cpus", default="0", show_default=True, help="Server CPUs (sched_setaffinity).")
@click.option("--load-cpus", default="1", show_default=True, help="This client's CPUs.")
@click.option("--output-dir", type=click.Path(path_type=Path), default=None,
              help="Where rl.json and rl.md go [bench-results/rl-<timestamp>].")  # fmt: skip
def rl(preset: str, sessions: int | None, concurrent_resets: int | None, turns: str | None,
       think: str | None, tool_ms: float | None, seed: int | None, arms: tuple[str, ...],
       url: str | None, cpus: str, load_cpus: str, output_dir: Path | None) -> None:  # fmt: skip
    """One RL step: every session connects and resets (--concurrent-resets at once),
    runs a seeded random number of turns with a seeded random think time before each,
    and closes. Reports the per-turn server overhead (reply latency minus the env's own
    time) p50/p99, connect and reset latency, sessions and turns per second per server
    core, server CPU per turn and failures, arm by arm (rl.md, rl.json)."""
    import dataclasses

    from stadium.bench.arms import parse_cpus
    from stadium.bench.rl import PRESETS, parse_range, run_rl

    changes: dict[str, Any] = {}
    if sessions is not None:
        changes["sessions"] = sessions
    if concurrent_resets is not None:
        changes["concurrent_resets"] = concurrent_resets
    if turns is not None:
        changes["turns"] = parse_range(turns, int)
    if think is not None:
        changes["think_s"] = parse_range(think, float)
    if tool_ms is not None:
        changes["tool_s"] = tool_ms / 1000.0
    if seed is not None:
        changes["seed"] = seed
    profile = dataclasses.replace(PRESETS[preset], **changes)
    out = output_dir or Path("bench-results") / time.strftime("rl-%Y%m%d-%H%M%S")
    summaries = run_rl(
        profile, arms, out, server_cpus=parse_cpus(cpus) if cpus else None,
        client_cpus=parse_cpus(load_cpus) if load_cpus else None, url=url, echo=click.echo,
    )  # fmt: skip
    click.echo(f"rl: {out / 'rl.md'}")
    if any(s.failed for s in summaries):
        raise click.ClickException("some episodes failed (see the failures column)")

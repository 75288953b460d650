"""Run a benchmark: the grid of points over every arm, then the outputs.

Order: for each wait W, for each N (ascending), for each repetition, for each
arm still running — so the arms of one point run back to back and drift in
the machine affects them alike. Each point of a started arm gets a fresh
server process (started, capped, health-checked, sampled, stopped).

With ``stop_at_collapse`` (``stadium bench ramp``), an arm stops at its first
collapse for that W: success < 95 %, an OOM kill, or a missed deadline. The
whole run has a hard deadline (``deadline_s``): points not started by then
are skipped, and a running point is cut at it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import shlex
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from stadium._errors import ConfigError
from stadium.bench import arms as arms_mod
from stadium.bench import report
from stadium.bench.arms import Arm, CapReport, Caps, RunningServer, ServerSettings
from stadium.bench.loadgen import load
from stadium.bench.loadspec import LoadSpec, ThinkModel
from stadium.bench.procstat import ServerSampler
from stadium.bench.results import (
    PointKey,
    PointSettings,
    PointSummary,
    ServerStats,
    SessionResult,
    summarize,
)


@dataclass
class BenchConfig:
    """Everything a run needs. ``arms`` are :class:`Arm` or their names."""

    arms: Sequence[Arm | str]
    requests_grid: Sequence[int]
    wait_grid: Sequence[float]
    output_dir: Path
    reps: int = 1
    steps: int = 1
    think: ThinkModel = field(default_factory=ThinkModel)
    state_kb: int = 0
    mode: str = "ws"
    stop_at_collapse: bool = True
    cpus: tuple[int, ...] | None = None
    load_cpus: tuple[int, ...] | None = None
    mem_bytes: int | None = None
    load_procs: int = 0
    connect_window: int = 0
    server_workers: int = 1
    max_sessions: int = 0
    serve_args: tuple[str, ...] = ()
    """Extra arguments of every started Stadium server (``--serve-arg``)."""
    connect_timeout: float = 30.0
    request_timeout: float = 30.0
    deadline_s: float = 3600.0
    cache_dir: Path | None = None
    command: str = ""
    progress: bool = True
    settle_s: float = 0.2

    def arm_list(self) -> list[Arm]:
        """The arms, parsed."""
        return [a if isinstance(a, Arm) else Arm.parse(a) for a in self.arms]


def pin_defaults(cpus: int | None = None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``--pin``: the server on the first half of the allowed CPUs, the load on the rest."""
    allowed = sorted(os.sched_getaffinity(0))
    if cpus is not None:
        allowed = allowed[: max(cpus, 1)]
    if len(allowed) < 2:
        return tuple(allowed), tuple(allowed)
    half = len(allowed) // 2
    return tuple(allowed[:half]), tuple(allowed[half:])


class _Progress:
    """Rich progress bars (or nothing): the whole run and the current point."""

    def __init__(self, enabled: bool, total_points: int) -> None:
        self.bar: Any = None
        if not enabled:
            return
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        self.bar = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            transient=False,
        )
        self.run_task = self.bar.add_task("points", total=total_points)
        self.point_task = self.bar.add_task("sessions", total=1)

    def __enter__(self) -> _Progress:
        if self.bar is not None:
            self.bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()

    def point(self, label: str, n: int) -> None:
        if self.bar is not None:
            self.bar.reset(self.point_task, total=n, description=label)

    def sessions(self, done: int) -> None:
        if self.bar is not None:
            self.bar.update(self.point_task, completed=done)

    def advance(self) -> None:
        if self.bar is not None:
            self.bar.advance(self.run_task)

    def log(self, text: str) -> None:
        if self.bar is not None:
            self.bar.console.print(text)


@dataclass
class _Run:
    """One run in progress: what every point needs, and what the points add up to."""

    config: BenchConfig
    settings: ServerSettings
    openenv_py: str | None
    deadline: float
    """The run's hard deadline, on the monotonic clock."""
    progress: _Progress
    raw: IO[bytes]
    """``raw.jsonl``, open for writing."""
    rows: list[PointSummary] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    cap_methods: dict[str, str] = field(default_factory=dict)
    """How each cap was applied (``CPU``, ``memory``), for the report's notes."""

    @property
    def caps(self) -> Caps:
        return Caps(cpus=self.config.cpus, mem_bytes=self.config.mem_bytes)

    @property
    def server_cores(self) -> float:
        """The CPUs a started server may use."""
        cpus = self.config.cpus
        return float(len(cpus)) if cpus else float(os.cpu_count() or 1)

    def expired(self) -> bool:
        return time.monotonic() >= self.deadline

    def point(self, key: PointKey, arm: Arm) -> PointSummary:
        """Run one point, record it (``summary.csv`` rewritten) and return its summary."""
        self.progress.point(f"{key.arm} N={key.n} W={key.wait_s:g} rep {key.rep + 1}", key.n)
        summary = _run_point(self, key, arm)
        if summary.failures and summary.collapsed:
            self.say(f"{key.arm} N={key.n} W={key.wait_s:g} rep {key.rep + 1}: {summary.failures}")
        self.rows.append(summary)
        report.write_summary(self.config.output_dir / "summary.csv", self.rows)
        self.progress.advance()
        return summary

    def say(self, text: str) -> None:
        """Print ``text`` whatever the progress setting (the progress console, else stderr)."""
        if self.progress.bar is not None:
            from rich.markup import escape

            self.progress.log(f"[red]{escape(text)}[/]")
        else:
            print(text, file=sys.stderr, flush=True)

    def note_caps(self, applied: CapReport) -> None:
        if applied.cpu != "none":
            self.cap_methods["CPU"] = applied.cpu
        if applied.mem != "none":
            self.cap_methods["memory"] = applied.mem


def run(config: BenchConfig) -> Path:
    """Run every point, write the outputs; return the path of ``report.md``.

    Raises :class:`stadium._errors.ConfigError` for a bad configuration (e.g.
    an arm that cannot start). Always returns by ``config.deadline_s`` plus
    the last point's shutdown.
    """
    deadline = time.monotonic() + config.deadline_s
    config.output_dir.mkdir(parents=True, exist_ok=True)
    arm_list = config.arm_list()
    names = [a.name for a in arm_list]
    if len(set(names)) != len(names):
        raise ConfigError(f"arms must be distinct: {names}")
    if config.mode != "ws" and any(a.batch for a in arm_list):
        raise ConfigError("batches are WebSocket frames: use --mode ws with batched arms")
    grid = sorted(set(config.requests_grid))
    settings = ServerSettings(
        workers=config.server_workers,
        max_sessions=config.max_sessions or max(100_000, 2 * max(grid)),
        cache_dir=config.cache_dir or Path.home() / ".cache" / "stadium-bench",
        serve_args=config.serve_args,
    )
    openenv_py = None
    if any(a.kind == "openenv" for a in arm_list):
        openenv_py = arms_mod.openenv_python(settings.cache_dir)
    total_points = len(grid) * len(config.wait_grid) * config.reps * len(arm_list)
    with contextlib.ExitStack() as stack:
        for ref in {a.git_ref for a in arm_list if a.git_ref is not None}:
            settings.worktrees[ref] = stack.enter_context(
                arms_mod.git_worktree(ref, settings.cache_dir / "worktrees")
            )
        state = _Run(
            config,
            settings,
            openenv_py,
            deadline,
            progress=stack.enter_context(_Progress(config.progress, total_points)),
            raw=stack.enter_context((config.output_dir / "raw.jsonl").open("wb")),
        )
        if openenv_py is not None:
            state.notes.append(f"openenv arm served by {openenv_py}")
        _run_grid(state, arm_list, grid)
    return _write_outputs(state, names, grid)


def _run_grid(state: _Run, arms: Sequence[Arm], grid: Sequence[int]) -> None:
    """Every point, in the order of the module docstring, until the run's deadline."""
    config = state.config
    for wait in config.wait_grid:
        alive = list(arms)
        for n, rep in itertools.product(grid, range(config.reps)):
            for arm in list(alive):
                if state.expired():
                    state.notes.append("the run's deadline passed; later points skipped")
                    return
                summary = state.point(PointKey(arm.name, n, float(wait), rep), arm)
                if summary.collapsed and config.stop_at_collapse:
                    alive.remove(arm)
                    state.progress.log(_collapse_text(summary))


def _collapse_text(s: PointSummary) -> str:
    return (
        f"[bold]{s.arm}[/] collapsed at N={s.n}, W={s.wait_s:g}s: success {s.success_rate:.1%}"
        + (" (OOM)" if s.oom else "")
        + (" (deadline)" if s.deadline_hit else "")
    )


def _write_outputs(state: _Run, names: Sequence[str], grid: Sequence[int]) -> Path:
    """Figures, ``report.md`` (and the terminal tables); the report's path."""
    config = state.config
    notes = [*state.notes, *(f"{k} cap: {v}" for k, v in sorted(state.cap_methods.items()))]
    rowdicts = [r.as_row() for r in state.rows]
    figures = report.write_figures(config.output_dir, rowdicts) if rowdicts else []
    path = report.write_report(
        config.output_dir,
        rowdicts,
        command=config.command or shlex.join(sys.argv),
        settings=_settings_table(config, names, grid),
        figures=figures,
        notes=notes,
    )
    if config.progress:
        report.print_table(rowdicts)
    return path


def _settings_table(
    config: BenchConfig, names: Sequence[str], grid: Sequence[int]
) -> dict[str, Any]:
    """The report's settings table."""
    return {
        "arms": ", ".join(names),
        "requests grid": ",".join(map(str, grid)),
        "wait grid (s)": ",".join(f"{w:g}" for w in config.wait_grid),
        "repetitions": config.reps,
        "steps per session": config.steps,
        "think per step (ms)": f"{config.think.seconds * 1000:g}",
        "state per session (KB)": config.state_kb,
        "mode": config.mode,
        "sessions per connection": ", ".join(
            f"{a.name}: {a.batch}" for a in config.arm_list() if a.batch
        )
        or "1 (one frame per session and step)",
        "server CPUs": ",".join(map(str, config.cpus)) if config.cpus else "all",
        "load CPUs": ",".join(map(str, config.load_cpus)) if config.load_cpus else "all",
        "server memory cap": config.mem_bytes or "none",
        "server workers": config.server_workers,
        "server arguments": " ".join(config.serve_args) or "none",
        "connect window": config.connect_window or "none (pure burst)",
        "stop at collapse": config.stop_at_collapse,
        "run deadline (s)": config.deadline_s,
    }


def _run_point(state: _Run, key: PointKey, arm: Arm) -> PointSummary:
    """Start the arm's server, run the point's load against it, stop it; the summary."""
    config = state.config
    settings = PointSettings(
        steps=config.steps,
        think_s=config.think.seconds,
        state_kb=config.state_kb,
        mode=config.mode,
        batch=arm.batch,
        server_cores=state.server_cores if arm.kind != "url" else None,
    )
    spec = dataclasses.replace(_load_spec(config, key), batch=arm.batch)
    deadline = min(spec.deadline(), max(1.0, state.deadline - time.monotonic()))
    tag = f"{arm.name.replace('@', '_')}-n{key.n}-w{key.wait_s:g}-r{key.rep}"
    log_dir = config.output_dir / "logs"
    try:
        server, applied = arms_mod.start_server(
            arm, state.settings, state.caps, log_dir, tag, openenv_py=state.openenv_py
        )
    except ConfigError as exc:
        state.progress.log(f"[red]{arm.name}: could not start the server: {exc.message}[/]")
        s = summarize(key, [], settings, note=f"server did not start: {exc.message}")
        s.collapsed = True
        return s
    state.note_caps(applied)
    spec = dataclasses.replace(spec, url=server.url, deadline_s=deadline)
    if len(server.urls) > 1:
        weights = arms_mod.endpoint_weights(server.urls)
        spec = dataclasses.replace(spec, urls=server.urls, weights=weights)
        spread = ", ".join(f"{u} ×{w}" for u, w in zip(server.urls, weights, strict=True))
        note = f"{key.arm}: sessions spread statically over {spread} (weights: free capacity)"
        if note not in state.notes:
            state.notes.append(note)
    records, stats, note = _measure(state, server, spec, settings)
    report.append_raw(state.raw, key, records)
    state.raw.flush()
    return summarize(key, records, settings, stats, note=note)


def _load_spec(config: BenchConfig, key: PointKey) -> LoadSpec:
    """The point's load, without its server's URL yet."""
    return LoadSpec(
        url="",
        sessions=key.n,
        wait_s=key.wait_s,
        steps=config.steps,
        think=config.think,
        state_kb=config.state_kb,
        mode=config.mode,
        connect_timeout=config.connect_timeout,
        request_timeout=config.request_timeout,
        procs=config.load_procs,
        cpus=config.load_cpus,
        connect_window=config.connect_window,
    )


def _measure(
    state: _Run, server: RunningServer, spec: LoadSpec, settings: PointSettings
) -> tuple[list[SessionResult], ServerStats | None, str]:
    """Run the load while sampling the server, then stop the server (always).

    Returns the records, the server's figures (``None`` when its PID is
    unknown) and a note (a non-zero exit code). Sets ``settings.load_procs`` and
    ``settings.client_cpu_s``.
    """
    stats: ServerStats | None = None
    try:
        time.sleep(state.config.settle_s)
        sampler = ServerSampler(server.pids or server.pid)
        sampler.start()
        result = load(spec, progress=state.progress.sessions)
        records, settings.load_procs = result.records, result.procs
        settings.client_cpu_s = result.cpu_s
        stats = sampler.stop() if server.pid is not None or server.pids else None
    finally:
        code = server.stop()
    if stats is None:
        return records, None, ""
    stats.exit_code = code
    stats.oom = server.oom()
    return records, stats, f"server exit code {code}" if code not in (0, None) else ""


def run_ramp(
    arms: Sequence[str] = ("stadium", "floor"),
    requests_grid: Sequence[int] = (32, 128, 512, 2048),
    wait_grid: Sequence[float] = (1.0,),
    reps: int = 1,
    output_dir: str | Path = "bench-results",
    **options: Any,
) -> Path:
    """Ramp each arm over the grid until it collapses; return the ``report.md`` path.

    ``options`` are further :class:`BenchConfig` fields (``steps``, ``think``,
    ``state_kb``, ``cpus``, ``load_cpus``, ``mem_bytes``, ``deadline_s``,
    ``progress``, ...). Example (what ``make demo`` runs)::

        run_ramp(["stadium", "floor"], [32, 128, 512, 2048], [1.0], 1, "bench-demo")
    """
    config = BenchConfig(
        arms=list(arms),
        requests_grid=list(requests_grid),
        wait_grid=list(wait_grid),
        reps=reps,
        output_dir=Path(output_dir),
        **options,
    )
    return run(config)

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
import os
import shlex
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stadium._errors import ConfigError
from stadium.bench import arms as arms_mod
from stadium.bench import report
from stadium.bench.arms import Arm, Caps, ServerSettings
from stadium.bench.loadgen import LoadSpec, ThinkModel, run_load
from stadium.bench.procstat import ServerSampler
from stadium.bench.results import PointKey, PointSettings, PointSummary, ServerStats, summarize


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


def run(config: BenchConfig) -> Path:
    """Run every point, write the outputs; return the path of ``report.md``.

    Raises :class:`stadium._errors.ConfigError` for a bad configuration (e.g.
    an arm that cannot start). Always returns by ``config.deadline_s`` plus
    the last point's shutdown.
    """
    run_deadline = time.monotonic() + config.deadline_s
    out = config.output_dir
    out.mkdir(parents=True, exist_ok=True)
    log_dir = out / "logs"
    arm_list = config.arm_list()
    names = [a.name for a in arm_list]
    if len(set(names)) != len(names):
        raise ConfigError(f"arms must be distinct: {names}")
    cache_dir = config.cache_dir or Path.home() / ".cache" / "stadium-bench"
    grid = sorted(set(config.requests_grid))
    settings = ServerSettings(
        workers=config.server_workers,
        max_sessions=config.max_sessions or max(100_000, 2 * max(grid)),
        cache_dir=cache_dir,
    )
    caps = Caps(cpus=config.cpus, mem_bytes=config.mem_bytes)
    server_cores = float(len(config.cpus)) if config.cpus else float(os.cpu_count() or 1)
    think_s = config.think.seconds
    rows: list[PointSummary] = []
    notes: list[str] = []
    cap_methods: dict[str, str] = {}
    openenv_py: str | None = None
    if any(a.kind == "openenv" for a in arm_list):
        openenv_py = arms_mod.openenv_python(cache_dir)
        notes.append(f"openenv arm served by {openenv_py}")
    total_points = len(grid) * len(config.wait_grid) * config.reps * len(arm_list)

    with contextlib.ExitStack() as stack:
        for ref in {a.git_ref for a in arm_list if a.git_ref is not None}:
            settings.worktrees[ref] = stack.enter_context(
                arms_mod.git_worktree(ref, cache_dir / "worktrees")
            )
        raw = stack.enter_context((out / "raw.jsonl").open("wb"))
        prog = stack.enter_context(_Progress(config.progress, total_points))
        for wait in config.wait_grid:
            alive = list(arm_list)
            for n in grid:
                for rep in range(config.reps):
                    for arm in list(alive):
                        if time.monotonic() >= run_deadline:
                            if not any("deadline" in x for x in notes):
                                notes.append("the run's deadline passed; later points skipped")
                            break
                        key = PointKey(arm.name, n, float(wait), rep)
                        prog.point(f"{arm.name} N={n} W={wait:g} rep {rep + 1}", n)
                        summary = _run_point(
                            key, arm, config, settings, caps, log_dir, openenv_py,
                            run_deadline, prog, raw, server_cores, think_s, cap_methods,
                        )  # fmt: skip
                        rows.append(summary)
                        report.write_summary(out / "summary.csv", rows)
                        prog.advance()
                        if summary.collapsed and config.stop_at_collapse:
                            alive.remove(arm)
                            prog.log(
                                f"[bold]{arm.name}[/] collapsed at N={n}, W={wait:g}s: "
                                f"success {summary.success_rate:.1%}"
                                + (" (OOM)" if summary.oom else "")
                                + (" (deadline)" if summary.deadline_hit else "")
                            )
    if cap_methods:
        notes.extend(f"{k} cap: {v}" for k, v in sorted(cap_methods.items()))
    rowdicts = [r.as_row() for r in rows]
    figures = report.write_figures(out, rowdicts) if rowdicts else []
    settings_table = {
        "arms": ", ".join(names),
        "requests grid": ",".join(map(str, grid)),
        "wait grid (s)": ",".join(f"{w:g}" for w in config.wait_grid),
        "repetitions": config.reps,
        "steps per session": config.steps,
        "think per step (ms)": f"{think_s * 1000:g}",
        "state per session (KB)": config.state_kb,
        "mode": config.mode,
        "server CPUs": ",".join(map(str, config.cpus)) if config.cpus else "all",
        "load CPUs": ",".join(map(str, config.load_cpus)) if config.load_cpus else "all",
        "server memory cap": config.mem_bytes or "none",
        "server workers": config.server_workers,
        "connect window": config.connect_window or "none (pure burst)",
        "stop at collapse": config.stop_at_collapse,
        "run deadline (s)": config.deadline_s,
    }
    command = config.command or shlex.join(sys.argv)
    path = report.write_report(
        out, rowdicts, command=command, settings=settings_table, figures=figures, notes=notes
    )
    if config.progress:
        report.print_table(rowdicts)
    return path


def _run_point(
    key: PointKey,
    arm: Arm,
    config: BenchConfig,
    settings: ServerSettings,
    caps: Caps,
    log_dir: Path,
    openenv_py: str | None,
    run_deadline: float,
    prog: _Progress,
    raw: Any,
    server_cores: float,
    think_s: float,
    cap_methods: dict[str, str],
) -> PointSummary:
    tag = f"{arm.name.replace('@', '_')}-n{key.n}-w{key.wait_s:g}-r{key.rep}"
    point_settings = PointSettings(
        steps=config.steps,
        think_s=think_s,
        state_kb=config.state_kb,
        mode=config.mode,
        server_cores=server_cores if arm.kind != "url" else None,
    )
    spec = LoadSpec(
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
    remaining = run_deadline - time.monotonic()
    deadline = min(spec.deadline(), max(1.0, remaining))
    try:
        server, capr = arms_mod.start_server(
            arm, settings, caps, log_dir, tag, openenv_py=openenv_py
        )
    except ConfigError as exc:
        prog.log(f"[red]{arm.name}: could not start the server: {exc.message}[/]")
        s = summarize(key, [], point_settings, note=f"server did not start: {exc.message}")
        s.collapsed = True
        return s
    if capr.cpu != "none":
        cap_methods["CPU"] = capr.cpu
    if capr.mem != "none":
        cap_methods["memory"] = capr.mem
    stats: ServerStats | None = None
    note = ""
    try:
        time.sleep(config.settle_s)
        sampler = ServerSampler(server.pid)
        sampler.start()
        spec = LoadSpec(**{**_fields(spec), "url": server.url, "deadline_s": deadline})
        records, nprocs = run_load(spec, progress=prog.sessions)
        point_settings.load_procs = nprocs
        stats = sampler.stop()
        if server.pid is None:
            stats = None
    finally:
        code = server.stop()
    if stats is not None:
        stats.exit_code = code
        stats.oom = server.oom()
        if code not in (0, None):
            note = f"server exit code {code}"
    report.append_raw(raw, key, records)
    raw.flush()
    return summarize(key, records, point_settings, stats, note=note)


def _fields(spec: LoadSpec) -> dict[str, Any]:
    return {f: getattr(spec, f) for f in spec.__dataclass_fields__}


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

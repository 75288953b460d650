"""``stadium bench goals``: the performance goals, each measured by one ramp, in one run.

Every goal is read off one ramp (:data:`RAMPS`): typed ``stadium bench ramp``
options (:class:`~stadium.bench.bench_options.RampOptions`) with the ``stadium``,
``floor`` and ``openenv`` arms side by side. Each ramp runs in this process
(:func:`stadium.bench.grid.run`); its command line, rendered from the same
options, is printed in the report, so one command reproduces each row.
Nothing here times anything itself: the ramps measure, this module only runs
them in turn and tables what their ``summary.csv`` says.

A goal may read its ``stadium`` column off another arm of its ramp
(:attr:`Goal.arms`: the batched rows read ``stadium+batch64``, the same server
loaded with 64 sessions per connection) and show a second arm's figure beside it
(:attr:`Goal.versus`: one frame per session, measured in the same ramp).

Output (``--output-dir``): one sub-directory per ramp (its full report and
figures), ``goals.md`` (the table: each goal, its target, the three arms, the
stadium/floor and openenv/stadium ratios, met or not) and ``goals.json``.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import platform
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stadium.bench import grid
from stadium.bench.bench_options import RampOptions

ARMS = ("stadium", "floor", "openenv")

Values = dict[str, float | None]
"""A figure per arm (``None``: not measured)."""

Row = dict[str, Any]


@dataclass(frozen=True)
class Ramp:
    """One ``stadium bench ramp``: its name (the sub-directory) and its options."""

    name: str
    options: RampOptions

    def into(self, out: Path) -> RampOptions:
        """The options, writing into ``out``."""
        return dataclasses.replace(self.options, output_dir=out)

    def command(self, out: Path) -> str:
        """The shell command that reproduces this ramp into ``out``."""
        return self.into(out).command()

    def keeping(self, arms: Sequence[str]) -> Ramp | None:
        """This ramp with only the arms in ``arms`` (``None`` if none is left)."""
        kept = tuple(a for a in self.options.arms if a in arms)
        if not kept:
            return None
        return dataclasses.replace(self, options=dataclasses.replace(self.options, arms=kept))


@dataclass(frozen=True)
class Goal:
    """A row of the goals table: which ramp, which point, which figure, which target."""

    key: str
    metric: str
    target: str
    ramps: tuple[str, ...]
    n: int
    figure: Callable[[Row], float | None]
    unit: str
    met: Callable[[Values, Values], bool | None]
    """(figures at ``n``, figures at ``baseline_n``) → met, missed, or None if unmeasured."""
    note: str = ""
    fmt: Callable[[float], str] = field(default=lambda v: f"{v:,.3g}")
    baseline_n: int | None = None
    """Also read each arm's figure at this N of the same ramp (shown in brackets)."""
    arms: Mapping[str, str | None] = field(default_factory=dict)
    """Column → the ramp's arm it shows (default: the arm of that name); ``None``:
    the column is empty for this goal."""
    versus: tuple[str, str] | None = None
    """(label, arm): that arm's figure at ``n`` is the ``stadium`` column's baseline,
    shown in brackets with the label (e.g. one frame per session beside a batch)."""


def _f(row: Row, col: str) -> float | None:
    value = row.get(col)
    if value in (None, "", "None"):
        return None
    return float(value)


def _cpu_step(row: Row) -> float | None:
    return _f(row, "server_cpu_us_per_step")


def _cpu_session(row: Row) -> float | None:
    return _f(row, "server_cpu_ms_per_session")


def _total_p99_s(row: Row) -> float | None:
    v = _f(row, "total_p99_ms")
    return None if v is None else v / 1000.0


def _rss_kb(row: Row) -> float | None:
    v = _f(row, "rss_per_session_kb")  # KiB in summary.csv
    return None if v is None else v * 1.024  # KB (1,000 bytes), the goal's unit


def _threads(row: Row) -> float | None:
    return _f(row, "server_peak_threads")


def _success(row: Row) -> float | None:
    v = _f(row, "success_rate")
    return None if v is None else v * 100.0


def _stadium(test: Callable[[float], bool]) -> Callable[[Values, Values], bool | None]:
    """A goal on Stadium's figure alone."""

    def met(v: Values, _baseline: Values) -> bool | None:
        s = v.get("stadium")
        return None if s is None else test(s)

    return met


def _per_step_met(v: Values, _baseline: Values) -> bool | None:
    s, f = v.get("stadium"), v.get("floor")
    if s is None or f is None:
        return None
    return s <= 20.0 and s <= 1.5 * f


def _quarter_of_floor(v: Values, _baseline: Values) -> bool | None:
    s, f = v.get("stadium"), v.get("floor")
    return None if s is None or f is None else s <= 0.25 * f


def _half_of_versus(v: Values, baseline: Values) -> bool | None:
    s, own = v.get("stadium"), baseline.get("stadium")
    return None if s is None or own is None else s <= 0.5 * own


def _measured(_v: Values, _baseline: Values) -> bool | None:
    return None


def _client_cpu_step(row: Row) -> float | None:
    return _f(row, "client_cpu_us_per_step")


def _flat_met(v: Values, baseline: Values) -> bool | None:
    big, small = v.get("stadium"), baseline.get("stadium")
    return None if big is None or small is None else big <= small


def _ramp(name: str, *arms: str, **options: Any) -> Ramp:
    return Ramp(name, RampOptions(arms=arms, reps=1, **options))


RAMPS: dict[str, Ramp] = {
    r.name: r
    for r in (
        _ramp("per_step", *ARMS, requests_grid=(64,), wait_grid=(0.0,), steps=500, pin=True),
        _ramp("lifecycle", *ARMS, requests_grid=(2048,), wait_grid=(0.0,), steps=1, pin=True),
        _ramp("p99_8192", *ARMS, requests_grid=(512, 8192), wait_grid=(1.0,), pin=True),
        _ramp("idle_rss", *ARMS, requests_grid=(4096,), wait_grid=(0.0,), think_ms=3000.0,
              pin=True, batch=(64,)),
        # Batches: the floor has none, so Stadium's batches are measured against the
        # floor's one frame per step (and Stadium's own), side by side.
        _ramp("batch", "stadium", "floor", requests_grid=(256,), wait_grid=(0.0,), steps=500,
              pin=True, batch=(64, 256)),
        _ramp("burst_32768", "stadium", "floor", server_workers=2, requests_grid=(32768,),
              wait_grid=(10.0,)),
        # A thread-per-session server cannot hold 32,768 sessions here: pid_max is
        # 32,768 for the whole machine. OpenEnv's burst row stops at 8,192.
        _ramp("burst_openenv", "openenv", server_workers=2, requests_grid=(8192,),
              wait_grid=(10.0,)),
    )
}  # fmt: skip
"""Every ramp the goals read, by name (each one ``stadium bench ramp``)."""

GOALS: tuple[Goal, ...] = (
    Goal("per_step", "Server CPU per step, benchmark env, W = 0, 64 sessions, 1 worker on "
         "1 core", "≤ 20 µs and ≤ 1.5 × floor", ("per_step",), 64, _cpu_step, "µs",
         _per_step_met, "500 steps per session; includes each session's connect, reset, close"),
    Goal("lifecycle", "Server CPU per session lifecycle (connect, reset, step, close)",
         "≤ 0.3 ms", ("lifecycle",), 2048, _cpu_session, "ms", _stadium(lambda s: s <= 0.3),
         "a burst of 2,048, W = 0, one step"),
    Goal("burst_success", "Burst, W = 10 s, 2 workers: success", "≥ 99 % at N = 32,768",
         ("burst_32768", "burst_openenv"), 32768, _success, "%", _stadium(lambda s: s >= 99.0),
         "openenv at N = 8,192 (32,768 threads exceed the machine's pid_max)",
         lambda v: f"{v:.2f}"),
    Goal("burst_p99", "Burst, W = 10 s, 2 workers: total p99", "≤ 2 × W = 20 s at N = 32,768",
         ("burst_32768", "burst_openenv"), 32768, _total_p99_s, "s", _stadium(lambda s: s <= 20.0),
         "openenv at N = 8,192", lambda v: f"{v:.2f}"),
    Goal("p99_8192", "Total p99 at N = 8,192, W = 1 s", "≤ 3 s", ("p99_8192",), 8192,
         _total_p99_s, "s", _stadium(lambda s: s <= 3.0), "1 worker on 1 core, pure burst",
         lambda v: f"{v:.2f}"),
    Goal("idle_rss", "Server RSS per idle session (benchmark env)", "≤ 20 KB", ("idle_rss",),
         4096, _rss_kb, "KB", _stadium(lambda s: s <= 20.0),
         "4,096 sessions idle 3 s after reset; KB = 1,000 B",
         lambda v: f"{v:.1f}"),
    Goal("threads", "Peak server threads at N = 8,192", "flat (as at N = 512)",
         ("p99_8192",), 8192, _threads, "", _flat_met, "", lambda v: f"{v:,.0f}", 512),
    Goal("batch_step", "Server CPU per step, batch 64 (256 sessions on 4 connections), W = 0, "
         "1 worker on 1 core", "≤ 0.25 × floor (same run)", ("batch",), 256, _cpu_step, "µs",
         _quarter_of_floor, "stadium = stadium+batch64, one batch frame per round of 64 steps, "
         "500 rounds (in brackets: one frame per step); floor = one frame per step",
         arms={"stadium": "stadium+batch64", "openenv": None}, versus=("one frame", "stadium")),
    Goal("batch256_step", "Server CPU per step, batch 256 (one connection), W = 0",
         "≤ 0.25 × floor (same run)", ("batch",), 256, _cpu_step, "µs", _quarter_of_floor,
         "stadium = stadium+batch256",
         arms={"stadium": "stadium+batch256", "openenv": None}, versus=("one frame", "stadium")),
    Goal("batch_client", "Client (load generator) CPU per step, batch 64, W = 0",
         "measured (no target)", ("batch",), 256, _client_cpu_step, "µs", _measured,
         "the load generator's worker processes over the point / steps",
         arms={"stadium": "stadium+batch64", "openenv": None}, versus=("one frame", "stadium")),
    Goal("batch_rss", "Server RSS per idle multiplexed session, batch 64 (4,096 sessions on "
         "64 connections)", "≤ ½ × a session on its own connection (same run)", ("idle_rss",),
         4096, _rss_kb, "KB", _half_of_versus, "stadium = stadium+batch64 (in brackets: one "
         "connection per session); floor = one connection per session",
         lambda v: f"{v:.1f}", arms={"stadium": "stadium+batch64", "openenv": None},
         versus=("own connection", "stadium")),
)  # fmt: skip


def read_rows(directory: Path) -> list[Row]:
    """The rows of ``directory/summary.csv`` (empty if the ramp wrote none)."""
    path = directory / "summary.csv"
    if not path.exists():
        return []
    with path.open(newline="") as fh:
        return list(csv.DictReader(fh))


def _pick(rows: Sequence[Row], arm: str, n: int) -> Row | None:
    """The arm's row at N = n, else its largest N (averaging nothing: reps = 1)."""
    mine = [r for r in rows if r.get("arm") == arm]
    exact = [r for r in mine if int(r["n"]) == n]
    if exact:
        return exact[0]
    return max(mine, key=lambda r: int(r["n"]), default=None)


@dataclass
class GoalResult:
    """One evaluated row."""

    goal: Goal
    values: Values
    ns: dict[str, int]
    met: bool | None
    baseline: Values = field(default_factory=dict)
    """Each arm's figure at the goal's ``baseline_n`` (empty without one)."""

    def as_json(self) -> dict[str, Any]:
        return {
            "key": self.goal.key,
            "metric": self.goal.metric,
            "target": self.goal.target,
            "unit": self.goal.unit,
            "values": self.values,
            "n": self.ns,
            "baseline_n": self.goal.baseline_n,
            "baseline": self.baseline,
            "met": self.met,
        }


def evaluate(out: Path) -> list[GoalResult]:
    """Read every ramp's summary under ``out`` and evaluate each goal (pure but for reading)."""
    results: list[GoalResult] = []
    for goal in GOALS:
        rows = [row for name in goal.ramps for row in read_rows(out / name)]
        values: Values = {}
        ns: dict[str, int] = {}
        baseline: Values = {}
        for arm in ARMS:
            name = goal.arms.get(arm, arm)
            row = _pick(rows, name, goal.n) if name is not None else None
            values[arm] = goal.figure(row) if row is not None else None
            if row is not None:
                ns[arm] = int(row["n"])
            if goal.baseline_n is not None and name is not None:
                small = _pick(rows, name, goal.baseline_n)
                baseline[arm] = goal.figure(small) if small is not None else None
        if goal.versus is not None:
            other = _pick(rows, goal.versus[1], goal.n)
            baseline["stadium"] = goal.figure(other) if other is not None else None
        met = goal.met(values, baseline)
        results.append(GoalResult(goal, values, ns, met, baseline))
    return results


def _cell(goal: Goal, value: float | None, n: int | None, small: float | None) -> str:
    if value is None:
        return "—"
    text = goal.fmt(value)
    if n is not None and n != goal.n:
        text += f" (N = {n:,})"
    if small is not None:
        label = goal.versus[0] if goal.versus is not None else f"at {goal.baseline_n:,}"
        text += f" ({goal.fmt(small)} {label})"
    return text


def _ratio(r: GoalResult, a: str, b: str) -> str:
    """``a / b``, only where both arms were measured at the same N."""
    x, y = r.values.get(a), r.values.get(b)
    if x is None or y is None or y == 0 or r.ns.get(a) != r.ns.get(b):
        return "—"
    return f"{x / y:,.2f}"


def goals_markdown(results: Sequence[GoalResult], commands: dict[str, str], head: str) -> str:
    """The goals table and the commands, as Markdown."""
    lines = [
        "# Stadium performance goals",
        "",
        head,
        "",
        "| metric | goal | stadium | floor | openenv | stadium ÷ floor | openenv ÷ stadium | met |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        g = r.goal
        unit = f" ({g.unit})" if g.unit else ""
        cells = [_cell(g, r.values[a], r.ns.get(a), r.baseline.get(a)) for a in ARMS]
        met = {True: "yes", False: "**no**", None: "—"}[r.met]
        lines.append(
            f"| {g.metric}{unit} | {g.target} | {' | '.join(cells)} | "
            f"{_ratio(r, 'stadium', 'floor')} | {_ratio(r, 'openenv', 'stadium')} | {met} |"
        )
    lines += ["", "Notes:", ""]
    lines += [f"- {r.goal.metric}: {r.goal.note}" for r in results if r.goal.note]
    lines += ["", "## Commands (one per ramp; each ramp's report is in its directory)", ""]
    lines += [f"- `{name}`: `{cmd}`" for name, cmd in commands.items()]
    return "\n".join(lines) + "\n"


RampRunner = Callable[[Ramp, Path], object]
"""Runs one ramp into a directory (``summary.csv`` and the rest of its outputs there)."""


def run_in_process(ramp: Ramp, out: Path) -> Path:
    """Run ``ramp`` into ``out`` in this process (:func:`stadium.bench.grid.run`);
    return its ``report.md``, which shows the command that reproduces it."""
    options = ramp.into(out)
    config = options.config()
    config.command = options.command()
    return grid.run(config)


def run_goals(
    output_dir: Path,
    *,
    only: Sequence[str] = (),
    arms: Sequence[str] = ARMS,
    run_ramp: RampRunner = run_in_process,
) -> Path:
    """Run every ramp the goals need (or ``only`` those), then write ``goals.md``.

    ``arms`` drops arms from every ramp (e.g. without ``openenv`` on a machine
    that cannot create its venv); a ramp left without arms is not run.
    ``run_ramp`` runs one ramp into a directory (default: :func:`run_in_process`).
    """
    output_dir.mkdir(parents=True, exist_ok=True)
    commands: dict[str, str] = {}
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    for name, ramp in RAMPS.items():
        kept = ramp.keeping(arms) if not only or name in only else None
        if kept is None:
            continue
        out = output_dir / name
        commands[name] = kept.command(out)
        run_ramp(kept, out)
    results = evaluate(output_dir)
    head = (
        f"Run {started} on {platform.node() or 'this machine'} ({os.cpu_count()} CPUs, "
        f"{platform.machine()}, Linux {platform.release()}, Python "
        f"{platform.python_version()}; versions of every package in each ramp's "
        "report.md). One repetition per point: compare the ratios, taken in one run, "
        "not absolute times across runs."
    )
    md = goals_markdown(results, commands, head)
    path = output_dir / "goals.md"
    path.write_text(md)
    (output_dir / "goals.json").write_text(
        json.dumps([r.as_json() for r in results], indent=2) + "\n"
    )
    return path

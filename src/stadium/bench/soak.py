"""``stadium bench soak``: hold a load for a given time and watch the server over time.

N session slots each open sessions one after another (connect → reset →
steps → close) for ``duration`` seconds, from the load generator's worker
processes (:mod:`stadium.bench.loadgen`). Every ``interval`` seconds one row is
taken: the server process tree's RSS, open file descriptors, threads,
processes and CPU (from /proc, :func:`~stadium.bench.procstat.tree_figures`),
and the load's sessions and steps so far, failed ones by kind, and the step
latency percentiles of the interval. A server that leaks memory, descriptors
or threads, or starts failing steps after a while, shows it in the rows.

Results: ``soak.csv`` (one line per row), ``soak.json`` (the rows, the load
and a summary) and ``soak.png`` (the rows over time) in the output directory.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from stadium._core.urls import ws_url
from stadium.bench.arms import spawn_server
from stadium.bench.loadgen import LoadWorker, pump_until, start_workers, stop_workers
from stadium.bench.loadspec import LoadSpec
from stadium.bench.procstat import TreeFigures, tree_figures
from stadium.bench.stats import percentile

_MIB = 1024.0 * 1024.0


@dataclasses.dataclass(frozen=True, slots=True)
class SoakRow:
    """The server and the load at one instant, ``t`` seconds after the start."""

    t: float
    rss_mib: float | None
    fds: int | None
    threads: int | None
    procs: int | None
    cpu_s: float | None
    sessions_ok: int
    sessions_failed: int
    steps_ok: int
    steps_failed: int
    step_p50_ms: float | None
    step_p99_ms: float | None
    errors: dict[str, int]


@dataclasses.dataclass(frozen=True, slots=True)
class SoakOptions:
    """What ``stadium bench soak`` was told (see its ``--help``)."""

    target: str = "benchmark"
    url: str | None = None
    server_pid: int | None = None
    server_workers: int = 1
    sessions: int = 100
    duration_s: float = 60.0
    interval_s: float = 5.0
    steps: int = 100
    wait_s: float = 0.0
    mode: str = "ws"
    load_procs: int = 0
    output_dir: Path = Path("bench-results/soak")


def _rows_figure(rows: list[SoakRow], path: Path) -> bool:
    """Plot the rows (RSS, fds and threads, steps/s and failures); False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    t = [r.t for r in rows]
    fig, axes = plt.subplots(4, 1, figsize=(8, 9), sharex=True)
    axes[0].plot(t, [r.rss_mib or 0.0 for r in rows])
    axes[0].set_ylabel("server RSS (MiB)")
    axes[1].plot(t, [r.fds or 0 for r in rows], label="open fds")
    axes[1].plot(t, [r.threads or 0 for r in rows], label="threads")
    axes[1].legend()
    rates = [0.0] + [
        (b.steps_ok - a.steps_ok) / max(b.t - a.t, 1e-9) for a, b in itertools.pairwise(rows)
    ]
    axes[2].plot(t, rates)
    axes[2].set_ylabel("steps / s")
    axes[3].plot(t, [r.steps_failed for r in rows], label="failed steps")
    axes[3].plot(t, [r.sessions_failed for r in rows], label="failed sessions")
    axes[3].set_ylabel("cumulative")
    axes[3].set_xlabel("seconds since start")
    axes[3].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def _row(t: float, figures: TreeFigures | None, workers: list[LoadWorker]) -> SoakRow:
    sample = [s for w in workers for s in w.samples]
    for w in workers:
        w.samples.clear()
    errors: dict[str, int] = {}
    for w in workers:
        for kind, n in w.tally.errors.items():
            errors[kind] = errors.get(kind, 0) + n
    p50, p99 = percentile(sample, 50), percentile(sample, 99)
    return SoakRow(
        t=round(t, 3),
        rss_mib=None if figures is None else round(figures.rss_bytes / _MIB, 2),
        fds=None if figures is None else figures.fds,
        threads=None if figures is None else figures.threads,
        procs=None if figures is None else figures.procs,
        cpu_s=None if figures is None else round(figures.cpu_s, 2),
        sessions_ok=sum(w.tally.sessions_ok for w in workers),
        sessions_failed=sum(w.tally.sessions_failed for w in workers),
        steps_ok=sum(w.tally.steps_ok for w in workers),
        steps_failed=sum(w.tally.steps_failed for w in workers),
        step_p50_ms=None if p50 is None else round(p50 * 1e3, 3),
        step_p99_ms=None if p99 is None else round(p99 * 1e3, 3),
        errors=errors,
    )


def describe(row: SoakRow) -> str:
    """One row as a line of text."""

    def num(v: float | int | None, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    return (
        f"t={row.t:7.1f}s rss={num(row.rss_mib, '.1f')}MiB fds={num(row.fds, 'd')} "
        f"threads={num(row.threads, 'd')} procs={num(row.procs, 'd')} "
        f"sessions={row.sessions_ok} steps={row.steps_ok} "
        f"failed steps={row.steps_failed} failed sessions={row.sessions_failed} "
        f"step p50/p99={num(row.step_p50_ms, '.2f')}/{num(row.step_p99_ms, '.2f')} ms"
    )


def summarize(rows: list[SoakRow]) -> dict[str, object]:
    """What changed between the first row under load and the last: RSS, fds,
    threads; and the totals."""
    if not rows:
        return {}
    first = rows[1] if len(rows) > 2 else rows[0]  # rows[0] is taken before the load starts
    last = rows[-1]

    def growth(a: float | int | None, b: float | int | None) -> float | None:
        return None if a is None or b is None else round(b - a, 2)

    return {
        "rss_mib_first_last": [first.rss_mib, last.rss_mib],
        "rss_growth_mib": growth(first.rss_mib, last.rss_mib),
        "fds_growth": growth(first.fds, last.fds),
        "threads_growth": growth(first.threads, last.threads),
        "sessions_ok": last.sessions_ok,
        "sessions_failed": last.sessions_failed,
        "steps_ok": last.steps_ok,
        "steps_failed": last.steps_failed,
        "errors": last.errors,
    }


@contextmanager
def _server(opts: SoakOptions) -> Iterator[tuple[str, int | None]]:
    if opts.url is not None:
        yield ws_url(opts.url), opts.server_pid
        return
    args = [
        opts.target,
        "--workers",
        str(opts.server_workers),
        "--max-sessions",
        str(max(2 * opts.sessions, 100)),
        "--log-level",
        "warning",
    ]
    with spawn_server(*args) as (proc, url):
        yield url.replace("http://", "ws://", 1) + "/ws", proc.pid


def run_soak(
    opts: SoakOptions, *, echo: Callable[[str], None] = print
) -> tuple[Path, dict[str, object]]:
    """Run the soak; write soak.csv, soak.json and soak.png; return (json path, summary)."""
    out = opts.output_dir
    out.mkdir(parents=True, exist_ok=True)
    rows: list[SoakRow] = []
    with _server(opts) as (url, pid):
        spec = LoadSpec(
            url=url,
            sessions=opts.sessions,
            wait_s=opts.wait_s,
            steps=opts.steps,
            mode=opts.mode,
            procs=opts.load_procs,
            duration_s=opts.duration_s,
        )
        workers: list[LoadWorker] = []

        def take(t0: float) -> None:
            figures = tree_figures(pid) if pid is not None else None
            rows.append(_row(time.monotonic() - t0, figures, workers))
            echo(describe(rows[-1]))

        try:
            t0 = start_workers(spec, workers, 0.3)
            take(t0)
            until = t0 + spec.deadline() + 30.0
            next_row = t0 + opts.interval_s
            while not all(w.finished for w in workers) and time.monotonic() < until:
                pump_until(workers, lambda w: w.finished, min(next_row, until), lambda: None)
                if time.monotonic() >= next_row:
                    take(t0)
                    next_row += opts.interval_s
            take(t0)
        finally:
            stop_workers(workers)
        failed_workers = [w.error for w in workers if w.error]
    summary = summarize(rows)
    if failed_workers:
        summary["load_errors"] = failed_workers
    _write(out, opts, spec, rows, summary)
    return out / "soak.json", summary


def _write(
    out: Path, opts: SoakOptions, spec: LoadSpec, rows: list[SoakRow], summary: dict[str, object]
) -> None:
    fields = [f.name for f in dataclasses.fields(SoakRow)]
    lines = [",".join(fields)]
    for r in rows:
        values = dataclasses.asdict(r)
        values["errors"] = ";".join(f"{k}={v}" for k, v in sorted(r.errors.items()))
        lines.append(",".join("" if values[f] is None else str(values[f]) for f in fields))
    (out / "soak.csv").write_text("\n".join(lines) + "\n")
    doc = {
        "options": {k: str(v) for k, v in dataclasses.asdict(opts).items()},
        "load": {"url": spec.url, "sessions": spec.sessions, "steps": spec.steps},
        "summary": summary,
        "rows": [dataclasses.asdict(r) for r in rows],
    }
    (out / "soak.json").write_text(json.dumps(doc, indent=1) + "\n")
    _rows_figure(rows, out / "soak.png")

"""Outputs of a run: ``raw.jsonl``, ``summary.csv``, PNG figures, ``report.md``/``.html``.

* ``raw.jsonl`` — one JSON object per session: the point's ``arm``, ``n``,
  ``wait_s``, ``rep`` and every field of :class:`~stadium.bench.results.SessionRecord`.
* ``summary.csv`` — one row per point, the columns of
  :func:`stadium.bench.results.columns`; empty cells for unknown figures.
* figures (Agg backend, PNG): ``scaling.png`` (success rate vs batch),
  ``max_batch.png`` (max batch by arm and wait), ``batch_per_core.png``,
  ``p99_heatmap.png`` (total p99, batch x wait, one panel per arm),
  ``latency_phases.png`` (p50 and p99 of connect, reset, step, total vs batch),
  ``server_cost.png`` (server CPU per step and RSS per session vs batch).
* ``report.md`` — machine, versions, exact command, caps, knees, tables and figures.
* ``report.html`` — the same report as one self-contained page (figures embedded).
"""

from __future__ import annotations

import contextlib
import csv
import math
import os
import platform
import socket
import sys
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from importlib import metadata
from pathlib import Path
from typing import IO, Any

import msgspec

from stadium.bench import stats
from stadium.bench.results import PointKey, PointSummary, SessionResult, columns, error_column

Row = Mapping[str, Any]


# ------------------------------------------------------------------ raw / csv


def append_raw(fh: IO[bytes], key: PointKey, records: Iterable[SessionResult]) -> None:
    """Append one line per session to an open ``raw.jsonl``."""
    head = {"arm": key.arm, "n": key.n, "wait_s": key.wait_s, "rep": key.rep}
    enc = msgspec.json.Encoder()
    for r in records:
        fh.write(enc.encode({**head, **msgspec.structs.asdict(r)}))
        fh.write(b"\n")


def write_summary(path: Path, rows: Sequence[PointSummary]) -> None:
    """Write ``summary.csv`` (header = :func:`columns`); ``None`` becomes an empty cell."""
    cols = columns()
    tmp = path.with_suffix(".csv.tmp")
    with tmp.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=cols)
        w.writeheader()
        for s in rows:
            w.writerow({k: ("" if v is None else v) for k, v in s.as_row().items()})
    os.replace(tmp, path)


def _convert(value: str) -> Any:
    if value == "":
        return None
    if value in ("True", "False"):
        return value == "True"
    try:
        return int(value)
    except ValueError:
        pass
    try:
        return float(value)
    except ValueError:
        return value


def read_summary(path: Path) -> list[dict[str, Any]]:
    """Read a ``summary.csv`` back as dicts of typed values (ints, floats, bools, None)."""
    with path.open(newline="") as fh:
        return [{k: _convert(v) for k, v in row.items()} for row in csv.DictReader(fh)]


# ---------------------------------------------------------------- aggregation


def max_batches(rows: Iterable[Row]) -> dict[tuple[str, float], int]:
    """Max batch per (arm, wait) by the study's rule (:func:`stats.max_batch`)."""
    rates: dict[tuple[str, float], dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        rates[(str(r["arm"]), float(r["wait_s"]))][int(r["n"])].append(float(r["success_rate"]))
    return {k: stats.max_batch(v) for k, v in rates.items()}


def server_cores(rows: Iterable[Row]) -> dict[str, float]:
    """The CPUs each arm's server could use (its ``server_cores``, else this machine's)."""
    cores: dict[str, float] = {}
    for r in rows:
        c = r.get("server_cores")
        cores[str(r["arm"])] = float(c) if c else float(os.cpu_count() or 1)
    return cores


def _mean(values: Iterable[Any]) -> float | None:
    vs = [float(v) for v in values if v is not None]
    vs = [v for v in vs if not math.isnan(v)]
    return sum(vs) / len(vs) if vs else None


def by_point(rows: Iterable[Row]) -> dict[tuple[str, float, int], list[Row]]:
    """Rows grouped by (arm, wait, n) over repetitions, sorted by key."""
    out: dict[tuple[str, float, int], list[Row]] = defaultdict(list)
    for r in rows:
        out[(str(r["arm"]), float(r["wait_s"]), int(r["n"]))].append(r)
    return dict(sorted(out.items()))


def mean_of(rows: Sequence[Row], column: str) -> float | None:
    """The mean of ``column`` over repetitions, ignoring missing values."""
    return _mean(r.get(column) for r in rows)


# -------------------------------------------------------------------- figures


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _n_axis(ax: Any, ns: Sequence[int]) -> None:
    """Log x axis labelled with the batch sizes themselves."""
    ax.set_xscale("log")
    ax.minorticks_off()
    if ns:
        ax.set_xticks(list(ns), [f"{n:,}" for n in ns], fontsize=7)


class _Plot:
    """The rows of a run grouped for the figures: arms, waits, batch sizes, series."""

    def __init__(self, rows: Sequence[Row]) -> None:
        self.rows = rows
        self.groups = by_point(rows)
        self.arms = sorted({k[0] for k in self.groups})
        self.waits = sorted({k[1] for k in self.groups})
        self.ns = sorted({k[2] for k in self.groups})
        self.first_wait = self.waits[0] if self.waits else 0.0

    def arm_ns(self, arm: str) -> list[int]:
        """The batch sizes ``arm`` ran, ascending."""
        return sorted({k[2] for k in self.groups if k[0] == arm})

    def series(self, arm: str, wait: float, col: str) -> tuple[list[int], list[float | None]]:
        """``col`` (mean over repetitions) against N, for one arm and wait."""
        ns = sorted(k[2] for k in self.groups if k[0] == arm and k[1] == wait)
        return ns, [mean_of(self.groups[(arm, wait, n)], col) for n in ns]

    def points(self, arm: str, wait: float, col: str) -> list[tuple[int, float]]:
        """The known values of :meth:`series`, as (N, value)."""
        ns, ys = self.series(arm, wait, col)
        return [(n, y) for n, y in zip(ns, ys, strict=True) if y is not None]


_STYLES = ("-", "--", ":", "-.")


def _scaling_figure(plt: Any, d: _Plot) -> Any:
    """Success rate vs N, one line per arm and wait."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for arm in d.arms:
        for j, w in enumerate(d.waits):
            ns, ys = d.series(arm, w, "success_rate")
            if ns:
                ax.plot(ns, [100 * (y or 0) for y in ys], _STYLES[j % 4], marker="o",
                        label=f"{arm}, W={w:g}s")  # fmt: skip
    ax.axhline(95, color="grey", lw=0.8, ls=":")
    ax.set(xlabel="concurrent sessions N", ylabel="success rate (%)",
           title="Scaling: success rate vs batch", ylim=(0, 105))  # fmt: skip
    _n_axis(ax, d.ns)
    ax.legend(fontsize=8)
    return fig


def _knee_figure(plt: Any, d: _Plot, *, per_core: bool) -> Any:
    """Max batch by arm and wait, absolute or per server core."""
    mb = max_batches(d.rows)
    cores = server_cores(d.rows)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    width = 0.8 / max(1, len(d.waits))
    for j, w in enumerate(d.waits):
        vals = [mb.get((a, w), 0) / (cores.get(a, 1.0) if per_core else 1.0) for a in d.arms]
        xs = [i + j * width for i in range(len(d.arms))]
        bars = ax.bar(xs, vals, width, label=f"W={w:g}s")
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
    ax.set_xticks([i + width * (len(d.waits) - 1) / 2 for i in range(len(d.arms))], d.arms)
    ax.set(ylabel="sessions per core" if per_core else "sessions",
           title=("Max batch per core" if per_core else "Max batch")
           + " (largest N with >= 95% success in every rep)")  # fmt: skip
    ax.legend(fontsize=8)
    return fig


def _max_batch_figure(plt: Any, d: _Plot) -> Any:
    return _knee_figure(plt, d, per_core=False)


def _batch_per_core_figure(plt: Any, d: _Plot) -> Any:
    return _knee_figure(plt, d, per_core=True)


def _p99_heatmap_figure(plt: Any, d: _Plot) -> Any:
    """Total p99 over N x wait, one panel per arm."""
    panels = max(1, len(d.arms))
    fig, axes = plt.subplots(1, panels, figsize=(4.2 * panels, 3.8), squeeze=False)
    for ax, arm in zip(axes[0], d.arms, strict=False):
        grid = [
            [mean_of(d.groups.get((arm, w, n), []), "total_p99_ms") for n in d.ns] for w in d.waits
        ]
        data = [[(v / 1000.0 if v is not None else float("nan")) for v in row] for row in grid]
        im = ax.imshow(data, aspect="auto", cmap="viridis", origin="lower")
        ax.set_xticks(range(len(d.ns)), [str(n) for n in d.ns], rotation=45, fontsize=7)
        ax.set_yticks(range(len(d.waits)), [f"{w:g}" for w in d.waits])
        ax.set(xlabel="N", ylabel="wait (s)", title=f"{arm}: total p99 (s)")
        for yi, row in enumerate(data):
            for xi, v in enumerate(row):
                if not math.isnan(v):
                    ax.text(xi, yi, f"{v:.2f}", ha="center", va="center", fontsize=6, color="w")
        fig.colorbar(im, ax=ax)
    return fig


def _latency_phases_figure(plt: Any, d: _Plot) -> Any:
    """p50 and p99 of connect, reset, step and total vs N at the first wait, per arm."""
    panels = max(1, len(d.arms))
    fig, axes = plt.subplots(1, panels, figsize=(4.5 * panels, 4), squeeze=False, sharey=True)
    w0 = d.first_wait
    for ax, arm in zip(axes[0], d.arms, strict=False):
        for ph in ("connect", "reset", "step", "total"):
            for q, ls in (("p50", "--"), ("p99", "-")):
                pts = [(n, y) for n, y in d.points(arm, w0, f"{ph}_{q}_ms") if y > 0]
                if pts:
                    ax.plot(*zip(*pts, strict=True), ls, marker=".", label=f"{ph} {q}")
        ax.set(yscale="log", xlabel="N", ylabel="latency (ms)",
               title=f"{arm}: latency by phase, W={w0:g}s")  # fmt: skip
        _n_axis(ax, d.arm_ns(arm))
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6, ncol=2)
    return fig


def _server_cost_figure(plt: Any, d: _Plot) -> Any:
    """Server CPU per step and RSS per session vs N at the first wait."""
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for arm in d.arms:
        for ax, col in ((ax1, "server_cpu_us_per_step"), (ax2, "rss_per_session_kb")):
            pts = d.points(arm, d.first_wait, col)
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=arm)
    ax1.set(xlabel="N", ylabel="µs", title="Server CPU per step")
    ax2.set(xlabel="N", ylabel="KiB", title="Server RSS per session")
    for ax in (ax1, ax2):
        _n_axis(ax, d.ns)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    return fig


_FIGURE_MAKERS: dict[str, Callable[[Any, _Plot], Any]] = {
    "scaling.png": _scaling_figure,
    "max_batch.png": _max_batch_figure,
    "batch_per_core.png": _batch_per_core_figure,
    "p99_heatmap.png": _p99_heatmap_figure,
    "latency_phases.png": _latency_phases_figure,
    "server_cost.png": _server_cost_figure,
}
"""Each figure's file name and the function that draws it (``plt``, the grouped rows)."""

FIGURES = tuple(_FIGURE_MAKERS)
"""The figures every run writes, in order."""


def write_figures(out_dir: Path, rows: Sequence[Row]) -> list[Path]:
    """Write every figure of :data:`FIGURES` into ``out_dir``; return their paths."""
    plt = _plt()
    data = _Plot(rows)
    paths: list[Path] = []
    for name, draw in _FIGURE_MAKERS.items():
        fig = draw(plt, data)
        path = out_dir / name
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


# ------------------------------------------------------------------- markdown


def _fmt(v: Any, digits: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else ""
    if isinstance(v, float):
        if math.isnan(v):
            return "-"
        return f"{v:,.{digits}f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


TABLE_COLUMNS: tuple[tuple[str, str, int], ...] = (
    ("arm", "arm", 0),
    ("wait_s", "W (s)", 1),
    ("n", "N", 0),
    ("success_rate", "success", 3),
    ("errors", "errors", 0),
    ("connect_p99_ms", "connect p99 ms", 1),
    ("reset_p99_ms", "reset p99 ms", 1),
    ("step_p99_ms", "step p99 ms", 1),
    ("total_p50_ms", "total p50 ms", 1),
    ("total_p99_ms", "total p99 ms", 1),
    ("inflation_p99", "infl. p99", 2),
    ("rps", "RPS", 0),
    ("effective_concurrency", "eff. conc.", 0),
    ("server_peak_rss_mb", "peak RSS MiB", 1),
    ("rss_per_session_kb", "RSS/session KiB", 1),
    ("server_peak_threads", "threads", 0),
    ("server_cpu_ms_per_session", "CPU ms/session", 3),
    ("server_cpu_us_per_step", "CPU µs/step", 1),
    ("client_cpu_us_per_step", "client CPU µs/step", 1),
    ("steps_per_s_per_core", "steps/s per server core", 0),
    ("unique_pids", "PIDs", 0),
    ("unique_hosts", "hosts", 0),
)


def errors_text(rows: Sequence[Row]) -> str:
    """``timeout:3 capacity:1`` summed over repetitions ('' when none), in
    :data:`~stadium.bench.stats.ERROR_KINDS` order."""
    parts = []
    for kind in stats.ERROR_KINDS:
        total = sum(int(r.get(error_column(kind)) or 0) for r in rows)
        if total:
            parts.append(f"{kind.value}:{total}")
    return " ".join(parts)


TERMINAL_COLUMNS = (
    "arm", "wait_s", "n", "success_rate", "errors", "total_p50_ms", "total_p99_ms",
    "inflation_p99", "rps", "rss_per_session_kb", "server_peak_threads",
    "server_cpu_us_per_step", "client_cpu_us_per_step", "unique_hosts",
)  # fmt: skip
"""The columns of the terminal table (the report has all of :data:`TABLE_COLUMNS`)."""


def table_rows(rows: Sequence[Row], columns: Sequence[str] | None = None) -> list[list[str]]:
    """Formatted cells (means over repetitions) for the tables of :data:`TABLE_COLUMNS`."""
    cols = [c for c in TABLE_COLUMNS if columns is None or c[0] in columns]
    out = []
    for (arm, wait, n), reps in by_point(rows).items():
        cells = []
        for col, _, digits in cols:
            if col == "arm":
                cells.append(arm)
            elif col == "wait_s":
                cells.append(f"{wait:g}")
            elif col == "n":
                cells.append(f"{n:,}")
            elif col == "errors":
                cells.append(errors_text(reps))
            else:
                cells.append(_fmt(mean_of(reps, col), digits))
        out.append(cells)
    return out


def failure_lines(rows: Iterable[Row]) -> list[str]:
    """``arm N=64 W=1 rep 1: 100 % failed: refused (64): ...`` for each point with failures."""
    return [
        f"{r['arm']} N={r['n']} W={float(r['wait_s']):g} rep {int(r['rep']) + 1}: {r['failures']}"
        for r in rows
        if r.get("failures")
    ]


def host_lines(rows: Iterable[Row]) -> list[str]:
    """``| arm | W | N | rep | hosts | split |`` rows: the sessions per host of each point."""
    return [
        f"| {r['arm']} | {float(r['wait_s']):g} | {int(r['n']):,} | {int(r['rep']) + 1} "
        f"| {r.get('unique_hosts') or 0} | {r.get('sessions_per_host') or '-'} |"
        for r in rows
        if r.get("sessions_per_host")
    ]


def machine_info() -> dict[str, str]:
    """CPU model, cores, memory, kernel, Python and package versions."""
    info: dict[str, str] = {
        "host": socket.gethostname(),
        "kernel": platform.release(),
        "python": sys.version.split()[0],
        "cores": str(os.cpu_count()),
    }
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                info["memory"] = f"{int(line.split()[1]) / 1024 / 1024:.1f} GiB"
                break
    except OSError:
        pass
    for pkg in ("stadium-rl", "picows", "uvloop", "msgspec", "openenv", "uvicorn", "websockets"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            info[pkg] = metadata.version(pkg)
    return info


def write_report(
    out_dir: Path,
    rows: Sequence[Row],
    *,
    command: str,
    settings: Mapping[str, Any],
    figures: Sequence[Path],
    notes: Sequence[str] = (),
    machine: Mapping[str, str] | None = None,
) -> Path:
    """Write ``report.md`` (tables, knees, figures, machine, versions, command)."""
    machine = machine if machine is not None else machine_info()
    lines = ["# Stadium benchmark report", ""]
    lines += ["Command:", "", "```", command, "```", ""]
    lines += ["## Machine and versions", "", "| item | value |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in machine.items()]
    lines += ["", "## Settings", "", "| setting | value |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in settings.items()]
    lines += ["", "## Max batch (knee) per arm", ""]
    lines += ["Largest N with >= 95 % success in every repetition.", ""]
    lines += ["| arm | W (s) | max batch | batch per core |", "|---|---|---|---|"]
    cores = server_cores(rows)
    for (arm, wait), mb in sorted(max_batches(rows).items()):
        per_core = stats.batch_per_core(mb, cores.get(arm, 1.0))
        lines.append(f"| {arm} | {wait:g} | {mb:,} | {per_core:,.0f} |")
    lines += ["", "## Points (means over repetitions)", ""]
    lines.append("| " + " | ".join(h for _, h, _ in TABLE_COLUMNS) + " |")
    lines.append("|" + "---|" * len(TABLE_COLUMNS))
    lines += ["| " + " | ".join(cells) + " |" for cells in table_rows(rows)]
    hosts = host_lines(rows)
    if hosts:
        lines += ["", "## Sessions per host", ""]
        lines += ["From each session's observation (`host`): how the load spread over nodes.", ""]
        lines += ["| arm | W (s) | N | rep | hosts | sessions per host |", "|---" * 6 + "|"]
        lines += hosts
    failures = failure_lines(rows)
    if failures:
        lines += ["", "## Failures", ""]
        lines += ["The most common error kinds of each point, with the first session's detail.", ""]
        lines += [f"- {f}" for f in failures]
    if notes:
        lines += ["", "## Notes", ""]
        lines += [f"- {n}" for n in notes]
    lines += ["", "## Figures", ""]
    for f in figures:
        lines += [f"### {f.stem.replace('_', ' ')}", "", f"![{f.stem}]({f.name})", ""]
    lines += [
        "## Method",
        "",
        "Each point is a burst of N sessions started at one instant by the load",
        "generator's processes: connect, reset, `steps` x (think, step waiting W s), close.",
        "Percentiles are nearest-rank; latency inflation is total latency over",
        "(W + think) x steps; server CPU is the server process tree's user + system",
        "time during the point, divided by sessions or steps; RSS per session is",
        "(peak RSS - idle RSS) / N. See BENCHMARKS.md.",
        "",
        "Files: `raw.jsonl` (one row per session), `summary.csv` (one row per point).",
        "",
    ]
    path = out_dir / "report.md"
    path.write_text("\n".join(lines))
    write_html(path)
    return path


_HTML_STYLE = """
body { font: 14px/1.5 system-ui, -apple-system, "Segoe UI", sans-serif; color: #1d2330;
       max-width: 1200px; margin: 24px auto; padding: 0 24px; }
h1 { font-size: 24px; } h2 { font-size: 18px; margin-top: 28px; border-bottom: 1px solid #e4e7ec; }
h3 { font-size: 15px; }
table { border-collapse: collapse; font-variant-numeric: tabular-nums; font-size: 12px;
        display: block; overflow-x: auto; }
th, td { border: 1px solid #e4e7ec; padding: 3px 8px; text-align: right; }
th { background: #f3f4f6; } td:first-child, th:first-child { text-align: left; }
pre { background: #f3f4f6; padding: 10px; border-radius: 6px; overflow-x: auto; }
code { font-size: 12px; } img { max-width: 100%; border: 1px solid #e4e7ec; }
"""


def write_html(md_path: Path) -> Path:
    """Write ``report.html`` beside ``md_path``: the same report rendered to HTML
    (markdown-it-py, tables on) with every figure embedded as a ``data:`` PNG, so the page
    reads on its own (no external file, script or style)."""
    import base64
    import html

    from markdown_it import MarkdownIt

    md = MarkdownIt("commonmark", {"html": False}).enable("table")
    tokens = md.parse(md_path.read_text())
    for token in tokens:
        for child in token.children or ():
            src = child.attrGet("src") if child.type == "image" else None
            if not isinstance(src, str) or "/" in src or src.startswith("."):
                continue
            image = md_path.parent / src
            if image.is_file():
                data = base64.b64encode(image.read_bytes()).decode("ascii")
                child.attrSet("src", f"data:image/png;base64,{data}")
    body = md.renderer.render(tokens, md.options, {})
    title = html.escape(md_path.parent.name or "report")
    page = (
        '<!doctype html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f"<title>Stadium benchmark report · {title}</title>\n"
        f"<style>{_HTML_STYLE}</style>\n</head>\n<body>\n{body}</body>\n</html>\n"
    )
    out = md_path.with_suffix(".html")
    out.write_text(page)
    return out


def print_table(rows: Sequence[Row], title: str = "stadium bench") -> None:
    """Print the points table and the knees to the terminal (rich)."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not console.is_terminal:  # piped or in CI: do not squeeze the table into 80 columns
        console = Console(width=160)
    table = Table(title=title, show_lines=False)
    for col, header, _ in TABLE_COLUMNS:
        if col in TERMINAL_COLUMNS:
            table.add_column(header, justify="left" if header in ("arm", "errors") else "right")
    for cells in table_rows(rows, TERMINAL_COLUMNS):
        table.add_row(*cells)
    console.print(table)
    knees = Table(title="max batch (>= 95 % success in every rep)")
    for h in ("arm", "W (s)", "max batch"):
        knees.add_column(h)
    for (arm, wait), mb in sorted(max_batches(rows).items()):
        knees.add_row(arm, f"{wait:g}", f"{mb:,}")
    console.print(knees)

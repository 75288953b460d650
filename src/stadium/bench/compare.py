"""``stadium bench compare``: two result sets side by side, with ratios.

Points are matched on (arm, wait, N), averaged over repetitions. When the two
directories share no arm name (e.g. ``stadium`` before a change and
``stadium`` after, or ``floor`` vs ``stadium``) and each has exactly one arm,
their arms are matched to each other. Ratios are B / A: below 1 means B is
lower (better for latency, CPU and memory; worse for success and batch).

Outputs in ``out_dir`` (default: DIR_B): ``compare.csv``, ``compare.md`` and
``compare.png``.
"""

from __future__ import annotations

import csv
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from stadium._errors import ConfigError
from stadium.bench import report, stats

METRICS: tuple[tuple[str, str], ...] = (
    ("success_rate", "success"),
    ("total_p50_ms", "total p50 ms"),
    ("total_p99_ms", "total p99 ms"),
    ("step_p99_ms", "step p99 ms"),
    ("connect_p99_ms", "connect p99 ms"),
    ("rps", "RPS"),
    ("server_cpu_us_per_step", "CPU µs/step"),
    ("server_cpu_ms_per_session", "CPU ms/session"),
    ("rss_per_session_kb", "RSS/session KiB"),
    ("server_peak_threads", "threads"),
)


def _load(d: Path) -> list[dict[str, Any]]:
    path = d / "summary.csv" if d.is_dir() else d
    if not path.exists():
        raise ConfigError(f"no summary.csv in {d}")
    return report.read_summary(path)


def _pairing(a_arms: set[str], b_arms: set[str]) -> list[tuple[str, str]]:
    common = sorted(a_arms & b_arms)
    if common:
        return [(x, x) for x in common]
    if len(a_arms) == 1 and len(b_arms) == 1:
        return [(next(iter(a_arms)), next(iter(b_arms)))]
    raise ConfigError(f"no arm to compare: A has {sorted(a_arms)}, B has {sorted(b_arms)}")


def compare_rows(
    rows_a: Sequence[Mapping[str, Any]], rows_b: Sequence[Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """One dict per matched (arm, wait, N): ``<metric>_a``, ``<metric>_b``, ``<metric>_ratio``."""
    ga, gb = report.by_point(rows_a), report.by_point(rows_b)
    pairs = _pairing({k[0] for k in ga}, {k[0] for k in gb})
    out: list[dict[str, Any]] = []
    for arm_a, arm_b in pairs:
        keys = sorted(
            {(w, n) for (a, w, n) in ga if a == arm_a} & {(w, n) for (b, w, n) in gb if b == arm_b}
        )
        for w, n in keys:
            ra, rb = ga[(arm_a, w, n)], gb[(arm_b, w, n)]
            row: dict[str, Any] = {
                "arm": arm_a if arm_a == arm_b else f"{arm_a} → {arm_b}",
                "wait_s": w,
                "n": n,
            }
            for col, _ in METRICS:
                va, vb = report.mean_of(ra, col), report.mean_of(rb, col)
                row[f"{col}_a"], row[f"{col}_b"] = va, vb
                row[f"{col}_ratio"] = stats.ratio(vb, va)
            out.append(row)
    mba, mbb = report.max_batches(rows_a), report.max_batches(rows_b)
    for arm_a, arm_b in pairs:
        for (arm, w), mb in sorted(mba.items()):
            if arm == arm_a and (arm_b, w) in mbb:
                out.append(
                    {
                        "arm": arm_a if arm_a == arm_b else f"{arm_a} → {arm_b}",
                        "wait_s": w,
                        "n": "max batch",
                        "max_batch_a": mb,
                        "max_batch_b": mbb[(arm_b, w)],
                        "max_batch_ratio": stats.ratio(mbb[(arm_b, w)], mb),
                    }
                )
    return out


def compare(dir_a: Path, dir_b: Path, out_dir: Path | None = None, *, echo: bool = True) -> Path:
    """Compare two result directories; write compare.{csv,md,png}; return the .md path."""
    out = out_dir or (dir_b if dir_b.is_dir() else dir_b.parent)
    return write_comparison(
        compare_rows(_load(dir_a), _load(dir_b)), out, str(dir_a), str(dir_b), echo=echo
    )


def compare_arms(result_dir: Path, arm_a: str, arm_b: str, *, echo: bool = True) -> Path:
    """Compare two arms of one result directory (e.g. ``stadium@REF`` and ``stadium``)."""
    rows = _load(result_dir)
    rows_a = [r for r in rows if r["arm"] == arm_a]
    rows_b = [r for r in rows if r["arm"] == arm_b]
    if not rows_a or not rows_b:
        raise ConfigError(f"{result_dir} has no rows for {arm_a!r} and {arm_b!r}")
    return write_comparison(compare_rows(rows_a, rows_b), result_dir, arm_a, arm_b, echo=echo)


def write_comparison(
    rows: Sequence[Mapping[str, Any]], out: Path, label_a: str, label_b: str, *, echo: bool = True
) -> Path:
    """Write compare.{csv,md,png} for rows of :func:`compare_rows`; return the .md path."""
    dir_a, dir_b = label_a, label_b
    out.mkdir(parents=True, exist_ok=True)
    cols = ["arm", "wait_s", "n"]
    for col, _ in (*METRICS, ("max_batch", "max batch")):
        cols += [f"{col}_a", f"{col}_b", f"{col}_ratio"]
    with (out / "compare.csv").open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=cols)
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in cols})
    shown = ("success_rate", "total_p99_ms", "server_cpu_us_per_step", "rss_per_session_kb")
    headers = ["arm", "W", "N"]
    for col, label in METRICS:
        if col in shown:
            headers += [f"{label} A", f"{label} B", "B/A"]
    table: list[list[str]] = []
    for r in rows:
        cells = [str(r["arm"]), f"{r['wait_s']:g}", str(r["n"])]
        if r["n"] == "max batch":
            cells += [str(r["max_batch_a"]), str(r["max_batch_b"]), _f(r["max_batch_ratio"], 2)]
            cells += [""] * (len(headers) - len(cells))
        else:
            for col, _ in METRICS:
                if col in shown:
                    cells += [_f(r[f"{col}_a"]), _f(r[f"{col}_b"]), _f(r[f"{col}_ratio"], 2)]
        table.append(cells)
    md = [f"# Compare: A = `{dir_a}`, B = `{dir_b}`", "", "Ratios are B / A.", ""]
    md.append("| " + " | ".join(headers) + " |")
    md.append("|" + "---|" * len(headers))
    md += ["| " + " | ".join(c) + " |" for c in table]
    md += ["", "![compare](compare.png)", ""]
    (out / "compare.md").write_text("\n".join(md))
    _plot(out / "compare.png", [r for r in rows if r["n"] != "max batch"])
    if echo:
        from rich.console import Console
        from rich.table import Table

        t = Table(title=f"A = {dir_a}   B = {dir_b}   (ratios B/A)")
        for h in headers:
            t.add_column(h, justify="left" if h == "arm" else "right")
        for c in table:
            t.add_row(*c)
        console = Console()
        if not console.is_terminal:
            console = Console(width=160)
        console.print(t)
    return out / "compare.md"


def _f(v: Any, digits: int = 1) -> str:
    if v is None:
        return "-"
    return f"{v:,.{digits}f}" if isinstance(v, float) else str(v)


def _plot(path: Path, rows: Sequence[Mapping[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (("total_p99_ms", "total p99 (ms)"), ("server_cpu_us_per_step", "CPU µs/step"),
              ("success_rate", "success rate"))  # fmt: skip
    fig, axes = plt.subplots(1, len(panels), figsize=(13, 4))
    keys = sorted({(str(r["arm"]), float(r["wait_s"])) for r in rows})
    for ax, (col, label) in zip(axes, panels, strict=True):
        for arm, w in keys:
            pts = sorted(
                (int(r["n"]), r[f"{col}_a"], r[f"{col}_b"])
                for r in rows
                if r["arm"] == arm and r["wait_s"] == w
            )
            xa = [(n, a) for n, a, _ in pts if a is not None]
            xb = [(n, b) for n, _, b in pts if b is not None]
            if xa:
                ax.plot(*zip(*xa, strict=True), "--", marker="o", label=f"A {arm} W={w:g}")
            if xb:
                ax.plot(*zip(*xb, strict=True), "-", marker="s", label=f"B {arm} W={w:g}")
        ax.set(xscale="log", xlabel="N", title=label)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

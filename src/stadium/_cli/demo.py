"""``stadium demo``: a server with the benchmark env, concurrent sessions, a readable report.

The server is started by :func:`stadium.bench.arms.spawn_server`, its CPU,
RSS and threads read by :func:`stadium.bench.procstat.read_stat`, latencies
summarized by :func:`stadium.bench.stats.percentile` (nearest rank), as in
``stadium bench``.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from stadium._client.session import AsyncClient
from stadium.bench.arms import spawn_server as spawn_server
from stadium.bench.procstat import read_stat
from stadium.bench.stats import percentile

_proc_stats = read_stat
"""(CPU seconds, RSS bytes, threads) of a process: the name the lifecycle tests import."""


async def _drive(url: str, sessions: int, steps: int, wait: float) -> dict[str, Any]:
    latencies: list[float] = []
    failures: list[str] = []

    async def one(i: int) -> None:
        t0 = time.perf_counter()
        try:
            client: AsyncClient[Any] = AsyncClient(url)
            async with client as env:
                await env.reset(seed=i)
                for _ in range(steps):
                    await env.step({"wait_seconds": wait})
        except Exception as exc:
            failures.append(type(exc).__name__)
            return
        latencies.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(sessions)))
    return {
        "elapsed": time.perf_counter() - t0,
        "latencies": latencies,
        "failures": failures,
    }


def _seconds(values: list[float], p: float) -> str:
    q = percentile(values, p)
    return "-" if q is None else f"{q:.3f}s"


def run_demo(*, sessions: int, steps: int, wait: float, bench: bool) -> int:
    """Run the demo; return the exit code."""
    console = Console()
    console.rule("[bold]Stadium demo")
    with spawn_server(
        "benchmark", "--max-sessions", str(max(sessions, 1)), "--log-level", "warning"
    ) as (proc, url):
        console.print(f"server pid {proc.pid} at {url}, benchmark env")
        before = read_stat(proc.pid)
        res = asyncio.run(_drive(url, sessions, steps, wait))
        after = read_stat(proc.pid)
    lat = res["latencies"]
    ok = len(lat)
    total_steps = ok * steps
    ideal = steps * wait
    table = Table(title=f"{sessions} concurrent sessions × {steps} steps of {wait:g}s")
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_row("sessions succeeded", f"{ok}/{sessions}")
    table.add_row("session latency p50 / p99", f"{_seconds(lat, 50)} / {_seconds(lat, 99)}")
    table.add_row("ideal session time (steps × wait)", f"{ideal:.3f}s")
    table.add_row("wall time", f"{res['elapsed']:.2f}s")
    table.add_row("steps per second", f"{total_steps / res['elapsed']:.0f}")
    table.add_row(
        "server CPU per session (incl. steps)",
        f"{(after.cpu_s - before.cpu_s) / max(ok, 1) * 1e3:.3f} ms",
    )
    table.add_row("server threads before / after", f"{before.threads} / {after.threads}")
    table.add_row("server RSS after", f"{after.rss_bytes / 2**20:.1f} MiB")
    console.print(table)
    if res["failures"]:
        console.print(f"[red]failures: {sorted(set(res['failures']))}")
    if bench:
        from stadium.bench import run_ramp

        out = Path("bench-results") / time.strftime("demo-%Y%m%d-%H%M%S")
        report = run_ramp(
            arms=["stadium", "floor"],
            requests_grid=[32, 128, 512, 2048],
            wait_grid=[1.0],
            reps=1,
            output_dir=out,
        )
        console.print(f"[bold]Benchmark report:[/bold] {report}")
    return 0 if ok == sessions else 1

"""``stadium demo``: a server with the benchmark env, concurrent sessions, a readable report."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from stadium._client import AsyncClient

_LISTENING = re.compile(r"listening on (http://\S+)")


@contextlib.contextmanager
def spawn_server(*args: str, timeout: float = 30.0) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """Start ``stadium serve ARGS`` on a free port; yield (process, base URL); stop it after."""
    cmd = [sys.executable, "-m", "stadium", "serve", *args]
    if "--port" not in args:
        cmd += ["--port", "0"]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True
    )
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + timeout
        url = None
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            match = _LISTENING.search(line)
            if match:
                url = match.group(1)
                break
        if url is None:
            raise RuntimeError(f"server did not start: {' '.join(cmd)} (exit {proc.poll()})")
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _proc_stats(pid: int) -> tuple[float, int, int]:
    """CPU seconds (user+sys), RSS bytes and thread count of a process, from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    cpu = (int(fields[11]) + int(fields[12])) / ticks
    threads = int(fields[17])
    rss = int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
    return cpu, rss, threads


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
        "latencies": sorted(latencies),
        "failures": failures,
    }


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    return values[min(len(values) - 1, int(q * len(values)))]


def run_demo(*, sessions: int, steps: int, wait: float, bench: bool) -> int:
    """Run the demo; return the exit code."""
    console = Console()
    console.rule("[bold]Stadium demo")
    with spawn_server(
        "benchmark", "--max-sessions", str(max(sessions, 1)), "--log-level", "warning"
    ) as (proc, url):
        console.print(f"server pid {proc.pid} at {url}, benchmark env")
        cpu0, _, threads0 = _proc_stats(proc.pid)
        res = asyncio.run(_drive(url, sessions, steps, wait))
        cpu1, rss, threads1 = _proc_stats(proc.pid)
    lat = res["latencies"]
    ok = len(lat)
    total_steps = ok * steps
    ideal = steps * wait
    table = Table(title=f"{sessions} concurrent sessions × {steps} steps of {wait:g}s")
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_row("sessions succeeded", f"{ok}/{sessions}")
    table.add_row("session latency p50 / p99", f"{_pct(lat, 0.5):.3f}s / {_pct(lat, 0.99):.3f}s")
    table.add_row("ideal session time (steps × wait)", f"{ideal:.3f}s")
    table.add_row("wall time", f"{res['elapsed']:.2f}s")
    table.add_row("steps per second", f"{total_steps / res['elapsed']:.0f}")
    table.add_row(
        "server CPU per session (incl. steps)", f"{(cpu1 - cpu0) / max(ok, 1) * 1e3:.3f} ms"
    )
    table.add_row("server threads before / after", f"{threads0} / {threads1}")
    table.add_row("server RSS after", f"{rss / 2**20:.1f} MiB")
    console.print(table)
    if res["failures"]:
        console.print(f"[red]failures: {sorted(set(res['failures']))}")
    if bench:
        try:
            from stadium.bench import run_ramp  # type: ignore[import-not-found,unused-ignore]
        except ImportError:
            console.print("[yellow]stadium.bench is not available: skipping the ramp")
        else:
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

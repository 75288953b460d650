"""``stadium bench start``: time to first observation, the way sandbox providers are compared.

For each isolation level (``none`` / ``process`` / ``sandbox``) and each start kind
(``warm``: ``--warm-pool N`` env processes built ahead; ``cold``: none, each session's
process forked when it connects), one ``stadium serve TARGET`` subprocess on
127.0.0.1 is timed from a client's connect to its first ``reset`` observation, in three
patterns:

* **sequential**: one session at a time (each closed before the next opens; the warm
  pool is topped up between them, as a provider's idle pool would be);
* **staggered**: sessions opened at a fixed rate (``--rate`` per second), held open;
* **burst**: ``--sessions`` opened at once, held open.

p50 and p99 of each (ms), one run, side by side (``start.md``, ``start.json``). The
warm pool is full again before each pattern. ``none`` has no env process to start:
its rows are the floor (connect, admission, env construction, reset).

Every load is bounded (``--sessions`` per pattern, a deadline per session); the
servers are stopped by their pid.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from stadium._core.frames import Request
from stadium._core.urls import ws_url
from stadium._util.health import healthy
from stadium.bench.procstat import terminate
from stadium.bench.sessions import connection_class

PATTERNS = ("sequential", "staggered", "burst")
_RESET = msgspec.json.encode(Request("reset", {}))
#: Seconds one session may take to its first observation before the run fails.
SESSION_DEADLINE_S = 120.0


def isolated_processes(url: str) -> float:
    """``stadium_isolated_processes`` from a server's ``/metrics`` (env processes alive,
    warm pool included)."""
    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("stadium_isolated_processes "):
                return float(line.split()[1])
    return 0.0


@dataclasses.dataclass(frozen=True, slots=True)
class StartOptions:
    """What ``stadium bench start`` runs (see the module docstring)."""

    target: str = "benchmark"
    isolation: tuple[str, ...] = ("none", "process", "sandbox")
    warm_pool: int = 64
    sessions: int = 50
    rate: float = 50.0
    output_dir: Path = Path("bench-results/start")


class _Server:
    """``stadium serve`` in a subprocess on a free loopback port."""

    def __init__(self, opts: StartOptions, isolation: str, warm: int) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.warm = warm
        argv = [
            sys.executable, "-m", "stadium", "serve", opts.target, "--host", "127.0.0.1",
            "--port", str(port), "--isolation", isolation, "--warm-pool", str(warm),
            "--max-sessions", str(max(256, 2 * opts.sessions)), "--log-level", "warning",
            "--admission-timeout", "60",
        ]  # fmt: skip
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while not healthy(self.url, 1.0):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"stadium serve --isolation {isolation} did not start")
            time.sleep(0.1)

    def processes(self) -> float:
        return isolated_processes(self.url)

    async def settle(self) -> None:
        """Until the warm pool is full and no session's process is left (at most 60 s)."""
        if not self.warm:
            await asyncio.sleep(0.2)
            return
        for _ in range(300):
            if await asyncio.to_thread(self.processes) == self.warm:
                return
            await asyncio.sleep(0.2)

    def stop(self) -> None:
        terminate(self.proc)


async def _first_observation(url: str, opened: list[Any]) -> float:
    """Connect (the bench's own picows client) and reset: seconds to the observation."""
    t0 = time.perf_counter()
    conn = connection_class("ws")(ws_url(url), None)
    opened.append(conn)
    await conn.connect(SESSION_DEADLINE_S)
    await conn.request("reset", _RESET, SESSION_DEADLINE_S)
    return time.perf_counter() - t0


async def _close(opened: list[Any]) -> None:
    """Say goodbye on each connection that opened, wait for the closes, drop the rest."""
    for conn in opened:
        if conn.transport is not None and not conn.disconnected:
            conn.close()
    await asyncio.gather(*(conn.closed(10.0) for conn in opened), return_exceptions=True)
    for conn in opened:
        conn.abort()


async def sequential(url: str, n: int, settle: Callable[[], Any]) -> list[float]:
    """``n`` sessions one after the other, each closed (and the pool topped up) before the next."""
    out = []
    for _ in range(n):
        opened: list[Any] = []
        try:
            out.append(await _first_observation(url, opened))
        finally:
            await _close(opened)
        await settle()
    return out


async def together(url: str, n: int, interval: float) -> list[float]:
    """``n`` sessions opened ``interval`` s apart (0: a burst), held open until the last
    one's first observation."""
    opened: list[Any] = []

    async def one(delay: float) -> float:
        await asyncio.sleep(delay)
        return await _first_observation(url, opened)

    try:
        return list(await asyncio.gather(*(one(i * interval) for i in range(n))))
    finally:
        await _close(opened)


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def _measure(opts: StartOptions, isolation: str, warm: int) -> dict[str, Any]:
    server = await asyncio.to_thread(_Server, opts, isolation, warm)
    try:
        await together(server.url, 3, 0.0)  # the template's start is the worker's, not a session's
        row: dict[str, Any] = {"isolation": isolation, "warm_pool": warm}
        for pattern in PATTERNS:
            await server.settle()
            if pattern == "sequential":
                times = await sequential(server.url, opts.sessions, server.settle)
            else:
                interval = 1.0 / opts.rate if pattern == "staggered" else 0.0
                times = await together(server.url, opts.sessions, interval)
            row[pattern] = {
                "p50_ms": statistics.median(times) * 1000,
                "p99_ms": pct(times, 0.99) * 1000,
                "max_ms": max(times) * 1000,
            }
        return row
    finally:
        await asyncio.to_thread(server.stop)


def _sandbox_missing() -> str | None:
    """Why ``--isolation sandbox`` cannot run here (the server's own check), else ``None``."""
    if os.geteuid() != 0:
        return "it needs root"
    out = subprocess.run(
        [sys.executable, "-c", "from stadium._server.isolation import sandbox_unavailable as s;"
         "print(s() or '')"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    return out.stdout.strip() or None


async def run_start(opts: StartOptions, echo: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the benchmark; write ``start.json`` and ``start.md`` under ``opts.output_dir``."""
    rows: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    for isolation in opts.isolation:
        if isolation == "sandbox":
            why = await asyncio.to_thread(_sandbox_missing)
            if why is not None:
                skipped[isolation] = why
                echo(f"start: sandbox skipped: {why}")
                continue
        for warm in (opts.warm_pool, 0) if isolation != "none" else (0,):
            echo(f"start: {isolation}, warm pool {warm} ...")
            rows.append(await _measure(opts, isolation, warm))
    result = {
        "machine": f"{platform.node()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "command": " ".join(["stadium", "bench", "start", *sys.argv[3:]]),
        "options": {k: str(v) for k, v in dataclasses.asdict(opts).items()},
        "rows": rows,
        "skipped": skipped,
    }
    opts.output_dir.mkdir(parents=True, exist_ok=True)
    (opts.output_dir / "start.json").write_text(json.dumps(result, indent=2))
    (opts.output_dir / "start.md").write_text(table(result, opts))
    return result


def table(result: dict[str, Any], opts: StartOptions) -> str:
    """The Markdown table of a run."""
    lines = [
        f"Time to first observation (connect → first `reset` observation), ms, p50 / p99; "
        f"{opts.sessions} sessions per pattern, staggered at {opts.rate:g}/s; "
        f"{result['machine']}.",
        "",
        "| isolation | start | sequential | staggered | burst |",
        "|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        kind = f"warm (pool {row['warm_pool']})" if row["warm_pool"] else "cold"
        if row["isolation"] == "none":
            kind = "— (in the worker)"
        cells = [f"{row[p]['p50_ms']:.2f} / {row[p]['p99_ms']:.2f}" for p in PATTERNS]
        lines.append(f"| {row['isolation']} | {kind} | {' | '.join(cells)} |")
    for isolation, why in result["skipped"].items():
        lines.append(f"| {isolation} | skipped: {why} | | | |")
    return "\n".join(lines) + "\n"


__all__ = ["PATTERNS", "StartOptions", "run_start", "table"]

#!/usr/bin/env python3
"""Burst start and mass close of isolated sessions, before/after in one run.

For each ``--python LABEL=PYTHON`` (an interpreter whose ``stadium`` is the tree to
measure, e.g. another checkout's ``.venv/bin/python``; default: this one), one
``stadium serve scripts/isolation_env.py:BenchEnv --isolation MODE`` subprocess on
127.0.0.1:

1. **burst start**: ``--burst`` sessions connect and reset at once (no warm pool: each
   env process forked then); p50/p99/max of connect → first observation, and the
   server's CPU (its process tree) per session started;
2. **mass close**: ``--sessions`` sessions opened (32 at a time) and held, then all
   closed at once, while a probe connection (a separate process, so the closing clients
   do not delay it) sends WebSocket pings in a loop: the worker's event loop answers
   them (the connection never asks its env anything, so it has no env process), so the
   worker's loop lag shows as the probe's latency (a probe whose env process answered
   would measure that process's turn among a thousand exiting ones instead). Reported: the probe's max and
   p99 latency during the close (and its max before it, at rest), how long until every
   env process was gone, and the
   watchdog's stall reports (a loop stuck over 1 s, with its stack) from the server's log.

Run as root for ``sandbox``::

    .venv/bin/python scripts/bench-mass-close.py \
        --python before=/work/main/.venv/bin/python --python after=.venv/bin/python

Every load is bounded (counts, and a deadline per phase); servers and the probe are
stopped by pid.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import stadium
from stadium._util.health import healthy
from stadium.bench.procstat import terminate, tree_cpu_s
from stadium.bench.start import isolated_processes

HERE = Path(__file__).resolve().parent
TARGET = f"{HERE / 'isolation_env.py'}:BenchEnv"
PHASE_DEADLINE_S = 180.0

PROBE = r"""
import asyncio, json, sys, time
import websockets

async def main(url):
    out = []
    # Pings only: the session never asks its env anything, so it has no env process.
    async with websockets.connect(url.replace("http://", "ws://") + "/ws") as ws:
        await (await ws.ping())
        print("ready", flush=True)
        loop = asyncio.get_running_loop()
        stop = loop.create_future()
        loop.add_reader(sys.stdin.fileno(), lambda: stop.done() or stop.set_result(None))
        deadline = time.monotonic() + 600
        while not stop.done() and time.monotonic() < deadline:
            t0 = time.monotonic()
            await (await ws.ping())  # the pong comes from the worker's loop: its lag
            out.append((t0, time.monotonic() - t0))
            await asyncio.sleep(0.001)
    print(json.dumps(out), flush=True)

asyncio.run(main(sys.argv[1]))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    def __init__(self, python: str, mode: str, max_sessions: int, log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [
            python, "-m", "stadium", "serve", TARGET, "--host", "127.0.0.1",
            "--port", str(self.port), "--isolation", mode, "--max-sessions",
            str(max_sessions), "--idle-timeout", "0", "--log-level", "warning",
            "--admission-timeout", "120",
        ]  # fmt: skip
        self.log = log
        self._log_file = open(log, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(argv, stdout=self._log_file, stderr=self._log_file)
        deadline = time.monotonic() + 60
        while not healthy(self.url, 1.0):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"server ({python}) did not start; see {log}")
            time.sleep(0.1)

    def processes(self) -> float:
        return isolated_processes(self.url)

    def cpu_s(self) -> float:
        return tree_cpu_s(self.proc.pid)

    def stop(self) -> None:
        terminate(self.proc, 60.0)
        self._log_file.close()


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def open_sessions(url: str, n: int, at_once: int) -> tuple[list[Any], list[float]]:
    envs: list[Any] = []
    times: list[float] = []
    sem = asyncio.Semaphore(at_once)

    async def one() -> None:
        async with sem:
            t0 = time.perf_counter()
            env: stadium.AsyncClient[Any] = stadium.AsyncClient(url)
            envs.append(env)
            await env.connect()
            await env.reset()
            times.append(time.perf_counter() - t0)

    async with asyncio.timeout(PHASE_DEADLINE_S):
        await asyncio.gather(*(one() for _ in range(n)))
    return envs, times


async def wait_processes(server: Server, at_most: float) -> float:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < PHASE_DEADLINE_S:
        if await asyncio.to_thread(server.processes) <= at_most:
            break
        await asyncio.sleep(0.05)
    return time.perf_counter() - t0


async def measure(label: str, python: str, args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    row: dict[str, Any] = {"label": label, "python": python}
    server = Server(python, args.isolation, args.sessions + args.burst + 16, logs / f"{label}.log")
    try:
        warm, _ = await open_sessions(server.url, 4, 4)  # the template is up, the code warm
        await asyncio.gather(*(e.close() for e in warm), return_exceptions=True)
        await asyncio.sleep(1.0)
        await wait_processes(server, 0)
        # 1. burst start
        cpu0 = server.cpu_s()
        envs, times = await open_sessions(server.url, args.burst, args.burst)
        row["burst_cpu_ms"] = (server.cpu_s() - cpu0) / args.burst * 1000
        row["burst"] = [statistics.median(times), pct(times, 0.99), max(times)]
        await asyncio.gather(*(e.close() for e in envs), return_exceptions=True)
        await wait_processes(server, 0)
        # 2. mass close, with a probe stepping meanwhile
        envs, _ = await open_sessions(server.url, args.sessions, 32)
        probe = subprocess.Popen(  # noqa: ASYNC220 - started once, read in a thread
            [sys.executable, "-c", PROBE, server.url],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert probe.stdout is not None
        assert probe.stdin is not None
        try:
            assert (await asyncio.to_thread(probe.stdout.readline)).strip() == "ready"
            await asyncio.sleep(2.0)  # the probe at rest
            closing = time.monotonic()
            await asyncio.gather(*(e.close() for e in envs), return_exceptions=True)
            row["gone_s"] = await wait_processes(server, 0)
            await asyncio.sleep(1.0)
            probe.stdin.close()
            samples = json.loads(await asyncio.to_thread(probe.stdout.readline))
        finally:
            if probe.poll() is None:
                probe.kill()
            probe.wait()
        rest = [lat for t, lat in samples if t < closing]
        during = [lat for t, lat in samples if t >= closing]
        row["rest_max"] = max(rest)
        row["close_max"] = max(during)
        row["close_p99"] = pct(during, 0.99)
    finally:
        server.stop()
    row["stalls"] = [
        line.strip()
        for line in server.log.read_text(errors="replace").splitlines()
        if "stall" in line
    ]
    return row


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--python", action="append", default=[],
                   help="LABEL=PYTHON: an interpreter and its Stadium (repeat)")  # fmt: skip
    p.add_argument("--isolation", default="sandbox", choices=["process", "sandbox"])
    p.add_argument("--sessions", type=int, default=1000)
    p.add_argument("--burst", type=int, default=100)
    args = p.parse_args()
    pythons = [s.split("=", 1) for s in args.python] or [["this", sys.executable]]
    logs = Path(tempfile.mkdtemp(prefix="stadium-mass-close-"))
    rows = [await measure(label, python, args, logs) for label, python in pythons]
    print(f"# {' '.join(sys.argv)}  ({os.cpu_count()} cores; logs in {logs})")
    print()
    print(
        f"| tree | burst of {args.burst}: first observation p50 / p99 / max (ms) | server CPU "
        f"per start (ms) | close of {args.sessions}: probe max / p99 (ms) | at rest: "
        "max (ms) | all env processes gone (s) | watchdog stall reports |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        burst = " / ".join(f"{v * 1000:.0f}" for v in r["burst"])
        print(
            f"| {r['label']} | {burst} | {r['burst_cpu_ms']:.2f} | {r['close_max'] * 1000:.0f} / "
            f"{r['close_p99'] * 1000:.0f} | {r['rest_max'] * 1000:.0f} | {r['gone_s']:.1f} | "
            f"{len(r['stalls'])} |"
        )
    for r in rows:
        for line in r["stalls"]:
            print(f"{r['label']}: {line[:300]}")


if __name__ == "__main__":
    asyncio.run(main())

#!/usr/bin/env python3
"""``--record``'s cost on a whole server: ``stadium bench`` against a server without and
with ``--record`` (then ``stadium bench compare``), and the event loop's stalls meanwhile.

For each variant, one ``stadium serve benchmark`` (one worker, on CPU 0) and, on CPU 1,
``stadium bench --url`` (N sessions at once, steps waiting W, S steps each, R repetitions: one
episode of S steps per session, recorded when it closes) with a probe process sending
WebSocket pings on a session of its own: the worker's loop answers each ping (the
session asks its env nothing), so the probe's latency is the loop's lag. Reported per
variant: the pings' p50/p99/max and how many took over 5 ms, during the load; then
``stadium bench compare off record`` (the server CPU per step, record/off).

    flock /tmp/bench.lock .venv/bin/python scripts/bench-record-stall.py \\
        [--sessions 2000] [--steps 50] [--wait W] [--reps 3] [--out DIR]

At W = 0 the worker is saturated (pings queue behind the sessions' frames: their latency
is the queue's, with or without --record); W > 0 (e.g. 0.2: 2,000 sessions step 10,000
times a second, the loop partly idle) shows stalls.

Servers and the probe are stopped by pid; every phase is bounded in time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

PROBE = r"""
import asyncio, json, sys, time
import websockets

async def main(url):
    out = []
    async with websockets.connect(url.replace("http://", "ws://") + "/ws",
                                  max_queue=None) as ws:
        await (await ws.ping())
        print("ready", flush=True)
        loop = asyncio.get_running_loop()
        stop = loop.create_future()
        loop.add_reader(sys.stdin.fileno(), lambda: stop.done() or stop.set_result(None))
        deadline = time.monotonic() + 900
        while not stop.done() and time.monotonic() < deadline:
            t0 = time.monotonic()
            await (await ws.ping())
            out.append(time.monotonic() - t0)
            await asyncio.sleep(0.002)
    print(json.dumps(out), flush=True)

asyncio.run(main(sys.argv[1]))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=1.0) as r:
            return bool(r.status == 200)
    except OSError:
        return False


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def run(variant: str, args: argparse.Namespace, work: Path) -> dict[str, float]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [
        "taskset", "-c", "0", sys.executable, "-m", "stadium", "serve", "benchmark",
        "--host", "127.0.0.1", "--port", str(port), "--max-sessions",
        str(args.sessions * 2 + 64), "--log-level", "warning",
    ]  # fmt: skip
    if variant == "record":
        argv += ["--record", str(work / "rec")]
    log = open(work / f"{variant}.log", "wb")  # noqa: SIM115 - closed below
    server = subprocess.Popen(argv, stdout=log, stderr=log)
    probe = None
    try:
        deadline = time.monotonic() + 60
        while not healthy(url):
            if time.monotonic() > deadline or server.poll() is not None:
                raise RuntimeError(f"the server did not start: {work / variant}.log")
            time.sleep(0.1)
        probe = subprocess.Popen(
            ["taskset", "-c", "1", sys.executable, "-c", PROBE, url],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert probe.stdout is not None
        assert probe.stdin is not None
        assert probe.stdout.readline().strip() == "ready"
        bench = [
            sys.executable, "-m", "stadium", "bench", "--url", url, "--server-pid",
            str(server.pid), "--requests-grid", str(args.sessions), "--wait-grid", str(args.wait),
            "--steps", str(args.steps), "--reps", str(args.reps), "--load-cpus", "1",
            "--output-dir", str(args.out / variant), "--no-progress", "--deadline", "900",
        ]  # fmt: skip
        subprocess.run(bench, check=True, timeout=960, stdout=subprocess.DEVNULL)
        probe.stdin.write("\n")
        probe.stdin.flush()
        lags = json.loads(probe.stdout.readline())
        probe.wait(30)
    finally:
        if probe is not None and probe.poll() is None:
            probe.kill()
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
    ms = [x * 1e3 for x in lags]
    return {
        "pings": len(ms), "p50_ms": pct(ms, 0.5), "p99_ms": pct(ms, 0.99),
        "max_ms": max(ms), "over_5ms": sum(1 for x in ms if x > 5.0),
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sessions", type=int, default=2000)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--wait", type=float, default=0.0, help="W: seconds each step waits")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="stadium-record-stall-"))
    args.out = args.out or work / "bench"
    try:
        for variant in ("off", "record"):
            got = run(variant, args, work)
            print(variant, " ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}"
                                    for k, v in got.items()), flush=True)  # fmt: skip
        shards = list((work / "rec").glob("*.parquet"))
        print(f"record: {len(shards)} shard(s)")
        subprocess.run(
            [sys.executable, "-m", "stadium", "bench", "compare", str(args.out / "off"),
             str(args.out / "record")],
            check=False,
        )  # fmt: skip
    finally:
        shutil.rmtree(work / "rec", ignore_errors=True)
        if os.environ.get("KEEP") is None and args.out.is_relative_to(work):
            shutil.rmtree(work, ignore_errors=True)


main()

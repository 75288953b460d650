"""What session resume, durable sessions and fork cost (BENCHMARKS.md, "Sessions that survive").

1. Server CPU per step, in process (the driver of ``stadium bench ops``: no sockets,
   uvloop, 4 benchmark sessions, ``time.process_time`` per batch), arms alternated:
   a plain session, a resumable one, a durable one writing to tmpfs (/dev/shm) and
   to disk (a directory under /var/tmp).
2. Against a real server (``stadium serve benchmark`` in a subprocess), through a TCP
   relay this script controls: resume latency (cut the connection, time until the
   next step's reply), fork vs a fresh session + reset (client wall time per new
   session, same server), and the memory a detached session holds (server RSS with
   N sessions connected, then detached, then gone).

Usage: ``.venv/bin/python scripts/bench-resume.py [--steps N] [--sessions N]``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import stadium
from stadium._core.resume import new_session_id, new_token
from stadium._server.config import ServerConfig
from stadium._server.processes.worker import Worker
from stadium._server.sessions.runner import Session
from stadium._util.process import new_event_loop
from stadium.bench.opcount import _Driver
from stadium.envs.benchmark import BenchmarkEnv
from tests.relay import relay_to

STEP = b'{"type":"step","data":{"wait_seconds":0},"id":1}'


def _resumable(runtime: Any, channel: Any) -> Session:
    return Session(runtime, channel, resume=(new_session_id(os.getpid()), new_token()))


async def per_step(steps: int, reps: int) -> dict[str, list[float]]:
    shm = Path(tempfile.mkdtemp(prefix="stadium-bench-", dir="/dev/shm"))
    disk = Path(tempfile.mkdtemp(prefix="stadium-bench-", dir="/var/tmp"))
    arms: dict[str, tuple[Any, Any]] = {}
    for name, kwargs, factory in (
        ("plain", {}, None),
        ("resumable", {}, _resumable),
        ("durable tmpfs", {"durable": True, "session_store": str(shm / "s")}, _resumable),
        ("durable disk", {"durable": True, "session_store": str(disk / "s")}, _resumable),
    ):
        config = ServerConfig(target="benchmark", max_sessions=8, **kwargs)
        rt = Worker.build(config, BenchmarkEnv).runtime
        driver = _Driver(rt, STEP, factory)
        opened = [await driver.open() for _ in range(4)]
        await driver.steps(opened, 2000)
        arms[name] = (driver, opened)
    out: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(reps):
        for name, (driver, opened) in arms.items():
            t = time.process_time()
            await driver.steps(opened, steps)
            out[name].append((time.process_time() - t) / steps * 1e6)
    for driver, _opened in arms.values():
        driver.runtime.shutdown()
    shutil.rmtree(shm, ignore_errors=True)
    shutil.rmtree(disk, ignore_errors=True)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


async def _wait_healthy(url: str) -> None:
    import urllib.request

    for _ in range(300):
        try:
            with urllib.request.urlopen(url + "/health", timeout=1):
                return
        except OSError:
            await asyncio.sleep(0.05)
    raise SystemExit("server did not come up")


async def end_to_end(cuts: int, forks: int, detached: int) -> dict[str, Any]:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "stadium", "serve", "benchmark", "--host", "127.0.0.1",
         "--port", str(port), "--log-level", "warning", "--drain-timeout", "1",
         "--resume-grace", "5"],
    )  # fmt: skip
    out: dict[str, Any] = {}
    try:
        await _wait_healthy(url)
        async with relay_to(url) as relay:
            # Resume latency: cut, then time the next step (reconnect + resume + step).
            async with stadium.AsyncClient(relay.url) as env:
                await env.reset()
                plain, resumed = [], []
                for _ in range(cuts):
                    t = time.perf_counter()
                    await env.step({"wait_seconds": 0.0})
                    plain.append(time.perf_counter() - t)
                    relay.cut()
                    await asyncio.sleep(0.01)  # let the loss be seen (no request in flight)
                    t = time.perf_counter()
                    await env.step({"wait_seconds": 0.0})
                    resumed.append(time.perf_counter() - t)
                out["step ms (median)"] = statistics.median(plain) * 1e3
                out["resume + step ms (median)"] = statistics.median(resumed) * 1e3
                out["resume + step ms (max)"] = max(resumed) * 1e3
        # Fork vs a new session + reset, alternated.
        async with stadium.AsyncClient(url) as parent:
            await parent.reset(seed=1)
            for _ in range(5):
                await parent.step({"wait_seconds": 0.0})
            fork_s, fresh_s = [], []
            for _ in range(forks):
                t = time.perf_counter()
                child = await parent.fork()
                fork_s.append(time.perf_counter() - t)
                await child.close()
                t = time.perf_counter()
                fresh = stadium.AsyncClient(url)
                await fresh.connect()
                await fresh.reset(seed=1)
                fresh_s.append(time.perf_counter() - t)
                await fresh.close()
            out["fork ms (median)"] = statistics.median(fork_s) * 1e3
            out["new session + reset ms (median)"] = statistics.median(fresh_s) * 1e3
        # Memory held by detached sessions.
        await asyncio.sleep(0.5)
        base = _rss_kib(proc.pid)
        async with relay_to(url) as relay:
            clients = [stadium.AsyncClient(relay.url, max_retries=20) for _ in range(detached)]
            for i in range(0, detached, 256):
                await asyncio.gather(*(c.connect() for c in clients[i : i + 256]))
            await asyncio.gather(*(c.reset() for c in clients))
            await asyncio.sleep(0.5)
            connected = _rss_kib(proc.pid)
            relay.refusing = True
            relay.cut()
            await asyncio.sleep(1.0)
            held = _rss_kib(proc.pid)
            await asyncio.sleep(6.0)  # past the 5 s grace: gone
            gone = _rss_kib(proc.pid)
            for c in clients:
                c._stop_resuming(stadium.SessionClosedError("benchmark over"))
        out["sessions"] = detached
        out["RSS KiB: before / connected / detached / expired"] = (base, connected, held, gone)
        out["KiB per connected session"] = (connected - base) / detached
        out["KiB per detached session"] = (held - base) / detached
    finally:
        proc.terminate()
        proc.wait(30)
    return out


async def big_state(state_kb: int, steps: int) -> dict[str, float]:
    """What a session with a large state costs the others (``--durable``): one client
    steps a session holding ``state_kb`` KiB while another steps a small one on the same
    one-worker server; the small session's step latency, against the same with no
    large session."""
    store = tempfile.mkdtemp(prefix="stadium-bench-", dir="/var/tmp")
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "stadium", "serve", "benchmark", "--host", "127.0.0.1",
         "--port", str(port), "--log-level", "warning", "--drain-timeout", "1",
         "--durable", "--session-store", os.path.join(store, "s")],
    )  # fmt: skip
    out: dict[str, float] = {}
    try:
        await _wait_healthy(url)

        async def small_steps() -> list[float]:
            took = []
            async with stadium.AsyncClient(url) as small:
                await small.reset()
                for _ in range(steps):
                    t = time.perf_counter()
                    await small.step({"wait_seconds": 0.0})
                    took.append(time.perf_counter() - t)
            return took

        alone = await small_steps()
        async with stadium.AsyncClient(url) as big:
            await big.reset(options={"state_kb": state_kb})
            done = asyncio.Event()
            big_steps = 0

            async def stepping() -> None:
                nonlocal big_steps
                while not done.is_set() and big_steps < 100 * steps:
                    await big.step({"wait_seconds": 0.0})
                    big_steps += 1

            task = asyncio.create_task(stepping())
            await asyncio.sleep(0.2)
            beside = await small_steps()
            done.set()
            await task
        for name, took in (("alone", alone), ("beside", beside)):
            took.sort()
            out[f"small step ms {name}: median"] = statistics.median(took) * 1e3
            out[f"small step ms {name}: p99"] = took[int(len(took) * 0.99) - 1] * 1e3
            out[f"small step ms {name}: max"] = took[-1] * 1e3
        out["big session steps meanwhile"] = big_steps
    finally:
        proc.terminate()
        proc.wait(30)
        shutil.rmtree(store, ignore_errors=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20000)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--cuts", type=int, default=50)
    p.add_argument("--forks", type=int, default=200)
    p.add_argument("--sessions", type=int, default=2000)
    p.add_argument(
        "--big-state-kb",
        type=int,
        default=0,
        help="only measure what a durable session holding this much state costs the others",
    )
    a = p.parse_args()
    if a.big_state_kb:
        with asyncio.Runner(loop_factory=new_event_loop) as r:
            big = r.run(big_state(a.big_state_kb, a.steps))
        print(f"--durable, one session holding {a.big_state_kb} KiB beside a small one:")
        for k, v in big.items():
            print(f"  {k}: {round(v, 3)}")
        return
    with asyncio.Runner(loop_factory=new_event_loop) as r:
        steps = r.run(per_step(a.steps, a.reps))
    print("server CPU per step, in process (µs; median of", a.reps, "alternated batches)")
    base = statistics.median(steps["plain"])
    for name, values in steps.items():
        med = statistics.median(values)
        print(f"  {name:15s} {med:7.2f}  (+{med - base:.2f})  {[round(v, 2) for v in values]}")
    with asyncio.Runner(loop_factory=new_event_loop) as r:
        e2e = r.run(end_to_end(a.cuts, a.forks, a.sessions))
    for k, v in e2e.items():
        print(f"  {k}: {v if not isinstance(v, float) else round(v, 3)}")


if __name__ == "__main__":
    main()

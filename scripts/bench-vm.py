"""Measure ``--isolation vm`` against ``sandbox`` on this machine (BENCHMARKS.md, "vm").

    flock /tmp/bench.lock python scripts/bench-vm.py [--modes vm,sandbox] [--sessions 20]
        [--forks 20] [--only-forks]

For each mode it starts ``stadium serve`` (the hostile test env, echo steps) as a process
of its own and measures, from a client process: session start (connect + ``reset``) p50/p99
from a warm pool (``--warm-pool 4``, a pause between sessions so the pool refills) and
cold (``--warm-pool 0``); ``fork`` of a session that has stepped (the copy's client
connected, p50/p99; each copy closed before the next); the server's CPU per step (its
own process, from /proc) and its VMs' (the QEMU processes, apart); the host memory (PSS)
per idle session; and how many sessions open at once before one fails or
``--max-concurrent`` is reached.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time

import stadium

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET = os.path.join(ROOT, "tests/isolation/vm_env.py") + ":VmHostile"
TICK = os.sysconf("SC_CLK_TCK")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cpu(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:  # ended meanwhile (the template VM, once saved)
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICK


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    kids = [int(p) for p in out.split()]
    return kids + [g for k in kids for g in _children(k)]


def _pss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


async def _wait_up(url: str, limit: float) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        try:
            async with stadium.AsyncClient(url, request_timeout=limit) as env:
                await env.reset()
                return
        except Exception:
            await asyncio.sleep(0.5)
    raise RuntimeError("the server did not come up")


def _serve(mode: str, warm: int, port: int) -> subprocess.Popen[bytes]:
    env = dict(os.environ, PYTHONPATH=f"{ROOT}/src:{ROOT}")
    return subprocess.Popen(
        [sys.executable, "-m", "stadium", "serve", TARGET, "--host", "127.0.0.1", "--port",
         str(port), "--isolation", mode, "--warm-pool", str(warm), "--max-sessions", "1000",
         "--log-level", "warning"],
        env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1000


async def starts(mode: str, warm: int, n: int, pause: float) -> dict[str, float]:
    port = _port()
    server = _serve(mode, warm, port)
    url = f"ws://127.0.0.1:{port}"
    try:
        await _wait_up(url, 300)
        await asyncio.sleep(pause * 4)  # the pool full
        times = []
        for _ in range(n):
            t = time.perf_counter()
            async with stadium.AsyncClient(url, request_timeout=300) as env:
                await env.reset()
                times.append(time.perf_counter() - t)
            await asyncio.sleep(pause)
        return {"p50_ms": _pct(times, 0.5), "p99_ms": _pct(times, 0.99), "n": n}
    finally:
        server.terminate()
        server.wait(30)


async def forks(mode: str, n: int) -> dict[str, float]:
    port = _port()
    server = _serve(mode, 4, port)
    url = f"ws://127.0.0.1:{port}"
    try:
        await _wait_up(url, 300)
        times = []
        async with stadium.AsyncClient(url, request_timeout=300) as env:
            await env.reset()
            await env.step({"do": "echo", "arg": "x"})
            for _ in range(n):
                t = time.perf_counter()
                copy = await env.fork()
                times.append(time.perf_counter() - t)
                await copy.step({"do": "echo", "arg": "y"})
                await copy.close()
        return {"p50_ms": _pct(times, 0.5), "p99_ms": _pct(times, 0.99), "n": n}
    finally:
        server.terminate()
        server.wait(30)


async def steady(mode: str, steps: int, idle: int, max_concurrent: int) -> dict[str, float]:
    port = _port()
    server = _serve(mode, 0, port)
    url = f"ws://127.0.0.1:{port}"
    out: dict[str, float] = {}
    try:
        await _wait_up(url, 300)
        async with stadium.AsyncClient(url, request_timeout=300) as env:
            await env.reset()
            for i in range(20):
                await env.step({"do": "echo", "arg": str(i)})
            await asyncio.sleep(1)
            kids = _children(server.pid)
            cpu0, kid0 = _cpu(server.pid), sum(_cpu(k) for k in kids)
            t = time.perf_counter()
            for i in range(steps):
                await env.step({"do": "echo", "arg": str(i)})
            wall = time.perf_counter() - t
            cpu1, kid1 = _cpu(server.pid), sum(_cpu(k) for k in kids)
        out["step_ms"] = wall / steps * 1000
        out["server_cpu_us_per_step"] = (cpu1 - cpu0) / steps * 1e6
        out["env_cpu_us_per_step"] = (kid1 - kid0) / steps * 1e6
        # idle sessions: host memory (PSS) of their processes
        clients = []
        base = {k for k in _children(server.pid)}
        pss0 = sum(_pss(k) for k in base)
        for _ in range(idle):
            c = stadium.AsyncClient(url, request_timeout=300)
            await c.__aenter__()
            await c.reset()
            clients.append(c)
        await asyncio.sleep(2)
        kids = set(_children(server.pid))
        pss1 = sum(_pss(k) for k in kids)
        out["pss_kib_per_idle_session"] = (pss1 - pss0) / idle
        idle_cpu0 = sum(_cpu(k) for k in kids)
        await asyncio.sleep(5)
        idle_cpu1 = sum(_cpu(k) for k in _children(server.pid))
        out["idle_cpu_pct_per_session"] = (idle_cpu1 - idle_cpu0) / 5 / idle * 100
        # concurrent: open more until one fails or the bound
        t = time.perf_counter()
        try:
            while len(clients) < max_concurrent and time.perf_counter() - t < 240:
                c = stadium.AsyncClient(url, request_timeout=120)
                await c.__aenter__()
                clients.append(c)
                await c.reset()
                await c.step({"do": "echo", "arg": "x"})
        except Exception as exc:
            out["concurrent_failed_with"] = str(exc)[:120]  # type: ignore[assignment]
            clients.pop()
        out["concurrent_open"] = len(clients)
        ok = 0
        for c in clients:
            try:
                await c.step({"do": "echo", "arg": "y"})
                ok += 1
            except Exception:
                pass
        out["concurrent_all_stepping"] = ok
        for c in clients:
            await c.__aexit__(None, None, None)
    finally:
        server.terminate()
        server.wait(60)
    return out


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--modes", default="vm,sandbox")
    parser.add_argument("--sessions", type=int, default=20)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--idle", type=int, default=10)
    parser.add_argument("--max-concurrent", type=int, default=64)
    parser.add_argument("--skip-starts", action="store_true", help="only the steady part")
    parser.add_argument("--forks", type=int, default=20)
    parser.add_argument("--only-forks", action="store_true", help="only the forks")
    args = parser.parse_args()
    for mode in args.modes.split(","):
        row: dict[str, object] = {"mode": mode}
        if args.forks:
            row["fork"] = await forks(mode, args.forks)
        if args.only_forks:
            print(json.dumps(row), flush=True)
            continue
        if not args.skip_starts:
            row["warm"] = await starts(mode, 4, args.sessions, 1.0)
            row["cold"] = await starts(mode, 0, args.sessions, 0.2)
        row.update(await steady(mode, args.steps, args.idle, args.max_concurrent))
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    asyncio.run(main())

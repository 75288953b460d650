#!/usr/bin/env python3
"""Isolated sessions side by side: in-process (``none``) / ``process`` / ``sandbox``, one run.

For each level, a ``stadium serve scripts/isolation_env.py:BenchEnv`` subprocess on
127.0.0.1, driven by Stadium's AsyncClient from this process. Prints a Markdown table:

* start p50/p99: connect + reset → first observation, sequential, cold (no warm pool:
  the env process is forked on demand) and warm (``--warm-pool 64``, topped up between
  sessions); and time to first observation of 50 sessions started one after the other,
  20 ms apart, and all at once (the warm pool full before each pattern);
* server CPU per step: the server's whole process tree (worker, template, env
  processes; /proc utime+stime, reaped children included), ``--sessions`` sessions
  stepping an env that answers at once;
* memory per idle session: the private memory (USS, /proc/PID/smaps_rollup) of one
  env process, and the server tree's PSS grown per open idle session, over ``--idle``
  sessions (in-process: no env process; the PSS is the worker's growth);
* concurrent sessions: how many of ``--max-try`` sessions opened (connect + reset) and
  answered a step, all held at once;
* CPU-bound throughput: steps/s of ``--burn-ms`` of pure Python per step, 8 sessions,
  for ``--burn-s`` seconds (2 cores; ``none`` runs the sync env on the worker's thread pool).

Run: ``.venv/bin/python scripts/bench-isolation.py`` (as root for ``sandbox``). Every
load is bounded in count and time; the servers are stopped by pid at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import stadium
from stadium._util.health import healthy
from stadium.bench.procstat import process_tree, terminate, tree_cpu_s
from stadium.bench.start import isolated_processes

HERE = Path(__file__).resolve().parent
TARGET = f"{HERE / 'isolation_env.py'}:BenchEnv"
#: The warm pool of the warm-start and time-to-first-observation server.
WARM = 64
#: Sessions of each time-to-first-observation pattern.
BURST = 50
STADIUM = str(Path(sys.executable).with_name("stadium"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProc:
    def __init__(self, mode: str, warm: int, max_sessions: int) -> None:
        self.warm = warm
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [
            STADIUM, "serve", TARGET, "--port", str(self.port), "--isolation", mode,
            "--warm-pool", str(warm), "--max-sessions", str(max_sessions),
            "--idle-timeout", "0", "--log-level", "warning", "--executor-threads", "8",
            "--admission-timeout", "60",
        ]  # fmt: skip
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while not healthy(self.url, 1.0):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError(f"server ({mode}) did not start")
            time.sleep(0.1)

    def stop(self) -> None:
        terminate(self.proc)

    def tree(self) -> list[int]:
        return process_tree(self.proc.pid)

    def cpu_s(self) -> float:
        return tree_cpu_s(self.proc.pid)

    def memory_kib(self, pids: list[int] | None = None) -> tuple[int, int]:
        """(USS, PSS) of the tree (or of ``pids``), KiB."""
        uss = pss = 0
        for pid in self.tree() if pids is None else pids:
            try:
                with open(f"/proc/{pid}/smaps_rollup") as f:
                    for line in f:
                        key, _, rest = line.partition(":")
                        if key in ("Private_Clean", "Private_Dirty"):
                            uss += int(rest.split()[0])
                        elif key == "Pss":
                            pss += int(rest.split()[0])
            except OSError:
                continue
        return uss, pss


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def starts(url: str, n: int, pause: float) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        async with stadium.AsyncClient(url) as env:
            await env.reset()
            out.append(time.perf_counter() - t0)
        await asyncio.sleep(pause)  # the warm pool tops up meanwhile
    return out


async def first_observations(url: str, n: int, interval: float) -> list[float]:
    """``n`` sessions started ``interval`` s apart (0: a burst), each timed from its
    connect to its first observation; all held open until the last one's."""
    envs: list[Any] = []

    async def one(delay: float) -> float:
        await asyncio.sleep(delay)
        t0 = time.perf_counter()
        env = stadium.AsyncClient(url)
        envs.append(env)
        await env.connect()
        await env.reset()
        return time.perf_counter() - t0

    try:
        return list(await asyncio.gather(*(one(i * interval) for i in range(n))))
    finally:
        await asyncio.gather(*(e.close() for e in envs), return_exceptions=True)


def pool_full(server: ServerProc) -> bool:
    """Whether the server's warm pool is full (/metrics: env processes alive)."""
    return isolated_processes(server.url) >= server.warm


async def wait_warm(server: ServerProc) -> None:
    """Until the server's warm pool is full (at most a minute)."""
    for _ in range(300):
        if await asyncio.to_thread(pool_full, server):
            return
        await asyncio.sleep(0.2)


async def step_cpu(server: ServerProc, sessions: int, steps: int) -> float:
    envs = [stadium.AsyncClient(server.url) for _ in range(sessions)]
    for env in envs:
        await env.connect()
        await env.reset()

    async def run(env: Any) -> None:
        for _ in range(steps):
            await env.step({})

    await asyncio.gather(*(run(env) for env in envs[:1]))  # warm-up
    before = server.cpu_s()
    await asyncio.gather(*(run(env) for env in envs))
    used = server.cpu_s() - before
    for env in envs:
        await env.close()
    return used / (sessions * steps) * 1e6


async def idle_memory(server: ServerProc, n: int) -> tuple[float, float]:
    """(USS of one env process, PSS of the tree per session), KiB: a forked process's
    pages are shared with its template until written, so only these two add up."""
    await asyncio.sleep(1.0)
    before = set(server.tree())
    _, pss0 = server.memory_kib()
    envs = []
    for _ in range(n):
        env = stadium.AsyncClient(server.url)
        await env.connect()
        await env.reset()
        envs.append(env)
    await asyncio.sleep(1.0)
    _, pss1 = server.memory_kib()
    new = [pid for pid in server.tree() if pid not in before]
    uss = server.memory_kib(new)[0] / len(new) if new else 0.0
    for env in envs:
        await env.close()
    return uss, (pss1 - pss0) / n


async def concurrent(server: ServerProc, n: int, limit_s: float) -> tuple[int, float]:
    envs: list[Any] = []
    t0 = time.perf_counter()
    sem = asyncio.Semaphore(32)

    async def one() -> None:
        async with sem:
            env = stadium.AsyncClient(server.url)
            await env.connect()
            await env.reset()
            envs.append(env)

    tasks = [asyncio.ensure_future(one()) for _ in range(n)]
    _done, pending = await asyncio.wait(tasks, timeout=limit_s)
    for task in pending:
        task.cancel()
    took = time.perf_counter() - t0
    ok = 0
    results = await asyncio.gather(*(e.step({}) for e in envs), return_exceptions=True)
    ok = sum(1 for r in results if not isinstance(r, BaseException))
    await asyncio.gather(*(e.close() for e in envs), return_exceptions=True)
    return ok, took


async def burn(server: ServerProc, ms: float, seconds: float, sessions: int = 8) -> float:
    envs = [stadium.AsyncClient(server.url) for _ in range(sessions)]
    for env in envs:
        await env.connect()
        await env.reset()
    count = 0
    deadline = time.perf_counter() + seconds

    async def run(env: Any) -> None:
        nonlocal count
        while time.perf_counter() < deadline:
            await env.step({"burn_ms": ms})
            count += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(run(env) for env in envs))
    took = time.perf_counter() - t0
    for env in envs:
        await env.close()
    return count / took


async def measure(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    row: dict[str, Any] = {"mode": mode}
    server = ServerProc(mode, 0, args.max_try + 64)
    try:
        await starts(server.url, 3, 0.0)  # the template's start is the worker's, not a session's
        cold = await starts(server.url, args.starts, 0.0)
        row["cold"] = cold
        row["cpu_us"] = await step_cpu(server, args.sessions, args.steps)
        row["uss_kib"], row["pss_kib"] = await idle_memory(server, args.idle)
        row["burn"] = await burn(server, args.burn_ms, args.burn_s)
        row["max"], row["max_s"] = await concurrent(server, args.max_try, args.max_s)
    finally:
        server.stop()
    server = ServerProc(mode, WARM if mode != "none" else 0, 256)
    try:
        await starts(server.url, 3, 0.5)
        await wait_warm(server)
        if mode != "none":
            row["warm"] = await starts(server.url, args.starts, 0.05)
        for kind, interval in (("sequential", None), ("staggered", 0.02), ("burst", 0.0)):
            await wait_warm(server)
            if interval is None:
                row[kind] = await starts(server.url, BURST, 0.05)
            else:
                row[kind] = await first_observations(server.url, BURST, interval)
    finally:
        server.stop()
    return row


def podman(image: str, n_starts: int, n_idle: int) -> dict[str, Any]:
    """A container per session, for comparison: ``podman run`` of a bare ``python3 -c``
    (create → first command, sequential), and the PSS of idle containers (their process
    and conmon). Not a Stadium session in a container: a lower bound on one."""
    base = ["podman", "run", "--rm", "--network", "none", image]
    cold = []
    for _ in range(n_starts):
        t0 = time.perf_counter()
        subprocess.run([*base, "python3", "-c", "pass"], check=True, capture_output=True)
        cold.append(time.perf_counter() - t0)
    ids = []
    try:
        for _ in range(n_idle):
            out = subprocess.run(
                ["podman", "run", "-d", "--rm", "--network", "none", image, "python3", "-c",
                 "import time; time.sleep(300)"],
                check=True, capture_output=True, text=True,
            )  # fmt: skip
            ids.append(out.stdout.strip())
        time.sleep(1.0)
        pids = []
        for cid in ids:
            out = subprocess.run(
                ["podman", "inspect", "-f", "{{.State.Pid}} {{.State.ConmonPid}}", cid],
                check=True,
                capture_output=True,
                text=True,
            )
            pids += [int(p) for p in out.stdout.split()]
        pss = 0
        for pid in pids:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                pss += sum(int(line.split()[1]) for line in f if line.startswith("Pss:"))
    finally:
        if ids:
            subprocess.run(["podman", "rm", "-f", "-t", "0", *ids], capture_output=True)
    return {"mode": "podman (container per session)", "cold": cold, "pss_kib": pss / n_idle}


def ms(v: float) -> str:
    return f"{v * 1000:.2f}"


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--modes", default="none,process,sandbox")
    p.add_argument("--starts", type=int, default=100)
    p.add_argument("--sessions", type=int, default=4)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--idle", type=int, default=100)
    p.add_argument("--max-try", type=int, default=1000)
    p.add_argument("--max-s", type=float, default=120.0)
    p.add_argument("--burn-ms", type=float, default=1.0)
    p.add_argument("--burn-s", type=float, default=10.0)
    p.add_argument(
        "--podman-image", help="also time a Podman container per session (an image with python3)"
    )
    args = p.parse_args()
    rows = [await measure(mode, args) for mode in args.modes.split(",")]
    if args.podman_image:
        rows.append(podman(args.podman_image, min(args.starts, 20), min(args.idle, 10)))
    print(f"# {platform.node()} {os.cpu_count()} cores, Python {platform.python_version()}")
    print(f"# {' '.join(sys.argv)}")
    print(
        "| isolation | start cold p50 / p99 (ms) | start warm p50 / p99 (ms) | server CPU per "
        "step (µs) | env process USS / tree PSS per idle session (KiB) | concurrent "
        "sessions (of tried, s) | "
        f"CPU-bound steps/s ({args.burn_ms:g} ms each, 8 sessions) |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if "cpu_us" not in r:  # the container arm: starts and memory only
            print(
                f"| {r['mode']} | {ms(statistics.median(r['cold']))} / "
                f"{ms(pct(r['cold'], 0.99))} | — | — | — / {r['pss_kib']:.0f} | — | — |"
            )
            continue
        warm = r.get("warm")
        warm_s = f"{ms(statistics.median(warm))} / {ms(pct(warm, 0.99))}" if warm else "—"
        print(
            f"| {r['mode']} | {ms(statistics.median(r['cold']))} / {ms(pct(r['cold'], 0.99))} "
            f"| {warm_s} | {r['cpu_us']:.0f} | {r['uss_kib']:.0f} / {r['pss_kib']:.0f} "
            f"| {r['max']} of {args.max_try} ({r['max_s']:.1f} s) | {r['burn']:.0f} |"
        )
    print_first_observations(rows)


def print_first_observations(rows: list[dict[str, Any]]) -> None:
    print()
    print(
        f"Time to first observation (ms, p50 / p99), {BURST} sessions, --warm-pool {WARM} "
        "(none: no pool)"
    )
    print()
    print("| isolation | sequential | staggered (20 ms apart) | burst (all at once) |")
    print("|---|---|---|---|")
    for r in rows:
        if "burst" not in r:
            continue
        cells = [
            f"{ms(statistics.median(r[k]))} / {ms(pct(r[k], 0.99))}"
            for k in ("sequential", "staggered", "burst")
        ]
        print(f"| {r['mode']} | {' | '.join(cells)} |")


if __name__ == "__main__":
    asyncio.run(main())

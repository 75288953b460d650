#!/usr/bin/env python3
"""The per-step cost of the worker↔sandbox wire, two source trees side by side.

For each tree (``--a`` and ``--b``: a checkout's ``src``), a ``stadium serve benchmark
--isolation sandbox`` subprocess on 127.0.0.1 with that tree first on ``PYTHONPATH``,
driven by Stadium's AsyncClient from this process: ``--sessions`` sessions step the
benchmark env (a step that answers at once) ``--steps`` times each. Per round, each
tree's server CPU per step (its whole process tree: worker, template, env processes;
/proc utime+stime) and the clients' mean step time; the trees alternate, ``--rounds``
rounds, and the medians are compared (B/A).

A tree whose host code does not pass ``PYTHONPATH`` to its sandboxed template runs the
installed copy in the template: bench ``main`` as ``--a`` with the installed copy at
``main`` (``/work/main``), or both trees with a template that honours ``PYTHONPATH``.

Run (as root): ``flock /tmp/bench.lock .venv/bin/python scripts/bench-wire.py --a
/path/main/src --b src``. Every load is bounded in count and time; servers are stopped by
pid at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import stadium
from stadium._util.health import healthy
from stadium.bench.procstat import terminate, tree_cpu_s


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(src: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    argv = [
        sys.executable, "-m", "stadium", "serve", "benchmark", "--port", str(port),
        "--isolation", "sandbox", "--log-level", "warning", "--idle-timeout", "0",
    ]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(Path(src).resolve()))
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while not healthy(url, 1.0):
        if time.monotonic() > deadline or proc.poll() is not None:
            terminate(proc)
            raise RuntimeError(f"the server of {src} did not start")
        time.sleep(0.1)
    return proc, url


async def drive(url: str, sessions: int, steps: int) -> float:
    """Mean seconds per step of ``sessions`` sessions stepping ``steps`` times each."""

    async def one() -> float:
        async with stadium.AsyncClient(url) as env:
            await env.reset()
            t0 = time.perf_counter()
            for _ in range(steps):
                await env.step({"wait_seconds": 0.0})
            return (time.perf_counter() - t0) / steps

    return statistics.mean(await asyncio.gather(*(one() for _ in range(sessions))))


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--a", required=True, help="the 'before' tree's src directory")
    p.add_argument("--b", required=True, help="the 'after' tree's src directory")
    p.add_argument("--sessions", type=int, default=4)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    servers = {name: start(src) for name, src in (("A", args.a), ("B", args.b))}
    cpu: dict[str, list[float]] = {"A": [], "B": []}
    step: dict[str, list[float]] = {"A": [], "B": []}
    try:
        for _proc, url in servers.values():  # warm up: the sessions' processes forked
            await asyncio.wait_for(drive(url, args.sessions, 50), 120)
        for r in range(args.rounds):
            order = ("A", "B") if r % 2 == 0 else ("B", "A")
            for name in order:
                proc, url = servers[name]
                c0 = tree_cpu_s(proc.pid)
                mean = await asyncio.wait_for(drive(url, args.sessions, args.steps), 600)
                per_step = (tree_cpu_s(proc.pid) - c0) / (args.sessions * args.steps)
                cpu[name].append(per_step)
                step[name].append(mean)
                print(f"round {r} {name}: server CPU {per_step * 1e6:.1f} us/step, "
                      f"step {mean * 1e6:.0f} us", flush=True)  # fmt: skip
    finally:
        for proc, _url in servers.values():
            terminate(proc)
    med = {k: (statistics.median(cpu[k]), statistics.median(step[k])) for k in cpu}
    print("| tree | server CPU per step (us, median) | client step time (us, median) |")
    print("|---|---|---|")
    for k in ("A", "B"):
        print(f"| {k} | {med[k][0] * 1e6:.1f} | {med[k][1] * 1e6:.0f} |")
    print(f"| B/A | {med['B'][0] / med['A'][0]:.3f} | {med['B'][1] / med['A'][1]:.3f} |")


if __name__ == "__main__":
    asyncio.run(main())

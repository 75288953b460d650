"""Server CPU per batched step through :class:`stadium.SessionPool` against the floor
(BENCHMARKS.md, "Batched steps through SessionPool").

Two servers, both started by this script and pinned to one core (``--server-cpu``): a
``stadium serve benchmark`` (1 worker) and the floor (``stadium.bench.floor``, one frame per
step). The load runs in this process, pinned to another core (``--client-cpu``). Arms, one
after the other in each repetition (their order alternates between repetitions):

* ``floor``: ``--size`` sessions on their own connections (``SessionPool(batch=False)``,
  one frame per step and session) against the floor;
* ``pool``: a ``SessionPool(batch=True)`` of ``--size`` sessions on one batch connection
  (resumable, the default) against Stadium;
* ``pool-noresume``: the same with ``resume=False``;
* ``raw`` (not run unless asked, ``--arms floor,pool,raw``): the batch connection alone, one
  frame built once per arm, as ``stadium bench``'s own batch client sends it.

Each arm: reset, ``--warmup`` rounds, then ``--rounds`` rounds of ``pool.step`` (W = 0);
the server's CPU (its threads' ``/proc/PID/task/*/schedstat``) and the client's
(``time.process_time``) over the timed rounds only, per step (a round is ``--size`` steps).
Prints each repetition and the medians, and each arm's ratio to the floor's server CPU in
the same repetition.

Usage: ``.venv/bin/python scripts/bench-pool-batch.py [--reps 5] [--rounds 500] [--size 64]``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
ACTION = {"wait_seconds": 0.0}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cpu_s(pid: int) -> float:
    """CPU time of ``pid``'s threads and its children's (seconds, from ``schedstat``:
    nanoseconds, not clock ticks)."""
    total = 0
    pids = [pid]
    try:
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        pids += [int(k) for k in kids]
    except OSError:
        pass
    for p in pids:
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                total += int((task / "schedstat").read_text().split()[0])
            except OSError:
                continue
    return total / 1e9


def _start(cmd: Sequence[str], cpu: str, port: int) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        ["taskset", "-c", cpu, *cmd],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc
        except OSError:
            if proc.poll() is not None:
                raise SystemExit(f"server exited ({proc.returncode}): {' '.join(cmd)}") from None
            time.sleep(0.1)
    proc.kill()
    raise SystemExit(f"server did not listen on {port}: {' '.join(cmd)}")


async def _arm(
    url: str, server: int, size: int, rounds: int, warmup: int, **kwargs: Any
) -> tuple[float, float]:
    """Server and client CPU µs per step of ``rounds`` rounds of a pool of ``size``."""
    import stadium

    actions = [ACTION] * size
    async with stadium.SessionPool(url, size=size, sessions_per_connection=size, **kwargs) as pool:
        await pool.reset(seeds=range(size))
        for _ in range(warmup):
            await pool.step(actions)
        s0, c0 = _cpu_s(server), time.process_time()
        for _ in range(rounds):
            results = await pool.step(actions)
        s1, c1 = _cpu_s(server), time.process_time()
        assert len(results) == size
        assert all(r.observation is not None for r in results)
    steps = rounds * size
    return (s1 - s0) / steps * 1e6, (c1 - c0) / steps * 1e6


async def _raw(url: str, server: int, size: int, rounds: int, warmup: int) -> tuple[float, float]:
    """The same rounds on one :class:`~stadium._client.batch.BatchConnection` with the frame
    built once (no pool, no ids: what ``stadium bench``'s own batch client sends)."""
    from stadium._client.batch import BatchConnection, call

    conn = await BatchConnection.open(url)
    try:
        await conn.batch([call(n, "reset", {"seed": n}) for n in range(size)])
        steps = [call(n, "step", ACTION) for n in range(size)]
        for _ in range(warmup):
            await conn.batch(steps)
        s0, c0 = _cpu_s(server), time.process_time()
        for _ in range(rounds):
            results = await conn.batch(steps)
        s1, c1 = _cpu_s(server), time.process_time()
        assert len(results) == size
        assert all(r.type == "observation" for r in results)
    finally:
        await conn.close()
    n = rounds * size
    return (s1 - s0) / n * 1e6, (c1 - c0) / n * 1e6


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=500)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--server-cpu", default="0")
    ap.add_argument("--client-cpu", default="1")
    ap.add_argument("--arms", default="floor,pool,pool-noresume")
    args = ap.parse_args(argv)
    os.sched_setaffinity(0, {int(c) for c in args.client_cpu.split(",")})
    sp, fp = _free_port(), _free_port()
    stadium_cmd = [sys.executable, "-m", "stadium", "serve", "benchmark", "--host", "127.0.0.1",
                   "--port", str(sp), "--workers", "1", "--max-sessions", "4096",
                   "--log-level", "warning"]  # fmt: skip
    floor_cmd = [sys.executable, "-m", "stadium.bench.floor", "--host", "127.0.0.1",
                 "--port", str(fp)]  # fmt: skip
    procs = [_start(stadium_cmd, args.server_cpu, sp), _start(floor_cmd, args.server_cpu, fp)]
    s_url, f_url = f"http://127.0.0.1:{sp}", f"http://127.0.0.1:{fp}"
    runs: dict[str, Callable[[], Any]] = {
        "floor": lambda: _arm(
            f_url, procs[1].pid, args.size, args.rounds, args.warmup, batch=False, resume=False
        ),
        "pool": lambda: _arm(s_url, procs[0].pid, args.size, args.rounds, args.warmup, batch=True),
        "pool-noresume": lambda: _arm(
            s_url, procs[0].pid, args.size, args.rounds, args.warmup, batch=True, resume=False
        ),
        "raw": lambda: _raw(s_url, procs[0].pid, args.size, args.rounds, args.warmup),
    }
    arms = args.arms.split(",")
    figures: dict[str, list[tuple[float, float]]] = {a: [] for a in arms}
    ratios: dict[str, list[float]] = {a: [] for a in arms if a != "floor"}
    try:
        for rep in range(args.reps):
            order = arms if rep % 2 == 0 else arms[::-1]
            got = {a: asyncio.run(runs[a]()) for a in order}
            line = [f"rep {rep + 1}:"]
            for a in arms:
                figures[a].append(got[a])
                line.append(f"{a} server {got[a][0]:.2f} client {got[a][1]:.2f}")
                if a != "floor" and "floor" in got:
                    ratios[a].append(got[a][0] / got["floor"][0])
                    line.append(f"(x floor {ratios[a][-1]:.3f})")
            print(" ".join(line), flush=True)
    finally:
        for p in procs:
            os.killpg(p.pid, signal.SIGTERM)
            p.wait(10)
    print(f"\nmedians of {args.reps} repetitions, {args.size} sessions, {args.rounds} rounds:")
    print("| arm | server CPU µs/step | client CPU µs/step | server ÷ floor (per rep) | median |")
    print("|---|---|---|---|---|")
    for a in arms:
        srv = statistics.median(f[0] for f in figures[a])
        cli = statistics.median(f[1] for f in figures[a])
        per = ", ".join(f"{r:.3f}" for r in ratios.get(a, []))
        med = f"{statistics.median(ratios[a]):.3f}" if ratios.get(a) else "1"
        print(f"| {a} | {srv:.2f} | {cli:.2f} | {per or '—'} | {med} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

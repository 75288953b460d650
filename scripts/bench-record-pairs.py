#!/usr/bin/env python3
"""``--record``'s server CPU per step, paired: without against with, many short pairs.

Two ``stadium serve benchmark`` servers run side by side for the whole run, the same
command as ``scripts/bench-record-stall.py``'s (one worker, on ``--server-cpu``), ``off``
without and ``record`` with ``--record DIR`` (the writer chosen as usual:
``STADIUM_RECORD_WRITER``, native by default), driven from ``--client-cpu`` by the bench's
own WebSocket client (:mod:`stadium.bench.sessions`). A *block* is ``--sessions``
sessions at once, each a reset, ``--steps`` steps and a close (one recorded episode per
session, written when it closes). Blocks alternate between the arms ABBA ... (each
pair's order flipped, so that a drift of the machine within a pair falls on both arms
alike), ``--pairs`` pairs after a warm-up pair. After each block the arm rests
``--settle`` seconds (both arms alike) so that its writer's shard (written within a
second of its episodes' end) falls inside the block's own measure.

* **CPU µs per step**: the run time of every thread of the server's process tree (the
  writer process included; ``/proc/PID/task/TID/schedstat``, nanoseconds) over the block
  and its rest, divided by its steps: CPU, not wall time, so that another process on the
  core does not count;
* the **ratio** record / off of each pair; printed: the median ratio with its 95 %
  distribution-free confidence interval (order statistics of the pairs' ratios,
  binomial), quartiles and min–max, each arm's median, and the load average.

Two server processes differ by more than chance between blocks (where their memory
landed, which core their writer ran on: a pair's median moved 1.05–1.15 between runs of
the same code): ``--instances K`` runs the pairs on K fresh pairs of servers, one after the
other, and pools them (each pair of servers' median printed too).

``--src DIR`` serves both arms from another tree's ``src`` (e.g. a worktree at an older
commit): run the script once per tree, back to back.

    flock /tmp/bench.lock .venv/bin/python scripts/bench-record-pairs.py --pairs 24

Every load is bounded in count and time; each server is stopped by its pid.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time

from stadium._core.urls import ws_url
from stadium._util.health import healthy
from stadium.bench.procstat import run_time_s, terminate
from stadium.bench.sessions import connection_class

START_S = 60.0
CALL_S = 60.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    def __init__(self, args: argparse.Namespace, arm: str) -> None:
        port = free_port()
        self.arm = arm
        self.url = f"http://127.0.0.1:{port}"
        argv = [
            "taskset", "-c", str(args.server_cpu), sys.executable, "-m", "stadium", "serve",
            "benchmark", "--host", "127.0.0.1", "--port", str(port), "--max-sessions",
            str(args.sessions * 2 + 64), "--log-level", "warning",
            *(["--record", os.path.join(args.tmp, "rec")] if arm == "record" else []),
        ]  # fmt: skip
        env = dict(os.environ)
        env.pop("STADIUM_AUTH_TOKEN", None)
        if args.src:
            env["PYTHONPATH"] = args.src
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, env=env)
        deadline = time.monotonic() + START_S
        while not healthy(self.url, 1.0):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"stadium serve ({arm}) did not start")
            time.sleep(0.1)

    def cpu_s(self) -> float:
        return run_time_s([self.proc.pid])

    def stop(self) -> None:
        terminate(self.proc)


async def block(server: Server, args: argparse.Namespace) -> None:
    """``args.sessions`` sessions at once: connect, reset, ``args.steps`` steps, close."""
    cls = connection_class("ws")
    url = ws_url(server.url)
    step = b'{"type":"step","data":{"wait_seconds":0}}'
    reset = b'{"type":"reset","data":{}}'

    async def one() -> None:
        conn = cls(url, None)
        await conn.connect(CALL_S)
        try:
            await conn.request("reset", reset, CALL_S)
            for _ in range(args.steps):
                await conn.request("step", step, CALL_S)
            conn.close()
            note = await conn.closed(CALL_S)
            if note:
                raise RuntimeError(f"{server.arm}: {note}")
        finally:
            conn.abort()

    await asyncio.gather(*(one() for _ in range(args.sessions)))


async def timed(server: Server, args: argparse.Namespace) -> float:
    c0 = await asyncio.to_thread(server.cpu_s)
    await asyncio.wait_for(block(server, args), 10 * CALL_S)
    await asyncio.sleep(args.settle)  # the writer's shard, the closes' tails
    c1 = await asyncio.to_thread(server.cpu_s)
    return (c1 - c0) / (args.sessions * args.steps) * 1e6


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    i = q * (len(s) - 1)
    lo = int(i)
    return s[lo] + (s[min(lo + 1, len(s) - 1)] - s[lo]) * (i - lo)


def median_ci(values: list[float], level: float = 0.95) -> tuple[float, float]:
    """A distribution-free interval for the median: the order statistics ``k`` and
    ``n + 1 - k`` (1-based) with the largest ``k`` whose binomial(n, ½) coverage is at
    least ``level``."""
    s = sorted(values)
    n = len(s)
    k = 0
    for j in range(1, n // 2 + 1):  # coverage of [s_j, s_(n+1-j)]: 1 - 2 P(B < j)
        tail = sum(math.comb(n, i) for i in range(j)) / 2**n
        if 1 - 2 * tail >= level:
            k = j
    return (s[k - 1], s[n - k]) if k else (s[0], s[-1])


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sessions", type=int, default=64, help="sessions per block, at once")
    p.add_argument("--steps", type=int, default=100, help="steps per session")
    p.add_argument("--pairs", type=int, default=24, help="pairs in all (over the instances)")
    p.add_argument(
        "--instances", type=int, default=1,
        help="fresh pairs of servers, one after the other, --pairs shared among them",
    )  # fmt: skip
    p.add_argument("--settle", type=float, default=1.2, help="seconds of rest after a block")
    p.add_argument("--server-cpu", default="0")
    p.add_argument("--client-cpu", type=int, default=1)
    p.add_argument("--src", help="serve from this tree's src (PYTHONPATH)")
    args = p.parse_args()
    os.sched_setaffinity(0, {args.client_cpu})
    load0 = os.getloadavg()
    a: list[float] = []
    b: list[float] = []
    medians: list[float] = []
    shards = 0
    for k in range(max(1, args.instances)):
        n = args.pairs // args.instances + (k < args.pairs % args.instances)
        with tempfile.TemporaryDirectory() as tmp:
            args.tmp = tmp
            servers = [Server(args, "off"), Server(args, "record")]
            try:
                got = await pairs(servers, args, n, k)
            finally:
                for s in servers:
                    s.stop()
            shards += sum(1 for f in os.listdir(os.path.join(tmp, "rec")) if f.endswith(".parquet"))
        a += got[0]
        b += got[1]
        medians.append(statistics.median(y / x for x, y in zip(*got, strict=True)))
    summary(a, b, medians, args, load0)
    print(f"# {shards} shards written by the record arm")


async def pairs(
    servers: list[Server], args: argparse.Namespace, n: int, instance: int
) -> tuple[list[float], list[float]]:
    """``n`` ABBA pairs of blocks on one pair of servers, after a warm-up block each."""
    off, record = servers
    for s in servers:
        await timed(s, args)  # warm-up: imports, first-use caches, the writer's first shard
    a: list[float] = []
    b: list[float] = []
    for i in range(n):
        order = (off, record) if i % 2 == 0 else (record, off)
        got = {s.arm: await timed(s, args) for s in order}
        a.append(got["off"])
        b.append(got["record"])
        print(f"# instance {instance + 1}, pair {i + 1}: off {got['off']:.2f} µs, record "
              f"{got['record']:.2f} µs, {got['record'] / got['off']:.3f}", flush=True)  # fmt: skip
    return a, b


def summary(
    a: list[float], b: list[float], medians: list[float], args: argparse.Namespace, load0: tuple
) -> None:
    ratios = [y / x for x, y in zip(a, b, strict=True)]
    lo, hi = median_ci(ratios)
    load = os.getloadavg()
    print(f"\n# {platform.node()} {os.cpu_count()} cores, Python {platform.python_version()}, "
          f"load {load0[0]:.1f} at the start, {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} at the "
          f"end; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")  # fmt: skip
    print(f"# {' '.join(sys.argv)}; STADIUM_RECORD_WRITER="
          f"{os.environ.get('STADIUM_RECORD_WRITER', '(default)')}")  # fmt: skip
    print(f"# server CPU per step (schedstat, whole tree); {len(ratios)} pairs of blocks of "
          f"{args.sessions} sessions × {args.steps} steps, ABBA, on {len(medians)} pair(s) "
          "of servers\n")  # fmt: skip
    print("| arm | CPU µs / step: median (min–max) |")
    print("|---|---|")
    print(f"| off | {statistics.median(a):.2f} ({min(a):.2f}–{max(a):.2f}) |")
    print(f"| record | {statistics.median(b):.2f} ({min(b):.2f}–{max(b):.2f}) |")
    print(
        f"\nrecord / off, per pair: median {statistics.median(ratios):.3f}, 95 % interval "
        f"{lo:.3f}–{hi:.3f}, quartiles {pct(ratios, 0.25):.3f}–{pct(ratios, 0.75):.3f}, "
        f"min–max {min(ratios):.3f}–{max(ratios):.3f} ({len(ratios)} pairs); ratio of the "
        f"sums {sum(b) / sum(a):.3f}"
    )
    if len(medians) > 1:
        print("each pair of servers' median: " + ", ".join(f"{m:.3f}" for m in medians))


if __name__ == "__main__":
    asyncio.run(main())

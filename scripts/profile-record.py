#!/usr/bin/env python3
"""``--record``'s cost per process, and a profiler attached: one server (``off`` or ``record``)
driven by ``scripts/bench-record-pairs.py``'s blocks (``--sessions`` sessions × ``--steps``
steps, then ``--settle`` seconds of rest), two warm-up blocks, then ``--blocks`` measured.

Printed: each process of the server's tree (the worker, its writer) with its CPU µs per step
over the measured blocks (``/proc/PID/task/*/schedstat``). ``--perf CMD`` runs CMD (a shell
command; ``{pid}`` the worker's pid, ``{wpid}`` its writer's) during the measured blocks and
stops it with SIGINT after them, e.g. (BENCHMARKS.md, "Episode ledger cost", sixth round)::

    flock /tmp/bench.lock env PYTHONPATH=$PWD/src .venv/bin/python scripts/profile-record.py \\
        record --perf "perf stat -e task-clock,page-faults -p {wpid} -o writer.txt"
    PYTHONPERFSUPPORT=1 ... scripts/profile-record.py record \\
        --perf "perf record -F 2999 -p {pid} -o worker.data"

Every load is bounded in count and time; the server is stopped by its pid.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from stadium.bench.procstat import process_trees

sys.path.insert(0, str(Path(__file__).parent))
pairs = importlib.import_module("bench-record-pairs")


def cpu_s(pid: int) -> float:
    """CPU seconds of every live thread of ``pid`` (schedstat)."""
    total = 0
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            total += int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    return total / 1e9


def comm(pid: int) -> str:
    return Path(f"/proc/{pid}/comm").read_text().strip()


def attach(cmd: str) -> subprocess.Popen[bytes]:
    """Start the profiler's command, in a process group of its own (stopped by SIGINT)."""
    return subprocess.Popen(cmd, shell=True, start_new_session=True)


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("arm", choices=("off", "record"))
    p.add_argument("--blocks", type=int, default=6)
    p.add_argument("--sessions", type=int, default=64)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--settle", type=float, default=1.2)
    p.add_argument("--perf", default="", help="a command run meanwhile ({pid}, {wpid})")
    p.add_argument("--server-cpu", default="0")
    p.add_argument("--client-cpu", type=int, default=1)
    p.add_argument("--src", help="serve from this tree's src (PYTHONPATH)")
    args = p.parse_args()
    os.sched_setaffinity(0, {args.client_cpu})
    with tempfile.TemporaryDirectory() as tmp:
        args.tmp = tmp
        server = pairs.Server(args, args.arm)
        try:
            for _ in range(2):
                await pairs.timed(server, args)
            pids = sorted(process_trees([server.proc.pid]))
            names = {q: comm(q) for q in pids}
            writer = next((q for q in pids if q != server.proc.pid), server.proc.pid)
            perf = None
            if args.perf:
                cmd = args.perf.format(pid=server.proc.pid, wpid=writer)
                perf = attach(cmd)
                await asyncio.sleep(0.5)
            before = {q: cpu_s(q) for q in pids}
            for _ in range(args.blocks):
                await asyncio.wait_for(pairs.block(server, args), 10 * pairs.CALL_S)
                await asyncio.sleep(args.settle)
            after = {q: cpu_s(q) for q in pids}
            if perf is not None:
                os.killpg(perf.pid, signal.SIGINT)
                perf.wait(pairs.CALL_S)
        finally:
            server.stop()
    steps = args.blocks * args.sessions * args.steps
    for q in pids:
        print(f"{q} {names[q]}: {(after[q] - before[q]) / steps * 1e6:.3f} µs/step")
    total = sum(after[q] - before[q] for q in pids) / steps * 1e6
    load = os.getloadavg()
    print(f"total {total:.3f} µs/step; load {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")


if __name__ == "__main__":
    asyncio.run(main())

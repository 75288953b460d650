#!/usr/bin/env python3
"""Python bytecodes per step of in-process / ``process`` / ``sandbox`` sessions, per side
and per function: where an isolated step's CPU goes, counted (load-insensitive), not timed.
Functions that run by the clock (metrics, the watchdog, threads) are counted apart.

Each arm is a ``stadium serve benchmark --isolation LEVEL`` subprocess run with a
``sitecustomize`` (a temporary folder first on ``PYTHONPATH``) that counts every Python
bytecode (``sys.monitoring`` INSTRUCTION events, Python ≥ 3.12) per function, in the
server and, through ``os.register_at_fork``, in every process forked from a process it
counts, each writing its counts to a file of its own pid every 50 ms. ``process``: the
template inherits the server's environment, so it and the env processes it forks are
counted; ``sandbox``: the template starts in bubblewrap with a bare environment, so only
the worker is (its env processes run the same serve loop as ``process``'s).

``--sessions`` sessions (one by default: every step one whole round trip, so the counts do
not depend on how replies batch under load) are reset and stepped ``--warmup`` times,
then the counts are read (once idle), the sessions stepped ``--steps`` times, and read
again. Printed: bytecodes per step, worker and env side, and the ``--top`` functions of
each side with the most::

    .venv/bin/python scripts/bench-step-count.py --arm none --arm process --arm sandbox

Every load is bounded in count and time; each server is stopped by its pid.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from stadium._core.urls import ws_url
from stadium._util.health import healthy
from stadium.bench.procstat import terminate
from stadium.bench.sessions import connection_class

START_S = 120.0
CALL_S = 60.0

#: The counter: every process that imports it (the server at startup) or is forked from one
#: that did counts its own bytecodes into DIR/PID.
SITECUSTOMIZE = r"""
import os, sys, threading, time
_dir = os.environ.get("STADIUM_BYTECODE_DIR")
if _dir and hasattr(sys, "monitoring"):
    mon = sys.monitoring
    _by = {}
    def _on(code, offset):
        if code is _REPORT:
            return mon.DISABLE
        _by[code] = _by.get(code, 0) + 1
    def _report():
        path = os.path.join(_dir, str(os.getpid()))
        while True:
            time.sleep(0.05)
            with open(path + ".tmp", "w") as f:
                for code, k in list(_by.items()):
                    f.write(f"{k} {code.co_filename.rsplit('/src/', 1)[-1]}:{code.co_qualname}\n")
            os.replace(path + ".tmp", path)
    _REPORT = _report.__code__
    def _start():
        _by.clear()
        threading.Thread(target=_report, daemon=True).start()
    os.register_at_fork(after_in_child=_start)
    mon.use_tool_id(mon.PROFILER_ID, "bytecodes")
    mon.register_callback(mon.PROFILER_ID, mon.events.INSTRUCTION, _on)
    _start()
    mon.set_events(mon.PROFILER_ID, mon.events.INSTRUCTION)
"""


#: Functions that run by the clock, not per step (metrics, the watchdog, threads, the
#: counter's own file writes): their bytecodes per step grow as a step slows, so they are
#: given apart.
PERIODIC = (
    "threading.py:", "<frozen codecs>", "metrics.py:", "watchdog.py:", "runtime.py:Runtime.",
    "Isolation.counts", "server.py:_FdWatch", "thread_pool.py:", "_weakrefset.py:_Iteration",
    "imaging.py:", "Admission.waiting", "Worker.watch", "PicowsTransport.__init__",
)  # fmt: skip


def periodic(fn: str) -> bool:
    return any(p in fn for p in PERIODIC)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    def __init__(self, args: argparse.Namespace, arm: str) -> None:
        level, *extra = shlex.split(arm)
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.dir = tempfile.mkdtemp(prefix=f"counts-{level}-", dir=args.tmp)
        argv = [
            sys.executable, "-m", "stadium", "serve", "benchmark", "--host", "127.0.0.1",
            "--port", str(port), "--isolation", level, "--warm-pool", "0",
            "--max-sessions", str(args.sessions + 16), "--idle-timeout", "0",
            "--log-level", "warning", *extra,
        ]  # fmt: skip
        env = dict(os.environ)
        env.pop("STADIUM_AUTH_TOKEN", None)
        env["STADIUM_BYTECODE_DIR"] = self.dir
        env["PYTHONPATH"] = os.pathsep.join(
            [args.tmp, args.src or str(Path(__file__).resolve().parent.parent / "src")]
        )
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, env=env)
        deadline = time.monotonic() + START_S
        while not healthy(self.url, 1.0):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"stadium serve ({arm}) did not start")
            time.sleep(0.2)

    def counts(self) -> dict[int, dict[str, int]]:
        """Each counted process's bytecodes per function so far, once they stop growing."""
        last: dict[int, dict[str, int]] = {}
        for _ in range(100):
            time.sleep(0.3)
            now: dict[int, dict[str, int]] = {}
            for name in os.listdir(self.dir):
                if name.isdigit():
                    per: dict[str, int] = {}
                    for line in Path(self.dir, name).read_text().splitlines():
                        k, _, fn = line.partition(" ")
                        per[fn] = per.get(fn, 0) + int(k)
                    now[int(name)] = per
            total = sum(sum(p.values()) for p in now.values())
            if total - sum(sum(p.values()) for p in last.values()) < 200:
                return now
            last = now
        return last

    def stop(self) -> None:
        terminate(self.proc)


async def drive(server: Server, args: argparse.Namespace, conns: list, steps: int) -> None:
    step = b'{"type":"step","data":{"wait_seconds":0}}'

    async def one(conn: object) -> None:
        for _ in range(steps):
            await conn.request("step", step, CALL_S)  # type: ignore[attr-defined]

    await asyncio.gather(*(one(c) for c in conns))


def diff(a: dict[int, dict[str, int]], b: dict[int, dict[str, int]], pids: set[int]) -> dict:
    out: dict[str, int] = {}
    for pid in pids:
        before = a.get(pid, {})
        for fn, k in b.get(pid, {}).items():
            d = k - before.get(fn, 0)
            if d:
                out[fn] = out.get(fn, 0) + d
    return out


async def run_arm(args: argparse.Namespace, arm: str) -> None:
    server = await asyncio.to_thread(Server, args, arm)
    cls = connection_class("ws")
    conns = []
    try:
        for _ in range(args.sessions):
            conn = cls(ws_url(server.url), None)
            await conn.connect(CALL_S)
            await conn.request("reset", b'{"type":"reset","data":{}}', CALL_S)
            conns.append(conn)
        await drive(server, args, conns, args.warmup)
        c0 = await asyncio.to_thread(server.counts)
        await drive(server, args, conns, args.steps)
        c1 = await asyncio.to_thread(server.counts)
        n = args.steps * args.sessions
        worker = {server.proc.pid}
        env = set(c1) - worker
        sides = {"worker": diff(c0, c1, worker), "env side": diff(c0, c1, env)}
        print(f"\n## {arm}: bytecodes per step ({args.sessions} sessions x {args.steps} steps)")
        print("\n| side | bytecodes / step | of which by the clock (metrics, threads) |")
        print("|---|---|---|")
        for side, per in sides.items():
            clock = sum(k for fn, k in per.items() if periodic(fn))
            print(f"| {side} | {(sum(per.values()) - clock) / n:.1f} | {clock / n:.1f} |")
        for side, per in sides.items():
            if not per:
                continue
            print(f"\n| {side}: function | bytecodes / step |\n|---|---|")
            steps = [(fn, k) for fn, k in per.items() if not periodic(fn) and k >= n]
            for fn, k in sorted(steps, key=lambda kv: -kv[1])[: args.top]:
                print(f"| `{fn}` | {k / n:.1f} |")
    finally:
        for conn in conns:
            conn.abort()
        server.stop()


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arm", action="append", help="none | process | sandbox [serve options]")
    p.add_argument("--sessions", type=int, default=1)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--src", help="serve from this tree's src (default: this script's tree)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        args.tmp = tmp
        await asyncio.to_thread(Path(tmp, "sitecustomize.py").write_text, SITECUSTOMIZE)
        for arm in args.arm or ["none", "process", "sandbox"]:
            await run_arm(args, arm)
    print(f"\n# {platform.node()}, Python {platform.python_version()}, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")  # fmt: skip


if __name__ == "__main__":
    asyncio.run(main())

#!/usr/bin/env python3
"""Server CPU (and Python bytecodes) per session, with tenants against without: paired.

Two ``stadium serve benchmark`` servers run side by side for the whole run, both pinned
to one core (``--server-cpu``), driven from another (``--client-cpu``) by the bench's
own WebSocket client (:mod:`stadium.bench.sessions`): ``none`` (no tenants, no token)
and ``tenants`` (``--tenants`` with two tenants, weights 1 and 3; the clients send
tenant ``t0``'s token, and the same header to ``none``). A *block* is ``--sessions``
session lifecycles (connect, reset, ``--steps`` steps, close), ``--concurrency`` at a
time. Blocks alternate between the arms, ABBA ... (each pair's order flipped, so
that a drift of the machine within a pair falls on both arms alike), ``--pairs``
pairs after a warm-up pair; with ``--together`` a pair's two blocks run at the same
time instead (both servers share the one core: whatever else loads the machine at
that moment loads both alike; the steadiest ratio on a busy machine). For each block:

* **CPU µs per session**: the run time of every thread of the server's tree
  (``/proc/PID/task/TID/schedstat``, nanoseconds) over the block, divided by its
  sessions: CPU, not wall time, so that another process on the core does not count;
* the **ratio** tenants / none of each pair; the table gives the median ratio, its
  quartiles and min–max over the pairs, and each arm's median µs.

``--count`` instead runs each server under ``sys.monitoring`` (Python ≥ 3.12) counting
every Python bytecode the server executes (INSTRUCTION events, every thread): per
session, deterministic to within a few bytecodes (timers), whatever the machine's
load; the trim of a path shows there when the timing cannot resolve it.

``--src DIR`` serves from another tree's ``src`` (e.g. a worktree at an older commit).

Run (take the machine's bench lock for the timing)::

    flock /tmp/bench.lock .venv/bin/python scripts/bench-tenant-cost.py --pairs 20
    .venv/bin/python scripts/bench-tenant-cost.py --count

Every load is bounded in count and time; each server is stopped by its pid.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

T0 = "t0-bench-token-0123456789abcdef"
T1 = "t1-bench-token-0123456789abcdef"
os.environ["STADIUM_AUTH_TOKEN"] = T0  # read by stadium.bench.sessions at import

from stadium._core.urls import ws_url  # noqa: E402
from stadium._util.health import healthy  # noqa: E402
from stadium.bench.procstat import run_time_s, terminate  # noqa: E402
from stadium.bench.sessions import connection_class  # noqa: E402

START_S = 60.0
CALL_S = 60.0

#: Run as ``python -c COUNTER -m stadium serve ...``: the server with every bytecode
#: counted; the count is written to $STADIUM_BYTECODE_FILE every 50 ms.
COUNTER = r"""
import os, runpy, sys, threading, time
mon = sys.monitoring
n = [0]
by_code = {}
def on_instruction(code, offset):
    if code is REPORT:  # not this thread's own
        return mon.DISABLE
    n[0] += 1
    by_code[code] = by_code.get(code, 0) + 1
mon.use_tool_id(mon.PROFILER_ID, "bytecodes")
mon.register_callback(mon.PROFILER_ID, mon.events.INSTRUCTION, on_instruction)
path = os.environ["STADIUM_BYTECODE_FILE"]
def report():
    while True:
        time.sleep(0.05)
        with open(path + ".tmp", "w") as f:
            f.write(str(n[0]))
            for code, k in list(by_code.items()):
                f.write(f"\n{k} {code.co_filename.rsplit('/src/', 1)[-1]}:{code.co_qualname}")
        os.replace(path + ".tmp", path)
REPORT = report.__code__
threading.Thread(target=report, daemon=True).start()
mon.set_events(mon.PROFILER_ID, mon.events.INSTRUCTION)
sys.argv = ["stadium", *sys.argv[3:]]  # after -c and -m stadium
runpy.run_module("stadium", run_name="__main__", alter_sys=True)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    def __init__(self, args: argparse.Namespace, arm: str, tenants_file: str) -> None:
        port = free_port()
        self.arm = arm
        self.url = f"http://127.0.0.1:{port}"
        self.count_file = os.path.join(args.tmp, f"bytecodes-{arm}")
        python = [sys.executable, "-c", COUNTER, "-m"] if args.count else [sys.executable, "-m"]
        self.callgrind = os.path.join(args.tmp, f"callgrind-{arm}.out")
        if args.callgrind:
            python = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={self.callgrind}",
                      "--dump-line=no", "--compress-strings=no", *python]  # fmt: skip
        argv = [
            "taskset", "-c", str(args.server_cpu), *python, "stadium", "serve", "benchmark",
            "--host", "127.0.0.1", "--port", str(port), "--max-sessions", "10000",
            "--log-level", "warning",
            *(["--tenants", tenants_file] if arm == "tenants" else []),
        ]  # fmt: skip
        env = dict(os.environ)
        env.pop("STADIUM_AUTH_TOKEN", None)
        env["STADIUM_BYTECODE_FILE"] = self.count_file
        if args.src:
            env["PYTHONPATH"] = args.src
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, env=env)
        deadline = time.monotonic() + START_S * (10 if args.callgrind else 5 if args.count else 1)
        while not healthy(self.url, 1.0):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"stadium serve ({arm}) did not start")
            time.sleep(0.1)

    def cpu_s(self) -> float:
        return run_time_s([self.proc.pid])

    def busy_s(self) -> float:
        """Seconds the server's threads ran or waited on a run queue (schedstat)."""
        total = 0
        for tid in os.listdir(f"/proc/{self.proc.pid}/task"):
            try:
                with open(f"/proc/{self.proc.pid}/task/{tid}/schedstat") as f:
                    ran, waited, _ = f.read().split()
            except (OSError, ValueError):
                continue
            total += int(ran) + int(waited)
        return total / 1e9

    def bytecodes(self) -> tuple[int, dict[str, int]]:
        """The count so far, in all and per function (once the server is idle)."""
        last, busy = -(1 << 62), self.busy_s()
        for _ in range(100):  # until idle: the count grows by < 100 in 0.3 s (timers
            time.sleep(0.3)  # only) and the server neither ran nor waited to run for
            first, *rest = Path(self.count_file).read_text().split("\n")  # 5 ms of it
            now = self.busy_s()  # (a server starved of the core is not idle)
            if int(first) - last < 100 and now - busy < 0.005:
                break
            last, busy = int(first), now
        per = {}
        for line in rest:
            k, _, name = line.partition(" ")
            per[name] = per.get(name, 0) + int(k)
        return int(first), per

    def machine_instructions(self) -> int:
        """Instructions (callgrind's ``Ir``) since the last call (once the server is idle)."""
        time.sleep(1.0)
        before = set(os.listdir(os.path.dirname(self.callgrind)))
        subprocess.run(["callgrind_control", "-d", str(self.proc.pid)], check=True,
                       stdout=subprocess.DEVNULL, timeout=CALL_S)  # fmt: skip
        new = set(os.listdir(os.path.dirname(self.callgrind))) - before
        (dump,) = (n for n in new if n.startswith(os.path.basename(self.callgrind)))
        for line in Path(os.path.dirname(self.callgrind), dump).read_text().splitlines():
            if line.startswith(("summary:", "totals:")):
                return int(line.split()[1])
        raise RuntimeError(f"no totals in callgrind's dump {dump}")

    def stop(self) -> None:
        terminate(self.proc)


async def block(server: Server, args: argparse.Namespace) -> None:
    """``args.sessions`` lifecycles, ``args.concurrency`` at a time."""
    cls = connection_class("ws")
    url = ws_url(server.url)
    step = b'{"type":"step","data":{"wait_seconds":0}}'
    reset = b'{"type":"reset","data":{}}'
    left = [args.sessions]

    async def worker() -> None:
        while left[0] > 0:
            left[0] -= 1
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

    await asyncio.gather(*(worker() for _ in range(min(args.concurrency, args.sessions))))


async def timed(server: Server, args: argparse.Namespace) -> float:
    c0 = await asyncio.to_thread(server.cpu_s)
    await block(server, args)
    await asyncio.sleep(0.05)  # the last closes' tails
    c1 = await asyncio.to_thread(server.cpu_s)
    return (c1 - c0) / args.sessions * 1e6


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    i = q * (len(s) - 1)
    lo = int(i)
    return s[lo] + (s[min(lo + 1, len(s) - 1)] - s[lo]) * (i - lo)


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sessions", type=int, default=1000, help="session lifecycles per block")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--pairs", type=int, default=20)
    p.add_argument("--server-cpu", default="0")
    p.add_argument("--client-cpu", type=int, default=1)
    p.add_argument("--src", help="serve from this tree's src (PYTHONPATH)")
    p.add_argument("--count", action="store_true", help="count bytecodes, not CPU")
    p.add_argument(
        "--callgrind",
        action="store_true",
        help="count machine instructions (valgrind's callgrind), not CPU",
    )
    p.add_argument("--together", action="store_true",
                   help="drive both arms' blocks at once (same core, same moment), "
                   "not one after the other")  # fmt: skip
    p.add_argument("--by-function", type=int, default=0, metavar="N",
                   help="with --count: the N functions that differ most")  # fmt: skip
    args = p.parse_args()
    os.sched_setaffinity(0, {args.client_cpu})
    with tempfile.TemporaryDirectory() as tmp:
        args.tmp = tmp
        tenants_file = os.path.join(tmp, "tenants.toml")
        d0, d1 = (hashlib.sha256(t.encode()).hexdigest() for t in (T0, T1))
        text = (
            f'[tenants.t0]\ntoken_sha256 = "{d0}"\n[tenants.t1]\ntoken_sha256 = "{d1}"\n'
            "weight = 3\n"
        )
        await asyncio.to_thread(Path(tenants_file).write_text, text)
        servers = [Server(args, "none", tenants_file), Server(args, "tenants", tenants_file)]
        try:
            if args.count:
                await count(servers, args)
            elif args.callgrind:
                await instructions(servers, args)
            else:
                await pairs(servers, args)
        finally:
            for s in servers:
                s.stop()


async def count(servers: list[Server], args: argparse.Namespace) -> None:
    per: dict[str, list[float]] = {"none": [], "tenants": []}
    funcs: dict[str, dict[str, int]] = {"none": {}, "tenants": {}}
    for server in servers:
        await block(server, args)  # warm-up: imports, first-use caches
    for _ in range(args.pairs):
        for server in servers:
            (b0, f0) = await asyncio.to_thread(server.bytecodes)
            await block(server, args)
            (b1, f1) = await asyncio.to_thread(server.bytecodes)
            per[server.arm].append((b1 - b0) / args.sessions)
            into = funcs[server.arm]
            for name, k in f1.items():
                into[name] = into.get(name, 0) + k - f0.get(name, 0)
    header(args, "Python bytecodes per session (sys.monitoring INSTRUCTION events)")
    print("| arm | bytecodes / session: median (min–max) |")
    print("|---|---|")
    for arm, xs in per.items():
        print(f"| {arm} | {statistics.median(xs):.0f} ({min(xs):.0f}–{max(xs):.0f}) |")
    diff = statistics.median(per["tenants"]) - statistics.median(per["none"])
    ratio = statistics.median(per["tenants"]) / statistics.median(per["none"])
    print(f"\ntenants − none: {diff:+.0f} bytecodes per session ({ratio:.3f} ×)")
    if args.by_function:
        n = args.pairs * args.sessions
        names = set(funcs["none"]) | set(funcs["tenants"])
        delta = {f: (funcs["tenants"].get(f, 0) - funcs["none"].get(f, 0)) / n for f in names}
        print("\n| function | none | tenants | difference (bytecodes / session) |")
        print("|---|---|---|---|")
        for f in sorted(names, key=lambda f: -abs(delta[f]))[: args.by_function]:
            print(f"| {f} | {funcs['none'].get(f, 0) / n:.1f} "
                  f"| {funcs['tenants'].get(f, 0) / n:.1f} | {delta[f]:+.1f} |")  # fmt: skip


async def instructions(servers: list[Server], args: argparse.Namespace) -> None:
    per: dict[str, list[float]] = {"none": [], "tenants": []}
    for server in servers:
        await block(server, args)  # warm-up: imports, first-use caches
        await asyncio.to_thread(server.machine_instructions)
    for _ in range(args.pairs):
        for server in servers:
            await block(server, args)
            ir = await asyncio.to_thread(server.machine_instructions)
            per[server.arm].append(ir / args.sessions)
    header(args, "machine instructions per session (callgrind Ir, the server process)")
    print("| arm | instructions / session: median (min–max) |")
    print("|---|---|")
    for arm, xs in per.items():
        print(f"| {arm} | {statistics.median(xs):.0f} ({min(xs):.0f}–{max(xs):.0f}) |")
    ratios = [b / a for a, b in zip(per["none"], per["tenants"], strict=True)]
    print(f"\ntenants / none: median {statistics.median(ratios):.3f} "
          f"(min–max {min(ratios):.3f}–{max(ratios):.3f})")  # fmt: skip


async def pairs(servers: list[Server], args: argparse.Namespace) -> None:
    none, tenants = servers
    for s in servers:
        await timed(s, args)  # warm-up
    a: list[float] = []
    b: list[float] = []
    for i in range(args.pairs):
        if args.together:
            both = await asyncio.gather(timed(none, args), timed(tenants, args))
            got = {"none": both[0], "tenants": both[1]}
        else:
            order = (none, tenants) if i % 2 == 0 else (tenants, none)
            got = {s.arm: await timed(s, args) for s in order}
        a.append(got["none"])
        b.append(got["tenants"])
        print(f"# pair {i + 1}: none {got['none']:.1f} µs, tenants {got['tenants']:.1f} µs, "
              f"{got['tenants'] / got['none']:.3f}", flush=True)  # fmt: skip
    ratios = [y / x for x, y in zip(a, b, strict=True)]
    header(args, "server CPU per session (schedstat, whole tree)")
    print("| arm | CPU µs / session: median (min–max) |")
    print("|---|---|")
    print(f"| none | {statistics.median(a):.1f} ({min(a):.1f}–{max(a):.1f}) |")
    print(f"| tenants | {statistics.median(b):.1f} ({min(b):.1f}–{max(b):.1f}) |")
    print(
        f"\ntenants / none, per pair: median {statistics.median(ratios):.3f}, quartiles "
        f"{pct(ratios, 0.25):.3f}–{pct(ratios, 0.75):.3f}, min–max "
        f"{min(ratios):.3f}–{max(ratios):.3f} ({len(ratios)} pairs); ratio of the sums "
        f"{sum(b) / sum(a):.3f}"
    )


def header(args: argparse.Namespace, what: str) -> None:
    load = os.getloadavg()
    print(f"\n# {platform.node()} {os.cpu_count()} cores, Python {platform.python_version()}, "
          f"load {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} at the end")  # fmt: skip
    print(f"# {' '.join(sys.argv)}")
    print(f"# {what}; {args.pairs} pairs of blocks of {args.sessions} sessions (connect, "
          f"reset, {args.steps} step(s), close), {args.concurrency} at a time\n")  # fmt: skip


if __name__ == "__main__":
    asyncio.run(main())

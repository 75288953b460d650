#!/usr/bin/env python3
"""CPU per step of in-process / ``process`` / ``sandbox`` sessions, side by side, one run.

For each arm, a ``stadium serve TARGET --isolation LEVEL`` subprocess on 127.0.0.1,
pinned to one core (``--server-cpu``; its template and env processes inherit the pin),
driven from another core (``--client-cpu``) by the bench's own WebSocket client
(:mod:`stadium.bench.sessions`, picows, JSON frames): ``--sessions`` sessions are opened and
reset, step ``--warmup`` times each, then ``--steps`` times each, all at once, as fast as
the server answers. Counted over the timed steps only, from ``/proc``:

* **CPU µs per step**: the run time of every thread of every process under the server
  (the worker, the template and bubblewrap, each family's init, each env process;
  ``/proc/PID/task/TID/schedstat``, nanoseconds), divided by the steps; also split into
  the server process's own share (``worker``) and its descendants' (``env side``);
* **steps/s**: the steps over the wall time they took.

The arms of one round run one after the other, each on a fresh server; ``--rounds``
rounds, and the table gives each figure's median and its spread (min–max) over the
rounds, and each arm's ratio to the first arm (the median of the per-round ratios).
An arm is ``LEVEL`` or ``LEVEL --serve-option ...`` (``--arm 'sandbox
--sandbox-seccomp off'``), or ``floor``: no Stadium, the machine's floor for the same exchange
(:data:`FLOOR`: a parent and one child per session on socketpairs, pinned as the server is,
the parent sending every session's small request, then collecting the replies through epoll;
CPU of the parent and of the children, as worker and env side), or ``floor-py``: the same,
each child doing a step's least Python work (the request and the action decoded by msgspec,
a coroutine's step building the observation, the reply encoded), or ``floor-ws``: the
least any relaying design costs, a bare picows relay in front of one child per session
running the real ``benchmark`` env (:data:`FLOOR_WS`; driven and counted as the Stadium
arms are, through WebSocket), or ``floor-own``: the same children each holding their
session's WebSocket themselves, no relay, or ``stadium-own`` (:data:`STADIUM_OWN`): Stadium's
own in-process server in a process per session, no relay. Each row also gives the
wake-ups per step (times scheduled in, schedstat) of the worker and of the env side.

Run (as root for ``sandbox``; take the machine's bench lock)::

    flock /tmp/bench.lock .venv/bin/python scripts/bench-step-cpu.py

Every load is bounded in count and time; each server is stopped by its pid.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from stadium._core.urls import ws_url
from stadium._util.health import healthy
from stadium.bench.procstat import process_trees, terminate
from stadium.bench.sessions import connection_class

#: ``--arm stadium-own``: Stadium's whole in-process stack in a process per session, with no
#: relay: what a design handing each connection to its session's process (the worker off
#: the step's path) costs at best. One parent imports Stadium, then forks a child per session,
#: each serving one port with ``stadium serve``'s own code (:func:`run_server`, one worker,
#: in-process sessions, every option at its default as in the ``none`` arm); session *i*
#: connects to port *i*, so each child holds exactly one session. Unlike ``--workers 64``
#: (the kernel spreads connections unevenly among the workers, and a worker holding several
#: sessions amortizes its loop's turns over them), the spread is the direct design's.
STADIUM_OWN = r"""
import os, signal, sys, time
from stadium._server.config import ServerConfig
from stadium._server.server import run_server
base, sessions, extra = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
kids = []
for i in range(sessions):
    pid = os.fork()
    if pid == 0:
        config = ServerConfig(target="benchmark", host="127.0.0.1", port=base + i,
                              isolation="none", warm_pool=0, max_sessions=4,
                              idle_timeout=0, log_level="warning")
        os._exit(run_server(config))
    kids.append(pid)
def stop(*_):
    for kid in kids:
        os.kill(kid, signal.SIGTERM)
    for kid in kids:
        os.waitpid(kid, 0)
    os._exit(0)
signal.signal(signal.SIGTERM, stop)
while True:
    signal.pause()
"""


def free_ports(n: int) -> int:
    """The first of ``n`` consecutive loopback ports free now (tried from a random base)."""
    for _ in range(100):
        base = free_port()
        if base + n >= 65535:
            continue
        socks = []
        try:
            for i in range(n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", base + i))
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
        return base
    raise RuntimeError(f"no {n} consecutive free ports")


#: Seconds a server has to start, and one request to be answered, before the run fails.
START_S = 60.0
CALL_S = 60.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """``stadium serve`` pinned to one core, on a free loopback port."""

    def __init__(self, args: argparse.Namespace, arm: str) -> None:
        level, *extra = shlex.split(arm)
        port = free_ports(args.sessions) if level == "stadium-own" else free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.urls = [self.url]
        argv = [
            "taskset", "-c", str(args.server_cpu), *shlex.split(args.server_prefix),
            sys.executable, "-m", "stadium", "serve", args.target, "--host", "127.0.0.1",
            "--port", str(port), "--isolation", level, "--warm-pool", "0",
            "--max-sessions", str(args.sessions + 16), "--idle-timeout", "0",
            "--log-level", "warning", *extra,
        ]  # fmt: skip
        if level in ("floor-ws", "floor-own"):
            argv = [
                "taskset", "-c", str(args.server_cpu), sys.executable, "-c", FLOOR_WS,
                str(port), str(args.sessions), level,
            ]  # fmt: skip
        if level == "stadium-own":
            argv = [
                "taskset", "-c", str(args.server_cpu), sys.executable, "-c", STADIUM_OWN,
                str(port), str(args.sessions),
            ]  # fmt: skip
            self.urls = [f"http://127.0.0.1:{port + i}" for i in range(args.sessions)]
        env = dict(os.environ)
        for pair in args.env:
            key, _, value = pair.partition("=")
            env[key] = value
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, env=env)
        deadline = time.monotonic() + START_S
        ready = listening if level.startswith("floor") else healthy
        while not all(ready(url, 1.0) for url in self.urls):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"stadium serve ({arm}) did not start")
            time.sleep(0.1)

    def times(self) -> tuple[float, float, int, int]:
        """CPU seconds of (the server process, everything under it), and how many times each
        was scheduled in (wake-ups), now."""
        own, own_runs = sched_one(self.proc.pid)
        rest, rest_runs = 0.0, 0
        for pid in process_trees([self.proc.pid])[1:]:
            t, n = sched_one(pid)
            rest, rest_runs = rest + t, rest_runs + n
        return own, rest, own_runs, rest_runs

    def stop(self) -> None:
        terminate(self.proc)


def listening(url: str, timeout: float) -> bool:
    """Whether something accepts TCP connections at ``url``'s port (the floor-ws server has
    no ``/health``)."""
    try:
        socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout).close()
    except OSError:
        return False
    return True


def sched_one(pid: int) -> tuple[float, int]:
    """CPU seconds of one process's live threads, and their times scheduled in (schedstat:
    run time in ns, wait time, timeslices run)."""
    total = runs = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0.0, 0
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                fields = f.read().split()
            total += int(fields[0])
            runs += int(fields[2])
        except (OSError, IndexError, ValueError):
            continue
    return total / 1e9, runs


async def measure(args: argparse.Namespace, arm: str) -> dict[str, Any]:
    server = await asyncio.to_thread(Server, args, arm)
    conns: list[Any] = []
    try:
        cls = connection_class("ws")
        urls = [ws_url(url) for url in server.urls]
        step = json.dumps({"type": "step", "data": json.loads(args.action)}).encode()
        for i in range(args.sessions):
            conn = cls(urls[i % len(urls)], None)
            conns.append(conn)
            await conn.connect(CALL_S)
            await conn.request("reset", b'{"type":"reset","data":{}}', CALL_S)

        async def run(conn: Any, n: int) -> None:
            for _ in range(n):
                await conn.request("step", step, CALL_S)

        await asyncio.gather(*(run(c, args.warmup) for c in conns))
        procs = len(process_trees([server.proc.pid]))
        own0, rest0, own_runs0, rest_runs0 = server.times()
        t0 = time.perf_counter()
        await asyncio.gather(*(run(c, args.steps) for c in conns))
        wall = time.perf_counter() - t0
        own1, rest1, own_runs1, rest_runs1 = server.times()
        if len(process_trees([server.proc.pid])) != procs:
            print(f"# {arm}: processes came or went while timed: CPU under-counted")
    finally:
        for conn in conns:
            conn.abort()
        await asyncio.to_thread(server.stop)
    n = args.sessions * args.steps
    worker, env_side = (own1 - own0) / n * 1e6, (rest1 - rest0) / n * 1e6
    return {
        "arm": arm, "cpu_us": worker + env_side, "worker_us": worker, "env_us": env_side,
        "steps_s": n / wall, "processes": procs, "worker_runs": (own_runs1 - own_runs0) / n,
        "env_runs": (rest_runs1 - rest_runs0) / n,
    }  # fmt: skip


#: The floor arm's two sides (``--arm floor``): no Stadium, one parent process (the worker's
#: part) and one child per session, each pair a socketpair (AF_UNIX, SOCK_STREAM, as a
#: session's), one small message each way per step; the parent sends every session's request,
#: then collects the replies as epoll reports them (as the worker does when 64 requests come).
FLOOR = r"""
import json, os, selectors, socket, sys, time
import msgspec
sessions, warmup, steps, work = map(int, sys.argv[1:5])
request, reply = b"\x93\xa4step\x81\xacwait_seconds\x00" + bytes(8), bytes(96)
class Step(msgspec.Struct, array_like=True, tag="step"):
    action: bytes
    kwargs: dict
class Obs(msgspec.Struct):
    waited_seconds: float
    pid: int
    session_hash: str
    host: str
    step_count: int
    host_url: str
class Ok(msgspec.Struct, array_like=True, tag=0):
    observation: Obs
    reward: float
    done: bool
    truncated: bool
    info: dict | None
class Action(msgspec.Struct):
    wait_seconds: float = 0.0
async def step(action, n):
    return Ok(Obs(action.wait_seconds, 1, "0b2f7b49d74b", "vm", n, "http://vm:1"), 1.0, False,
              False, None)
if work:  # a step's least Python: decode the request and the action, a coroutine, encode
    request = msgspec.msgpack.encode(Step(msgspec.msgpack.encode(Action()), {}))
kids, socks = [], []
for _ in range(sessions):
    mine, theirs = socket.socketpair()
    pid = os.fork()
    if pid == 0:
        mine.close()
        recv, send, encode = theirs.recv, theirs.send, msgspec.msgpack.encode
        decode = msgspec.msgpack.Decoder(Step).decode
        action = msgspec.msgpack.Decoder(Action).decode
        n = 0
        while data := recv(65536):
            if work:
                coro = step(action(decode(data).action), n)
                n += 1
                try:
                    coro.send(None)
                except StopIteration as done:
                    send(encode(done.value))
            else:
                send(reply)
        os._exit(0)
    theirs.close()
    kids.append(pid)
    socks.append(mine)
sel = selectors.EpollSelector()
for sock in socks:
    sel.register(sock, selectors.EVENT_READ)
def rounds(n):
    for _ in range(n):
        for sock in socks:
            sock.send(request)
        left = sessions
        while left:
            for key, _ in sel.select():
                key.fileobj.recv(65536)
                left -= 1
def sched(pids):
    t = r = 0
    for pid in pids:
        with open(f"/proc/{pid}/schedstat") as f:
            a, _, c = f.read().split()
        t, r = t + int(a), r + int(c)
    return t, r
rounds(warmup)
me0, kid0 = sched([os.getpid()]), sched(kids)
t0 = time.perf_counter()
rounds(steps)
wall = time.perf_counter() - t0
me1, kid1 = sched([os.getpid()]), sched(kids)
for sock in socks:
    sock.close()
for pid in kids:
    os.waitpid(pid, 0)
n = sessions * steps
print(json.dumps({"worker_us": (me1[0] - me0[0]) / n / 1e3, "env_us": (kid1[0] - kid0[0]) / n / 1e3,
                  "worker_runs": (me1[1] - me0[1]) / n, "env_runs": (kid1[1] - kid0[1]) / n,
                  "steps_s": n / wall}))
"""


#: The WebSocket floor of any design where a worker relays each session's steps to an env
#: process of its own (``--arm floor-ws``): a picows server on uvloop (as ``stadium serve``'s)
#: and one child per session on a socketpair, forked before the server starts. The parent
#: passes each frame's bytes to its session's child unread, and each reply's bytes back as a
#: frame unread (no protocol, no checks, no limits, no timers); the child runs the real
#: ``benchmark`` env: the request decoded (msgspec JSON), ``reset`` or ``step`` awaited as a
#: coroutine, the reply encoded as Stadium's. What Stadium adds over it, on either side, is
#: its own work; this arm is the least that relaying to another process costs here.
#: ``--arm floor-own`` is the other design: no relay, each session's process holding its own
#: WebSocket (64 picows servers on one port, ``SO_REUSEPORT``; the kernel spreads the
#: connections among them) and answering as above: the least a process per session costs
#: when the worker is not on the step's path at all.
FLOOR_WS = r"""
import os, signal, socket, sys
import msgspec, picows, uvloop
from stadium.envs.benchmark import BenchmarkAction, BenchmarkEnv
port, sessions, own = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "floor-own"
class Request(msgspec.Struct):
    type: str
    data: msgspec.Raw = msgspec.Raw(b"{}")
decode, action = msgspec.json.Decoder(Request).decode, msgspec.json.Decoder(BenchmarkAction).decode
encode = msgspec.json.Encoder().encode
def run(coro):
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    raise RuntimeError("the benchmark env suspended")
def answer(env, data):
    req = decode(data)
    if req.type == "step":
        r = run(env.step(action(req.data)))
        return encode({"type": "observation", "data": {"observation": r.observation,
                       "reward": r.reward, "done": r.done, "truncated": r.truncated}})
    obs = run(env.reset())
    return encode({"type": "observation", "data": {"observation": obs, "reward": None,
                   "done": False}})
class Own(picows.WSListener):  # floor-own: this process's session(s), no relay
    def on_ws_connected(self, transport):
        self.env = BenchmarkEnv()
    def on_ws_frame(self, transport, frame):
        if frame.msg_type == picows.WSMsgType.TEXT:
            transport.send(picows.WSMsgType.TEXT, answer(self.env, frame.get_payload_as_bytes()))
        elif frame.msg_type == picows.WSMsgType.CLOSE:
            transport.disconnect()
if own:  # one process per session, each listening on the port itself (SO_REUSEPORT)
    kids = []
    for _ in range(sessions):
        pid = os.fork()
        if pid == 0:
            loop = uvloop.new_event_loop()
            loop.run_until_complete(picows.ws_create_server(lambda request: Own(), "127.0.0.1",
                                                            port, reuse_port=True))
            loop.run_forever()
        kids.append(pid)
    def stop(*_):
        for kid in kids:
            os.kill(kid, signal.SIGKILL)
        os._exit(0)
    signal.signal(signal.SIGTERM, stop)
    while True:
        signal.pause()
free = []
for _ in range(sessions):
    mine, theirs = socket.socketpair()
    if os.fork() == 0:
        mine.close()
        env, recv, send = BenchmarkEnv(), theirs.recv, theirs.send
        while data := recv(65536):
            send(answer(env, data))
        os._exit(0)
    theirs.close()
    mine.setblocking(False)
    free.append(mine)
class Relay(picows.WSListener):
    def on_ws_connected(self, transport):
        self.transport, self.sock = transport, free.pop()
        loop.add_reader(self.sock.fileno(), self.readable)
    def on_ws_frame(self, transport, frame):
        if frame.msg_type == picows.WSMsgType.TEXT:
            self.sock.send(frame.get_payload_as_bytes())
        elif frame.msg_type == picows.WSMsgType.CLOSE:
            transport.disconnect()
    def readable(self):
        self.transport.send(picows.WSMsgType.TEXT, self.sock.recv(65536))
    def on_ws_disconnected(self, transport):
        loop.remove_reader(self.sock.fileno())
loop = uvloop.new_event_loop()
loop.run_until_complete(picows.ws_create_server(lambda request: Relay(), "127.0.0.1", port))
loop.run_forever()
"""


def measure_floor(args: argparse.Namespace, arm: str) -> dict[str, Any]:
    """The floor arms: :data:`FLOOR` pinned as the server is (``floor-py``: each child does
    a step's least Python work, msgspec decoding and encoding and a coroutine's step)."""
    argv = [
        "taskset", "-c", str(args.server_cpu), sys.executable, "-c", FLOOR,
        str(args.sessions), str(args.warmup), str(args.steps), str(int(arm == "floor-py")),
    ]  # fmt: skip
    out = subprocess.run(argv, capture_output=True, text=True, timeout=START_S * 10, check=True)
    row: dict[str, Any] = json.loads(out.stdout)
    row.update(arm=arm, cpu_us=row["worker_us"] + row["env_us"], processes=args.sessions + 1)
    return row


def spread(values: list[float], fmt: str) -> str:
    med = statistics.median(values)
    if len(values) == 1:
        return format(med, fmt)
    return f"{format(med, fmt)} ({format(min(values), fmt)}–{format(max(values), fmt)})"


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", default="benchmark")
    p.add_argument("--arm", action="append", default=[],
                   help="an isolation level and serve options, or floor, floor-py (repeat; "
                   "default: all five)")  # fmt: skip
    p.add_argument("--sessions", type=int, default=64)
    p.add_argument("--steps", type=int, default=500, help="timed steps per session")
    p.add_argument("--warmup", type=int, default=100, help="untimed steps per session first")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--action", default='{"wait_seconds": 0}', help="each step's data (JSON)")
    p.add_argument("--server-cpu", default="0", help="the server's cores (taskset -c)")
    p.add_argument("--client-cpu", type=int, default=1)
    p.add_argument("--server-prefix", default="", help="a command the server runs under "
                   "(e.g. 'chrt -b 0')")  # fmt: skip
    p.add_argument("--env", action="append", default=[], help="VAR=VALUE for the servers")
    p.add_argument("--json", help="also write every round's figures to this file")
    args = p.parse_args()
    arms = args.arm or ["none", "process", "sandbox", "floor", "floor-py"]
    os.sched_setaffinity(0, {args.client_cpu})
    rounds: list[list[dict[str, Any]]] = []
    for r in range(args.rounds):
        rows = []
        for arm in arms:
            if arm in ("floor", "floor-py"):
                row = await asyncio.to_thread(measure_floor, args, arm)
            else:
                row = await measure(args, arm)
            print(
                f"# round {r + 1} {arm}: {row['cpu_us']:.1f} µs/step "
                f"(worker {row['worker_us']:.1f}, env side {row['env_us']:.1f}), "
                f"{row['steps_s']:.0f} steps/s, runs/step {row['worker_runs']:.2f} + "
                f"{row['env_runs']:.2f}",
                flush=True,
            )
            rows.append(row)
        rounds.append(rows)
    load = os.getloadavg()
    print(f"# {platform.node()} {os.cpu_count()} cores, Python {platform.python_version()}, "
          f"load {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} at the end")  # fmt: skip
    print(f"# {' '.join(sys.argv)}")
    print(
        f"# {args.target}, {args.sessions} sessions x {args.steps} steps, server on cpu "
        f"{args.server_cpu}, client on cpu {args.client_cpu}, {args.rounds} rounds: "
        "median (min–max)"
    )
    print()
    print(
        "| arm | CPU µs per step (whole tree) | worker | env side | × first arm | steps/s "
        "| wake-ups per step (worker + env side) |"
    )
    print("|---|---|---|---|---|---|---|")
    for i, arm in enumerate(arms):
        col = [rows[i] for rows in rounds]
        ratios = [rows[i]["cpu_us"] / rows[0]["cpu_us"] for rows in rounds]
        print(
            f"| {arm} | {spread([c['cpu_us'] for c in col], '.1f')} "
            f"| {spread([c['worker_us'] for c in col], '.1f')} "
            f"| {spread([c['env_us'] for c in col], '.1f')} "
            f"| {spread(ratios, '.2f')} | {spread([c['steps_s'] for c in col], '.0f')} "
            f"| {spread([c['worker_runs'] for c in col], '.2f')} + "
            f"{spread([c['env_runs'] for c in col], '.2f')} |"
        )
    if args.json:
        text = json.dumps({"argv": sys.argv, "rounds": rounds}, indent=1)
        await asyncio.to_thread(Path(args.json).write_text, text)


if __name__ == "__main__":
    asyncio.run(main())

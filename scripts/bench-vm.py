"""Measure ``--isolation vm`` against ``sandbox`` and a Podman container per session on
this machine (BENCHMARKS.md, "vm").

    flock /tmp/bench.lock python scripts/bench-vm.py [--modes vm,sandbox,podman]
        [--sessions 20] [--forks 20] [--only-forks] [--podman-image IMAGE]

For each mode it starts ``stadium serve`` (the hostile test env, echo steps) as a process
of its own and measures, from a client process: session start (connect + ``reset``) p50/p99
from a warm pool (``--warm-pool 4``, a pause between sessions so the pool refills) and
cold (``--warm-pool 0``); ``fork`` of a session that has stepped (the copy's client
connected, p50/p99; each copy closed before the next); the server's CPU per step (its
own process, from /proc) and its VMs' (the QEMU processes, apart); the host memory (PSS)
per idle session; and how many sessions open at once before one fails or
``--max-concurrent`` is reached.

``podman`` is no Stadium isolation: a session is ``podman run -i --rm --network none IMAGE
python3`` of a line-echo loop (bench-isolation.py's container arm, kept attached so that
it can step), so its figures are a lower bound on a Stadium session in a container. Start:
``podman run`` to the first line echoed (cold only: no pool); step: a line written to the
container's stdin and read back (through the ``podman run`` client and conmon); "server"
CPU: the ``podman run`` client's and conmon's, "env" CPU: the container's processes; memory:
PSS of conmon and the container's processes per idle session (the attached client's apart);
concurrent: at most 50 containers, each stepping. Fork: none (``podman container
checkpoint`` needs CRIU). Every container carries a label of this run and is removed by id
at the end, on failure too.

The last lines are a Markdown table, one column per mode.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Any

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


#: The container's program: echo each line of stdin (one line = one step).
ECHO = (
    "import sys\n"
    "while True:\n"
    "    line = sys.stdin.readline()\n"
    "    if not line:\n"
    "        break\n"
    "    sys.stdout.write(line)\n"
    "    sys.stdout.flush()\n"
)
#: A label on every container of this run, to find and remove them by id at the end.
RUN_LABEL = f"stadium-bench-vm={uuid.uuid4().hex[:12]}"
#: The most containers opened at once, whatever ``--max-concurrent`` says.
PODMAN_MAX = 50


class Container:
    """One session in a container: ``podman run -i`` of ``ECHO``, attached."""

    def __init__(self, image: str) -> None:
        self.image = image
        self.dir = tempfile.mkdtemp(prefix="bench-vm-")
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self, limit: float) -> None:
        self.proc = await asyncio.create_subprocess_exec(
            "podman", "run", "-i", "--rm", "--network", "none", "--label", RUN_LABEL,
            "--cidfile", os.path.join(self.dir, "cid"), self.image, "python3", "-c", ECHO,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        await self.step("reset", limit)

    async def step(self, arg: str, limit: float = 60) -> None:
        assert self.proc is not None
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        self.proc.stdin.write(arg.encode() + b"\n")
        await self.proc.stdin.drain()
        line = await asyncio.wait_for(self.proc.stdout.readline(), limit)
        if not line:
            raise RuntimeError(
                f"the container of {self.image} ended before answering: is the image in the "
                "local store (`podman images`) with python3 in it? (--podman-image)"
            )
        if line != arg.encode() + b"\n":
            raise RuntimeError(f"the container answered {line[:80]!r} to {arg!r}")

    def cid(self) -> str | None:
        try:
            with open(os.path.join(self.dir, "cid")) as f:
                return f.read().strip() or None
        except OSError:
            return None

    def pids(self) -> tuple[int, int]:
        """The ``podman run`` client's pid and conmon's (the container's are its children)."""
        assert self.proc is not None
        out = subprocess.run(
            ["podman", "inspect", "-f", "{{.State.ConmonPid}}", str(self.cid())],
            check=True, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        return self.proc.pid, int(out.stdout.split()[0])

    async def close(self) -> None:
        cid = self.cid()
        if cid:
            await asyncio.to_thread(
                subprocess.run,
                ["podman", "rm", "-f", "-t", "0", cid],
                capture_output=True,
                timeout=60,
            )
        if self.proc is not None:
            if self.proc.returncode is None:
                self.proc.kill()  # the client this script started, by its pid
            await asyncio.wait_for(self.proc.wait(), 60)
        shutil.rmtree(self.dir, ignore_errors=True)


def _remove_run_containers() -> None:
    """Remove, by id, any container of this run still there (a start that failed midway)."""
    out = subprocess.run(
        ["podman", "ps", "-aq", "--filter", f"label={RUN_LABEL}"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    for cid in out.stdout.split():
        subprocess.run(["podman", "rm", "-f", "-t", "0", cid], capture_output=True, timeout=60)


async def podman_starts(image: str, n: int) -> dict[str, float]:
    times = []
    for _ in range(n):
        c = Container(image)
        try:
            t = time.perf_counter()
            await c.start(120)
            times.append(time.perf_counter() - t)
        finally:
            await c.close()
        await asyncio.sleep(0.2)
    return {"p50_ms": _pct(times, 0.5), "p99_ms": _pct(times, 0.99), "n": n}


async def podman_steady(image: str, steps: int, idle: int, max_concurrent: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    containers: list[Container] = []
    try:
        c = Container(image)
        containers.append(c)
        await c.start(120)
        for i in range(20):
            await c.step(str(i))
        await asyncio.sleep(1)
        client, conmon = c.pids()
        env = _children(conmon)
        srv0, env0 = _cpu(client) + _cpu(conmon), sum(_cpu(k) for k in env)
        t = time.perf_counter()
        for i in range(steps):
            await c.step(str(i))
        wall = time.perf_counter() - t
        srv1, env1 = _cpu(client) + _cpu(conmon), sum(_cpu(k) for k in env)
        out["step_ms"] = wall / steps * 1000
        out["server_cpu_us_per_step"] = (srv1 - srv0) / steps * 1e6
        out["env_cpu_us_per_step"] = (env1 - env0) / steps * 1e6
        # idle sessions: PSS of conmon + the container's processes; the clients' apart
        while len(containers) < idle:
            c = Container(image)
            containers.append(c)
            await c.start(120)
        await asyncio.sleep(2)
        trees, clients = [], []
        for c in containers[:idle]:
            client, conmon = c.pids()
            trees.append([conmon, *_children(conmon)])
            clients.append(client)
        out["pss_kib_per_idle_session"] = sum(_pss(p) for t in trees for p in t) / idle
        out["podman_client_pss_kib_per_session"] = sum(_pss(p) for p in clients) / idle
        cpu0 = sum(_cpu(p) for t in trees for p in t)
        await asyncio.sleep(5)
        cpu1 = sum(_cpu(p) for t in trees for p in t)
        out["idle_cpu_pct_per_session"] = (cpu1 - cpu0) / 5 / idle * 100
        # concurrent: open more until one fails, the bound or 240 s
        bound = min(max_concurrent, PODMAN_MAX)
        t = time.perf_counter()
        try:
            while len(containers) < bound and time.perf_counter() - t < 240:
                c = Container(image)
                containers.append(c)
                await c.start(120)
        except Exception as exc:
            out["concurrent_failed_with"] = str(exc)[:120] or type(exc).__name__
            await containers.pop().close()
        out["concurrent_open"] = len(containers)
        ok = 0
        for c in containers:
            try:
                await c.step("y")
                ok += 1
            except Exception:
                pass
        out["concurrent_all_stepping"] = ok
    finally:
        for c in containers:
            await c.close()
        _remove_run_containers()
    return out


async def podman_row(args: argparse.Namespace) -> dict[str, Any]:
    row: dict[str, Any] = {"mode": "podman", "fork": None}
    try:
        if not args.only_forks and not args.skip_starts:
            row["cold"] = await podman_starts(args.podman_image, args.sessions)
        if not args.only_forks:
            idle = min(args.idle, PODMAN_MAX)
            row.update(
                await podman_steady(args.podman_image, args.steps, idle, args.max_concurrent)
            )
    finally:
        _remove_run_containers()
    return row


def _ms(d: object) -> str:
    if not isinstance(d, dict):
        return "—"
    return f"{d['p50_ms']:.1f} / {d['p99_ms']:.1f} ms"


def _num(v: object, fmt: str) -> str:
    return format(v, fmt) if isinstance(v, (int, float)) else "—"


def table(rows: list[dict[str, Any]]) -> list[str]:
    """The rows as a Markdown table, one column per mode."""
    lines = [
        "| | " + " | ".join(f"`{r['mode']}`" for r in rows) + " |",
        "|---|" + "---|" * len(rows),
    ]
    cells = [
        ("session start, warm pool of 4, p50 / p99", lambda r: _ms(r.get("warm"))),
        ("session start, cold, p50 / p99", lambda r: _ms(r.get("cold"))),
        ("step (echo), one session, mean", lambda r: _num(r.get("step_ms"), ".2f") + " ms"),
        ("server CPU per step (µs)", lambda r: _num(r.get("server_cpu_us_per_step"), ".0f")),
        ("env CPU per step (µs)", lambda r: _num(r.get("env_cpu_us_per_step"), ".0f")),
        (
            "host memory (PSS) per idle session (MiB)",
            lambda r: (
                _num(r["pss_kib_per_idle_session"] / 1024, ".1f")
                if "pss_kib_per_idle_session" in r
                else "—"
            ),
        ),
        (
            "podman only: the attached `podman run` client's PSS per session (MiB)",
            lambda r: (
                _num(r["podman_client_pss_kib_per_session"] / 1024, ".1f")
                if "podman_client_pss_kib_per_session" in r
                else "—"
            ),
        ),
        (
            "CPU per idle session (% of a core)",
            lambda r: _num(r.get("idle_cpu_pct_per_session"), ".2f"),
        ),
        (
            "sessions open at once, all stepping",
            lambda r: (
                f"{_num(r.get('concurrent_all_stepping'), 'd')} of "
                f"{_num(r.get('concurrent_open'), 'd')}"
            ),
        ),
        ("fork, p50 / p99", lambda r: _ms(r.get("fork"))),
    ]
    for name, cell in cells:
        lines.append(f"| {name} | " + " | ".join(cell(r) for r in rows) + " |")
    return lines


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--modes", default="vm,sandbox,podman")
    parser.add_argument("--sessions", type=int, default=20)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--idle", type=int, default=10)
    parser.add_argument("--max-concurrent", type=int, default=64)
    parser.add_argument("--skip-starts", action="store_true", help="only the steady part")
    parser.add_argument("--forks", type=int, default=20)
    parser.add_argument("--only-forks", action="store_true", help="only the forks")
    parser.add_argument(
        "--podman-image",
        default="localhost/stadium-test-base:trixie",
        help="the image of the podman mode (python3 in it; the local store, no registry)",
    )
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    for mode in args.modes.split(","):
        if mode == "podman":
            rows.append(await podman_row(args))
            print(json.dumps(rows[-1]), flush=True)
            continue
        row: dict[str, Any] = {"mode": mode}
        if args.forks:
            row["fork"] = await forks(mode, args.forks)
        if args.only_forks:
            rows.append(row)
            print(json.dumps(row), flush=True)
            continue
        if not args.skip_starts:
            row["warm"] = await starts(mode, 4, args.sessions, 1.0)
            row["cold"] = await starts(mode, 0, args.sessions, 0.2)
        row.update(await steady(mode, args.steps, args.idle, args.max_concurrent))
        rows.append(row)
        print(json.dumps(row), flush=True)
    print()
    print("\n".join(table(rows)))


if __name__ == "__main__":
    asyncio.run(main())

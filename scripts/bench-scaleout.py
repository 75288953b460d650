#!/usr/bin/env python3
"""Scale-out of Stadium on the emulated cluster (root; ~5-10 minutes; bounded).

Brings up the 3-node emulated cluster of ``tests/cluster/harness.py`` (network
namespaces with their own hostnames on a private bridge), caps each node's CPU
with its own cgroup (CFS quota, :class:`stadium.bench.arms.CpuCap`; default 0.3
CPU each, so that the three nodes together, 0.9 CPU, fit on one core beside the
load generator on the other; the nodes, the load and HAProxy get cpu.shares
8192 against the machine's other processes' 1024, so that a busy neighbour
disturbs the measurement less), starts ``stadium serve benchmark`` (one process)
in each node, pinned to the server core, and HAProxy on the host (the
configuration ``stadium router`` renders, pinned to the server core too). Then,
with ``stadium bench`` (its Python API; the load pinned to the other core):

1. **goodput max batch** for 1, 2 and 3 nodes: a ramp of bursts (W = 1 s, one
   step, N on a geometric grid from 256, x1.15, rounded to 16) against the
   nodes directly, the sessions spread statically over them by the benchmark
   (weighted by free capacity: equal here). A point holds when >= 99 % of its
   sessions succeed and total p99 <= 2 x W; a ramp stops after two points in
   a row fail to hold, and the goodput max batch is the largest N that held.
   The ramps are interleaved (for each N, the 1-, 2- and 3-node points back to
   back), one repetition per point.
2. **server CPU per step** (W = 0, 64 sessions per node x 400 steps, 10 ms
   think before each step; the median of 3 runs): one node directly (64
   sessions); 3 nodes with the benchmark's client-side spread (192); 3 nodes
   through HAProxy (192); and HAProxy's own CPU per step. The same paced load
   per node in each, below every cap: a server's CPU per step falls as more
   frames arrive per wake-up (a saturated, throttled node batches), so an
   unpaced comparison measures saturation, not the path. CPU is each
   process's run time from ``/proc/PID/task/*/schedstat`` (nanoseconds) before
   and after the run, over the steps answered.
3. **through the router at the largest N**: one burst at the 3-node goodput N
   through HAProxy (W = 1 s): success, connect p50/p99, total p99, and the
   sessions per node.

Writes ``scaleout.md`` (tables and the exact command) and ``scaleout.json`` to
``--output-dir``, plus every bench run's own outputs below it. Traffic goes
only to loopback and the cluster's namespaces. Everything started is stopped by
pid and the cluster torn down, also on error or Ctrl-C.

    sudo .venv/bin/python scripts/bench-scaleout.py --output-dir bench-results/scaleout
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests.cluster.harness
sys.path.insert(0, str(REPO / "src"))

from stadium._util.health import healthy  # noqa: E402
from stadium.bench import report  # noqa: E402
from stadium.bench.arms import Arm, CpuCap  # noqa: E402
from stadium.bench.grid import BenchConfig, run  # noqa: E402
from stadium.bench.loadspec import ThinkModel  # noqa: E402
from stadium.bench.procstat import run_time_s  # noqa: E402
from stadium.deploy.deployment import Deployment  # noqa: E402
from stadium.deploy.haproxy import RouterOptions, render  # noqa: E402
from tests.cluster.harness import Cluster, haproxy_servers, stop_process, wait_for  # noqa: E402

SUCCESS = 0.99
"""A goodput point holds with at least this success rate ..."""
P99_OVER_W = 2.0
"""... and total p99 at most this many times W."""


@dataclass
class Setup:
    """What the measurement runs against."""

    cluster: Cluster
    node_urls: list[str]
    node_pids: list[int]
    caps: list[CpuCap]
    router_url: str
    router_pid: int
    args: argparse.Namespace
    out: Path
    deadline: float
    notes: list[str] = field(default_factory=list)

    def remaining(self) -> float:
        return self.deadline - time.monotonic()


def _pin(pid: int, cpus: set[int]) -> None:
    """Pin every thread of ``pid`` (children forked later inherit)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):
            os.sched_setaffinity(int(tid), cpus)


def _ready(url: str, proc: subprocess.Popen[Any]) -> Callable[[], bool]:
    return lambda: healthy(url) or proc.poll() is not None


@contextlib.contextmanager
def cluster_setup(args: argparse.Namespace, out: Path) -> Iterator[Setup]:
    """The capped nodes and the router, torn down after the block."""
    server_cpu = {args.server_cpu}
    tag = f"stadium-scaleout-{os.getpid()}"
    caps = [CpuCap(args.cpu_per_node, name=f"{tag}-node{k}", shares=args.shares)
            for k in (1, 2, 3)]  # fmt: skip
    # This process, the load generator's workers and HAProxy (children of this
    # process): no quota, the same weight as the nodes against the machine's others.
    load_cap = CpuCap(None, name=f"{tag}-load", shares=args.shares)
    procs: list[subprocess.Popen[Any]] = []
    cluster = Cluster(n_nodes=3, workdir=out / "cluster")
    try:
        cluster.up()
        methods = {cap.create() for cap in caps}
        load_method = load_cap.create()
        load_cap.add(os.getpid())
        urls, pids = [], []
        for node, cap in zip(cluster.nodes, caps, strict=True):
            # sh moves itself into the node's cgroup, then execs the pinned server
            # (same pid): the server never runs a moment uncapped.
            cmd = ["sh", "-c", 'echo $$ > "$0" && cpu="$1" && shift && exec taskset -c "$cpu" "$@"',
                   str(cap.procs_file), str(args.server_cpu), sys.executable, "-m", "stadium",
                   "serve", "benchmark", "--host", "0.0.0.0", "--port", str(args.port),
                   "--max-sessions", "16384", "--log-level", "warning"]  # fmt: skip
            log = (out / f"{node.name}.log").open("wb")
            procs.append(node.popen(cmd, stdout=log, stderr=subprocess.STDOUT))
            log.close()
            urls.append(node.url(args.port))
        for url, proc in zip(urls, procs, strict=True):
            wait_for(_ready(url, proc), 60.0, url)
            if proc.poll() is not None:
                raise RuntimeError(f"the node server at {url} exited: see {out}/node*.log")
            pids.append(proc.pid)
        for pid, cap in zip(pids, caps, strict=True):
            assert str(pid) in cap.procs_file.read_text().split(), f"{pid} is not capped"
        stats = str(cluster.workdir / "haproxy.sock")
        router_port = args.port + 1
        cfg = render(
            Deployment.of(urls),
            RouterOptions(bind="127.0.0.1", port=router_port, stats_socket=stats),
        )
        (out / "haproxy.cfg").write_text(cfg)
        router = cluster.haproxy(cfg)
        wait_for(lambda: len(haproxy_servers(stats, "stadium")) == 3, 10.0, "haproxy stats")
        _pin(router.pid, server_cpu)
        wait_for(
            lambda: set(haproxy_servers(stats, "stadium").values()) == {"UP"}, 15.0, "nodes UP"
        )
        setup = Setup(
            cluster, urls, pids, caps, f"http://127.0.0.1:{router_port}", router.pid, args, out,
            time.monotonic() + args.deadline,
        )  # fmt: skip
        setup.notes.append(f"CPU cap per node: {', '.join(sorted(methods))}")
        setup.notes.append(f"the load generator and HAProxy: {load_method}")
        yield setup
    finally:
        for proc in procs:
            stop_process(proc)
        cluster.down()
        for cap in [*caps, load_cap]:
            cap.remove()


# ------------------------------------------------------------------ one bench run


def bench_point(
    setup: Setup,
    label: str,
    urls: Sequence[str],
    n: int,
    wait: float,
    steps: int,
    think_ms: float = 0.0,
) -> tuple[dict[str, Any], list[dict[str, Any]], dict[int, float]]:
    """One ``stadium bench`` point (W, N) against ``urls`` (the nodes' trees sampled);
    its summary row, its raw rows, and each watched pid's schedstat CPU seconds."""
    out = setup.out / "runs" / f"{label}-n{n}-w{wait:g}-s{steps}-{time.monotonic_ns()}"
    arm = Arm.remote(list(urls), setup.node_pids, name=label)
    timeout = 10.0
    cfg = BenchConfig(
        arms=[arm], requests_grid=[n], wait_grid=[wait], output_dir=out, steps=steps,
        think=ThinkModel(ttft_ms=think_ms),
        load_cpus=(setup.args.load_cpu,), connect_timeout=timeout, request_timeout=timeout,
        deadline_s=max(
            5.0, min(steps * (wait + think_ms / 1e3) + 3 * timeout + 30.0, setup.remaining())
        ),
        progress=False, settle_s=0.3, command=f"(scripts/bench-scaleout.py) {label}",
    )  # fmt: skip
    watched = [*setup.node_pids, setup.router_pid]
    before = {p: run_time_s([p]) for p in watched}
    run(cfg)
    cpu = {p: run_time_s([p]) - before[p] for p in watched}
    (row,) = report.read_summary(out / "summary.csv")
    raw = [json.loads(line) for line in (out / "raw.jsonl").read_text().splitlines()]
    return row, raw, cpu


def holds(row: dict[str, Any], wait: float) -> bool:
    p99 = row.get("total_p99_ms")
    ok = row["success_rate"] >= SUCCESS - 1e-12
    return bool(ok and p99 is not None and p99 <= P99_OVER_W * wait * 1e3)


def grid(start: int, ratio: float, top: int) -> list[int]:
    out: list[int] = []
    x = float(start)
    while x <= top:
        n = int(round(x / 16) * 16)
        if not out or n > out[-1]:
            out.append(n)
        x *= ratio
    return out


def goodput(setup: Setup, ks: Sequence[int]) -> list[dict[str, Any]]:
    """The goodput ramps against the first k nodes directly, for each k of ``ks``,
    interleaved: for each N, every ramp still going runs its point back to back
    (drift in the machine affects them alike). A ramp stops after two points in a
    row do not hold; its goodput is the largest N that held."""
    args = setup.args
    ramps: dict[int, dict[str, Any]] = {
        k: {"nodes": k, "goodput": 0, "points": [], "misses": 0} for k in ks
    }
    for n in grid(args.start, args.ratio, args.top):
        for k, ramp in ramps.items():
            if ramp["misses"] >= 2:
                continue
            if setup.remaining() < 30:
                setup.notes.append(f"the run's deadline stopped the ramps at N={n}")
                return [_ramp_result(r) for r in ramps.values()]
            row, _, _ = bench_point(setup, f"{k}-node", setup.node_urls[:k], n, args.wait, 1)
            ok = holds(row, args.wait)
            ramp["points"].append(_point(row, ok))
            print(f"  {k}-node N={n}: {_point_text(row)} -> {'holds' if ok else 'does not hold'}",
                  flush=True)  # fmt: skip
            if ok:
                ramp["goodput"] = n
            ramp["misses"] = 0 if ok else ramp["misses"] + 1
        if all(r["misses"] >= 2 for r in ramps.values()):
            break
    return [_ramp_result(r) for r in ramps.values()]


def _ramp_result(ramp: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in ramp.items() if k != "misses"}


def _point(row: dict[str, Any], ok: bool) -> dict[str, Any]:
    keys = ("n", "success_rate", "connect_p50_ms", "connect_p99_ms", "total_p99_ms",
            "unique_hosts", "sessions_per_host", "failures")  # fmt: skip
    return {**{k: row.get(k) for k in keys}, "holds": ok}


def _point_text(row: dict[str, Any]) -> str:
    return (
        f"success {100 * row['success_rate']:.2f} %, connect p99 {_s(row['connect_p99_ms'])}, "
        f"total p99 {_s(row['total_p99_ms'])}, hosts {row.get('sessions_per_host') or '-'}"
        + (f", {row['failures']}" if row.get("failures") else "")
    )


def _s(ms: float | None) -> str:
    return "-" if ms is None else f"{ms / 1000:.2f} s"


def cpu_per_step(setup: Setup) -> dict[str, Any]:
    """Server (and router) CPU per step: one node direct, 3 spread, 3 through HAProxy."""
    args = setup.args
    per_node, steps = args.cpu_sessions, args.cpu_steps
    configs = {  # the same sessions per node in each: a node's work per wake-up alike
        "1 node, direct": (setup.node_urls[:1], per_node),
        "3 nodes, client-side spread": (setup.node_urls, 3 * per_node),
        "3 nodes, through HAProxy": ([setup.router_url], 3 * per_node),
    }
    out: dict[str, Any] = {}
    for rep in range(args.cpu_reps):
        for label, (urls, n) in configs.items():
            if setup.remaining() < 30:
                setup.notes.append("the run's deadline cut the CPU-per-step runs short")
                return out
            row, raw, cpu = bench_point(setup, "cpu", urls, n, 0.0, steps, args.cpu_think_ms)
            answered = sum(len(r["step_s"]) for r in raw)
            nodes = sum(cpu[p] for p in setup.node_pids)
            entry = out.setdefault(label, {"server_us": [], "router_us": [], "failures": []})
            entry["server_us"].append(1e6 * nodes / max(1, answered))
            entry["router_us"].append(1e6 * cpu[setup.router_pid] / max(1, answered))
            entry["failures"].append(row.get("failures") or "")
            print(f"  CPU/step rep {rep + 1} {label}: server "
                  f"{entry['server_us'][-1]:.2f} µs, router {entry['router_us'][-1]:.2f} µs "
                  f"({answered} steps)", flush=True)  # fmt: skip
    return out


def through_router(setup: Setup, n: int) -> dict[str, Any]:
    """One burst of ``n`` (W = --wait) through HAProxy, and its CPU."""
    row, raw, cpu = bench_point(setup, "router", [setup.router_url], n, setup.args.wait, 1)
    steps = sum(len(r["step_s"]) for r in raw)
    return {
        **_point(row, holds(row, setup.args.wait)),
        "router_cpu_ms_per_session": 1e3 * cpu[setup.router_pid] / max(1, row["ok"] or 0),
        "steps": steps,
    }


# ------------------------------------------------------------------------ output


def _med(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def markdown(result: dict[str, Any], command: str, notes: Sequence[str]) -> str:
    a = result["args"]
    lines = ["# Scale-out on the emulated cluster", "", "Command:", "", "```", command, "```", ""]
    lines += [
        f"One machine ({os.cpu_count()} cores): the nodes are network namespaces sharing its "
        f"kernel; each node's server is capped at {a['cpu_per_node']:g} CPU (cgroup CFS "
        f"quota) and pinned, with HAProxy, to CPU {a['server_cpu']}; the load generator is "
        f"pinned to CPU {a['load_cpu']}. The caps make the nodes independent in CPU only.",
        "",
        f"## Goodput max batch (W = {a['wait']:g} s; >= {SUCCESS:.0%} success and total p99 "
        f"<= {P99_OVER_W:g} x W)",
        "",
        "| nodes | goodput max batch | × one node | last points (N: success / total p99; ✗ "
        "does not hold) |",
        "|---|---|---|---|",
    ]
    one = next((g["goodput"] for g in result["goodput"] if g["nodes"] == 1), 0)
    for g in result["goodput"]:
        ratio = f"{g['goodput'] / one:.2f}" if one else "-"
        pts = ", ".join(
            f"{p['n']}: {100 * p['success_rate']:.1f} %/{_s(p['total_p99_ms'])}"
            + ("" if p["holds"] else " ✗")
            for p in g["points"][-4:]
        )
        lines.append(f"| {g['nodes']} | {g['goodput']:,} | {ratio} | {pts} |")
    cpu = result["cpu_per_step"]
    base = _med(cpu.get("1 node, direct", {}).get("server_us", []))
    lines += (
        []
        if not cpu
        else [
            "",
            f"## CPU per step (W = 0, {a['cpu_sessions']} sessions per node × {a['cpu_steps']:,} "
            f"steps each, {a['cpu_think_ms']:g} ms think before each step; median of "
            f"{a['cpu_reps']} runs)",
            "",
            "| configuration | server CPU µs/step (all nodes) | × one node direct "
            "| HAProxy CPU µs/step | server + HAProxy µs/step | runs (server µs) |",
            "|---|---|---|---|---|---|",
        ]
    )
    for label, e in cpu.items():
        server, router = _med(e["server_us"]), _med(e["router_us"])
        via = "HAProxy" in label
        lines.append(
            f"| {label} | {server:.2f} | {server / base:.3f} | "
            f"{f'{router:.2f}' if via else '-'} | {server + (router if via else 0):.2f} | "
            f"{', '.join(f'{x:.2f}' for x in e['server_us'])} |"
        )
    r = result.get("router")
    if r:
        lines += [
            "",
            f"## Through HAProxy at the largest N, {r['n']:,} (W = {a['wait']:g} s)",
            "",
            "| path | success | connect p50 | connect p99 | total p99 | sessions per node "
            "| HAProxy CPU per session |",
            "|---|---|---|---|---|---|---|",
            f"| 3 nodes through HAProxy | {100 * r['success_rate']:.2f} % | "
            f"{_s(r['connect_p50_ms'])} | {_s(r['connect_p99_ms'])} | {_s(r['total_p99_ms'])} "
            f"| {r['sessions_per_host'] or '-'} | {r['router_cpu_ms_per_session']:.3f} ms |",
        ]
        direct = [
            pt for g in result["goodput"] if g["nodes"] == 3 for pt in g["points"]
            if pt["n"] == r["n"]
        ]  # fmt: skip
        for pt in direct[:1]:
            lines.append(
                f"| 3 nodes, client-side spread (the ramp's point) | "
                f"{100 * pt['success_rate']:.2f} % | {_s(pt['connect_p50_ms'])} | "
                f"{_s(pt['connect_p99_ms'])} | {_s(pt['total_p99_ms'])} | "
                f"{pt['sessions_per_host'] or '-'} | - |"
            )
    lines += ["", "## Against the goals", "", "| goal | measured | met |", "|---|---|---|"]
    three = next((g["goodput"] for g in result["goodput"] if g["nodes"] == 3), None)
    if three is not None and one:
        ratio3 = three / one
        lines.append(
            f"| 3 capped nodes hold >= 2.7 x one node's goodput batch | {three:,} / {one:,} = "
            f"{ratio3:.2f} x | {'yes' if ratio3 >= 2.7 else 'no'} |"
        )
    spread = cpu.get("3 nodes, client-side spread")
    if spread and base == base:  # not NaN
        extra = _med(spread["server_us"]) / base - 1
        lines.append(
            f"| client-side balancing costs <= 5 % more server CPU per step than one node "
            f"direct | {100 * extra:+.1f} % | {'yes' if extra <= 0.05 else 'no'} |"
        )
    via = cpu.get("3 nodes, through HAProxy")
    if via:
        lines.append(
            f"| HAProxy's CPU per step reported beside Stadium's | HAProxy "
            f"{_med(via['router_us']):.2f} µs + nodes {_med(via['server_us']):.2f} µs per step "
            f"| reported |"
        )
    if notes:
        lines += ["", "Notes:", ""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu-per-node", type=float, default=0.3, help="CPU cap of each node")
    p.add_argument("--server-cpu", type=int, default=0, help="CPU of the nodes and HAProxy")
    p.add_argument("--load-cpu", type=int, default=1, help="CPU of the load generator")
    p.add_argument("--wait", type=float, default=1.0, help="W of the goodput ramps (s)")
    p.add_argument("--start", type=int, default=256, help="first N of each ramp")
    p.add_argument("--ratio", type=float, default=1.15, help="N grows by this factor")
    p.add_argument("--top", type=int, default=8192, help="largest N of a ramp")
    p.add_argument("--nodes", default="1,2,3", help="goodput ramps for these node counts")
    p.add_argument("--cpu-sessions", type=int, default=64, help="CPU per step: sessions per node")
    p.add_argument("--cpu-steps", type=int, default=400)
    p.add_argument("--cpu-think-ms", type=float, default=10.0,
                   help="CPU per step: think time before each step (paces the load)")  # fmt: skip
    p.add_argument("--cpu-reps", type=int, default=3)
    p.add_argument("--shares", type=int, default=8192,
                   help="cpu.shares of the nodes, the load and HAProxy (others: 1024)")  # fmt: skip
    p.add_argument("--port", type=int, default=18600, help="nodes' port (router: +1)")
    p.add_argument("--deadline", type=float, default=900.0, help="whole run, seconds")
    default_out = Path("bench-results") / time.strftime("scaleout-%Y%m%d-%H%M%S")
    p.add_argument("--output-dir", type=Path, default=default_out)
    args = p.parse_args(argv)
    if os.geteuid() != 0:
        print("needs root (network namespaces, cgroups)", file=sys.stderr)
        return 2
    out: Path = args.output_dir.resolve()
    out.mkdir(parents=True, exist_ok=True)
    os.sched_setaffinity(0, {args.load_cpu})  # this process and the load: the load core
    command = shlex.join(["sudo", ".venv/bin/python", "scripts/bench-scaleout.py",
                          *(sys.argv[1:] if argv is None else argv)])  # fmt: skip
    result: dict[str, Any] = {"args": {k: str(v) if isinstance(v, Path) else v
                                       for k, v in vars(args).items()}}  # fmt: skip
    started = time.monotonic()
    with cluster_setup(args, out) as setup:
        print(f"nodes {setup.node_urls} (pids {setup.node_pids}), router {setup.router_url}")
        print("CPU per step:", flush=True)
        result["cpu_per_step"] = cpu_per_step(setup)
        ks = [int(x) for x in args.nodes.split(",") if x.strip()]
        print(f"goodput, {ks} node(s), interleaved:", flush=True)
        result["goodput"] = goodput(setup, ks) if ks else []
        top = max((g["goodput"] for g in result["goodput"]), default=0)
        if top and setup.remaining() > 30:
            print(f"through HAProxy at N={top}:", flush=True)
            result["router"] = through_router(setup, top)
            print(f"  {result['router']}", flush=True)
        notes = setup.notes
    notes.append(f"whole run: {time.monotonic() - started:.0f} s; machine load average "
                 f"at the end {os.getloadavg()[0]:.2f}")  # fmt: skip
    result["notes"] = notes
    (out / "scaleout.json").write_text(json.dumps(result, indent=2) + "\n")
    md = markdown(result, command, notes)
    (out / "scaleout.md").write_text(md)
    print(md)
    print(f"written: {out / 'scaleout.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

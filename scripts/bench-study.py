#!/usr/bin/env python3
"""The OpenEnv scaling study's multi-node run, reproduced on the emulated cluster (root).

The study put its sessions behind **Envoy** with the configuration of its guide
(burtenshaw/openenv-scaling, ``envoy-config-generated.yaml``: ``ROUND_ROBIN``, WebSocket
upgrade, a 300 s route timeout, ``/health`` checks every 10 s, and no
``circuit_breakers``, so Envoy's defaults of 1,024 connections, 1,024 pending requests
and 1,024 requests per cluster apply) and measured a connect p50 of 17.5 s at 16,384
sessions. This script runs the same ``stadium bench`` bursts (connect, reset, one step of
W seconds, close; the study's harness) on the 3-node emulated cluster of
``tests/cluster/harness.py`` (each node's server capped with its own cgroup, all pinned to
the server core; the load on the other core) through four paths, interleaved per N:

1. **study Envoy** — the study's configuration verbatim, the nodes' addresses and the
   ports substituted (admin bound to loopback);
2. **Stadium's Envoy** — ``stadium router --kind envoy`` (least request, per-node caps,
   circuit breakers sized from the nodes' capacity);
3. **HAProxy** — ``stadium router`` (the default kind);
4. **client-side** — no router: the benchmark spreads the sessions over the nodes.

Both Envoys and HAProxy run on the host in a cgroup of their own with the nodes' and the
load's ``cpu.shares`` and no quota, on ``--router-cpus`` (default: every CPU, as a router on a
host of its own would have them), Envoy with ``--envoy-concurrency`` worker threads (default:
Envoy's own, one per CPU). For each point: success,
connect p50/p99, total p99, the sessions per node, the router's CPU, and for the Envoys
their overflow counters from the admin ``/stats`` (``upstream_cx_overflow``,
``upstream_rq_pending_overflow``, ``upstream_rq_pending_total``) over that point. Max batch
is the study's rule (the largest N with >= 95 % success), batch per core divides it by the
nodes' CPU caps added up.

Writes ``study.md`` (tables and the command) and ``study.json`` to ``--output-dir``.
Traffic goes only to loopback and the cluster's namespaces; every process started is
stopped by pid and the cluster torn down, also on error.

    sudo .venv/bin/python scripts/bench-study.py --output-dir bench-results/study
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests.cluster.harness
sys.path.insert(0, str(REPO / "src"))

from stadium._util.health import healthy  # noqa: E402
from stadium.bench import report  # noqa: E402
from stadium.bench.arms import Arm, CpuCap, free_port  # noqa: E402
from stadium.bench.grid import BenchConfig, run  # noqa: E402
from stadium.bench.procstat import run_time_s  # noqa: E402
from stadium.bench.stats import SUCCESS_THRESHOLD, batch_per_core, max_batch  # noqa: E402
from stadium.deploy import envoy, haproxy  # noqa: E402
from stadium.deploy.deployment import Deployment  # noqa: E402
from tests.cluster.harness import Cluster, haproxy_servers, stop_process, wait_for  # noqa: E402

PATHS = ("study Envoy", "Stadium's Envoy", "HAProxy", "client-side")
COUNTERS = ("upstream_cx_overflow", "upstream_rq_pending_overflow", "upstream_rq_pending_total",
            "upstream_cx_total", "upstream_rq_503")  # fmt: skip


HCM_TYPE = (
    "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3"
    ".HttpConnectionManager"
)


def study_envoy_config(nodes: Sequence[tuple[str, int]], port: int, admin_port: int) -> str:
    """The study's Envoy configuration (openenv-scaling ``envoy-config-generated.yaml``):
    its every setting, with these nodes, this listener port, and the admin on loopback."""
    endpoints = "\n".join(
        f'              - endpoint: {{ address: {{ socket_address: {{ address: "{host}", '
        f"port_value: {p} }} }} }}"
        for host, p in nodes
    )
    return f"""admin:
  address:
    socket_address:
      address: 127.0.0.1
      port_value: {admin_port}

static_resources:
  listeners:
    - name: listener_0
      address:
        socket_address:
          address: 127.0.0.1
          port_value: {port}
      filter_chains:
        - filters:
            - name: envoy.filters.network.http_connection_manager
              typed_config:
                "@type": {HCM_TYPE}
                stat_prefix: ingress_http
                codec_type: AUTO
                upgrade_configs:
                  - upgrade_type: websocket
                route_config:
                  name: local_route
                  virtual_hosts:
                    - name: local_service
                      domains: ["*"]
                      routes:
                        - match:
                            prefix: "/ws"
                          route:
                            cluster: openenv_cluster
                            timeout: 300s
                            upgrade_configs:
                              - upgrade_type: websocket
                                enabled: true
                        - match:
                            prefix: "/"
                          route:
                            cluster: openenv_cluster
                            timeout: 300s
                http_filters:
                  - name: envoy.filters.http.router
                    typed_config:
                      "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router

  clusters:
    - name: openenv_cluster
      connect_timeout: 30s
      type: STRICT_DNS
      lb_policy: ROUND_ROBIN
      load_assignment:
        cluster_name: openenv_cluster
        endpoints:
          - lb_endpoints:
{endpoints}
      health_checks:
        - timeout: 5s
          interval: 10s
          unhealthy_threshold: 3
          healthy_threshold: 2
          http_health_check:
            path: "/health"
"""


@dataclass
class Router:
    """One path: the URLs the load opens sessions on, the router's pid and Envoy stats."""

    name: str
    urls: list[str]
    pid: int | None = None
    admin_port: int | None = None
    cluster: str = ""


@dataclass
class Setup:
    cluster: Cluster
    node_urls: list[str]
    node_pids: list[int]
    routers: dict[str, Router]
    args: argparse.Namespace
    out: Path
    deadline: float
    notes: list[str] = field(default_factory=list)

    def remaining(self) -> float:
        return self.deadline - time.monotonic()


def _pin(pid: int, cpus: set[int]) -> None:
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):
            os.sched_setaffinity(int(tid), cpus)


def _start_envoy(cluster: Cluster, name: str, text: str, out: Path,
                 suffix: str, concurrency: int) -> subprocess.Popen[Any]:  # fmt: skip
    cfg = out / f"envoy-{name}.{suffix}"
    cfg.write_text(text)
    envoy.check_config(text, suffix=suffix)
    log = (out / f"envoy-{name}.log").open("wb")
    proc = subprocess.Popen(
        envoy.command(str(cfg), concurrency=concurrency), stdout=log, stderr=subprocess.STDOUT
    )
    log.close()
    cluster._track(proc, f"envoy-{name}")
    return proc


@contextlib.contextmanager
def cluster_setup(args: argparse.Namespace, out: Path) -> Iterator[Setup]:
    """Capped nodes, both Envoys and HAProxy; torn down after the block."""
    router_cpus = set(args.router_cpus)
    tag = f"stadium-study-{os.getpid()}"
    caps = [CpuCap(args.cpu_per_node, name=f"{tag}-node{k}", shares=args.shares)
            for k in (1, 2, 3)]  # fmt: skip
    load_cap = CpuCap(None, name=f"{tag}-load", shares=args.shares)
    # The routers' own group: the nodes' and the load's weight, no quota (a router is
    # not one of the capped nodes; at the host's default weight it got the core last).
    router_cap = CpuCap(None, name=f"{tag}-router", shares=args.shares)
    procs: list[subprocess.Popen[Any]] = []
    cluster = Cluster(n_nodes=3, workdir=out / "cluster")
    try:
        cluster.up()
        methods = {cap.create() for cap in caps}
        load_cap.create()
        load_cap.add(os.getpid())
        router_cap.create()
        urls: list[str] = []
        for node, cap in zip(cluster.nodes, caps, strict=True):
            cmd = ["sh", "-c", 'echo $$ > "$0" && cpu="$1" && shift && exec taskset -c "$cpu" "$@"',
                   str(cap.procs_file), str(args.server_cpu), sys.executable, "-m", "stadium",
                   "serve", "benchmark", "--host", "0.0.0.0", "--port", str(args.port),
                   "--max-sessions", str(args.max_sessions), "--log-level", "warning"]  # fmt: skip
            log = (out / f"{node.name}.log").open("wb")
            procs.append(node.popen(cmd, stdout=log, stderr=subprocess.STDOUT))
            log.close()
            urls.append(node.url(args.port))
        for url, proc in zip(urls, procs, strict=True):
            wait_for(lambda u=url, p=proc: healthy(u) or p.poll() is not None, 60.0, url)
            if proc.poll() is not None:
                raise RuntimeError(f"the node server at {url} exited: see {out}/node*.log")
        pids = [p.pid for p in procs]
        deployment = Deployment(nodes=tuple(urls), max_sessions_per_node=args.max_sessions)
        routers: dict[str, Router] = {}
        # Started on their CPUs, so that HAProxy's and Envoy's default thread counts see them
        os.sched_setaffinity(0, router_cpus)
        # 1. the study's Envoy
        port, admin = free_port(), free_port()
        nodes = [(n.addr, args.port) for n in cluster.nodes]
        proxy = _start_envoy(cluster, "study", study_envoy_config(nodes, port, admin), out, "yaml",
                             args.envoy_concurrency)  # fmt: skip
        routers["study Envoy"] = Router("study Envoy", [f"http://127.0.0.1:{port}"], proxy.pid,
                                        admin, "openenv_cluster")  # fmt: skip
        # 2. Stadium's Envoy
        port, admin = free_port(), free_port()
        text = envoy.render(
            deployment, haproxy.RouterOptions(bind="127.0.0.1", port=port), admin_port=admin
        )
        proxy = _start_envoy(cluster, "stadium", text, out, "json", args.envoy_concurrency)
        routers["Stadium's Envoy"] = Router("Stadium's Envoy", [f"http://127.0.0.1:{port}"],
                                            proxy.pid, admin, envoy.ALL_NODES)  # fmt: skip
        # 3. HAProxy
        port = free_port()
        stats = str(cluster.workdir / "haproxy.sock")
        cfg = haproxy.render(
            deployment, haproxy.RouterOptions(bind="127.0.0.1", port=port, stats_socket=stats)
        )
        (out / "haproxy.cfg").write_text(cfg)
        proxy = cluster.haproxy(cfg)
        routers["HAProxy"] = Router("HAProxy", [f"http://127.0.0.1:{port}"], proxy.pid)
        os.sched_setaffinity(0, {args.load_cpu})
        routers["client-side"] = Router("client-side", urls)
        for r in routers.values():
            if r.pid is not None:
                wait_for(lambda p=r.pid: os.path.isdir(f"/proc/{p}/task"), 10.0, r.name)
                router_cap.add(r.pid)
                _pin(r.pid, router_cpus)
        wait_for(lambda: set(haproxy_servers(stats, "stadium").values()) == {"UP"}, 20.0,
                 "HAProxy: nodes UP")  # fmt: skip
        for r in routers.values():
            if r.admin_port is not None:
                envoy.wait_ready(r.admin_port, None, 40.0, cluster=r.cluster)
        setup = Setup(cluster, urls, pids, routers, args, out,
                      time.monotonic() + args.deadline)  # fmt: skip
        setup.notes.append(f"CPU cap per node: {', '.join(sorted(methods))}")
        yield setup
    finally:
        for proc in procs:
            stop_process(proc)
        cluster.down()
        for cap in [*caps, load_cap, router_cap]:
            cap.remove()


def _envoy_counters(r: Router) -> dict[str, int]:
    if r.admin_port is None:
        return {}
    got = envoy.counters(r.admin_port, prefix=f"cluster.{r.cluster}.")
    return {k: got.get(f"cluster.{r.cluster}.{k}", 0) for k in COUNTERS}


def point(setup: Setup, r: Router, n: int) -> dict[str, Any]:
    """One burst of ``n`` sessions through ``r``; its figures."""
    args = setup.args
    label = r.name.replace(" ", "-").replace("'", "")
    out = setup.out / "runs" / f"{label}-n{n}-{time.monotonic_ns()}"
    arm = Arm.remote(r.urls, setup.node_pids, name=label)
    cfg = BenchConfig(
        arms=[arm], requests_grid=[n], wait_grid=[args.wait], output_dir=out, steps=1,
        load_cpus=(args.load_cpu,), connect_timeout=args.timeout, request_timeout=args.timeout,
        deadline_s=max(10.0, min(args.wait + 3 * args.timeout + 30.0, setup.remaining())),
        progress=False, settle_s=0.5, command=f"(scripts/bench-study.py) {r.name}",
    )  # fmt: skip
    before = _envoy_counters(r)
    cpu0 = run_time_s([r.pid]) if r.pid else 0.0
    run(cfg)
    cpu = run_time_s([r.pid]) - cpu0 if r.pid else None
    after = _envoy_counters(r)
    (row,) = report.read_summary(out / "summary.csv")
    keys = ("n", "success_rate", "connect_p50_ms", "connect_p99_ms", "total_p99_ms",
            "sessions_per_host", "failures", "ok")  # fmt: skip
    res = {k: row.get(k) for k in keys}
    res["router_cpu_s"] = cpu
    res["envoy"] = {k: after[k] - before.get(k, 0) for k in after}
    return res


def _s(ms: float | None) -> str:
    return "—" if ms is None else f"{ms / 1000:.2f} s"


def markdown(result: dict[str, Any], command: str, notes: Sequence[str]) -> str:
    a = result["args"]
    cores = 3 * a["cpu_per_node"]
    lines = ["# The study's multi-node run, reproduced (emulated cluster)", "", "Command:", "",
             "```", command, "```", "",
             f"3 nodes, each `stadium serve benchmark` capped at {a['cpu_per_node']:g} CPU "
             f"(cgroup CFS quota) and pinned to CPU {a['server_cpu']}; the routers (no quota, "
             f"the same cpu.shares, Envoy's --concurrency {a['envoy_concurrency'] or 'default'}) "
             f"on CPU {','.join(map(str, a['router_cpus']))}; the "
             f"load on CPU {a['load_cpu']}. Bursts of N sessions: connect, reset, one step of "
             f"W = {a['wait']:g} s, close; connect and request timeouts {a['timeout']:g} s. "
             f"Paths interleaved per N.", "",
             "| path | N | success | connect p50 | connect p99 | total p99 | sessions per node "
             "| router CPU ms/session | Envoy cx_overflow | Envoy rq_pending_overflow "
             "| Envoy rq_pending_total | failures |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for name in PATHS:
        for p in result["points"].get(name, []):
            e = p["envoy"]
            cpu = p["router_cpu_s"]
            ok = p.get("ok") or 0
            lines.append(
                f"| {name} | {p['n']:,} | {100 * p['success_rate']:.2f} % "
                f"| {_s(p['connect_p50_ms'])} | {_s(p['connect_p99_ms'])} "
                f"| {_s(p['total_p99_ms'])} | {p['sessions_per_host'] or '—'} "
                f"| {f'{1e3 * cpu / ok:.3f}' if cpu is not None and ok else '—'} "
                f"| {e.get('upstream_cx_overflow', '—')} "
                f"| {e.get('upstream_rq_pending_overflow', '—')} "
                f"| {e.get('upstream_rq_pending_total', '—')} | {p['failures'] or ''} |"
            )
    lines += ["", f"Max batch (>= {SUCCESS_THRESHOLD:.0%} success) and batch per core "
              f"({cores:g} CPU: the nodes' caps added up):", "",
              "| path | max batch | batch per core | connect p99 at the largest N "
              "| × client-side's |", "|---|---|---|---|---|"]  # fmt: skip
    top = {name: (pts[-1] if (pts := result["points"].get(name)) else None) for name in PATHS}
    base = top["client-side"]["connect_p99_ms"] if top["client-side"] else None
    for name in PATHS:
        pts = result["points"].get(name, [])
        mb = max_batch({p["n"]: [p["success_rate"]] for p in pts})
        t = top[name]
        c99 = t["connect_p99_ms"] if t else None
        ratio = f"{c99 / base:.2f}" if c99 is not None and base else "—"
        lines.append(f"| {name} | {mb:,} | {batch_per_core(mb, cores):,.0f} | {_s(c99)} "
                     f"| {ratio} |")  # fmt: skip
    if notes:
        lines += ["", "Notes:", ""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu-per-node", type=float, default=0.3, help="CPU cap of each node")
    p.add_argument("--server-cpu", type=int, default=0, help="CPU of the nodes")
    p.add_argument(
        "--router-cpus",
        type=lambda t: [int(c) for c in t.split(",")],
        default=None,
        help="CPUs the routers are pinned to, comma-separated (default: every CPU)",
    )
    p.add_argument(
        "--envoy-concurrency",
        type=int,
        default=None,
        help="Envoy's worker threads (default: Envoy's own, one per CPU)",
    )
    p.add_argument("--load-cpu", type=int, default=1, help="CPU of the load generator")
    p.add_argument("--wait", type=float, default=1.0, help="W: seconds the step waits")
    p.add_argument("--grid", default="512,1024,2048,4096", help="N of each burst")
    p.add_argument("--paths", default=",".join(PATHS), help="paths to run, in this order")
    p.add_argument("--timeout", type=float, default=60.0, help="connect and request timeout")
    p.add_argument("--max-sessions", type=int, default=16384, help="each node's --max-sessions")
    p.add_argument("--shares", type=int, default=8192, help="cpu.shares of nodes and load")
    p.add_argument("--port", type=int, default=18700, help="nodes' port")
    p.add_argument("--deadline", type=float, default=1800.0, help="whole run, seconds")
    default_out = Path("bench-results") / time.strftime("study-%Y%m%d-%H%M%S")
    p.add_argument("--output-dir", type=Path, default=default_out)
    args = p.parse_args(argv)
    if os.geteuid() != 0:
        print("needs root (network namespaces, cgroups)", file=sys.stderr)
        return 2
    if args.router_cpus is None:
        args.router_cpus = sorted(os.sched_getaffinity(0))
    out: Path = args.output_dir.resolve()
    out.mkdir(parents=True, exist_ok=True)
    os.sched_setaffinity(0, {args.load_cpu})
    command = shlex.join(["sudo", ".venv/bin/python", "scripts/bench-study.py",
                          *(sys.argv[1:] if argv is None else argv)])  # fmt: skip
    grid = [int(x) for x in args.grid.split(",") if x.strip()]
    paths = [x.strip() for x in args.paths.split(",") if x.strip()]
    result: dict[str, Any] = {"args": {k: str(v) if isinstance(v, Path) else v
                                       for k, v in vars(args).items()}, "points": {}}  # fmt: skip
    started = time.monotonic()
    with cluster_setup(args, out) as setup:
        print(f"nodes {setup.node_urls}", flush=True)
        for n in grid:
            for name in paths:
                if setup.remaining() < 60:
                    setup.notes.append(f"the run's deadline stopped it before {name} N={n}")
                    break
                res = point(setup, setup.routers[name], n)
                result["points"].setdefault(name, []).append(res)
                print(f"  {name} N={n}: success {100 * res['success_rate']:.2f} %, connect "
                      f"p50/p99 {_s(res['connect_p50_ms'])}/{_s(res['connect_p99_ms'])}, total "
                      f"p99 {_s(res['total_p99_ms'])}, envoy {res['envoy']}, "
                      f"{res['failures'] or ''}", flush=True)  # fmt: skip
        notes = setup.notes
    notes.append(f"whole run: {time.monotonic() - started:.0f} s; machine load average at the "
                 f"end {os.getloadavg()[0]:.2f}")  # fmt: skip
    result["notes"] = notes
    (out / "study.json").write_text(json.dumps(result, indent=2) + "\n")
    md = markdown(result, command, notes)
    (out / "study.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())

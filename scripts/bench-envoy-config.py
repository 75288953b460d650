#!/usr/bin/env python3
"""Envoy's CPU per session under variants of ``stadium router --kind envoy``'s bootstrap
(BENCHMARKS.md, "The study's multi-node run, reproduced": why Envoy costs more than HAProxy).

One ``stadium serve benchmark`` on loopback and one Envoy per variant (``--concurrency 1``),
all pinned to ``--server-cpu``; the load (``stadium bench``'s picows client: connect, reset,
one step of W = 0, close) on ``--load-cpu``. Each repetition sends a burst of ``--sessions``
through every variant in turn (the order reversed every other repetition); Envoy's CPU
(its threads' ``schedstat``) over the burst, per session, and the burst's connect p99.

Variants (each a change to the rendered bootstrap, nothing else):

* ``current``: as ``stadium router --kind envoy`` renders it;
* ``lean``: no ``x-request-id`` generated (``generate_request_id: false``), no
  ``x-envoy-*`` headers added (``suppress_envoy_headers``);
* ``lean+nostats``: the same and every stat rejected (``stats_matcher: reject_all``);
* ``noretry``: no retry policy on the routes;
* ``defaultroute``: only the catch-all route (no ``stadium_node`` / ``stadium_addr`` query
  matching);
* ``http1``: the listener's codec HTTP/1 only (``codec_type: HTTP1``, no protocol sniffing);
* ``haproxy`` (for scale): ``stadium router``'s HAProxy in front of the same server.

Usage: ``.venv/bin/python scripts/bench-envoy-config.py [--sessions 1000] [--reps 3]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from stadium._util.health import healthy  # noqa: E402
from stadium.bench import report  # noqa: E402
from stadium.bench.arms import Arm, free_port  # noqa: E402
from stadium.bench.grid import BenchConfig, run  # noqa: E402
from stadium.bench.procstat import run_time_s  # noqa: E402
from stadium.deploy import envoy, haproxy  # noqa: E402
from stadium.deploy.deployment import Deployment  # noqa: E402

Config = dict[str, Any]


def _hcm(c: Config) -> Config:
    filters = c["static_resources"]["listeners"][0]["filter_chains"][0]["filters"]
    hcm: Config = filters[0]["typed_config"]
    return hcm


def _lean(c: Config) -> Config:
    hcm = _hcm(c)
    hcm["generate_request_id"] = False
    hcm["http_filters"][0]["typed_config"]["suppress_envoy_headers"] = True
    return c


def _nostats(c: Config) -> Config:
    c = _lean(c)
    c["stats_config"] = {"stats_matcher": {"reject_all": True}}
    return c


def _noretry(c: Config) -> Config:
    for vh in _hcm(c)["route_config"]["virtual_hosts"]:
        for route in vh["routes"]:
            route["route"].pop("retry_policy", None)
    return c


def _defaultroute(c: Config) -> Config:
    for vh in _hcm(c)["route_config"]["virtual_hosts"]:
        vh["routes"] = vh["routes"][-1:]
    return c


def _http1(c: Config) -> Config:
    _hcm(c)["codec_type"] = "HTTP1"
    return c


VARIANTS: dict[str, Callable[[Config], Config]] = {
    "current": lambda c: c,
    "lean": _lean,
    "lean+nostats": _nostats,
    "noretry": _noretry,
    "defaultroute": _defaultroute,
    "http1": _http1,
    "haproxy": lambda c: c,  # not an Envoy: stadium router's haproxy.cfg
}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=1000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--server-cpu", default="0")
    ap.add_argument("--load-cpu", type=int, default=1)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args(argv)
    out = Path(tempfile.mkdtemp(prefix="stadium-envoy-config-"))
    procs: list[subprocess.Popen[bytes]] = []

    def start(cmd: list[str], log: Path) -> subprocess.Popen[bytes]:
        with log.open("wb") as fh:
            p = subprocess.Popen(["taskset", "-c", args.server_cpu, *cmd], stdout=fh,
                                 stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        procs.append(p)
        return p

    taken: set[int] = set()

    def port_() -> int:  # distinct: free_port() may hand out a port it gave before
        while (port := free_port()) in taken:
            pass
        taken.add(port)
        return port

    try:
        port = port_()
        server = start([sys.executable, "-m", "stadium", "serve", "benchmark", "--host",
                        "127.0.0.1", "--port", str(port), "--max-sessions", "16384",
                        "--log-level", "warning"], out / "server.log")  # fmt: skip
        deadline = time.monotonic() + 60
        while not healthy(f"http://127.0.0.1:{port}"):
            if time.monotonic() > deadline or server.poll() is not None:
                raise SystemExit(f"the server did not start: see {out}/server.log")
            time.sleep(0.1)
        nodes = Deployment(nodes=(f"http://127.0.0.1:{port}",), max_sessions_per_node=16384)
        routers: dict[str, tuple[int, int, subprocess.Popen[bytes]]] = {}
        for name in args.variants.split(","):
            rport, admin = port_(), port_()
            opts = haproxy.RouterOptions(bind="127.0.0.1", port=rport)
            if name == "haproxy":
                cfg = out / "haproxy.cfg"
                cfg.write_text(haproxy.render(nodes, opts))
                routers[name] = (rport, 0, start(["haproxy", "-db", "-f", str(cfg)], out / "h.log"))
                continue
            cfg = out / f"{name}.json"
            cfg.write_text(json.dumps(VARIANTS[name](envoy.config(nodes, opts, admin_port=admin))))
            proc = start(envoy.command(str(cfg), concurrency=1), out / f"{name}.log")
            routers[name] = (rport, admin, proc)
        for rport, admin, proc in routers.values():
            if admin:
                envoy.wait_ready(admin, proc, 40.0)
            else:
                while not healthy(f"http://127.0.0.1:{rport}"):
                    if time.monotonic() > deadline + 60 or proc.poll() is not None:
                        raise SystemExit(f"haproxy did not start: see {out}/h.log")
                    time.sleep(0.1)
        figures: dict[str, list[tuple[float, float]]] = {name: [] for name in routers}
        for rep in range(args.reps):
            order = list(routers) if rep % 2 == 0 else list(routers)[::-1]
            for name in order:
                rport, _admin, proc = routers[name]
                run_dir = out / "runs" / f"{name}-{rep}"
                bench = BenchConfig(
                    arms=[Arm.remote([f"http://127.0.0.1:{rport}"], [server.pid], name=name)],
                    requests_grid=[args.sessions], wait_grid=[0.0], output_dir=run_dir, steps=1,
                    load_cpus=(args.load_cpu,), connect_timeout=60, request_timeout=60,
                    deadline_s=300, progress=False, settle_s=0.5,
                )  # fmt: skip
                cpu0 = run_time_s([proc.pid])
                run(bench)
                cpu = run_time_s([proc.pid]) - cpu0
                (row,) = report.read_summary(run_dir / "summary.csv")
                if float(row.get("success_rate") or 0) < 1.0:
                    raise SystemExit(f"{name}: not every session succeeded ({row})")
                p99 = float(row.get("connect_p99_ms") or "nan")
                figures[name].append((cpu / args.sessions * 1e3, p99))
                print(f"rep {rep + 1} {name}: router {cpu / args.sessions * 1e3:.3f} ms CPU per "
                      f"session, connect p99 {p99:.0f} ms", flush=True)  # fmt: skip
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            p.wait(10)
    base = statistics.median(f[0] for f in figures["current"]) if "current" in figures else None
    print(f"\nmedians of {args.reps} repetitions, bursts of {args.sessions} sessions:")
    print("| variant | router CPU ms per session | ÷ current | connect p99 ms |")
    print("|---|---|---|---|")
    for name, rows in figures.items():
        cpu = statistics.median(r[0] for r in rows)
        ratio = f"{cpu / base:.2f}" if base else "—"
        print(f"| {name} | {cpu:.3f} | {ratio} | {statistics.median(r[1] for r in rows):.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

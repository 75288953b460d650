"""Fair admission between tenants, measured (BENCHMARKS.md "Tenants").

Serves the ``benchmark`` env in this process with ``--tenants`` (two tenants, weights
``W1:W2``) and ``--max-sessions CAP``; each tenant keeps ``CAP`` requests in flight
(together 2 x capacity), each ``POST /step`` a session holding a slot for ``HOLD``
seconds on average (uniform over 0.5-1.5 x: sessions of one length all end together, and
a tenant whose requests are all seated has none waiting at that instant to take the
slots back). After a warm-up it counts admissions per tenant over the window (from
``GET /tenant/usage``) and each request's queue wait (its time to answer less the hold).
Then the admission cost: ``Doorway.admit`` + ``release`` of one session, with and
without tenants, on a worker of its own (no sockets).

    PYTHONPATH=src python scripts/tenant_fairness.py --weights 1:3
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import random
import statistics
import tempfile
import time

import httpx

from stadium._server.admission.doorway import Door
from stadium._server.config import ServerConfig
from stadium._server.processes.worker import Worker
from stadium._server.server import Server

TOKENS = ("token-of-tenant-one-xxxxxxxx", "token-of-tenant-two-xxxxxxxx")


def tenants_file(weights: tuple[float, float]) -> str:
    fd, path = tempfile.mkstemp(suffix=".toml")
    with os.fdopen(fd, "w") as f:
        for i, (token, weight) in enumerate(zip(TOKENS, weights, strict=True)):
            digest = hashlib.sha256(token.encode()).hexdigest()
            f.write(f'[tenants.t{i}]\ntoken_sha256 = ["{digest}"]\nweight = {weight}\n')
    return path


async def fairness(weights: tuple[float, float], cap: int, hold: float, seconds: float) -> None:
    path = tenants_file(weights)
    cfg = ServerConfig(
        target="benchmark", host="127.0.0.1", port=0, tenants=path, max_sessions=cap,
        admission_timeout=120.0, drain_timeout=0.0,
    )  # fmt: skip
    server = Server(cfg)
    await server.start()
    stop = asyncio.Event()
    waits: list[list[float]] = [[], []]
    measuring = [False]
    rng = random.Random(1)

    async def tenant(i: int) -> None:
        headers = {"Authorization": f"Bearer {TOKENS[i]}"}
        async with httpx.AsyncClient(
            base_url=server.url, timeout=120, limits=httpx.Limits(max_connections=cap)
        ) as http:

            async def one() -> None:
                while not stop.is_set():
                    held = hold * rng.uniform(0.5, 1.5)  # no lockstep waves of equal sessions
                    t0 = time.perf_counter()
                    r = await http.post(
                        "/step", json={"action": {"wait_seconds": held}}, headers=headers
                    )
                    r.raise_for_status()
                    if measuring[0]:
                        waits[i].append(max(0.0, time.perf_counter() - t0 - held))

            await asyncio.gather(*(one() for _ in range(cap)))

    async def opened() -> list[int]:
        async with httpx.AsyncClient(base_url=server.url) as http:
            out = []
            for token in TOKENS:
                r = await http.get("/tenant/usage", headers={"Authorization": f"Bearer {token}"})
                out.append(int(r.json()["sessions_opened"]))
            return out

    load = [asyncio.ensure_future(tenant(i)) for i in range(2)]
    await asyncio.sleep(1.0)  # warm-up: both queues full
    start = await opened()
    measuring[0] = True
    await asyncio.sleep(seconds)
    end = await opened()
    measuring[0] = False
    stop.set()
    await asyncio.gather(*load)
    await server.stop()
    os.unlink(path)
    got = [b - a for a, b in zip(start, end, strict=True)]
    want = weights[0] / sum(weights)
    print(
        f"weights {weights[0]:g}:{weights[1]:g}, capacity {cap}, demand {2 * cap} "
        f"(hold {hold * 1000:g} ms), {seconds:g} s: admissions {got[0]} : {got[1]}, "
        f"share of t0 {got[0] / sum(got):.3f} (fair {want:.3f})"
    )
    for i in range(2):
        w = sorted(waits[i])
        p50 = statistics.median(w) * 1000
        p99 = w[min(len(w) - 1, int(0.99 * len(w)))] * 1000
        print(f"  t{i} (weight {weights[i]:g}): queue wait p50 {p50:.1f} ms, p99 {p99:.1f} ms")


async def admission_cost(n: int) -> None:
    """CPU per session of Doorway.admit + open + release, without and with tenants."""
    path = tenants_file((1.0, 3.0))
    for label, kwargs in (("no tenants", {}), ("tenants", {"tenants": path})):
        worker = Worker.build(ServerConfig(target="benchmark", max_sessions=n, **kwargs))
        doors = worker.runtime.doors
        tenant = None
        if doors.tenants is not None:
            tenant = doors.tenants.book.table.identify(TOKENS[0].encode())
        loop = asyncio.get_running_loop()

        def waiter(ok: bool) -> None:
            raise AssertionError("never queued")

        best = float("inf")
        for _ in range(5):
            t0 = time.process_time()
            for _ in range(n):
                now = loop.time()
                charged, _verdict = doors.admit(Door.WEBSOCKET, None, now, waiter, None, tenant)
                doors.open(Door.WEBSOCKET)
                doors.release(charged, now)
            best = min(best, time.process_time() - t0)
        print(f"  admission {label}: {best / n * 1e6:.2f} µs CPU per session (best of 5 x {n})")
    os.unlink(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--weights", default="1:3")
    parser.add_argument("--capacity", type=int, default=8)
    parser.add_argument("--hold", type=float, default=0.02)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--cost", type=int, default=20000, help="sessions for the cost (0: skip)")
    args = parser.parse_args()
    w1, w2 = (float(x) for x in args.weights.split(":"))
    asyncio.run(fairness((w1, w2), args.capacity, args.hold, args.seconds))
    if args.cost:
        asyncio.run(admission_cost(args.cost))


if __name__ == "__main__":
    main()

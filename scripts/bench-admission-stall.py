"""The event loop's longest stall while a batch connection with K waiting sessions closes
(issue 22 item 3), another connection holding K waiters too, on a full one-worker server.

    .venv/bin/python scripts/bench-admission-stall.py 4096
    /work/main/.venv/bin/python scripts/bench-admission-stall.py 4096   # another checkout

K above ``--max-waiting-per-connection`` (4096) is refused past the bound on a server
that has it.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import websockets
from websockets.typing import Subprotocol

from stadium import Server, ServerConfig


async def main(k: int) -> None:
    cfg = ServerConfig(
        target="benchmark", host="127.0.0.1", port=0, max_sessions=1,
        admission_timeout=120, drain_timeout=0,
    )  # fmt: skip
    server = Server(cfg)
    await server.start()
    url = server.url.replace("http", "ws") + "/ws"
    holder = await websockets.connect(url)
    await holder.send(json.dumps({"type": "reset", "data": {}}))
    await holder.recv()
    calls = [{"session": i, "type": "reset"} for i in range(k)]
    conns = []
    for _ in range(2):
        ws = await websockets.connect(
            url, subprotocols=[Subprotocol("stadium.batch")], max_size=None
        )
        await ws.send(json.dumps({"type": "batch", "id": 1, "calls": calls}))
        conns.append(ws)
    admission = server.runtime.admission
    deadline = time.monotonic() + 60
    while admission.waiting < 2 * k and time.monotonic() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.05)
    stall = 0.0
    beating = True

    async def beat() -> None:
        nonlocal stall
        last = time.perf_counter()
        while beating:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            stall = max(stall, now - last)
            last = now

    task = asyncio.ensure_future(beat())
    await asyncio.sleep(0.1)
    stall = 0.0
    conns[1].transport.abort()
    deadline = time.monotonic() + 60
    while admission.waiting > k and time.monotonic() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.001)
    await asyncio.sleep(0.1)
    beating = False
    await task
    print(f"K={k}: longest loop stall {stall * 1e3:.1f} ms while {k} of {2 * k} waiters went")
    conns[0].transport.abort()
    await holder.close()
    await server.stop()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 4096))

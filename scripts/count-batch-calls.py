#!/usr/bin/env python3
"""Python and C calls per batched step on the server, counted without sockets
(BENCHMARKS.md, "Batched steps through SessionPool"): a deterministic measure of the
per-step work, where CPU times on a shared machine are noise.

A :class:`~stadium._server.http.batch_socket.BatchServerConnection` of 64 ``benchmark``
sessions with an in-memory channel, fed batch frames as the picows transport feeds them, counted with
``sys.setprofile`` (``call`` and ``c_call`` events; this script's own are left out). Arms:

* ``plain``: calls without ids, sessions not resumable (``stadium bench``'s frame, and
  ``SessionPool(resume=False)``'s);
* ``resumable+ids``: resumable sessions (``?stadium_resume=1``), each call numbered
  (``"id"``), as ``SessionPool`` sent them before it numbered them in its book only;
* ``resumable``: resumable sessions, no ids (``SessionPool``'s default now).

Also prints each arm's in-process µs per step (median of three; noisy on a shared machine).

Usage: ``.venv/bin/python scripts/count-batch-calls.py [-v]`` (``-v``: the calls by function).
"""

from __future__ import annotations

import asyncio
import collections
import gc
import sys
import time
from types import FrameType
from typing import Any

import msgspec

from stadium._env.spec import EnvSpec
from stadium._server.config import ServerConfig
from stadium._server.http.batch_socket import BatchServerConnection
from stadium._server.loader import load_target
from stadium._server.processes.worker import Worker
from stadium._util.process import new_event_loop
from stadium.testing import MemoryChannel

N = 64
ROUNDS = 500


def _frame(k: int, kind: str, ids: bool) -> bytes:
    calls = []
    for i in range(N):
        call: dict[str, Any] = {"session": i, "type": kind}
        if kind == "step":
            call["data"] = {"wait_seconds": 0}
        if ids:
            call["id"] = k
        calls.append(call)
    return msgspec.json.encode({"type": "batch", "id": k, "calls": calls})


async def arm(resumable: bool, ids: bool, by_function: bool) -> tuple[float, float, float, Any]:
    spec = EnvSpec.of(load_target("benchmark"))
    config = ServerConfig(target="benchmark", max_sessions=N + 2)
    runtime = Worker.build(config, spec.env_cls).runtime
    channel = MemoryChannel(keep_frames=False)
    conn = BatchServerConnection(runtime, channel, where=("node", "a:1") if resumable else None)
    frames = [_frame(k, "reset" if k == 1 else "step", ids) for k in range(1, 2 * ROUNDS + 60)]
    sent = 0

    async def rounds(n: int) -> None:
        nonlocal sent
        for _ in range(n):
            reply = channel.sent()
            conn.feed(frames[sent])
            sent += 1
            await reply

    await rounds(50)
    counts: collections.Counter[str] = collections.Counter()
    totals = [0, 0]

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if frame.f_code.co_filename == __file__:
            return
        if event == "call":
            totals[0] += 1
            if by_function:
                counts["py " + frame.f_code.co_qualname] += 1
        elif event == "c_call":
            totals[1] += 1
            if by_function:
                counts["c " + getattr(arg, "__qualname__", str(arg))] += 1

    gc.collect()
    start = time.perf_counter()
    await rounds(ROUNDS)
    wall = (time.perf_counter() - start) / ROUNDS / N * 1e6
    sys.setprofile(profile)
    await rounds(ROUNDS // 5)
    sys.setprofile(None)
    steps = ROUNDS // 5 * N
    conn.connection_lost()
    runtime.shutdown()
    return wall, totals[0] / steps, totals[1] / steps, (counts, steps)


def main() -> None:
    by_function = "-v" in sys.argv
    print("arm             µs/step (in process)  Python calls/step  C calls/step")
    arms = [("plain", False, False), ("resumable+ids", True, True), ("resumable", True, False)]
    for name, resumable, ids in arms:
        with asyncio.Runner(loop_factory=new_event_loop) as runner:
            runs = [runner.run(arm(resumable, ids, by_function)) for _ in range(3)]
        wall = sorted(r[0] for r in runs)[1]
        print(f"{name:15s} {wall:10.2f} {runs[0][1]:20.2f} {runs[0][2]:14.2f}")
        if by_function:
            counts, steps = runs[0][3]
            for function, n in counts.most_common(30):
                print(f"    {n / steps:6.3f} {function}")


if __name__ == "__main__":
    main()

"""The event loop's stalls from ``--record``, in process, at 2,000 sessions.

The driver of ``stadium bench ops`` (no sockets, uvloop): N benchmark sessions stepped
round-robin, each reset every EPISODE steps (so episodes end and are recorded), the
driver handing the loop back (``asyncio.sleep(0)``) after every 64 requests, as a busy
server's loop turns between reads. A probe task sleeps 1 ms in a loop and measures how
late it wakes: the loop's lag. The driver's own 64 requests are in every lag alike; what
``--record`` adds is its work left on the loop (the copy into the buffer, the pipe writes;
before #33's writer process: the writer thread holding the GIL when the loop wants it). Reported per
variant (each in its own interpreter, alternated ROUNDS times): the lag's p99 and max, and
how many wake-ups were over 5 ms late. Usage (BENCHMARKS.md, "Episode ledger cost"):
``flock /tmp/bench.lock .venv/bin/python scripts/bench-record-lag.py``
``[SESSIONS] [STEPS] [ROUNDS] [EPISODE]``
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile

CHILD = r"""
import asyncio, json, sys, time
from stadium._server.config import ServerConfig
from stadium._server.processes.worker import Worker
from stadium._util.process import new_event_loop
from stadium.bench.opcount import _Driver
from stadium.envs.benchmark import BenchmarkEnv

RESET = b'{"type":"reset","data":{}}'

async def run(sessions, steps, episode, record):
    config = ServerConfig(target="benchmark", max_sessions=sessions + 8, record=record)
    rt = Worker.build(config, BenchmarkEnv).runtime
    d = _Driver(rt, b'{"type":"step","data":{"wait_seconds":0}}', None)
    opened = [await d.open() for _ in range(sessions)]
    async def go(n):
        k = 0
        for i in range(max(1, n // len(opened))):
            for session, channel in opened:
                if i % episode == episode - 1:
                    await d.request(session, channel, RESET)
                await d.request(session, channel, d.step_frame)
                k += 1
                if k % 64 == 0:
                    await asyncio.sleep(0)
    await go(sessions * episode)  # warm: every session's first episodes
    if record:
        while not rt.ledger.recorder.written:
            await go(sessions)
    import gc
    gc.collect()  # the warm-up's garbage (sessions, imports): a long-running server's is old
    loop = asyncio.get_running_loop()
    lags, done = [], False
    async def probe():
        while not done:
            t = loop.time()
            await asyncio.sleep(0.001)
            lags.append(loop.time() - t - 0.001)
    task = asyncio.ensure_future(probe())
    await go(steps)
    done = True
    await task
    rt.ledger.close()
    lags.sort()
    ms = [x * 1e3 for x in lags]
    print(json.dumps({"p99": ms[int(0.99 * len(ms))], "max": ms[-1],
                      "over5": sum(x > 5 for x in ms), "n": len(ms)}))
    rt.shutdown()

with asyncio.Runner(loop_factory=new_event_loop) as r:
    r.run(run(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]))
"""


def main() -> None:
    sessions = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 200_000
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    episode = int(sys.argv[4]) if len(sys.argv) > 4 else 10
    work = tempfile.mkdtemp(prefix="stadium-record-lag-")
    try:
        for _ in range(rounds):
            for variant in ("off", "record"):
                rec = os.path.join(work, "rec") if variant == "record" else ""
                shutil.rmtree(rec or os.path.join(work, "rec"), ignore_errors=True)
                out = subprocess.run(
                    [sys.executable, "-c", CHILD, str(sessions), str(steps), str(episode), rec],
                    capture_output=True, text=True, check=True, timeout=900,
                )  # fmt: skip
                got = json.loads(out.stdout.strip().splitlines()[-1])
                print(variant, f"lag p99 {got['p99']:.2f} ms, max {got['max']:.2f} ms, "
                      f"{got['over5']} of {got['n']} wake-ups > 5 ms late", flush=True)  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)


main()

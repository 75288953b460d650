"""Server CPU per step of two source trees, in process: the episode ledger's cost.

The driver of ``stadium bench ops`` (no sockets, uvloop): 4 benchmark sessions, steps
round-robin, ``time.process_time`` over a batch. Each tree runs in its own interpreter
(``PYTHONPATH=TREE/src``), the two alternated ``ROUNDS`` times; the medians and their
ratio are printed. Usage (BENCHMARKS.md, "Episode ledger cost"):
``flock /tmp/bench.lock .venv/bin/python scripts/bench-ledger-ab.py A_SRC B_SRC [STEPS] [ROUNDS]``
"""

import os
import statistics
import subprocess
import sys

CHILD = r"""
import asyncio, sys, time
from stadium._server.config import ServerConfig
from stadium._server.processes.worker import Worker
from stadium._util.process import new_event_loop
from stadium.bench.opcount import _Driver
from stadium.envs.benchmark import BenchmarkEnv

async def run(steps):
    rt = Worker.build(ServerConfig(target="benchmark", max_sessions=8), BenchmarkEnv).runtime
    d = _Driver(rt, b'{"type":"step","data":{"wait_seconds":0}}', None)
    opened = [await d.open() for _ in range(4)]
    await d.steps(opened, 5000)
    t = time.process_time()
    await d.steps(opened, steps)
    print((time.process_time() - t) / steps * 1e6)
    rt.shutdown()

with asyncio.Runner(loop_factory=new_event_loop) as r:
    r.run(run(int(sys.argv[1])))
"""


def once(src: str, steps: int) -> float:
    env = {**os.environ, "PYTHONPATH": src}
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(steps)], env=env, capture_output=True, text=True,
        check=True, cwd="/",
    )  # fmt: skip
    return float(out.stdout.split()[-1])


def main() -> None:
    a, b = sys.argv[1], sys.argv[2]
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 100_000
    rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 7
    got: dict[str, list[float]] = {"A": [], "B": []}
    for _ in range(rounds):
        got["A"].append(once(a, steps))
        got["B"].append(once(b, steps))
    for k, v in got.items():
        print(k, "median µs/step", round(statistics.median(v), 3), [round(x, 3) for x in v])
    print("B/A", round(statistics.median(got["B"]) / statistics.median(got["A"]), 4))


main()

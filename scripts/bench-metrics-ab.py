"""CPU per step with and without the /metrics lines of ``Session._reply``, in process.

The driver of ``stadium bench ops`` (no sockets, uvloop): 4 benchmark sessions, steps
round-robin, ``time.process_time`` per batch, the two variants alternated 7 times.
Usage: ``.venv/bin/python scripts/bench-metrics-ab.py [STEPS_PER_BATCH]`` (BENCHMARKS.md,
"Metrics cost").
"""

import asyncio
import statistics
import sys
import time

from stadium._core.protocol import Op
from stadium._server.config import ServerConfig
from stadium._server.processes.worker import Worker
from stadium._server.sessions.runner import Session
from stadium._util.process import new_event_loop
from stadium.bench.opcount import _Driver
from stadium.envs.benchmark import BenchmarkEnv

with_metrics = Session._reply


def without_metrics(self, call, result):  # the _reply of HEAD
    protocol = self.protocol
    if call.op is Op.STATE:
        frame = protocol.state_reply(call, result)
    else:
        frame = protocol.observation_reply(call, result)
        if call.op is Op.STEP:
            self.runtime.sessions_total += 1  # stands for HEAD's steps_total += 1
    self.channel.send(frame)


async def run(steps):
    config = ServerConfig(target="benchmark", max_sessions=8)
    rt = Worker.build(config, BenchmarkEnv).runtime
    d = _Driver(rt, b'{"type":"step","data":{"wait_seconds":0}}', None)
    opened = [await d.open() for _ in range(4)]
    await d.steps(opened, 2000)
    out = {}
    for _ in range(7):
        for name, fn in (("off", without_metrics), ("on", with_metrics)):
            Session._reply = fn
            t = time.process_time()
            await d.steps(opened, steps)
            out.setdefault(name, []).append((time.process_time() - t) / steps * 1e6)
    rt.shutdown()
    return out


with asyncio.Runner(loop_factory=new_event_loop) as r:
    out = r.run(run(int(sys.argv[1]) if len(sys.argv) > 1 else 50000))
for k, v in out.items():
    print(k, "median µs/step", round(statistics.median(v), 3), [round(x, 3) for x in v])
print("added", round(statistics.median(out["on"]) - statistics.median(out["off"]), 3), "µs/step")

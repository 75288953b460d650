"""Server CPU per step with and without ``--record``, in process; then replay's speed.

The driver of ``stadium bench ops`` (no sockets, uvloop): 4 benchmark sessions, steps
round-robin, each session reset every ``EPISODE`` steps (so episodes end and are
recorded); ``time.process_time`` (every thread of the worker's process) over a batch, then the
recorder closed and its time added; and that plus the writer process's CPU over the same
batch (its ``/proc`` time at the start, its reaped time after the close). The two variants run
in their own interpreters, alternated ``ROUNDS`` times. Then the last recording is
replayed in process (``stadium replay DIR benchmark``) with 1 and 2 jobs: episodes/s.
Usage (BENCHMARKS.md, "Episode ledger cost"):
``flock /tmp/bench.lock .venv/bin/python scripts/bench-record-ab.py [STEPS] [ROUNDS] [EPISODE]``
"""

import os
import shutil
import statistics
import subprocess
import sys
import tempfile

CHILD = r"""
import asyncio, os, resource, sys, time
from stadium._server.config import ServerConfig
from stadium._server.processes.worker import Worker
from stadium._util.process import new_event_loop
from stadium.bench.opcount import _Driver
from stadium.envs.benchmark import BenchmarkEnv

RESET = b'{"type":"reset","data":{}}'

async def run(steps, episode, record):
    config = ServerConfig(target="benchmark", max_sessions=8, record=record)
    rt = Worker.build(config, BenchmarkEnv).runtime
    d = _Driver(rt, b'{"type":"step","data":{"wait_seconds":0}}', None)
    opened = [await d.open() for _ in range(4)]
    async def go(n):
        for i in range(n // len(opened)):
            for session, channel in opened:
                if i % episode == episode - 1:
                    await d.request(session, channel, RESET)
                await d.request(session, channel, d.step_frame)
    await go(4000)
    if record:  # the writer warmed up: its first shard written (pyarrow's first use)
        while not rt.ledger.recorder.written:
            await go(400)
            await asyncio.sleep(0.05)
    proc = getattr(rt.ledger.recorder, "_proc", None)  # a writer process (since #33's)
    before = 0.0
    if proc is not None:
        fields = open(f"/proc/{proc.pid}/stat").read().rsplit(")", 1)[1].split()
        before = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    t = time.process_time()
    await go(steps)
    rt.ledger.close()  # the writer's last shard, in the measured time
    own = time.process_time() - t
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)  # the writer process, reaped
    writer = usage.ru_utime + usage.ru_stime - before if proc is not None else 0.0
    print(own / steps * 1e6, (own + writer) / steps * 1e6)
    rt.shutdown()

with asyncio.Runner(loop_factory=new_event_loop) as r:
    r.run(run(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]))
"""


def once(steps: int, episode: int, record: str) -> tuple[float, float]:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(steps), str(episode), record],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    own, total = out.stdout.split()[-2:]
    return float(own), float(total)


def main() -> None:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 100_000
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    episode = int(sys.argv[3]) if len(sys.argv) > 3 else 10
    got: dict[str, list[float]] = {"off": [], "record": [], "record+writer": []}
    work = tempfile.mkdtemp(prefix="stadium-record-ab-")
    try:
        for _ in range(rounds):
            got["off"].append(once(steps, episode, "")[0])
            shutil.rmtree(os.path.join(work, "rec"), ignore_errors=True)
            own, total = once(steps, episode, os.path.join(work, "rec"))
            got["record"].append(own)
            got["record+writer"].append(total)
        for k, v in got.items():
            print(k, "median µs/step", round(statistics.median(v), 3), [round(x, 3) for x in v])
        off = statistics.median(got["off"])
        print("record/off (the worker)", round(statistics.median(got["record"]) / off, 4))
        print("record+writer/off", round(statistics.median(got["record+writer"]) / off, 4))
        for jobs in (1, 2):
            out = subprocess.run(
                [sys.executable, "-m", "stadium", "replay", os.path.join(work, "rec"),
                 "benchmark", "--jobs", str(jobs)],
                capture_output=True, text=True,
            )  # fmt: skip
            print(f"replay --jobs {jobs}:", out.stdout.strip().splitlines()[-1])
    finally:
        shutil.rmtree(work, ignore_errors=True)


main()

"""The ``--record`` writer process's CPU per step on a fixed stream, and the loop's copy.

A stream like a benchmark server's (SESSIONS interleaved episodes of EPISODE steps, the
benchmark env's frames, ROUNDS times) is made by the tree's own ``Recorder`` (its wire
format), then fed to its own ``Writer`` in process (as its pipe would: 256 KiB reads); the
writer's ``process_time`` (every thread: pyarrow's too) over the whole stream, shards
written, is divided by the steps. Each tree (``SRC`` directories, e.g. a ``lead`` checkout
and this one) runs in its own interpreter, alternated ``REPS`` times; medians and ranges.
The loop's side: ``Recorder.step`` alone, best of 7 × 100,000 calls. (``_flush`` every 400
steps: a no-op without a pipe here; a tree whose stream is cut at flushes cuts it there, as a
loop flushing every 10 ms at 40,000 steps/s.)
``--writer native`` (or ``both``) measures the native writer (``ledger/writers.py``'s binary in
that tree) instead: the same stream written to its pipe, its CPU (``wait4``'s rusage) minus
that of a run over an empty stream (its start-up).
Usage (BENCHMARKS.md, "Episode ledger cost"):
``flock /tmp/bench.lock .venv/bin/python scripts/bench-record-writer.py SRC... [--sessions 64]``
``[--episode 300] [--rounds 4] [--reps 5] [--writer python|native|both]``
"""

import argparse
import os
import statistics
import subprocess
import sys

CHILD = r"""
import os, sys, tempfile, time, shutil
from stadium._env.cost import EpisodeCost
from stadium._server.ledger import record
from stadium._server.ledger.episode import EndReason
from stadium._server.ledger.writer import Writer
import pyarrow.parquet  # the writer imports it at its start

sessions, episode, rounds = map(int, sys.argv[1:4])
kind = sys.argv[4]
req = b'{"type":"step","data":{"wait_seconds":0}}'
def reply(i):
    return (b'{"type":"observation","data":{"observation":{"wait_seconds":0.0,"pid":1234,'
            b'"hash":"ab12cd34","host":"127.0.0.1","step":%d,"host_url":'
            b'"http://127.0.0.1:8000"},"reward":1.0,"done":false,"truncated":false,'
            b'"metadata":{}}}' % i)
work = tempfile.mkdtemp()
config = record.RecordConfig(directory=work)
counts = [0.0] * 4
rec = record.Recorder(config, ("benchmark", "1"), "metadata", counts)
rec.state = record.RecorderState.RECORDING  # no pipe: the stream is taken from its buffer
stream = bytearray()
steps = 0
cost = EpisodeCost(wall_s=1.0, cpu_s=0.5, steps=episode, bytes_in=1, bytes_out=2)
for r in range(rounds):
    rids = [rec.begin(f"e{r}-{s}", s, None, reply(0), True) for s in range(sessions)]
    for i in range(episode):
        for rid in rids:
            rec.step(rid, req, reply(i), 0.0001)
            steps += 1
            if steps % 400 == 0:  # (module doc)
                rec._flush()
    for rid in rids:
        rec.end(rid, EndReason.DONE, cost, False)
rec._flush()
stream += rec._buf
chunks = [bytes(stream[i:i + (256 << 10)]) for i in range(0, len(stream), 256 << 10)]

class Pipe:
    def take(self, timeout):
        return (chunks.pop(0) if chunks else b""), not chunks


def native(data):
    import json, mmap, subprocess, threading
    from stadium._server.ledger import writers
    read_fd, write_fd = os.pipe()
    memfd = os.memfd_create("counts")
    os.ftruncate(memfd, 32)
    shared = memoryview(mmap.mmap(memfd, 32)).cast("d")
    settings = {"config": {"directory": work, "sample": 1.0, "filter": "", "redact": "",
                "flush_s": 1.0, "shard_bytes": 64 << 20, "queue_bytes": 64 << 20,
                "episode_bytes": 16 << 20}, "env": "benchmark", "version": "1",
                "info_key": "metadata", "worker": os.getpid(), "stem": "episodes-b"}
    proc = subprocess.Popen([str(writers.NATIVE), str(read_fd), str(memfd), json.dumps(settings)],
                            pass_fds=(read_fd, memfd))
    os.close(read_fd)
    os.close(memfd)
    view = memoryview(data)
    while view:
        n = os.write(write_fd, view[:1 << 20])
        view = view[n:]
    os.close(write_fd)
    _, status, usage = os.wait4(proc.pid, 0)
    assert status == 0, status
    return usage.ru_utime + usage.ru_stime, shared[0]

if kind == "native":
    base, _ = native(b"")
    full, recorded = native(bytes(stream))
    used = full - base
    assert recorded == sessions * rounds, recorded
else:
    writer = Writer(config, ("benchmark", "1"), "metadata", os.getpid(), "episodes-b", counts)
    t = time.process_time()
    writer.run(Pipe())
    used = time.process_time() - t
    assert counts[record.RECORDED] == sessions * rounds, counts
shutil.rmtree(work)
rec2 = record.Recorder(config, ("benchmark", "1"), "metadata", [0.0] * 4)
rec2.state = record.RecorderState.RECORDING
rec2._timer = object()  # a flush already due
frame = reply(17)
best = 1e9
for _ in range(7):
    t0 = time.perf_counter()
    for _ in range(100_000):
        rec2.step(5, req, frame, 0.001)
    best = min(best, time.perf_counter() - t0)
    rec2.__init__(config, ("benchmark", "1"), "metadata", [0.0] * 4)
    rec2.state = record.RecorderState.RECORDING
    rec2._timer = object()
print(used / steps * 1e6, best / 100_000 * 1e6)
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("src", nargs="+")
    ap.add_argument("--sessions", type=int, default=64)
    ap.add_argument("--episode", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--writer", choices=["python", "native", "both"], default="python")
    args = ap.parse_args()
    kinds = ["python", "native"] if args.writer == "both" else [args.writer]
    arms = [(src, kind) for src in args.src for kind in kinds]
    got: dict[str, list[tuple[float, float]]] = {f"{s} ({k})": [] for s, k in arms}
    for _ in range(args.reps):
        for src, kind in arms:
            out = subprocess.run(
                [sys.executable, "-c", CHILD, str(args.sessions), str(args.episode),
                 str(args.rounds), kind],
                capture_output=True, text=True, check=True, timeout=600,
                env={**os.environ, "PYTHONPATH": src},
            )  # fmt: skip
            writer, loop = map(float, out.stdout.split()[-2:])
            got[f"{src} ({kind})"].append((writer, loop))
    for src, runs in got.items():
        w = [r[0] for r in runs]
        lp = [r[1] for r in runs]
        print(f"{src}: writer µs/step median {statistics.median(w):.2f} "
              f"(min {min(w):.2f}, max {max(w):.2f}); Recorder.step µs median "
              f"{statistics.median(lp):.3f} (min {min(lp):.3f}, max {max(lp):.3f})")  # fmt: skip


main()

"""Instructions per step of ``--record``'s writer and of the loop's copy, counted by callgrind
(noise-free: the same on a busy machine), for BENCHMARKS.md "Episode ledger cost".

    PYTHONPATH=src python scripts/count-record-writer.py make STREAM [SESSIONS EPISODE ROUNDS]
    PYTHONPATH=src valgrind --tool=callgrind --callgrind-out-file=full.out \\
        python scripts/count-record-writer.py run STREAM
    PYTHONPATH=src valgrind --tool=callgrind --callgrind-out-file=empty.out \\
        python scripts/count-record-writer.py run STREAM --empty
    PYTHONPATH=src valgrind --tool=callgrind --callgrind-out-file=loopN.out \\
        python scripts/count-record-writer.py loop N        # and N = 0

The native writer over the same stream (fd 0 the stream, fd 3 a 32-byte counts file; SETTINGS
its JSON settings, as ``ledger/writers.py`` passes them, with ``"worker": 1``), and over an empty
one:

    valgrind --tool=callgrind --callgrind-out-file=native.out \
        src/stadium/_server/ledger/stadium-record-writer 0 3 "$SETTINGS" <STREAM 3<>counts
    valgrind --tool=callgrind --callgrind-out-file=native-empty.out \
        src/stadium/_server/ledger/stadium-record-writer 0 3 "$SETTINGS" </dev/null 3<>counts

``make`` writes the stream the tree's own ``Recorder`` makes (its wire format) for
SESSIONS interleaved episodes of EPISODE steps of the benchmark env's frames, ROUNDS times
(default 64 300 2: 38,400 steps) and prints the steps; ``run`` feeds it to the tree's
``Writer`` in 256 KiB reads (``--empty``: an empty stream, the same start-up); ``loop``
calls ``Recorder.step`` N times. Per step: (full − empty) / steps, (loopN − loop0) / N,
each ``summary:`` line of the callgrind output.
"""

import os
import shutil
import sys
from pathlib import Path

from stadium._env.cost import EpisodeCost
from stadium._server.ledger import record
from stadium._server.ledger.episode import EndReason

REQUEST = b'{"type":"step","data":{"wait_seconds":0}}'


def reply(i: int) -> bytes:
    return (b'{"type":"observation","data":{"observation":{"wait_seconds":0.0,"pid":1234,'
            b'"hash":"ab12cd34","host":"127.0.0.1","step":%d,"host_url":'
            b'"http://127.0.0.1:8000"},"reward":1.0,"done":false,"truncated":false,'
            b'"metadata":{}}}' % i)  # fmt: skip


def recorder(directory: str) -> record.Recorder:
    rec = record.Recorder(
        record.RecordConfig(directory=directory), ("benchmark", "1"), "metadata", [0.0] * 4
    )
    rec.state = record.RecorderState.RECORDING  # no pipe: the stream stays in its buffer
    return rec


def make(out: str, sessions: int, episode: int, rounds: int) -> None:
    rec = recorder("/tmp/unused")
    cost = EpisodeCost(wall_s=1.0, cpu_s=0.5, steps=episode, bytes_in=1, bytes_out=2)
    steps = 0
    for r in range(rounds):
        rids = [rec.begin(f"e{r}-{s}", s, None, reply(0), True) for s in range(sessions)]
        for i in range(episode):
            for rid in rids:
                rec.step(rid, REQUEST, reply(i), 0.0001)  # type: ignore[arg-type]
                steps += 1
        for rid in rids:
            rec.end(rid, EndReason.DONE, cost, False)  # type: ignore[arg-type]
    with open(out, "wb") as f:
        f.write(bytes(rec._buf))
    print(steps)


def run(stream: str, empty: bool) -> None:
    from stadium._server.ledger.writer import Writer

    data = b"" if empty else Path(stream).read_bytes()
    chunks = [data[i : i + (256 << 10)] for i in range(0, len(data), 256 << 10)]
    directory = f"/tmp/count-record-writer-{os.getpid()}"
    counts = [0.0] * 4
    config = record.RecordConfig(directory=directory)
    writer = Writer(config, ("benchmark", "1"), "metadata", os.getpid(), "episodes-b", counts)

    class Pipe:
        def take(self, timeout: float) -> tuple[bytes, bool]:
            return (chunks.pop(0) if chunks else b""), not chunks

    writer.run(Pipe())  # type: ignore[arg-type]
    shutil.rmtree(directory, ignore_errors=True)
    print(counts)


def loop(n: int) -> None:
    rec = recorder("/tmp/unused")
    rec._timer = object()  # type: ignore[assignment]  # a flush already due
    frame = reply(17)
    for i in range(n):
        rec.step(5, REQUEST, frame, 0.001)
        if i % 400 == 399:
            rec._buf.clear()


if __name__ == "__main__":
    import pyarrow.parquet  # noqa: F401 (as the writer process does at its start)

    cmd, args = sys.argv[1], sys.argv[2:]
    if cmd == "make":
        make(args[0], *(map(int, args[1:4]) if len(args) > 1 else (64, 300, 2)))
    elif cmd == "run":
        run(args[0], "--empty" in args)
    else:
        loop(int(args[0]))

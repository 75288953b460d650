"""The ``--record`` writer process's CPU per step inside a real server, apart from its worker's.

One ``stadium serve benchmark`` (one worker, on CPU 0) without and one with ``--record``, each
driven by ``stadium bench --url`` (64 sessions, 300 steps, 2 repetitions, load on CPU 1); the
CPU (``/proc/PID/stat`` utime + stime) of the serving process and of each child (the writer)
over the bench, divided by its 38,400 steps. ``STADIUM_RECORD_WRITER`` picks the writer. The
server's own figure is noisy on a shared machine; the writer's is steady.

    flock /tmp/bench.lock env PYTHONPATH=$PWD/src STADIUM_RECORD_WRITER=native \
        .venv/bin/python scripts/bench-record-split.py
"""

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")
STEPS = 64 * 300 * 2


def cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def children(pid: int) -> list[int]:
    out: list[int] = []
    for task in os.listdir(f"/proc/{pid}/task"):
        path = Path(f"/proc/{pid}/task/{task}/children")
        if path.exists():
            out += [int(x) for x in path.read_text().split()]
    return out


def run(variant: str, work: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    argv = [
        "taskset", "-c", "0", sys.executable, "-m", "stadium", "serve", "benchmark",
        "--host", "127.0.0.1", "--port", str(port), "--max-sessions", "192",
        "--log-level", "warning",
    ]  # fmt: skip
    if variant == "record":
        argv += ["--record", str(work / "rec")]
    server = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(url + "/health", timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        time.sleep(1)
        procs = [server.pid, *children(server.pid)]
        before = {p: cpu(p) for p in procs}
        subprocess.run(
            [sys.executable, "-m", "stadium", "bench", "--url", url, "--server-pid",
             str(server.pid), "--requests-grid", "64", "--wait-grid", "0", "--steps", "300",
             "--reps", "2", "--load-cpus", "1", "--output-dir", str(work / variant),
             "--no-progress", "--deadline", "900"],
            check=True, stdout=subprocess.DEVNULL,
        )  # fmt: skip
        for p in procs:
            who = "server" if p == server.pid else f"child {p}"
            print(variant, who, f"{(cpu(p) - before[p]) / STEPS * 1e6:.2f} us/step")
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(60)


if __name__ == "__main__":
    where = Path(tempfile.mkdtemp())
    run("off", where)
    run("record", where)

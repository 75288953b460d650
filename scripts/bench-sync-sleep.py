"""Blocking sync envs, Stadium vs OpenEnv, side by side in one run (issue 23 item 4).

The env has the scaling study's shape: an OpenEnv ``Environment`` whose sync ``step``
blocks in ``time.sleep(W)``. Each server serves it (Stadium: ``stadium serve
file.py:SleepEnv``; OpenEnv: ``create_app`` under uvicorn), one worker each, and N
clients at once each run reset + step, over WebSocket (``/ws``) or HTTP (``POST /reset``
then ``POST /step``). Printed: the wall time of the N sessions, per server and mode.

    .venv/bin/python scripts/bench-sync-sleep.py --sessions 256 --wait 0.5 --repeat 3 \\
        [--workers 2] [--before ../main/.venv/bin/python]

The HTTP client is the study's harness's (``tests/test_scaling.py``): httpx, at most 100
keep-alive connections, ``POST /reset`` without a body.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import httpx
import websockets

ENV_FILE = textwrap.dedent(
    """
    import os, socket, time
    from openenv.core.env_server.interfaces import Environment
    from openenv.core.env_server.types import Action, Observation, State

    class SleepAction(Action):
        wait_seconds: float = 0.0

    class SleepObservation(Observation):
        host_url: str = ""

    class SleepEnv(Environment):
        SUPPORTS_CONCURRENT_SESSIONS = True

        def __init__(self):
            super().__init__()
            self._state = State(episode_id="e", step_count=0)

        def reset(self, seed=None, episode_id=None, **kw):
            return SleepObservation(host_url=socket.gethostname())

        def step(self, action: SleepAction, timeout_s=None, **kw):
            time.sleep(action.wait_seconds)
            self._state.step_count += 1
            return SleepObservation(host_url=socket.gethostname(), reward=0.0)

        @property
        def state(self):
            return self._state

    def app():
        from openenv.core.env_server.http_server import create_app
        return create_app(SleepEnv, SleepAction, SleepObservation,
                          max_concurrent_envs=int(os.environ.get("MAX_ENVS", "4096")))
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(
    kind: str, python: str, workdir: Path, port: int, workers: int
) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(workdir)}
    if kind.startswith("stadium"):
        cmd = [
            python, "-m", "stadium", "serve", f"{workdir}/sleepenv.py:SleepEnv",
            "--port", str(port), "--log-level", "warning", "--workers", str(workers),
        ]  # fmt: skip
    else:
        cmd = [
            python, "-m", "uvicorn", "sleepenv:app", "--factory", "--port", str(port),
            "--log-level", "warning", "--ws-max-size", "10485760", "--workers", str(workers),
        ]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"{kind} server did not come up")


async def _ws_session(url: str, wait: float) -> None:
    async with websockets.connect(url, max_size=None, compression=None) as ws:
        await ws.send(json.dumps({"type": "reset", "data": {}}))
        assert json.loads(await ws.recv())["type"] == "observation"
        await ws.send(json.dumps({"type": "step", "data": {"wait_seconds": wait}}))
        reply = json.loads(await ws.recv())
        assert reply["type"] == "observation", reply


async def _http_session(client: httpx.AsyncClient, base: str, wait: float) -> None:
    r = await client.post(f"{base}/reset")  # no body, as the study's harness sends it
    r.raise_for_status()
    r = await client.post(f"{base}/step", json={"action": {"wait_seconds": wait}})
    r.raise_for_status()


async def _run(mode: str, port: int, sessions: int, wait: float) -> float:
    base = f"http://127.0.0.1:{port}"
    start = time.perf_counter()
    if mode == "ws":
        await asyncio.wait_for(
            asyncio.gather(
                *(_ws_session(f"ws://127.0.0.1:{port}/ws", wait) for _ in range(sessions))
            ),
            120,
        )
    else:
        # The study's harness (tests/test_scaling.py): httpx, these limits.
        limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
        async with httpx.AsyncClient(limits=limits, timeout=120) as client:
            await asyncio.gather(*(_http_session(client, base, wait) for _ in range(sessions)))
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=256)
    parser.add_argument("--wait", type=float, default=0.5)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--workers", type=int, default=1, help="worker processes per server")
    parser.add_argument(
        "--before",
        metavar="PYTHON",
        help="also run a 'stadium-before' arm: stadium serve under this Python (e.g. another "
        "checkout's .venv/bin/python)",
    )
    args = parser.parse_args()
    arms = [("stadium", sys.executable), ("openenv", sys.executable)]
    if args.before:
        arms.insert(1, ("stadium-before", args.before))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        (workdir / "sleepenv.py").write_text(ENV_FILE)
        for kind, python in arms:
            port = _free_port()
            proc = _start(kind, python, workdir, port, args.workers)
            try:
                for mode in ("ws", "http"):
                    for i in range(args.repeat):
                        wall = asyncio.run(_run(mode, port, args.sessions, args.wait))
                        rows.append((kind, mode, i, wall))
                        print(f"{kind:14} {mode:4} run {i}: {wall:.2f} s", flush=True)
            finally:
                proc.terminate()
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    print(
        f"\nN = {args.sessions}, W = {args.wait} s, --workers {args.workers}, "
        f"median of {args.repeat} (ratio: to openenv):"
    )
    for mode in ("ws", "http"):
        med = {
            k: statistics.median(w for kk, m, _, w in rows if kk == k and m == mode)
            for k, _ in arms
        }
        cells = ", ".join(f"{k} {v:.2f} s ({v / med['openenv']:.2f})" for k, v in med.items())
        print(f"  {mode:4}: {cells}")


if __name__ == "__main__":
    main()

"""Blocking sync envs, Stadium vs OpenEnv, side by side in one run (issue 23 item 4).

The env has the scaling study's shape: an OpenEnv ``Environment`` whose sync ``step``
blocks in ``time.sleep(W)``. Each server serves it (Stadium: ``stadium serve
file.py:SleepEnv``; OpenEnv: ``create_app`` under uvicorn), one worker each, and N
clients at once each run reset + step, over WebSocket (``/ws``) or HTTP (``POST /reset``
then ``POST /step``). Printed: the wall time of the N sessions, per server and mode.

    .venv/bin/python scripts/bench-sync-sleep.py --sessions 256 --wait 0.5 --repeat 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
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


def _start(kind: str, workdir: Path, port: int) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(workdir)}
    if kind == "stadium":
        cmd = [
            sys.executable, "-m", "stadium", "serve", f"{workdir}/sleepenv.py:SleepEnv",
            "--port", str(port), "--log-level", "warning",
        ]  # fmt: skip
    else:
        cmd = [
            sys.executable, "-m", "uvicorn", "sleepenv:app", "--factory", "--port", str(port),
            "--log-level", "warning", "--ws-max-size", "10485760",
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
    r = await client.post(f"{base}/reset", json={})
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
        limits = httpx.Limits(max_connections=sessions, max_keepalive_connections=sessions)
        async with httpx.AsyncClient(limits=limits, timeout=120) as client:
            await asyncio.gather(*(_http_session(client, base, wait) for _ in range(sessions)))
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=256)
    parser.add_argument("--wait", type=float, default=0.5)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        (workdir / "sleepenv.py").write_text(ENV_FILE)
        for kind in ("stadium", "openenv"):
            port = _free_port()
            proc = _start(kind, workdir, port)
            try:
                for mode in ("ws", "http"):
                    for i in range(args.repeat):
                        wall = asyncio.run(_run(mode, port, args.sessions, args.wait))
                        rows.append((kind, mode, i, wall))
                        print(f"{kind:8} {mode:4} run {i}: {wall:.2f} s", flush=True)
            finally:
                proc.terminate()
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    print(f"\nN = {args.sessions}, W = {args.wait} s, best of {args.repeat}:")
    for mode in ("ws", "http"):
        best = {
            k: min(w for kk, m, _, w in rows if kk == k and m == mode)
            for k in ("stadium", "openenv")
        }
        print(
            f"  {mode:4}: stadium {best['stadium']:.2f} s, openenv {best['openenv']:.2f} s, "
            f"ratio {best['stadium'] / best['openenv']:.2f}"
        )


if __name__ == "__main__":
    main()

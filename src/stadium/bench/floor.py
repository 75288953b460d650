"""The ``floor`` arm: the thinnest server that speaks the benchmark protocol.

picows + uvloop + the standard library's :mod:`json`, and nothing else: no
Stadium code (this file imports nothing from ``stadium`` and is started by its
path), no framework, one thread per process. It answers the frames of the
``benchmark`` environment with the same reply shapes as Stadium and OpenEnv:

* ``{"type": "reset", "data": {"state_kb": N, ...}}`` → an observation with
  ``step_count`` 0; the session then holds N KB of random bytes;
* ``{"type": "step", "data": {"wait_seconds": W}}`` → after W seconds (a timer,
  not a task), an observation ``{"waited_seconds", "pid", "session_hash",
  "host", "step_count"}`` with reward 1.0;
* ``{"type": "state"}`` → ``{"episode_id", "step_count", "state_kb"}``;
* ``{"type": "close"}`` → a close frame (1000) and a disconnect;
* bad JSON → ``INVALID_JSON``; another type → ``UNKNOWN_TYPE``; a bad field →
  ``VALIDATION_ERROR``; past ``--max-sessions`` → ``CAPACITY_REACHED`` and
  close 1013;
* ``GET /health`` → 200 ``{"status":"healthy"}``.

Its cost per step is the physical limit of the transport on this machine: an
arm is compared with it. Like a Stadium worker it freezes its start-up objects
and raises the cyclic collector's thresholds (the GC, not the transport, is
~25 % of a burst's CPU with CPython's defaults).

Run: ``python -m stadium.bench.floor --port 8000 [--workers N]``. It prints
``listening on http://HOST:PORT`` when ready; SIGTERM stops it (exit 0).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import signal
import socket
import sys
from typing import Any

import picows

_PID = os.getpid()
_HOST = socket.gethostname()
_HEALTH = b'{"status":"healthy"}'


class _FloorCounter:
    active = 0
    max_sessions = 0


def _error(message: str, code: str, **extra: Any) -> bytes:
    data: dict[str, Any] = {"message": message, "code": code}
    data.update(extra)
    return json.dumps({"type": "error", "data": data}).encode()


class FloorSession(picows.WSListener):
    """One WebSocket session of the floor server."""

    def __init__(self) -> None:
        self._transport: picows.WSTransport | None = None
        self._steps = 0
        self._ballast = b""
        self._hash = os.urandom(6).hex()
        self._counted = False
        self._loop = asyncio.get_running_loop()

    def on_ws_connected(self, transport: picows.WSTransport) -> None:
        self._transport = transport
        if _FloorCounter.max_sessions and _FloorCounter.active >= _FloorCounter.max_sessions:
            transport.send(
                picows.WSMsgType.TEXT,
                _error(
                    "no free session slot",
                    "CAPACITY_REACHED",
                    active_sessions=_FloorCounter.active,
                    max_sessions=_FloorCounter.max_sessions,
                    retry_after_s=1.0,
                ),
            )
            transport.send_close(picows.WSCloseCode.TRY_AGAIN_LATER)
            transport.disconnect()
            return
        _FloorCounter.active += 1
        self._counted = True

    def on_ws_disconnected(self, transport: picows.WSTransport) -> None:
        if self._counted:
            _FloorCounter.active -= 1
            self._counted = False
        self._ballast = b""

    def _obs(self, waited: float, reward: float | None) -> bytes:
        return json.dumps(
            {
                "type": "observation",
                "data": {
                    "observation": {
                        "waited_seconds": waited,
                        "pid": _PID,
                        "session_hash": self._hash,
                        "host": _HOST,
                        "step_count": self._steps,
                    },
                    "reward": reward,
                    "done": False,
                },
            }
        ).encode()

    def _send(self, payload: bytes) -> None:
        t = self._transport
        if t is not None and not t.is_disconnected:
            t.send(picows.WSMsgType.TEXT, payload)

    def _finish_step(self, wait: float) -> None:
        self._steps += 1
        self._send(self._obs(wait, 1.0))

    def on_ws_frame(self, transport: picows.WSTransport, frame: picows.WSFrame) -> None:
        mt = frame.msg_type
        if mt == picows.WSMsgType.CLOSE:
            transport.send_close(frame.get_close_code())
            transport.disconnect()
            return
        if mt not in (picows.WSMsgType.TEXT, picows.WSMsgType.BINARY):
            return
        try:
            msg = json.loads(frame.get_payload_as_bytes())
            if not isinstance(msg, dict):
                raise ValueError("not an object")
        except ValueError as exc:
            self._send(_error(f"Invalid JSON: {exc}", "INVALID_JSON"))
            return
        kind = msg.get("type")
        data = msg.get("data") or {}
        if kind == "step":
            wait = data.get("wait_seconds", 0.0)
            if not isinstance(wait, int | float) or not 0.0 <= wait <= 3600.0:
                self._send(_error("wait_seconds must be within [0, 3600]", "VALIDATION_ERROR"))
            elif wait > 0.0:
                self._loop.call_later(wait, self._finish_step, float(wait))
            else:
                self._finish_step(0.0)
        elif kind == "reset":
            kb = data.get("state_kb", 0)
            if not isinstance(kb, int) or isinstance(kb, bool) or not 0 <= kb <= 1024 * 1024:
                self._send(_error("state_kb must be an integer", "VALIDATION_ERROR"))
                return
            self._steps = 0
            self._ballast = os.urandom(kb * 1024) if kb else b""
            self._send(self._obs(0.0, None))
        elif kind == "state":
            state = {
                "episode_id": None,
                "step_count": self._steps,
                "state_kb": len(self._ballast) // 1024,
            }
            self._send(json.dumps({"type": "state", "data": state}).encode())
        elif kind == "close":
            transport.send_close(picows.WSCloseCode.OK)
            transport.disconnect()
        else:
            self._send(_error(f"Unknown message type: {kind}", "UNKNOWN_TYPE"))


def _route(request: picows.WSUpgradeRequest) -> Any:
    path = request.path.split(b"?", 1)[0]
    if path == b"/ws":
        return FloorSession()
    if path == b"/health":
        response = picows.WSUpgradeResponse.create_ok_response(
            _HEALTH, extra_headers={"Content-Type": "application/json"}
        )
        return picows.WSUpgradeResponseWithListener(response, None)
    return None


async def serve(host: str, port: int, *, reuse_port: bool = False, announce: bool = True) -> None:
    """Serve until SIGTERM or SIGINT; print ``listening on http://HOST:PORT`` when ready."""
    global _PID
    _PID = os.getpid()
    server = await picows.ws_create_server(
        _route, host, port, reuse_port=reuse_port or None, backlog=4096
    )
    actual = server.sockets[0].getsockname()[1]
    if announce:
        print(f"floor: listening on http://{host}:{actual}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    server.close()


def _run(host: str, port: int, reuse_port: bool, announce: bool) -> None:
    # The same collector settings as a Stadium worker (stadium._server.server.GC_THRESHOLDS),
    # so that the comparison isolates the framework, not the GC's defaults.
    gc.freeze()
    gc.set_threshold(50_000, 50, 100)
    try:
        import uvloop

        uvloop.run(serve(host, port, reuse_port=reuse_port, announce=announce))
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        asyncio.run(serve(host, port, reuse_port=reuse_port, announce=announce))


def main(argv: list[str] | None = None) -> int:
    """Command line: ``--host``, ``--port``, ``--workers``, ``--max-sessions``."""
    parser = argparse.ArgumentParser(prog="floor", description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--workers", type=int, default=1, help="processes sharing the port")
    parser.add_argument("--max-sessions", type=int, default=0, help="0: unlimited (per worker)")
    args = parser.parse_args(argv)
    _FloorCounter.max_sessions = args.max_sessions
    if args.workers <= 1:
        _run(args.host, args.port, False, True)
        return 0
    if args.port == 0:
        parser.error("--workers > 1 needs an explicit --port")
    children: list[int] = []
    for _ in range(args.workers):
        pid = os.fork()
        if pid == 0:  # pragma: no cover - child
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            _run(args.host, args.port, True, False)
            os._exit(0)
        children.append(pid)
    print(f"floor: listening on http://{args.host}:{args.port}", flush=True)

    def _forward(signum: int, _frame: object) -> None:
        for child in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGTERM)

    signal.signal(signal.SIGTERM, _forward)
    signal.signal(signal.SIGINT, _forward)
    for child in children:
        os.waitpid(child, 0)
    return 0


if __name__ == "__main__":
    sys.exit(main())

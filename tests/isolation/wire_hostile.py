"""An env whose steps attack the seam: from inside its session's process, it writes to the
worker what the worker must not trust (imported by the template process of each test
server; see test_seam.py). The session's socket is the ``sock`` of the ``_Session`` object
serving it, found on the call stack."""

from __future__ import annotations

import inspect
import os
import socket
import sys
import time
from typing import Any

import msgspec

import stadium


class Act(msgspec.Struct):
    do: str
    arg: str = ""


class Obs(msgspec.Struct):
    text: str


def _session() -> Any:
    """The ``_Session`` object serving this process (a caller's ``self``)."""
    frame = inspect.currentframe()
    while frame is not None:
        me = frame.f_locals.get("self")
        if type(me).__name__ == "_Session" and isinstance(getattr(me, "sock", None), socket.socket):
            return me
        frame = frame.f_back
    raise RuntimeError("no _Session on the stack")


def _write(data: bytes) -> None:
    """Write ``data`` on the session's socket as if it were the reply, then wait to be
    stopped (the worker must kill this process)."""
    sock = _session().sock
    sock.setblocking(True)
    sock.sendall(data)
    time.sleep(600)


def _header(size: int) -> bytes:
    return size.to_bytes(4, "little")


#: One MessagePack array of 6 (a step's reply, old wire and new: ``[0, observation, ...]``)
#: whose observation is an array of ``n`` empty arrays: 1 byte each, ~64 decoded.
def _amplifying(n: int) -> bytes:
    body = b"\x96\x00\xdd" + n.to_bytes(4, "big") + b"\x90" * n + b"\xc0\xc2\xc2\xc0"
    return _header(len(body)) + body


class Seam(stadium.Environment[Act, Obs, stadium.State]):
    """Steps do what ``action.do`` names; ``echo`` is the well-behaved one."""

    blocking = True

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> Obs:
        return Obs("ready")

    def step(self, action: Act) -> stadium.StepResult[Obs]:
        return stadium.StepResult(Obs(self._do(action.do, action.arg)), reward=0.0)

    def _do(self, do: str, arg: str) -> str:
        if do == "echo":
            return arg
        if do == "amplify":  # 11 MiB that decoded untyped is ~700 MiB of lists
            _write(_amplifying(11 * 1024 * 1024))
        if do == "malformed":
            _write(_header(12) + b"\xc1" * 12)
        if do == "oversized":  # a frame claiming 4 GiB
            _write(_header(0xFFFFFFFF) + b"\x00" * 1024)
        if do == "endless":  # a reply that never ends
            _write(_header(8 * 1024 * 1024) + b"\x96\x00" + b"\x00" * 65536)
        if do == "key":  # this process's key, as its template made it
            env_process = sys.modules["stadium._server.isolation.template.env_process"]
            return str(env_process._Ctx.key_base | os.getpid())
        if do == "slow-fork":  # the next fork's reply: one byte every 3 s
            _patch_fork_reply(slow=True)
            return "armed"
        if do == "forge-fork":  # the next fork's reply: a socket of ours, saying key ``arg``
            _patch_fork_reply(forged=int(arg))
            return "armed"
        if do == "oversnap":  # from the next call on, a snapshot 1 byte over what is asked
            cls = type(_session())
            result = cls._result

            def oversized(self: Any, value: Any, snap: int) -> Any:
                out = result(self, value, snap)
                out.snapshot, out.unsnapshotted = memoryview(b"o" * (snap + 1)), None
                return out

            cls._result = oversized
            return "armed"
        raise ValueError(f"unknown action {do!r}")


def _patch_fork_reply(*, slow: bool = False, forged: int = 0) -> None:
    """Replace how this process answers the worker's ``fork`` (``socket.send_fds`` on the
    session's socket): slowly, or with a socket this process made and a hello of its own
    naming ``forged`` as its key (the old wire took a copy's word for its key)."""
    sock = _session().sock
    send_fds = socket.send_fds

    def patched(to: socket.socket, buffers: Any, fds: Any, *args: Any) -> int:
        if to is not sock:
            return send_fds(to, buffers, fds, *args)
        data = b"".join(buffers)
        if forged:
            ours, theirs = socket.socketpair()
            wire = sys.modules["stadium._server.isolation.wire"]
            if hasattr(wire, "Hello"):  # the typed wire: a hello names no key
                hello = msgspec.msgpack.encode([2])
            else:
                hello = msgspec.msgpack.encode(["hello", forged])
            theirs.sendall(_header(len(hello)) + hello)
            _keep.append(theirs)
            fds = [ours.fileno()]
        if not slow:
            return send_fds(to, [data], fds, *args)
        send_fds(to, [data[:1]], fds, *args)
        for byte in data[1:]:
            time.sleep(3)
            to.sendall(bytes([byte]))
        return len(data)

    socket.send_fds = patched


_keep: list[socket.socket] = []


class HugeSnapshot(Seam):
    """``--durable``: a 150 MiB snapshot after every call."""

    size = 150 * 1024 * 1024

    def snapshot(self) -> bytes:
        return b"s" * self.size

    def restore(self, data: bytes) -> None:
        pass


class SpilledSnapshot(HugeSnapshot):
    """``--durable``: a 4 MiB snapshot: kept in a spill file, not in the worker's memory."""

    size = 4 * 1024 * 1024

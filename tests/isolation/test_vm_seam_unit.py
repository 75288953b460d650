"""``--isolation vm``'s seam, the worker's halves that need no VM (issue #30): what a VM's
console and its QEMU's QMP socket may cost the worker's event loop.

- A guest that floods its console costs the worker a bounded read per pause, whatever
  ``--sandbox-output`` says (with ``drop`` it read the flood as fast as it came, every
  wake-up of the loop); once the VM has ended, what it said last is still read whole.
- QMP replies (QEMU's: a QEMU the guest took over writes them) are decoded into what is
  expected or refused with an ``ExecutionError`` naming QMP: a line nested past the
  parser's depth, an ``error`` or ``return`` of another type (each escaped as a
  ``RecursionError`` or an ``AttributeError``).
"""

from __future__ import annotations

import array
import asyncio
import fcntl
import socket
import termios

import pytest

from stadium import ExecutionError
from stadium._server.isolation.worker import output, vmsnap
from stadium._server.isolation.worker.vmconsole import KEEP_MAX, Console

FLOOD = 4 << 20


def _flooded() -> tuple[socket.socket, socket.socket]:
    ours, theirs = socket.socketpair()
    theirs.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, FLOOD)
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, FLOOD)
    theirs.setblocking(False)
    return ours, theirs


def _fill(theirs: socket.socket, line: bytes) -> int:
    """Write as much of a flood as the socket takes now; how much."""
    sent = 0
    for _ in range(FLOOD // len(line)):
        try:
            sent += theirs.send(line)
        except BlockingIOError:
            break
    return sent


def _unread(fd: int) -> int:
    """Bytes a socket holds, not read yet."""
    count = array.array("i", [0])
    fcntl.ioctl(fd, termios.FIONREAD, count)
    return count[0]


@pytest.mark.parametrize("forward", [False, True], ids=["drop", "log"])
async def test_a_flooded_console_costs_a_bounded_read_per_pause(forward: bool) -> None:
    loop = asyncio.get_running_loop()
    ours, theirs = _flooded()
    console = Console(loop, ours.detach(), "vm 1", forward=forward)
    try:
        sent = _fill(theirs, b"x" * 1023 + b"\n")
        assert sent > 8 * output.READ_MAX, sent
        for _ in range(20):  # the loop's turns: each may read once
            await asyncio.sleep(0)
        read = sent - _unread(console.fd)
        assert read <= output.BURST + output.READ_MAX, read
        assert console.state is output.ReaderState.PAUSED
        # the VM ends: its last words, behind the flood, still reach the tail
        await loop.sock_sendall(theirs, b"\nKernel panic - the last words\n")
        theirs.close()
        await console.drained(within=30.0)
        assert console.state is output.ReaderState.CLOSED
        assert console.tail.endswith(b"Kernel panic - the last words\n")
        assert len(console.tail) == KEEP_MAX
    finally:
        console.close()
        theirs.close()


@pytest.mark.parametrize(
    "line",
    [
        b"[" * 200_000 + b"]" * 200_000 + b"\n",  # past the JSON parser's depth
        b'{"error": "not an object"}\n',
        b'{"return": ["not", "an", "object"]}\n',
        b"\xff\xfe not JSON\n",
    ],
    ids=["deep", "error-string", "return-list", "not-json"],
)
async def test_a_hostile_qmp_reply_is_refused_as_qemus(line: bytes) -> None:
    ours, theirs = socket.socketpair()
    qmp = vmsnap.Qmp(ours)
    theirs.setblocking(False)
    sending = asyncio.ensure_future(asyncio.get_running_loop().sock_sendall(theirs, line))
    try:
        with pytest.raises(ExecutionError, match="QMP"):
            (await qmp.command("query-migrate")).get("status")
        await sending
    finally:
        sending.cancel()
        ours.close()
        theirs.close()

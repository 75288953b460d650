"""What an ``--isolation vm`` guest and its QEMU said last: kept to say why a VM ended.

Each VM's QEMU process writes its own errors (its stderr) and its guest's console
(``hvc0``: the guest kernel's panic, the guest init's traceback, the env's prints) to one
socket the worker reads on its loop, without blocking (:class:`Console`), bounded as
:class:`~.output.OutputReader` bounds any env's output whatever ``--sandbox-output`` says:
a guest that floods its console costs the worker one read of ``READ_MAX`` per pause (its
writes block meanwhile), with ``drop`` as with ``log``; once the VM has ended, what its
socket still holds (its last words, behind a flood) is read whole (:meth:`Console.drained`:
bounded by the socket's buffer, its writer gone). Its last :data:`KEEP_MAX` bytes are
kept, and told as at most
:data:`TAIL_MAX` characters of printable lines, a guest kernel's stack dump left out (its
panic's reason stays: the dump would push it out) (:meth:`Console.text`). When a VM ends while
it boots or starts, its error carries them (:func:`why`), and when one ends during a
session, the server's log does (a session's console may hold what its env printed: it
is not sent to the client). With ``--sandbox-output log`` every line is logged as well,
at the reader's rate.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
from collections.abc import Callable

from stadium._server.isolation.worker.output import PAUSE_S, OutputReader, ReaderState, escape

#: The bytes of a VM's output kept (its last ones).
KEEP_MAX = 8192
#: The most characters of it told (its last lines, stack dumps left out).
TAIL_MAX = 2048
#: A line of a guest kernel's stack dump (a frame, a register, its code bytes).
_DUMP = re.compile(
    r"^\[\s*[\d.]+\]\s+(\? )?[\w.]+\+0x[0-9a-f]+/0x[0-9a-f]+"
    r"|^\[\s*[\d.]+\] (R[A-Z0-9]{1,2}:|RIP:|RSP:|Code:|CS:|CR2:|FS:|DS:| *</?TASK>|Call Trace:)"
)
#: Seconds to wait for an ended VM's last output to be read.
DRAIN_S = 1.0


class Console(OutputReader):
    """A VM's output (see the module docstring): its tail always, its lines to the log
    when ``forward``."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        fd: int,
        tag: str,
        forward: bool,
        on_close: Callable[[], object] | None = None,
    ) -> None:
        self.tail = bytearray()
        """The last :data:`KEEP_MAX` bytes read."""
        self.forward = forward
        self.final = False
        """The VM has ended: the rest is read whole, unthrottled (:meth:`drained`)."""
        self._ended = asyncio.Event()
        super().__init__(loop, fd, tag, on_close)

    def _read(self) -> bytes | None:
        data = super()._read()
        if data is not None:  # every byte read is kept (logged or not)
            self._keep(data)
        return data

    def _readable(self) -> None:
        if self.final:  # its writer gone: what is left, as fast as the loop reads it
            self._read()
            return
        super()._readable()  # rate-bounded

    def _lines(self, data: bytes) -> None:
        if self.forward:
            super()._lines(data)

    def _drop(self, count: int, now: float) -> None:
        if self.forward:  # logged: said as dropped; else only paused
            super()._drop(count, now)
        elif self.state is ReaderState.READING:
            self.dropped += count
            self.state = ReaderState.PAUSED
            self.loop.remove_reader(self.fd)
            self._resume = self.loop.call_later(PAUSE_S, self._resumed)

    def _keep(self, data: bytes) -> None:
        self.tail += data[-KEEP_MAX:]
        del self.tail[:-KEEP_MAX]

    def close(self) -> None:
        super().close()
        self._ended.set()

    async def drained(self, within: float = DRAIN_S) -> None:
        """Wait (at most ``within`` seconds) for the end of its output: every writer gone
        (its QEMU has ended), so what is left is read unthrottled."""
        if self.state is not ReaderState.CLOSED:
            self.final = True
            if self.state is ReaderState.PAUSED:
                if self._resume is not None:
                    self._resume.cancel()
                self._resumed()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._ended.wait(), within)

    def text(self) -> str:
        """The tail as printable lines (each escaped: no byte of it acts on a terminal), the
        last :data:`TAIL_MAX` characters of them, stack dumps left out; ``(none)`` when the
        VM said nothing."""
        lines = [escape(line.rstrip(b"\r")) for line in bytes(self.tail).split(b"\n")]
        kept = [f"  | {line}" for line in lines if line.strip() and not _DUMP.match(line)]
        said = "\n".join(kept)[-TAIL_MAX:]
        return said or "  (none)"


def exit_text(status: int | None) -> str:
    """QEMU's wait status in words."""
    if status is None or status < 0:
        return "its exit status is unknown"
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        return f"QEMU was killed by {name}"
    if os.WIFEXITED(status):
        return f"QEMU exited with code {os.WEXITSTATUS(status)}"
    return f"its wait status is {status}"


def why(status: int | None, console: Console | None) -> str:
    """Why a VM ended, for an error: QEMU's exit status, then its last output."""
    said = console.text() if console is not None else "  (not read)"
    return f"{exit_text(status)}; its last output (QEMU's and its guest console's):\n{said}"

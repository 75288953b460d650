"""What isolated env processes print: read by the worker from a pipe of their own, bounded,
escaped and tagged, into the server's log (``--sandbox-output log``), or dropped (``drop``).

A template's stdout and stderr, and each session's family's (the session's process, its
init, every process the env starts or forks), are the write end of a pipe the worker
made for it; stdin is ``/dev/null``. They are never the server's own descriptors: a
sandboxed process cannot read or write the server's log file or terminal through them,
nor send escape sequences to an operator's terminal. With ``drop``, a session's family
writes to ``/dev/null`` (no pipe at all: it costs the worker nothing).

:class:`OutputReader` holds the read end on the worker's event loop (non-blocking):

* per wake-up it reads at most :data:`READ_MAX` bytes (the loop goes on to other sessions);
* per pipe a token bucket of :data:`RATE` bytes per second (burst :data:`BURST`) bounds
  what reaches the log; past it the bytes are read and dropped, counted, and said once per
  :data:`NOTICE_S` (a WARNING with the count), and the reader pauses :data:`PAUSE_S` before
  it reads again: the pipe fills and the writer blocks, so a process that floods its
  output costs the worker one read of :data:`READ_MAX` per pause, whatever it writes;
* each line is cut at :data:`LINE_MAX` bytes, decoded as UTF-8 (bad bytes escaped), and every
  character that is not printable (control characters: escape sequences, carriage returns,
  bidirectional overrides) is escaped (``\\x1b``), so no byte of it acts on a terminal;
* each line is logged at INFO by the logger ``stadium.env`` as ``[TAG] line``, TAG naming
  the session (the record's ``session`` extra, for ``--log-format json``) or, before one has
  the process, the env process's key or ``template``.

It ends at end of file (every process holding the write end has exited), or when closed.
A copy of a session made by ``fork`` shares its family's pipe (and its tag).

``--isolation process`` gets the same pipes (they cost a spawn one ``pipe2`` and a reader),
but there they are tidiness, not a boundary: env processes run as the server's own user,
who can open the server's descriptors through ``/proc`` anyway. The template's own output
(bubblewrap's errors, the env's import-time prints) is always logged, bounded the same way,
tagged ``template``, whatever ``--sandbox-output`` says.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import os
import time
from collections.abc import Callable

log = logging.getLogger("stadium.env")

MODES = ("log", "drop")
#: Bytes read from a pipe per wake-up of the loop.
READ_MAX = 64 * 1024
#: Bytes per second of a pipe's output that reach the log (the token bucket's rate).
RATE = 16 * 1024
#: Bytes a pipe may print at once past a quiet spell (the bucket's size).
BURST = 64 * 1024
#: The longest line logged (a longer one is cut into lines of this size).
LINE_MAX = 4096
#: Seconds a reader over its rate waits before it reads again (the writer blocks meanwhile).
PAUSE_S = 0.5
#: Seconds between two notices of dropped output of one pipe.
NOTICE_S = 10.0


class ReaderState(enum.Enum):
    """An :class:`OutputReader`'s lifecycle: reading, paused (over its rate), closed."""

    READING = "reading"
    PAUSED = "paused"
    CLOSED = "closed"


def escape(raw: bytes) -> str:
    """``raw`` as one printable line: UTF-8 (invalid bytes as ``\\xNN``), every character
    that is not printable escaped (``\\x1b``, ``\\r``, ``\\u202e``...)."""
    text = raw.decode("utf-8", "backslashreplace")
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in text)


class OutputReader:
    """The worker's end of one output pipe (see the module docstring).

    Args:
        loop: the worker's event loop (the reader is registered on it at once).
        fd: the pipe's read end (made non-blocking; owned, closed at the end).
        tag: what the log lines name until :attr:`session` is set.
        on_close: called once when the reader ends (end of file, or :meth:`close`).
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        fd: int,
        tag: str,
        on_close: Callable[[], object] | None = None,
    ) -> None:
        self.loop = loop
        self._on_close = on_close
        self.fd = fd
        self.tag = tag
        self.session: str | None = None
        """The short id of the session that holds the process, once one does."""
        self.state = ReaderState.READING
        self.logged = 0
        """Bytes logged so far."""
        self.dropped = 0
        """Bytes read and dropped (over the rate) so far."""
        self._unsaid = 0
        self._said_at = -NOTICE_S
        self._tokens = float(BURST)
        self._filled_at = time.monotonic()
        self._partial = b""
        self._resume: asyncio.TimerHandle | None = None
        os.set_blocking(fd, False)
        loop.add_reader(fd, self._readable)

    def _read(self) -> bytes | None:
        """What the pipe holds now (at most ``READ_MAX``); ``None``: nothing now, or it
        ended (and is closed)."""
        try:
            data = os.read(self.fd, READ_MAX)
        except (BlockingIOError, InterruptedError):
            return None
        except OSError:
            data = b""
        if not data:
            self.close()
            return None
        return data

    def _readable(self) -> None:
        data = self._read()
        if data is None:
            return
        now = time.monotonic()
        self._tokens = min(float(BURST), self._tokens + (now - self._filled_at) * RATE)
        self._filled_at = now
        kept = min(len(data), int(self._tokens))
        self._tokens -= kept
        self._lines(data[:kept])
        if kept < len(data):
            self._drop(len(data) - kept, now)

    def _lines(self, data: bytes) -> None:
        if not data:
            return
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        for line in lines:
            self._emit(line)
        while len(self._partial) >= LINE_MAX:
            self._emit(self._partial[:LINE_MAX])
            self._partial = self._partial[LINE_MAX:]

    def _emit(self, line: bytes) -> None:
        for start in range(0, max(len(line), 1), LINE_MAX):
            chunk = line[start : start + LINE_MAX]
            self.logged += len(chunk)
            log.info("[%s] %s", self.name, escape(chunk.rstrip(b"\r")), extra=self._extra())

    def _drop(self, count: int, now: float) -> None:
        self.dropped += count
        self._unsaid += count
        if self._partial:  # the line is cut where the output is: the rest is lost
            self._emit(self._partial)
            self._partial = b""
        if now - self._said_at >= NOTICE_S:
            self._say_dropped(now)
        if self.state is ReaderState.READING:
            self.state = ReaderState.PAUSED
            self.loop.remove_reader(self.fd)
            self._resume = self.loop.call_later(PAUSE_S, self._resumed)

    def _say_dropped(self, now: float) -> None:
        log.warning(
            "[%s] %d bytes of output dropped (over %d bytes/s; %d dropped in all)",
            self.name, self._unsaid, RATE, self.dropped, extra=self._extra(),
        )  # fmt: skip
        self._unsaid = 0
        self._said_at = now

    def _resumed(self) -> None:
        self._resume = None
        if self.state is ReaderState.PAUSED:
            self.state = ReaderState.READING
            self.loop.add_reader(self.fd, self._readable)

    @property
    def name(self) -> str:
        """What the log lines name: ``session ID``, else the tag."""
        return f"session {self.session}" if self.session is not None else self.tag

    def _extra(self) -> dict[str, str]:
        return {"session": self.session} if self.session is not None else {}

    def close(self) -> None:
        """Stop reading (idempotent): the last partial line and the drop count are logged."""
        if self.state is ReaderState.CLOSED:
            return
        if self.state is ReaderState.READING and not self.loop.is_closed():
            self.loop.remove_reader(self.fd)
        if self._resume is not None:
            self._resume.cancel()
            self._resume = None
        self.state = ReaderState.CLOSED
        os.close(self.fd)
        if self._partial:
            self._emit(self._partial)
            self._partial = b""
        if self._unsaid:
            self._say_dropped(time.monotonic())
        if self._on_close is not None:
            self._on_close()

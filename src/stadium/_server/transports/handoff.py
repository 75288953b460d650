"""Connection hand-off between the workers of one server, for session resume.

Workers share one listening socket, so a client resuming a session lands on any
of them. The session id names the worker that holds the session (its pid, see
:mod:`stadium._core.resume`); a worker that receives a resume for another worker's
session passes the connection's socket to it over a Unix datagram socket
(``SCM_RIGHTS``), with the bytes of the request it has read so far, and forgets
it. The owner then serves the connection as if it had accepted it.

Each worker binds an abstract Unix socket named by the server's listening
address and its pid: it exists exactly as long as the worker does, so a hand-off to a worker
that died fails at once (the receiving worker then answers the resume itself:
with ``--durable`` it restores the session, else says it is gone). TLS
connections are not handed off (their TLS state lives in the worker that
accepted them): a resume over TLS reaches its session only when it lands on
the right worker; serve TLS through a proxy, or one worker, to resume over it.
"""

from __future__ import annotations

import array
import asyncio
import logging
import os
import socket
from collections.abc import Callable

from stadium._core.resume import owner_pid, resume_target_sid

log = logging.getLogger("stadium.transport")

#: Largest request head passed along with a connection (the transport reads at most
#: a request line of 8 KiB before deciding, plus what came in the same read).
MAX_HEAD = 65536
#: Connections taken per wake-up (the rest on the next loop iteration).
_BATCH = 64


def address(listening: str, pid: int) -> bytes:
    """The abstract socket address of worker ``pid`` of the server listening on
    ``listening`` (``host:port``)."""
    return b"\0stadium-handoff-%s-%d" % (listening.encode()[:64], pid)


class Handoff:
    """One worker's end: :meth:`pass_on` sends, ``adopt(sock, head)`` receives."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        listening: str,
        adopt: Callable[[socket.socket, bytes], None],
    ) -> None:
        self._loop = loop
        self._listening = listening
        self._pid = os.getpid()
        self._adopt = adopt
        self.passed = 0
        self.adopted = 0
        kind = socket.SOCK_DGRAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK
        self._rx = socket.socket(socket.AF_UNIX, kind)
        self._rx.bind(address(listening, self._pid))
        self._tx = socket.socket(socket.AF_UNIX, kind)
        loop.add_reader(self._rx.fileno(), self._receive)

    def pass_on(self, transport: asyncio.Transport, head: bytes, line: bytes) -> bool:
        """Pass the connection of request line ``line`` to the worker holding the session
        it resumes; ``False`` when that is this worker, or no live worker (serve it here)."""
        sid = resume_target_sid(line)
        pid = owner_pid(sid) if sid else None
        if pid is None or pid == self._pid or len(head) > MAX_HEAD:
            return False
        if transport.get_extra_info("sslcontext") is not None:
            return False
        sock = transport.get_extra_info("socket")
        if sock is None:
            return False
        try:
            # sendmsg, not socket.send_fds: Python 3.12.1's drops its ``address`` argument
            rights = array.array("i", [sock.fileno()])
            self._tx.sendmsg(
                [head],
                [(socket.SOL_SOCKET, socket.SCM_RIGHTS, rights)],
                0,
                address(self._listening, pid),
            )
        except OSError as exc:  # no such worker any more (or its queue is full): serve it here
            log.debug("connection hand-off to worker %d failed: %s", pid, exc)
            return False
        self.passed += 1
        transport.abort()  # this worker's descriptor only: the connection lives on there
        return True

    def _receive(self) -> None:
        for _ in range(_BATCH):
            try:
                head, fds, _flags, _addr = socket.recv_fds(self._rx, MAX_HEAD, 4)
            except BlockingIOError:
                return
            except OSError as exc:
                log.warning("connection hand-off: receive failed: %s", exc)
                return
            for fd in fds:
                try:
                    sock = socket.socket(fileno=fd)
                except OSError:
                    os.close(fd)
                    continue
                sock.setblocking(False)
                self.adopted += 1
                self._adopt(sock, head)

    def close(self) -> None:
        self._loop.remove_reader(self._rx.fileno())
        self._rx.close()
        self._tx.close()


__all__ = ["MAX_HEAD", "Handoff", "address"]

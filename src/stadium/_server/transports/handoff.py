"""Connection hand-off between the workers of one server, for session resume.

Workers share one listening socket, so a client resuming a session lands on any
of them. The session id names the worker that holds the session (its pid, see
:mod:`stadium._core.resume`); a worker that receives a resume for another worker's
session passes the connection's socket to it (``SCM_RIGHTS``), with the bytes of
the request it has read so far, and forgets it. The owner then serves the
connection as if it had accepted it.

Who may take part (the trust model, docs/SECURITY.md, "Other users on the node"):

* **Names nobody else can take.** Each worker listens on a Unix socket named by its
  pid in a directory private to the server (:func:`private_dir`: ``0700``, owned by
  its user, an unpredictable name under ``$XDG_RUNTIME_DIR`` or the temporary
  directory), made before the workers fork. Another user can neither bind a name
  there (a dead worker's included) nor connect to one. Names are not abstract
  sockets: those are open to every user of the network namespace.
* **Senders checked before anything is read.** One ``SOCK_SEQPACKET`` connection
  per hand-off (a datagram socket would give no ``SO_PEERCRED``): the receiver
  reads the sender's credentials from the connection and refuses, closing it
  unread (the kernel drops any descriptor in flight), a sender that is not a
  sibling: the same uid, and the same process or one with the same parent (the
  supervisor). The sender checks the listener the same way: the uid, and the pid
  the session id names.
* **Descriptors checked.** A descriptor received must be a connected TCP socket
  (``SO_DOMAIN`` IPv4/IPv6, ``SO_TYPE`` stream, a peer): anything else is closed.
  Every refusal is counted (:attr:`Handoff.refused`) and logged at most once per 10 s.
* **A name that cannot be bound** does not end the worker: it logs why once and
  only passes connections on; resumes of its sessions landing elsewhere are
  answered there (with ``--durable`` restored from the store, else "gone").

A hand-off to a worker that died fails at once (its socket is gone or refuses), and
the receiving worker answers the resume itself. TLS connections are not handed off
(their TLS state lives in the worker that accepted them): a resume over TLS reaches
its session only when it lands on the right worker; serve TLS through a proxy, or
one worker, to resume over it.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import errno
import logging
import os
import socket
import stat
import struct
import tempfile
from collections.abc import Callable

from stadium._core.resume import owner_pid, resume_target_sid
from stadium._util.throttle import ThrottledLog

log = logging.getLogger("stadium.transport")

#: Largest request head passed along with a connection (the transport reads at most
#: a request line of 8 KiB before deciding, plus what came in the same read).
MAX_HEAD = 65536
#: Connections taken per wake-up (the rest on the next loop iteration).
_BATCH = 64
#: How long an accepted hand-off may take to deliver its message before it is dropped.
PENDING_S = 2.0
#: Hand-offs accepted but not yet delivered, at most (past it, refused).
MAX_PENDING = 64
_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
_KIND = socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK


def private_dir() -> str:
    """A new directory for one server's hand-off sockets: ``0700``, owned by this user,
    an unpredictable name under ``$XDG_RUNTIME_DIR`` when that is the user's own and
    private, else in the temporary directory. Its caller removes it."""
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    base: str | None = None
    if runtime:
        with contextlib.suppress(OSError):
            info = os.stat(runtime)
            if info.st_uid == os.getuid() and not info.st_mode & 0o077:
                base = runtime
    return tempfile.mkdtemp(prefix="stadium-handoff-", dir=base)


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """``(pid, uid, gid)`` of the process at the other end of Unix socket ``sock``."""
    return _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))


def parent_pid(pid: int) -> int | None:
    """The parent of process ``pid`` (from ``/proc``), ``None`` if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as file:
            fields = file.read().rsplit(b")", 1)[1].split()
        return int(fields[1])
    except (OSError, IndexError, ValueError):
        return None


def why_not_tcp(sock: socket.socket) -> str | None:
    """Why ``sock`` is not a connected TCP socket (``None``: it is one)."""
    try:
        domain = sock.getsockopt(socket.SOL_SOCKET, socket.SO_DOMAIN)
        kind = sock.getsockopt(socket.SOL_SOCKET, socket.SO_TYPE)
        if domain not in (socket.AF_INET, socket.AF_INET6) or kind != socket.SOCK_STREAM:
            return f"not a TCP socket (domain {domain}, type {kind})"
        sock.getpeername()
    except OSError as exc:
        return f"not a connected TCP socket ({exc.strerror or exc})"
    return None


class Handoff:
    """One worker's end: :meth:`pass_on` sends, ``adopt(sock, head)`` receives.

    Args:
        loop: the worker's event loop.
        directory: the server's :func:`private_dir` (shared by its workers).
        adopt: serves a connection received, with the bytes of its request read so far.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        directory: str,
        adopt: Callable[[socket.socket, bytes], None],
    ) -> None:
        self._loop = loop
        self._dir = directory
        self._pid = os.getpid()
        self._uid = os.getuid()
        self._adopt = adopt
        self.passed = 0
        self.adopted = 0
        self.refused = 0
        """Hand-offs refused: a sender that is not a sibling, a bad descriptor or message."""
        self._pending: dict[socket.socket, asyncio.TimerHandle] = {}
        self._refusals = ThrottledLog(log, logging.WARNING)
        self._rx: socket.socket | None = None
        rx = socket.socket(socket.AF_UNIX, _KIND)
        try:
            path = self.path(self._pid)
            with contextlib.suppress(FileNotFoundError):  # a dead worker's of the same pid
                if not stat.S_ISDIR(os.lstat(path).st_mode):
                    os.unlink(path)
            rx.bind(path)
            rx.listen(128)
        except OSError as exc:
            rx.close()
            log.error(
                "worker %d cannot receive connection hand-offs (%s in %s): it serves on, "
                "but resumes of its sessions that land on another worker are answered there "
                "(restored from the store with --durable, else refused)",
                self._pid, exc.strerror or exc, directory,
            )  # fmt: skip
            return
        self._rx = rx
        loop.add_reader(rx.fileno(), self._accept)

    @property
    def receiving(self) -> bool:
        """Whether other workers can pass connections to this one."""
        return self._rx is not None

    def path(self, pid: int) -> str:
        """The socket of worker ``pid`` of this server."""
        return os.path.join(self._dir, str(pid))

    # -- sending -------------------------------------------------------------------

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
        tx = socket.socket(socket.AF_UNIX, _KIND)
        try:
            tx.connect(self.path(pid))
            peer, uid, _gid = peer_credentials(tx)
            if peer != pid or uid != self._uid:  # not the worker the session id names
                self._refuse(f"the listener for worker {pid} is pid {peer}, uid {uid}")
                return False
            rights = array.array("i", [sock.fileno()])
            tx.sendmsg([head], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, rights)])
        except OSError as exc:  # no such worker any more (or its queue is full): serve it here
            log.debug("connection hand-off to worker %d failed: %s", pid, exc)
            return False
        finally:
            tx.close()
        self.passed += 1
        transport.abort()  # this worker's descriptor only: the connection lives on there
        return True

    # -- receiving -----------------------------------------------------------------

    def _refuse(self, why: str) -> None:
        self.refused += 1
        self._refusals("connection hand-off refused: %s", why)

    def _why_not_sibling(self, conn: socket.socket) -> str | None:
        try:
            pid, uid, _gid = peer_credentials(conn)
        except OSError as exc:
            return f"no sender credentials ({exc.strerror or exc})"
        if uid != self._uid:
            return f"sent by uid {uid} (pid {pid}), not this server's user"
        if pid != self._pid and parent_pid(pid) != os.getppid():
            return f"sent by pid {pid}, not a worker of this server"
        return None

    def _accept(self) -> None:
        rx = self._rx
        if rx is None:
            return
        for _ in range(_BATCH):
            try:
                conn, _addr = rx.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno not in (errno.EMFILE, errno.ENFILE):
                    self._refuse(f"accept failed: {exc.strerror or exc}")
                    return
                self._refuse("out of descriptors")
                return
            conn.setblocking(False)  # accept() makes a blocking socket
            why = self._why_not_sibling(conn)
            if why is not None:
                conn.close()  # unread: the kernel drops what is in flight, descriptors too
                self._refuse(why)
                continue
            self._read(conn)

    def _read(self, conn: socket.socket) -> None:
        try:
            head, fds, flags, _addr = socket.recv_fds(conn, MAX_HEAD, 1)
        except BlockingIOError:  # connected, the message not sent yet
            if conn in self._pending:
                return
            if len(self._pending) >= MAX_PENDING:
                conn.close()
                self._refuse("too many hand-offs pending")
                return
            self._pending[conn] = self._loop.call_later(PENDING_S, self._expire, conn)
            self._loop.add_reader(conn.fileno(), self._read_pending, conn)
            return
        except OSError as exc:
            conn.close()
            self._refuse(f"receive failed: {exc.strerror or exc}")
            return
        conn.close()
        if flags & (socket.MSG_CTRUNC | socket.MSG_TRUNC) or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            self._refuse(f"a message with {len(fds)} descriptor(s) or cut short")
            return
        try:
            sock = socket.socket(fileno=fds[0])
        except OSError as exc:  # not a socket at all
            os.close(fds[0])
            self._refuse(f"a descriptor that is not a socket ({exc.strerror or exc})")
            return
        why = why_not_tcp(sock)
        if why is not None:
            sock.close()
            self._refuse(f"a descriptor {why}")
            return
        sock.setblocking(False)
        self.adopted += 1
        self._adopt(sock, head)

    def _read_pending(self, conn: socket.socket) -> None:
        timer = self._pending.pop(conn, None)
        if timer is not None:
            timer.cancel()
        self._loop.remove_reader(conn.fileno())
        self._read(conn)

    def _expire(self, conn: socket.socket) -> None:
        if self._pending.pop(conn, None) is not None:
            self._loop.remove_reader(conn.fileno())
            conn.close()
            self._refuse(f"no message within {PENDING_S:g} s of connecting")

    def close(self) -> None:
        for conn, timer in self._pending.items():
            timer.cancel()
            self._loop.remove_reader(conn.fileno())
            conn.close()
        self._pending.clear()
        rx, self._rx = self._rx, None
        if rx is not None:
            self._loop.remove_reader(rx.fileno())
            rx.close()
            with contextlib.suppress(OSError):
                os.unlink(self.path(self._pid))


__all__ = [
    "MAX_HEAD",
    "Handoff",
    "parent_pid",
    "peer_credentials",
    "private_dir",
    "why_not_tcp",
]

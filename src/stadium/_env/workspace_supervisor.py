"""The process supervisor of a :class:`~stadium._env.workspace.Workspace`: every process a
workspace's commands start stays where it can be stopped.

A command can leave processes behind that outlive it and its process group: ``setsid``,
a double fork, ``nohup ... &``. Such a daemon could, say, rewrite a test file after a
grader restored it. So the workspace does not start commands itself: one *supervisor*
per workspace does, a fork of the env's process (no ``exec``: it needs nothing of the
image, and works the same in-process and in an image-backed sandbox) that is a **child
subreaper** (``prctl(PR_SET_CHILD_SUBREAPER)``). An orphan is re-parented to its nearest
subreaper ancestor, so every process a command starts, daemons included, stays in the
supervisor's subtree, whatever session or group it moved to; :meth:`WorkspaceSupervisor.stop`
has the supervisor freeze (``SIGSTOP``) and kill (``SIGKILL``) that whole subtree, walking
``/proc/PID/task/TID/children`` until it is empty (bounded in rounds and time).

The supervisor closes every descriptor it inherited but its control socket, starts its own
session and is not dumpable (a process of the same uid cannot ``ptrace`` it). The same
uid can still signal it: a supervisor that died is seen through its pidfd, and
:class:`WorkspaceSupervisor` then says so (:attr:`WorkspaceSupervisor.lost`) rather than
pretending its subtree is empty. A stopped (``SIGSTOP``) supervisor is continued before each
request, and one that does not answer in time is an error too.

The wire (a socketpair, the env's end and the supervisor's): a request is a 4-byte length
with descriptors attached, then that many bytes (``marshal``: argv, cwd, env); its
descriptors are the command's stdin, stdout, stderr, a *reply* socket and optionally one
more to pass on (:data:`FD_MARK` in argv names its number). The supervisor answers on the
reply socket: the pid (4 bytes; negative: ``-errno``, it could not start), then, once the
command exited and its process group was killed, its exit status (negative: the signal).
A byte from the env on the reply socket (or its close) kills the command's group. A
request of length 0 is :meth:`~WorkspaceSupervisor.stop`, answered on the control socket (the
number of processes killed; -1: the subtree did not empty in time). EOF on the control
socket: the supervisor kills its subtree and exits.
"""

from __future__ import annotations

import array
import contextlib
import errno
import gc
import marshal
import os
import select
import signal
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence

from stadium._errors import ExecutionError
from stadium._util.libc import PR_SET_DUMPABLE, become_subreaper, libc

#: An argv item the supervisor replaces by the number of the extra descriptor passed on.
FD_MARK = "\0stadium-fd"
#: How long :meth:`WorkspaceSupervisor.stop` may take, and in how many rounds at most.
STOP_S = 5.0
STOP_ROUNDS = 2000
_INT = struct.Struct("<i")
_LEN = struct.Struct("<I")


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            return data
        data += chunk
    return data


class Child:
    """A command the supervisor started: its pid and the reply socket its exit status
    comes on (readable, :meth:`fileno`, once it ended, or the supervisor is gone)."""

    def __init__(self, pid: int, reply: socket.socket) -> None:
        self.pid = pid
        self.reply = reply
        self.status: int | None = None

    def fileno(self) -> int:
        return self.reply.fileno()

    def ended(self) -> bool:
        """Whether its status is there to read (or the supervisor is gone): no waiting."""
        return self.status is not None or bool(select.select([self.reply], [], [], 0)[0])

    def kill(self) -> None:
        """Ask the supervisor to kill its process group (it has not been reaped yet)."""
        with contextlib.suppress(OSError):
            self.reply.send(b"k")

    def wait(self, deadline: float) -> int:
        """Its exit status (negative: the signal), waited for until ``deadline``."""
        if self.status is not None:
            return self.status
        data = b""
        while len(data) < 4:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.reply], [], [], left)[0]:
                raise ExecutionError("the workspace's supervisor did not report a command's end")
            chunk = self.reply.recv(4 - len(data))
            if not chunk:
                raise ExecutionError(
                    "the workspace's process supervisor is gone (killed?): the command's exit "
                    "status is lost; the next command starts a new supervisor"
                )
            data += chunk
        self.status = _INT.unpack(data)[0]
        return self.status

    def close(self) -> None:
        self.reply.close()


class WorkspaceSupervisor:
    """The env side of a workspace's supervisor (forked here, at construction)."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        libc()  # loaded before the fork: the supervisor only calls it
        pid = os.fork()
        if pid == 0:  # the supervisor: never returns into the caller's code
            code = 70
            try:
                _serve(theirs.fileno())
                code = 0
            finally:
                os._exit(code)
        theirs.close()
        self.pid = pid
        self.pidfd = os.pidfd_open(pid)
        self.sock = ours
        self._lock = threading.Lock()
        self._closed = False

    def alive(self, wait: float = 0.0) -> bool:
        """Whether the supervisor still runs (its pidfd is not readable, within ``wait``
        seconds: a process being killed closes its sockets before its pidfd says so)."""
        return not self._closed and not select.select([self.pidfd], [], [], wait)[0]

    def _continue(self) -> None:
        with contextlib.suppress(OSError):
            os.kill(self.pid, signal.SIGCONT)  # a policy may have stopped it

    def spawn(
        self, argv: Sequence[str], cwd: str, env: Mapping[str, str], stdin: int, stdout: int,
        stderr: int, *, extra: int = -1, timeout: float = 10.0,
    ) -> Child:  # fmt: skip
        """Start ``argv`` in a new session (OSError: it could not start)."""
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        body = marshal.dumps((list(argv), cwd, dict(env)))
        fds = [stdin, stdout, stderr, theirs.fileno()] + ([extra] if extra >= 0 else [])
        try:
            with self._lock:
                self.sock.sendmsg(
                    [_LEN.pack(len(body))],
                    [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())],
                )
                self.sock.sendall(body)
        except OSError as exc:
            mine.close()
            raise ExecutionError(f"the workspace's process supervisor is gone ({exc})") from exc
        finally:
            theirs.close()
        child = Child(0, mine)
        try:
            if not select.select([mine], [], [], 0.05)[0]:
                self._continue()
            pid = child.wait(time.monotonic() + timeout)
        except BaseException:
            mine.close()
            raise
        child.status = None
        if pid < 0:
            mine.close()
            raise OSError(-pid, os.strerror(-pid))
        child.pid = pid
        return child

    def stop(self, timeout: float = STOP_S + 5.0) -> int:
        """Kill every process in the supervisor's subtree; the number killed."""
        with self._lock:
            self._continue()
            try:
                self.sock.sendall(_LEN.pack(0))
            except OSError as exc:
                raise ExecutionError(f"the workspace's process supervisor is gone ({exc})") from exc
            deadline = time.monotonic() + timeout
            data = b""
            while len(data) < 4:
                left = deadline - time.monotonic()
                ready = select.select([self.sock.fileno(), self.pidfd], [], [], max(left, 0))[0]
                if self.sock.fileno() in ready:
                    chunk = self.sock.recv(4 - len(data))
                    if not chunk:
                        break
                    data += chunk
                elif ready or left <= 0:
                    break
        if len(data) < 4:
            raise ExecutionError("the workspace's process supervisor did not stop its processes")
        count: int = _INT.unpack(data)[0]
        if count < 0:
            raise ExecutionError(
                f"the workspace's processes did not all end within {STOP_S:g} s"
            )  # fmt: skip
        return count

    def close(self) -> None:
        """End the supervisor (it kills its subtree first) and reap it."""
        if self._closed:
            return
        self._closed = True
        self.sock.close()
        self._continue()
        if not select.select([self.pidfd], [], [], STOP_S + 1.0)[0]:
            with contextlib.suppress(OSError):
                os.kill(self.pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, 0)
        os.close(self.pidfd)


# ---- the supervisor's side (runs in the forked child) -----------------------------------


def _descendants(root: int) -> set[int]:
    """Every process under ``root`` now (through each thread's ``children``)."""
    found: set[int] = set()
    todo = [root]
    while todo and len(found) < 1 << 16:
        pid = todo.pop()
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                    kids = [int(x) for x in f.read().split()]
            except (OSError, ValueError):
                continue
            for kid in kids:
                if kid not in found:
                    found.add(kid)
                    todo.append(kid)
    return found


def _signal(pids: set[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, sig)


class _Served:
    """The supervisor's state: the commands it started (pid -> its Popen, reply socket)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.me = os.getpid()
        self.running: dict[int, tuple[subprocess.Popen[bytes], socket.socket, int]] = {}
        self.muted: set[int] = set()  # commands whose reply socket the env closed

    def spawn(self, fds: list[int], body: bytes) -> None:
        reply = socket.socket(fileno=fds[3])
        extra = fds[4] if len(fds) > 4 else -1
        try:
            argv, cwd, env = marshal.loads(body)
            argv = [str(extra) if a == FD_MARK else a for a in argv]
            proc = subprocess.Popen(
                argv, cwd=cwd, env=env, stdin=fds[0], stdout=fds[1], stderr=fds[2],
                pass_fds=(extra,) if extra >= 0 else (), start_new_session=True,
            )  # fmt: skip
        except OSError as exc:
            with contextlib.suppress(OSError):
                reply.sendall(_INT.pack(-(exc.errno or errno.EIO)))
            reply.close()
            return
        except (ValueError, TypeError, EOFError):
            with contextlib.suppress(OSError):
                reply.sendall(_INT.pack(-errno.EINVAL))
            reply.close()
            return
        finally:
            for fd in fds[:3] + fds[4:]:
                os.close(fd)
        with contextlib.suppress(OSError):
            reply.sendall(_INT.pack(proc.pid))
        self.running[proc.pid] = (proc, reply, os.pidfd_open(proc.pid))

    def finish(self, pid: int) -> None:
        """A command ended (or is being killed): kill its group, reap it, report."""
        proc, reply, pidfd = self.running.pop(pid)
        self.muted.discard(pid)
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)
        status = os.waitpid(pid, 0)[1]
        proc.returncode = os.waitstatus_to_exitcode(status)
        with contextlib.suppress(OSError):
            reply.sendall(_INT.pack(proc.returncode))
        reply.close()
        os.close(pidfd)

    def reap(self) -> int:
        """Reap every child that ended (commands through :meth:`finish`); how many."""
        count = 0
        while count < 1 << 16:
            try:
                info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                break
            if info is None:
                break
            count += 1
            if info.si_pid in self.running:
                self.finish(info.si_pid)
            else:
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(info.si_pid, 0)
        return count

    def stop_all(self) -> int:
        """Freeze then kill the whole subtree until it is empty; how many were killed
        (-1: not empty at the end of the rounds or of :data:`STOP_S`)."""
        killed: set[int] = set()
        deadline = time.monotonic() + STOP_S
        for _ in range(STOP_ROUNDS):
            found = _descendants(self.me)
            if not found:
                return len(killed)
            stopped: set[int] = set()
            for _ in range(64):  # freeze: what we see cannot fork while we look again
                _signal(found - stopped, signal.SIGSTOP)
                stopped |= found
                found = _descendants(self.me)
                if found <= stopped:
                    break
            _signal(stopped, signal.SIGKILL)
            killed |= stopped
            for pid in list(self.running):
                with contextlib.suppress(OSError):
                    os.killpg(pid, signal.SIGKILL)
            if not self.reap():
                time.sleep(0.001)
            if time.monotonic() > deadline:
                break
        return -1 if _descendants(self.me) else len(killed)

    def serve(self) -> None:
        while True:
            replies = {
                r.fileno(): pid for pid, (_, r, _) in self.running.items() if pid not in self.muted
            }
            pidfds = {fd: pid for pid, (_, _, fd) in self.running.items()}
            control = self.sock.fileno()
            ready = select.select([control, *replies, *pidfds], [], [])[0]
            for fd in ready:
                if fd in pidfds and pidfds[fd] in self.running:
                    self.finish(pidfds[fd])
                elif fd in replies and replies[fd] in self.running:
                    _, reply, _ = self.running[replies[fd]]
                    with contextlib.suppress(OSError):
                        os.killpg(replies[fd], signal.SIGKILL)
                    try:
                        if not reply.recv(64):
                            self.muted.add(replies[fd])
                    except OSError:
                        self.muted.add(replies[fd])
            self.reap()
            if control in ready and not self.request():
                self.stop_all()
                return

    def request(self) -> bool:
        """Take one request (False: EOF, the env is gone)."""
        fds = array.array("i")
        head, anc, _, _ = self.sock.recvmsg(4, socket.CMSG_SPACE(5 * fds.itemsize))
        for level, kind, data in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
        if not head:
            return False
        head += _recv_exact(self.sock, 4 - len(head))
        if len(head) < 4:
            return False
        size: int = _LEN.unpack(head)[0]
        if size == 0:
            for fd in fds:
                os.close(fd)
            self.sock.sendall(_INT.pack(self.stop_all()))
            return True
        body = _recv_exact(self.sock, size)
        if len(fds) not in (4, 5) or len(body) < size:
            for fd in fds:
                os.close(fd)
            return len(body) == size
        self.spawn(list(fds), body)
        return True


def _serve(fd: int) -> None:
    """The supervisor's life: keep only its socket (and stdio), become a subreaper."""
    gc.freeze()  # the env's objects, shared copy-on-write: never scanned (nor copied) here
    os.closerange(3, fd)
    os.closerange(fd + 1, 1 << 20)
    with contextlib.suppress(ValueError, OSError):
        signal.set_wakeup_fd(-1)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD, signal.SIGHUP):
        with contextlib.suppress(ValueError, OSError):
            signal.signal(sig, signal.SIG_DFL)
    with contextlib.suppress(OSError):
        os.setsid()
    become_subreaper()
    libc().prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    _Served(socket.socket(fileno=fd)).serve()

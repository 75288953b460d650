"""``Workspace``: the commands and files of a session's filesystem, for env authors.

An env that runs commands, reads and writes files or runs Python snippets asks for its
workspace once (in ``__init__`` or its first ``reset``)::

    ws = stadium.Workspace.current()
    ws.write_file("main.py", "print(6 * 7)")
    ws.run("python3 main.py").stdout        # '42\\n'
    ws.python("import sys; print(sys.version_info[:2])")

Served with ``--isolation sandbox --image REF`` the session's ``/`` is the image (a private,
size-bounded copy-on-write layer over its read-only layers): commands come from the image
(its ``PATH``, shell, ``python3``, compilers), with the image's environment and working
directory (:attr:`Workspace.root`). Without an image (in-process, ``--isolation process``,
a sandbox without ``--image``, a unit test), each :meth:`Workspace.current` is a fresh
temporary directory on the host's tools, removed by :meth:`Workspace.close`.

:meth:`Workspace.run` starts a process per call (``/bin/sh -c`` for a string, an argv for
a sequence) in its own process group, killed as a whole at ``timeout`` and when the
command ends (what it left running in the background goes with it). :meth:`Workspace.python`
runs a snippet under ``python3`` through a warm fork server (:data:`FORK_SERVER`, started
on first use inside the session): a fork per snippet, made ahead (a spare waits for the
next snippet), no interpreter start. Both start through the workspace's process
supervisor (:mod:`stadium._env.workspace_supervisor`, a child subreaper forked on first use), so
that what escapes a command's group and session (``setsid``, a double fork) still stays
under it: :meth:`Workspace.stop_others` ends all of it (a grader calls it before it looks
at the files); :meth:`Workspace.start` starts a process there that the caller talks to on
pipes of its own (a grader's test run). Output is
decoded as UTF-8 (errors replaced) and at most ``max_output`` characters of each stream are
kept; a cut stream ends with a visible marker and sets ``truncated``.
"""

from __future__ import annotations

import array
import contextlib
import os
import select
import selectors
import shutil
import signal
import socket
import struct
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import msgspec

from stadium._env.workspace_supervisor import FD_MARK, Child, WorkspaceSupervisor
from stadium._errors import ExecutionError

#: The ``PATH`` a command gets when the image (or the host) names none.
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#: The most bytes a request to the fork server may take (the snippet's source).
MAX_SNIPPET = 16 << 20
#: How long a killed command's pipes are drained for before they are given up.
_DRAIN_S = 1.0


class RunResult(msgspec.Struct):
    """How a command (or snippet) ended and what it printed.

    ``exit_code`` is the process's exit status (negative: killed by that signal; ``None``:
    killed at its timeout). ``stdout``/``stderr`` are decoded UTF-8 (errors replaced), at
    most ``max_output`` characters each; ``truncated`` says a stream was cut (its text then
    ends with a visible marker).
    """

    exit_code: int | None
    stdout: str
    stderr: str
    truncated: bool
    timed_out: bool
    duration_s: float


class DirEntry(msgspec.Struct):
    """One entry of :meth:`Workspace.list_dir`: its name, kind (``"file"``, ``"dir"``,
    ``"link"`` or ``"other"``; a link is not followed) and size in bytes."""

    name: str
    kind: str
    size: int


@dataclass(frozen=True)
class ImageContext:
    """What the sandbox tells the session's process about its image (set before any env
    code runs, by :func:`bind_image`): its environment and working directory."""

    env: Mapping[str, str]
    workdir: str


#: The image of this process's session, or ``None`` (no image: a work directory per env).
_image: ImageContext | None = None


def bind_image(env: Mapping[str, str], workdir: str) -> None:
    """Tell this process's workspaces that the session runs in an image (the sandbox's
    child calls it after ``pivot_root``, before the env is built)."""
    global _image
    merged = dict(env)
    merged.setdefault("PATH", DEFAULT_PATH)
    _image = ImageContext(merged, workdir or "/")


def current_image() -> ImageContext | None:
    """The image of this process's session (``None`` without one)."""
    return _image


# The fork server: runs under the image's python3 (any Python 3 from 3.5 on: no f-strings,
# no walrus, stdlib only). It keeps one *spare*: a fork of itself waiting on the socket (fd
# argv[1]) for the next request, so that no fork is on a snippet's path. A request: a
# 4-byte length with three descriptors attached (the snippet's stdin, stdout, stderr),
# then that many bytes: the working directory, a NUL, the source. The spare reads it,
# starts a session of its own (a timeout kills its whole group), takes the descriptors as
# 0/1/2, answers its pid (4 bytes), tells the server it is taken (a pipe), closes the
# socket and runs the source as __main__. The server forks the next spare, waits for the
# taken one and answers its exit status (4 bytes; negative: the signal). EOF on the
# socket: the spare ends without a request, and so does the server.
FORK_SERVER = r"""
import array, os, socket, struct, sys, traceback
sock = socket.fromfd(int(sys.argv[1]), socket.AF_UNIX, socket.SOCK_STREAM)
os.close(int(sys.argv[1]))
def exact(n):
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            os._exit(0)
        data += chunk
    return data
def run(cwd, source):
    status = 0
    try:
        os.chdir(cwd)
        sys.argv[:] = ["-c"]
        scope = {"__name__": "__main__", "__builtins__": __builtins__}
        exec(compile(source, "<python>", "exec"), scope)
    except SystemExit as exc:
        if exc.code is None:
            status = 0
        elif isinstance(exc.code, int):
            status = exc.code
        else:
            sys.stderr.write(str(exc.code) + "\n")
            status = 1
    except BaseException:
        kind, value, tb = sys.exc_info()
        traceback.print_exception(kind, value, tb.tb_next if tb is not None else tb)
        status = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass
    os._exit(status & 255)
def spare(taken):
    fds = array.array("i")
    head, anc, flags, addr = sock.recvmsg(4, socket.CMSG_SPACE(3 * fds.itemsize))
    for level, kind, data in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
    if not head:
        os._exit(0)
    head += exact(4 - len(head))
    body = exact(struct.unpack("<I", head)[0])
    if len(fds) != 3:
        sock.sendall(struct.pack("<i", -1))
        os.write(taken, b"x")
        os._exit(0)
    cwd, _, source = body.partition(b"\0")
    os.setsid()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in fds:
        if fd > 2:
            os.close(fd)
    sock.sendall(struct.pack("<i", os.getpid()))
    os.write(taken, b"x")
    os.close(taken)
    sock.close()
    run(cwd.decode("utf-8", "surrogateescape"), source.decode("utf-8", "replace"))
def fork_spare():
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            spare(w)
        finally:
            os._exit(127)
    os.close(w)
    return pid, r
def wait(pid):
    while True:
        try:
            return os.waitpid(pid, 0)[1]
        except InterruptedError:
            continue
current = fork_spare()
while True:
    pid, taken = current
    got = os.read(taken, 1)
    os.close(taken)
    if not got:
        wait(pid)
        os._exit(0)
    current = fork_spare()
    status = wait(pid)
    code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else -os.WTERMSIG(status)
    sock.sendall(struct.pack("<i", code))
"""


class _Stream:
    """One output pipe's kept head (at most ``limit`` characters' worth of bytes)."""

    def __init__(self, fd: int, limit: int) -> None:
        self.fd = fd
        self.limit = limit
        self.kept = bytearray()
        self.dropped = 0

    def take(self, chunk: bytes) -> None:
        room = 4 * self.limit + 4 - len(self.kept)  # UTF-8: at most 4 bytes a character
        self.kept += chunk[: max(room, 0)]
        self.dropped += max(len(chunk) - max(room, 0), 0)

    def text(self) -> tuple[str, bool]:
        text = self.kept.decode("utf-8", "replace")
        if len(text) <= self.limit and not self.dropped:
            return text, False
        cut = len(self.kept) - len(text[: self.limit].encode("utf-8", "replace")) + self.dropped
        return text[: self.limit] + f"\n[... output truncated: {cut} more bytes]", True


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


class Workspace:
    """Commands and files of the session's filesystem: the image's when the server runs with
    ``--image`` (commands from the image, its env and workdir), else a work directory of
    the session (a fresh temporary directory per :meth:`current`, on the host's tools).

    Relative paths are relative to :attr:`root`. Safe to use from several threads (the
    Python fork server takes one snippet at a time).
    """

    def __init__(
        self, root: str, *, env: Mapping[str, str] | None = None, python: str | None = None,
        owned: bool = False,
    ) -> None:  # fmt: skip
        self.root = root
        base = dict(os.environ if env is None else env)
        base.setdefault("PATH", DEFAULT_PATH)
        self.env: dict[str, str] = base
        self._python = python
        self._lock = threading.Lock()
        self._sup_lock = threading.Lock()
        self._sup: WorkspaceSupervisor | None = None
        self._lost: str | None = None  # why stop_others() can no longer vouch for anything
        self._server: Child | None = None
        self._sock: socket.socket | None = None
        self._server_fd = -1
        self._owner = os.getpid()
        self._finalizer = (
            weakref.finalize(self, shutil.rmtree, root, ignore_errors=True) if owned else None
        )

    @classmethod
    def current(cls) -> Workspace:
        """The session's workspace: the image's filesystem (its env, workdir and tools) when
        the session runs in an image; else a fresh temporary work directory."""
        image = _image
        if image is not None:
            return cls(image.workdir, env=image.env)
        return cls(tempfile.mkdtemp(prefix="stadium-ws-"), python=sys.executable, owned=True)

    # ---- commands --------------------------------------------------------------------

    def _path(self, path: str) -> str:
        return os.path.join(self.root, path)

    def run(
        self, cmd: str | Sequence[str], *, cwd: str | None = None,
        env: Mapping[str, str] | None = None, stdin: str | bytes | None = None,
        timeout: float = 30.0, max_output: int = 65536,
    ) -> RunResult:  # fmt: skip
        """Run a command: a string is a shell line (``/bin/sh -c``), a sequence an argv.

        It runs in ``cwd`` (relative to :attr:`root`; default :attr:`root`) with the
        workspace's environment updated by ``env``, ``stdin`` fed to it (else
        ``/dev/null``), in a process group of its own that is killed at ``timeout``
        seconds (``exit_code`` ``None``, ``timed_out``) and when the command exits.
        A command that cannot be started (no such program) gives exit code 127.
        """
        argv = ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else [str(a) for a in cmd]
        if not argv:
            raise ExecutionError("run() needs a command: a shell line or a non-empty argv")
        full_env = {**self.env, **(env or {})}
        start = time.monotonic()
        deadline = start + timeout
        data = stdin.encode() if isinstance(stdin, str) else (stdin or b"")
        sup = self._supervisor()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        feed: int | None = None
        if stdin is not None:
            in_r, feed = os.pipe()
        else:
            in_r = os.open(os.devnull, os.O_RDONLY)
        try:
            child = sup.spawn(argv, self._path(cwd or "."), full_env, in_r, out_w, err_w)
        except BaseException as exc:
            for fd in (out_r, err_r) if feed is None else (out_r, err_r, feed):
                os.close(fd)
            if not isinstance(exc, OSError):
                raise
            return RunResult(
                127, "", f"{argv[0]}: {exc.strerror or exc}\n", False, False,
                time.monotonic() - start,
            )  # fmt: skip
        finally:
            for fd in (in_r, out_w, err_w):
                os.close(fd)
        try:
            out, err, timed_out = _collect(
                child.kill, out_r, err_r, feed, data, child.fileno(), deadline, max_output
            )
            if timed_out:
                child.kill()
            status = child.wait(time.monotonic() + 5.0)
        finally:
            child.close()
            os.close(out_r)
            os.close(err_r)
        code = None if timed_out else status
        return self._result(code, out, err, timed_out, start)

    def start(
        self, argv: Sequence[str], *, cwd: str, env: Mapping[str, str], stdin: int, stdout: int,
        stderr: int, extra: int = -1,
    ) -> Child:  # fmt: skip
        """Start ``argv`` under the workspace's supervisor, as :meth:`run` does, but leave it
        to the caller (a grader that talks to it on pipes of its own): ``env`` is its whole
        environment, ``extra`` one more descriptor passed on (:data:`FD_MARK` in ``argv``
        names its number). :meth:`stop_others` ends it and anything it left behind. The
        caller waits for the returned :class:`Child` (its ``kill`` ends its group) and
        closes it. OSError: it could not start."""
        return self._supervisor().spawn(
            argv, self._path(cwd), env, stdin, stdout, stderr, extra=extra
        )

    @staticmethod
    def _result(
        code: int | None, out: _Stream, err: _Stream, timed_out: bool, start: float
    ) -> RunResult:
        stdout, cut_out = out.text()
        stderr, cut_err = err.text()
        return RunResult(
            code, stdout, stderr, cut_out or cut_err, timed_out, time.monotonic() - start
        )

    # ---- python ----------------------------------------------------------------------

    def python(self, code: str, *, timeout: float = 30.0, max_output: int = 65536) -> RunResult:
        """Run a Python snippet under the workspace's ``python3`` (the image's), as
        ``__main__``, in :attr:`root`; ``exit_code`` is its exit status (an uncaught
        exception: 1, its traceback on stderr). Fast: a warm fork server in the session
        forks per snippet (started on first use)."""
        source = code.encode("utf-8", "surrogateescape")
        body = self.root.encode("utf-8", "surrogateescape") + b"\0" + source
        if len(body) > MAX_SNIPPET:
            raise ExecutionError(f"the snippet is over {MAX_SNIPPET} bytes: write it to a file")
        start = time.monotonic()
        deadline = start + timeout
        with self._lock:
            sock = self._fork_server()
            in_r, in_w = os.pipe()
            out_r, out_w = os.pipe()
            err_r, err_w = os.pipe()
            try:
                fds = array.array("i", (in_r, out_w, err_w))
                sock.sendmsg(
                    [struct.pack("<I", len(body))],
                    [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds.tobytes())],
                )
                sock.sendall(body)
            except OSError as exc:
                for fd in (in_r, in_w, out_r, out_w, err_r, err_w):
                    os.close(fd)
                self._stop_server()
                raise ExecutionError(f"the Python fork server is gone ({exc}); try again") from exc
            for fd in (in_r, out_w, err_w):
                os.close(fd)
            os.close(in_w)  # the snippet reads EOF on stdin
            try:
                pid = self._receive(sock, deadline)
                out, err, timed_out = _collect(
                    lambda: _kill_group(pid), out_r, err_r, None, b"", sock.fileno(), deadline,
                    max_output, self._server_fd,
                )  # fmt: skip
                if timed_out:
                    _kill_group(pid)
                # The server reaps it and answers (not in time: the server goes).
                status = self._receive(sock, time.monotonic() + 5.0)
            except ExecutionError:
                self._stop_server()
                raise
            finally:
                os.close(out_r)
                os.close(err_r)
        return self._result(None if timed_out else status, out, err, timed_out, start)

    def _receive(self, sock: socket.socket, deadline: float) -> int:
        """The fork server's next answer (4 bytes), waited for to ``deadline``; its death
        (its reply socket readable, its socket silent) is an :class:`ExecutionError` at once."""
        data = b""
        while len(data) < 4:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ExecutionError("the Python fork server did not answer in time")
            ready, _, _ = select.select([sock.fileno(), self._server_fd], [], [], left)
            if sock.fileno() in ready:
                chunk = sock.recv(4 - len(data))
                if not chunk:
                    raise ExecutionError("the Python fork server exited; the next call starts one")
                data += chunk
            elif ready:
                raise ExecutionError("the Python fork server exited; the next call starts one")
        value: int = struct.unpack("<i", data)[0]
        if value == -1:
            raise ExecutionError("the Python fork server refused the request")
        return value

    def _check_owner(self) -> None:
        """In a forked copy of the process that started the supervisor and the fork
        server: they are not this copy's (it starts its own)."""
        if self._owner != os.getpid():
            self._server, self._sock, self._sup, self._owner = None, None, None, os.getpid()
            self._server_fd = -1

    def _supervisor(self) -> WorkspaceSupervisor:
        """The running supervisor (started here on first use). One that died was killed
        by someone (the workspace never stops it but in :meth:`close`): what it started may
        have escaped, so :meth:`stop_others` refuses from then on."""
        self._check_owner()
        with self._sup_lock:
            sup = self._sup
            if sup is not None and sup.alive():
                return sup
            if sup is not None:
                self._lose(sup)
            self._sup = WorkspaceSupervisor()
            return self._sup

    def _lose(self, sup: WorkspaceSupervisor) -> str:
        lost = self._lost = self._lost or (
            f"the workspace's process supervisor (pid {sup.pid}) was killed, so processes "
            "its commands started may still run where nothing can stop them: this "
            "workspace's files cannot be vouched for (start a new session)"
        )
        sup.close()
        if self._sup is sup:
            self._sup = None
        return lost

    def stop_others(self) -> int:
        """End every process this workspace's commands and snippets started and anything
        they left behind (``setsid``, double forks, ``nohup``: the whole subtree of the
        workspace's supervisor, frozen then killed), the Python fork server included (the
        next :meth:`python` starts one); not this process, nor anything else. Returns how
        many processes were ended. An :class:`ExecutionError` when that cannot be vouched
        for: the supervisor was killed (then on every later call too), or did not answer.
        """
        with self._lock:
            self._check_owner()
            sup = self._sup
            if sup is not None and not sup.alive():
                self._lose(sup)
            if self._lost is not None:
                raise ExecutionError(self._lost)
            if sup is None:
                return 0
            try:
                count = sup.stop()
            except ExecutionError:
                if not sup.alive(wait=1.0):
                    raise ExecutionError(self._lose(sup)) from None
                raise
            self._stop_server()  # it was in the subtree
            return count

    def _fork_server(self) -> socket.socket:
        """The running fork server's socket (started here on first use, and again in a
        forked copy of this process or after the server died)."""
        self._check_owner()
        if self._sock is not None and self._server is not None and not self._server.ended():
            return self._sock
        self._stop_server()
        python = self._python or shutil.which("python3", path=self.env.get("PATH"))
        if python is None:
            raise ExecutionError(
                "no python3 on the workspace's PATH: install one in the image, or use run()"
            )
        sup = self._supervisor()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        null = os.open(os.devnull, os.O_RDWR)
        try:
            self._server = sup.spawn(
                [python, "-u", "-c", FORK_SERVER, FD_MARK], self.root, self.env, null, null,
                2, extra=theirs.fileno(),
            )  # fmt: skip
        except OSError as exc:
            ours.close()
            raise ExecutionError(f"cannot start {python}: {exc.strerror or exc}") from exc
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
            os.close(null)
        self._sock = ours
        self._server_fd = self._server.fileno()
        return ours

    def _stop_server(self) -> None:
        if self._sock is not None:  # its spare sees EOF and ends
            self._sock.close()
            self._sock = None
        self._server_fd = -1
        if self._server is not None:
            self._server.kill()
            with contextlib.suppress(ExecutionError):
                self._server.wait(time.monotonic() + 5.0)
            self._server.close()
            self._server = None

    # ---- files -----------------------------------------------------------------------

    def read_bytes(self, path: str, *, max_bytes: int = 1 << 20) -> bytes:
        """The file's bytes; a file over ``max_bytes`` is an :class:`ExecutionError`."""
        with open(self._path(path), "rb") as f:
            data = f.read(max_bytes + 1)
        if len(data) > max_bytes:
            raise ExecutionError(
                f"{path} is over {max_bytes} bytes: pass a larger max_bytes, or read a part "
                "of it with run(['head', '-c', N, path])", path=path, max_bytes=max_bytes,
            )  # fmt: skip
        return data

    def read_file(self, path: str, *, max_bytes: int = 1 << 20) -> str:
        """The file's text (UTF-8, errors replaced); over ``max_bytes``: an error."""
        return self.read_bytes(path, max_bytes=max_bytes).decode("utf-8", "replace")

    def write_file(self, path: str, data: str | bytes) -> None:
        """Write the file (replacing it), making its parent directories."""
        full = self._path(path)
        parent = os.path.dirname(full)
        if parent:
            os.makedirs(parent, exist_ok=True)
        with open(full, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)

    def list_dir(self, path: str = ".") -> list[DirEntry]:
        """The directory's entries, by name (links not followed)."""
        entries = []
        with os.scandir(self._path(path)) as it:
            for entry in it:
                st = entry.stat(follow_symlinks=False)
                if entry.is_symlink():
                    kind = "link"
                elif entry.is_dir(follow_symlinks=False):
                    kind = "dir"
                elif entry.is_file(follow_symlinks=False):
                    kind = "file"
                else:
                    kind = "other"
                entries.append(DirEntry(entry.name, kind, st.st_size))
        return sorted(entries, key=lambda e: e.name)

    # ---- lifecycle -------------------------------------------------------------------

    def close(self) -> None:
        """Stop the fork server; remove the work directory if this workspace made it."""
        if self._owner == os.getpid():
            self._stop_server()
            if self._sup is not None:
                self._sup.close()
                self._sup = None
        if self._finalizer is not None:
            self._finalizer()

    def __enter__(self) -> Workspace:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Workspace(root={self.root!r}, image={_image is not None})"


def _collect(
    kill: Callable[[], None], out: int, err: int, feed: int | None, data: bytes, ended: int,
    deadline: float, limit: int, also: int = -1,
) -> tuple[_Stream, _Stream, bool]:  # fmt: skip
    """Read both output pipes (writing ``data`` to ``feed``) until ``ended`` (the
    supervisor's reply socket of a command, or the fork server's socket) is readable and
    the pipes are at EOF; ``kill`` the process's group as soon as it ended (what it left in
    the background would otherwise hold the pipes open). ``also``: another descriptor
    whose readiness ends the wait as well (the fork server's reply socket). Returns the
    streams and whether ``deadline`` passed before it ended."""
    streams = {out: _Stream(out, limit), err: _Stream(err, limit)}
    sel = selectors.DefaultSelector()
    view = memoryview(data)
    try:
        for fd in (out, err):
            os.set_blocking(fd, False)
            sel.register(fd, selectors.EVENT_READ)
        if feed is not None:
            os.set_blocking(feed, False)
            sel.register(feed, selectors.EVENT_WRITE)
        sel.register(ended, selectors.EVENT_READ)
        ends = {ended}
        if also >= 0:
            sel.register(also, selectors.EVENT_READ)
            ends.add(also)
        open_fds = {out, err}
        finished = False
        while open_fds or not finished:
            left = deadline - time.monotonic()
            if left <= 0:
                return streams[out], streams[err], not finished
            for key, _ in sel.select(left):
                fd = int(key.fd)
                if fd in ends:
                    if not finished:
                        for end in ends:
                            sel.unregister(end)
                    finished = True
                    kill()
                    deadline = min(deadline, time.monotonic() + _DRAIN_S)
                elif fd == feed:
                    try:
                        view = view[os.write(fd, view) :]
                    except (BlockingIOError, InterruptedError):
                        continue
                    except OSError:  # it closed its stdin
                        view = view[len(view) :]
                    if not view:
                        sel.unregister(fd)
                        os.close(fd)
                        feed = None
                else:
                    try:
                        chunk = os.read(fd, 65536)
                    except (BlockingIOError, InterruptedError):
                        continue
                    if chunk:
                        streams[fd].take(chunk)
                    else:
                        sel.unregister(fd)
                        open_fds.discard(fd)
        return streams[out], streams[err], False
    finally:
        sel.close()
        if feed is not None:
            os.close(feed)

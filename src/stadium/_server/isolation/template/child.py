"""The env side of isolated sessions: the template process, which forks each session's.

:func:`template_main` (started by :mod:`.boot`, its settings read from a memfd, never from
argv or the environment) is a worker's *template*:
it imports the env's code once, then waits on its control socket (a
``SOCK_SEQPACKET`` socket inherited as ``control_fd``). For each ``spawn`` it
forks: the child (a session's process) gets one end of a new socket pair, the
worker the other (attached to a ``spawned`` reply). The child's stdout and stderr are the
pipe the worker sent with the ``spawn`` (its first descriptor; :mod:`.output`), or
``/dev/null`` (``--sandbox-output drop``); stdin is ``/dev/null``. The template is a child
subreaper: it reaps every session process (and the processes forked from them by
``fork``) and reports each one's wait status as ``["exit", pid, status]``, so the
worker can tell a segfault from an OOM kill from an exit.

Sandboxed, each spawn is a *family* in a pid namespace of its own: the template
forks the family's init (pid 1 of a new pid namespace; ``unshare(CLONE_NEWPID)``
then ``fork``, then ``setns`` back), which sets the sandbox up
(:func:`~stadium._server.isolation.template.confine.enter_sandbox`, the seccomp filter) and
forks the session's process (pid 2), the only one that joins the session's cgroups.
The init then reaps every process of the namespace (the session's, the copies
``fork`` makes, orphans) and reports each wait status to the template, which passes
it on: it executes the native init for that (``native/stadium-init``, a few lines of
Rust, ~0.1 MiB, shipped in the wheel; the template loads it into a sealed, execute-only
memfd once: :func:`native_init`), or runs the same loop itself when that is not built. The worker
names a sandboxed process by a *key*, ``family << 22 | pid in its namespace``,
unique per template (pids repeat across namespaces); unsandboxed, the key is the pid.
The init stays outside the cgroups, so killing a session's cgroup never kills the one
process that reports how it died; when its last process ends it exits, and the kernel
ends a namespace whose pid 1 ends. It is not dumpable (the interpreter, having changed
uid; the native init, by ``prctl``): the session's processes, of the same uid, can
neither see it nor open its memory.

With ``--untrusted-env-code`` (:mod:`.remote`) the template never imports the env's
code: only Stadium's loader modules and the operator's ``--preload`` modules. Each
session's process imports the target itself (:func:`~.remote.load_spec`), once it runs
as the session's uid with no capabilities, ``no_new_privs`` and the seccomp filter loaded,
so import-time code runs with exactly a session's privileges (the cost: one import per
session, paid ahead in the warm pool); it answers ``describe`` (the env's
:class:`~.remote.Description`) and decodes each action the worker passes through undecoded.

A session's process (:func:`~.env_process.session_main`) builds the env, then serves the
worker's requests one at a time until its socket closes: :mod:`.env_process`'s, with what every
session process of a template shares (:class:`~.env_process._Ctx`, set here once, inherited by
fork).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import gc
import itertools
import os
import selectors
import signal
import socket
import stat
import sys
from typing import Any

import msgspec

from stadium._env import workspace
from stadium._env.spec import EnvSpec
from stadium._server.isolation import remote, wire
from stadium._server.isolation.template import rootfs
from stadium._server.isolation.template.confine import enter_sandbox, session_workdir
from stadium._server.isolation.template.env_process import _Ctx, _send, session_main
from stadium._server.isolation.template.seccomp import build_filter
from stadium._server.loader import load_target
from stadium._util.libc import become_subreaper, die_with_parent, libc

_CLONE_NEWPID = 0x20000000
#: Bits of a sandboxed process's key holding its pid (pid_max is at most 2**22).
KEY_SHIFT = wire.KEY_SHIFT


def template_main(config: dict[str, Any]) -> None:
    """Run a template (see the module docstring) until its control socket closes."""
    if config.get("sys_path"):
        sys.path[:] = config["sys_path"]
    _Ctx.libc = libc()
    become_subreaper()
    die_with_parent(signal.SIGKILL)
    control = socket.socket(fileno=config["control_fd"])
    env_kwargs = config.get("env_kwargs") or {}
    try:
        if config.get("untrusted"):  # only operator-trusted modules here: never the env's
            remote.preload(config.get("preload") or [])
            _Ctx.untrusted = config
            _Ctx.image_target = rootfs.image_target(config["target"])
        else:
            _Ctx.spec = EnvSpec.of(load_target(config["target"], env_kwargs=env_kwargs))
    except Exception as exc:
        control.send(wire.encode(wire.Failed(f"{type(exc).__name__}: {exc}")))
        os._exit(3)
    _Ctx.env_kwargs = env_kwargs
    _Ctx.sandbox = bool(config.get("sandbox"))
    _Ctx.output = "drop" if config.get("output") == "drop" else "log"
    _Ctx.disk_mib = int(config.get("disk_mib", 256))
    _Ctx.ptys = int(config.get("ptys", 16))
    if config.get("seccomp"):  # built once here, loaded in each session's process
        try:
            _Ctx.seccomp = build_filter()
        except Exception as exc:
            control.send(wire.encode(wire.Failed(f"{type(exc).__name__}: {exc}")))
            os._exit(3)
    # The imported code's objects go to the permanent generation: the collector then never
    # walks them in a session's process, so its pages stay shared with the template.
    gc.collect()
    gc.freeze()
    report_w = -1
    if _Ctx.sandbox:
        _Ctx.host_roots = rootfs.host_roots()
        rootfs.plan_rebase()
        _Ctx.init = native_init()
        _Ctx.pid_ns = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
        _Ctx.report, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        _Ctx.report.setblocking(False)
        report_w = theirs.detach()
        # Unique per template, never reused: a fresh template starts elsewhere.
        _Ctx.families = itertools.count(int.from_bytes(os.urandom(4)) << 8)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    described = _Ctx.seccomp.description if _Ctx.seccomp is not None else None
    init = None if _Ctx.init is None else f"{NATIVE_INIT} (a sealed execute-only memfd copy)"
    control.send(wire.encode(wire.Ready(os.getpid(), described, init)))
    sel = selectors.DefaultSelector()
    sel.register(control, selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)
    if _Ctx.report is not None:
        sel.register(_Ctx.report, selectors.EVENT_READ)
    while True:
        for key, _ in sel.select():
            if key.fileobj is _Ctx.report:
                _relay(control, _Ctx.report)
            elif key.fileobj is control:
                try:
                    packet, fds, _flags, _addr = socket.recv_fds(control, 65536, 2)
                except OSError:  # the worker is gone
                    packet, fds = b"", []
                if not packet:
                    os._exit(0)
                msg = wire.decode_spawn(packet)  # from the worker: only ever a spawn
                out = fds[0] if fds and _Ctx.output == "log" else -1
                rest = fds[1:] if out >= 0 else fds
                _spawn(
                    control, sel, wake_r, wake_w, report_w, msg.cgroups, msg.uid, msg.hosts,
                    netns_fd=rest[0] if rest else -1, out_fd=out, image=msg.image,
                )  # fmt: skip
                for fd in fds:
                    os.close(fd)
            else:
                os.read(wake_r, 4096)
                _reap(control)


def _reap(control: socket.socket) -> None:
    if _Ctx.report is not None:  # an init reports its last process before it exits itself
        _relay(control, _Ctx.report)
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        if pid in _Ctx.inits:  # a family's init: its session's exit, if it never said it
            key = _Ctx.inits.pop(pid)
            if key not in _Ctx.unreported:
                continue
            _Ctx.unreported.discard(key)
            pid = key
        try:
            control.send(wire.encode(wire.Exit(pid, status)))
        except OSError:  # the worker is gone
            os._exit(0)


def _relay(control: socket.socket, report: socket.socket) -> None:
    """Pass the families' inits' exit reports (``["exit", key, status]``) on to the worker."""
    while True:
        try:
            packet = report.recv(256)
        except OSError:  # none left (non-blocking)
            return
        try:
            _Ctx.unreported.discard(_EXIT.decode(packet).key)
        except msgspec.DecodeError:  # no exit report: not passed on
            continue
        try:
            control.send(packet)
        except OSError:  # the worker is gone
            os._exit(0)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


#: The native init (native/stadium-init), in ``isolation/``: built there by ``make sandbox-deps``
#: in a checkout, or into the wheel by its build hook (``hatch_build.py``).
NATIVE_INIT = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "stadium-init"
)
_MAX_INIT_BYTES = 8 << 20
_MFD_EXEC = 0x10
"""``memfd_create``'s ``MFD_EXEC`` (Linux >= 6.3: an executable memfd, asked for explicitly)."""
_SEALS = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE


def native_init() -> int | None:
    """A sealed, execute-only copy of :data:`NATIVE_INIT` in memory (a memfd the family's
    init executes with ``fexecve``), or ``None`` (not built, not trusted, or no executable
    memfd here: ``vm.memfd_noexec=2``). It does what :func:`_start_family`'s loop does,
    reporting in the same format, so either serves; the native one costs a session ~0.8 MiB
    less (the pages a forked interpreter holds).

    The copy, not the file, is executed: it is owned by root and mode 0111 (the kernel makes a
    process executing a file it cannot read undumpable from its first instruction, so the
    session's processes, same uid, never get a moment to open its memory), sealed against
    every change, and on no filesystem the session could reach. The installed file may be
    0755 (as pip installs it); one that others may write, or owned by another user, is not
    used. A copy others may read is never executed (checked on the memfd itself)."""
    try:
        fd = os.open(NATIVE_INIT, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if (
            not stat.S_ISREG(info.st_mode)
            or info.st_mode & 0o022
            or info.st_uid not in (0, os.geteuid())
            or not 0 < info.st_size <= _MAX_INIT_BYTES
        ):
            return None
        data = os.read(fd, _MAX_INIT_BYTES + 1)
    finally:
        os.close(fd)
    try:
        mfd = _exec_memfd()
    except OSError:
        return None
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(mfd, view) :]
        os.fchmod(mfd, 0o111)
        fcntl.fcntl(mfd, fcntl.F_ADD_SEALS, _SEALS)
        if not _execute_only(mfd):
            raise OSError("the native init's copy is readable by others")
    except OSError:
        os.close(mfd)
        return None
    return mfd


def _exec_memfd() -> int:
    flags = os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING
    try:
        return os.memfd_create("stadium-init", flags | _MFD_EXEC)
    except OSError as exc:  # a kernel before 6.3 knows no MFD_EXEC (its memfds are executable)
        if exc.errno != errno.EINVAL:
            raise
        return os.memfd_create("stadium-init", flags)


def _execute_only(fd: int) -> bool:
    """The memfd is what :func:`native_init` made: root's (or ours), 0111, sealed."""
    info = os.fstat(fd)
    return (
        stat.S_IMODE(info.st_mode) == 0o111
        and info.st_uid == os.geteuid()
        and fcntl.fcntl(fd, fcntl.F_GET_SEALS) & _SEALS == _SEALS
    )


def _fork_family() -> tuple[int, int]:
    """Fork a family's init as pid 1 of a new pid namespace; ``(pid, key base)``."""
    _check(_Ctx.libc.unshare(_CLONE_NEWPID), "unshare(CLONE_NEWPID)")
    base = next(_Ctx.families) << KEY_SHIFT
    try:
        pid = os.fork()
    finally:
        if os.getpid() != 1:  # the template: its next children in its own namespace again
            _check(_Ctx.libc.setns(_Ctx.pid_ns, _CLONE_NEWPID), "setns(pid)")
    return pid, base


def _start_family(
    sock: socket.socket,
    report_w: int,
    cgroups: list[str],
    uid: int,
    *,
    netns_fd: int = -1,
    hosts: str | None = None,
    image: wire.Image | None = None,
    userns_fd: int = -1,
) -> None:
    """In a family's init: set the sandbox up, fork the session's process (which
    returns, to serve), then reap the namespace until it is empty (never returns).
    With an ``image``, the image is the family's root (:mod:`.rootfs`) and the session's
    :class:`~stadium.Workspace` is its filesystem."""
    die_with_parent(signal.SIGKILL)
    procs = [os.open(os.path.join(p, "cgroup.procs"), os.O_WRONLY) for p in cgroups]
    # The init stays out of the session's cgroups; the family shares its namespaces.
    enter_sandbox(
        [], uid, _Ctx.disk_mib, netns_fd=netns_fd, hosts=hosts, ptys=_Ctx.ptys, image=image,
        host_roots=_Ctx.host_roots, userns_fd=userns_fd,
    )  # fmt: skip
    if userns_fd >= 0:  # used by the mounts; never the session's
        os.close(userns_fd)
    if _Ctx.seccomp is not None:  # the last step: no env code has run yet
        _Ctx.seccomp.load()
    if os.fork() == 0:  # the session's process (pid 2)
        os.close(report_w)
        if _Ctx.init is not None:
            os.close(_Ctx.init)
        for fd in procs:
            os.write(fd, b"0")
            os.close(fd)
        if image is not None:
            workspace.bind_image(image.env, session_workdir(image))
        return
    for fd in procs:
        os.close(fd)
    sock.close()
    if _Ctx.init is not None:  # the same loop, in ~0.1 MiB instead of a forked interpreter
        with contextlib.suppress(OSError):  # could not run it: the loop below serves
            os.set_inheritable(report_w, True)
            # fexecve (execveat on the memfd): no path, so the same in an image's root
            os.execve(_Ctx.init, ["stadium-init", str(report_w), str(_Ctx.key_base)], {})
    report = socket.socket(fileno=report_w)
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:  # the namespace is empty: its end
            os._exit(0)
        try:
            report.send(wire.encode(wire.Exit(_Ctx.key_base + pid, status)))
        except OSError:  # the template is gone
            os._exit(0)


def _spawn(
    control: socket.socket,
    sel: selectors.BaseSelector,
    wake_r: int,
    wake_w: int,
    report_w: int,
    cgroups: list[str],
    uid: int,
    hosts: str | None = None,
    *,
    netns_fd: int = -1,
    out_fd: int = -1,
    image: wire.Image | None = None,
) -> None:
    mine, theirs = socket.socketpair()
    sys.stdout.flush()  # nothing of the template's own output is printed twice
    sys.stderr.flush()
    userns = -1
    if _Ctx.sandbox and image is not None:  # the idmapping of its layers (uid: theirs)
        try:
            userns = rootfs.user_namespace(uid)
        except OSError:  # no user namespaces here: the image's files stay root's
            userns = -1
    if _Ctx.sandbox:
        try:
            pid, base = _fork_family()
        except OSError as exc:
            if userns >= 0:
                os.close(userns)
            _send(theirs, wire.Raised("SandboxError", f"no pid namespace: {exc}"))
            theirs.close()
            _spawned(control, 0, mine)
            _tell(control, wire.Exit(0, 4 << 8))  # the worker forgets it
            return
    else:
        pid, base = os.fork(), 0
    if pid == 0:
        try:
            _own_output(out_fd)
            sel.close()
            control.close()
            os.close(wake_r)
            os.close(wake_w)
            mine.close()
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            os.setsid()
            if _Ctx.sandbox:
                assert _Ctx.report is not None
                _Ctx.report.close()
                os.close(_Ctx.pid_ns)
                _Ctx.key_base = base
                # returns in the session's process
                _start_family(
                    theirs, report_w, cgroups, uid, netns_fd=netns_fd, hosts=hosts, image=image,
                    userns_fd=userns,
                )  # fmt: skip
        except BaseException as exc:  # the session's socket says why, then the process ends
            _send(theirs, wire.Raised("SandboxError", f"setting up the sandbox failed: {exc}"))
            os._exit(4)
        session_main(theirs)
    theirs.close()
    if userns >= 0:
        os.close(userns)
    key = pid
    if _Ctx.sandbox:  # the worker knows the session's process (pid 2) by its key
        key = base | 2
        _Ctx.inits[pid] = key
        _Ctx.unreported.add(key)
    _spawned(control, key, mine)


def _own_output(out_fd: int) -> None:
    """The family's stdout and stderr: its pipe to the worker (``out_fd``), or ``/dev/null``
    (``drop``); never the template's (nor the server's). stdin stays ``/dev/null``."""
    if out_fd < 0:
        out_fd = os.open(os.devnull, os.O_WRONLY)
    os.dup2(out_fd, 1)
    os.dup2(out_fd, 2)
    os.close(out_fd)


def _spawned(control: socket.socket, key: int, mine: socket.socket) -> None:
    """Hand the worker its end of a new session's socket (``["spawned", key]``)."""
    try:
        socket.send_fds(control, [wire.encode(wire.Spawned(key))], [mine.fileno()])
    except OSError:  # the worker is gone (it stopped): so is this template, quietly
        os._exit(0)
    finally:
        mine.close()


def _tell(control: socket.socket, msg: msgspec.Struct) -> None:
    try:
        control.send(wire.encode(msg))
    except OSError:  # the worker is gone
        os._exit(0)


_EXIT = msgspec.msgpack.Decoder(wire.Exit)

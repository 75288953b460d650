"""An image-backed session's root filesystem, set up by its family's init (as root, in the
family's fresh mount namespace, before :func:`~.confine.enter_sandbox` drops privileges).

:func:`enter_image`: a tmpfs of the session's disk size (``--sandbox-disk``) holds the
overlay's upper and work directories (nothing is written to disk until the session writes,
and what it writes is bounded: a full layer is ``ENOSPC`` for that session alone); an
overlayfs stacks that private upper layer on the image's read-only layers (shared by every
session of the image, and by images sharing layers); under it, read-only:
:data:`HOST` + each folder the running interpreter and the code need (the paths the
template's bubblewrap binds, :func:`host_roots`); a ``/proc`` showing only the session's
processes (``hidepid=2``); a minimal ``/dev`` (``null``, ``zero``, ``full``, ``random``,
``urandom``, ``tty``, ``ptmx`` and a ``devpts`` instance of the session's own with at most
``ptys`` terminals, a small ``/dev/shm``); the session's work directory; then
``pivot_root`` into it, and the old root is detached. :func:`rebase_python` then points
the interpreter (``sys.path``, packages' ``__path__``, ``sys.executable``) at :data:`HOST`,
before anything else is imported.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys
from collections.abc import Iterable
from typing import Any

from stadium._util.libc import libc

#: Where the host's interpreter and code are, read-only, inside an image's root.
HOST = "/.stadium/host"
#: The device nodes an image-backed session gets (bound from the template's ``/dev``).
DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
# The mount API's system calls (one number on every architecture since Linux 5.x).
_SYS_OPEN_TREE, _SYS_MOVE_MOUNT, _SYS_MOUNT_SETATTR = 428, 429, 442
_AT_FDCWD = -100
_AT_EMPTY_PATH = 0x1000
_OPEN_TREE_CLONE = 1
_MOVE_MOUNT_F_EMPTY_PATH = 4
_MOUNT_ATTR_IDMAP = 0x00100000
_CLONE_NEWUSER = 0x10000000

_MS_RDONLY = 1
_MS_NOSUID = 2
_MS_NODEV = 4
_MS_NOEXEC = 8
_MS_REMOUNT = 32
_MS_BIND = 4096
_MS_REC = 0x4000
_MNT_DETACH = 2


def host_roots(extra: Iterable[str] = ()) -> list[str]:
    """The host folders the running interpreter and the code need (its prefixes, every
    folder on ``sys.path``, ``extra``): real paths, none inside another."""
    roots: set[str] = set()
    for path in (sys.prefix, sys.base_prefix, sys.exec_prefix, *sys.path, *extra):
        if path and os.path.isdir(path):
            real = os.path.realpath(path)
            if real != "/" and not real.startswith("/proc"):
                roots.add(real)
    exe_dir = os.path.dirname(os.path.realpath(sys.executable))
    roots.add(os.path.dirname(exe_dir) if exe_dir.endswith("/bin") else exe_dir)
    kept: list[str] = []
    for path in sorted(roots, key=len):
        if not any(path == k or path.startswith(k + "/") for k in kept):
            kept.append(path)
    return kept


_libc = libc


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(libc: Any, source: str, target: str, fstype: str | None, flags: int,
           data: str | None = None) -> None:  # fmt: skip
    rc = libc.mount(
        source.encode(), target.encode(), fstype.encode() if fstype else None,
        ctypes.c_ulong(flags), data.encode() if data else None,
    )  # fmt: skip
    _check(rc, f"mount {fstype or source} on {target}")


def user_namespace(uid: int) -> int:
    """A user namespace whose root is ``uid`` (a descriptor of it): the idmapping under
    which an image's layers show root's files as the session's own. Made by a short-lived
    child of the caller (the template: a family's init must not fork before the session's
    process, pid 2), which is reaped here."""
    libc = _libc()
    ready_r, ready_w = os.pipe()
    done_r, done_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child only unshares and waits
        try:
            os.close(ready_r)
            os.close(done_w)
            if libc.unshare(_CLONE_NEWUSER) == 0:
                os.write(ready_w, b"x")
            os.read(done_r, 1)  # EOF: the parent has what it needs
        finally:
            os._exit(0)
    os.close(ready_w)
    os.close(done_r)
    try:
        if os.read(ready_r, 1) != b"x":
            raise OSError("a user namespace could not be made (unshare)")
        for name in ("uid_map", "gid_map"):
            with open(f"/proc/{pid}/{name}", "w") as f:
                f.write(f"0 {uid} 1\n")
        return os.open(f"/proc/{pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        os.close(ready_r)
        os.close(done_w)
        os.waitpid(pid, 0)


def _idmapped(libc: Any, layer: str, target: str, userns_fd: int) -> None:
    """Mount ``layer`` on ``target``, idmapped by ``userns_fd`` (root's files: the uid's)."""
    tree = libc.syscall(
        ctypes.c_long(_SYS_OPEN_TREE), ctypes.c_int(_AT_FDCWD), layer.encode(),
        ctypes.c_uint(_OPEN_TREE_CLONE | os.O_CLOEXEC),
    )  # fmt: skip
    if tree < 0:
        _check(-1, f"open_tree {layer}")
    try:
        attr = (ctypes.c_uint64 * 4)(_MOUNT_ATTR_IDMAP, 0, 0, userns_fd)
        rc = libc.syscall(
            ctypes.c_long(_SYS_MOUNT_SETATTR), ctypes.c_int(tree), b"",
            ctypes.c_uint(_AT_EMPTY_PATH), ctypes.byref(attr), ctypes.c_size_t(32),
        )  # fmt: skip
        _check(rc, f"idmap {layer}")
        rc = libc.syscall(
            ctypes.c_long(_SYS_MOVE_MOUNT), ctypes.c_int(tree), b"", ctypes.c_int(_AT_FDCWD),
            target.encode(), ctypes.c_uint(_MOVE_MOUNT_F_EMPTY_PATH),
        )  # fmt: skip
        _check(rc, f"move_mount {layer}")
    finally:
        os.close(tree)


def enter_image(
    layers: list[str], uid: int, disk_mib: int, staging: str, work_dir: str, ptys: int,
    roots: list[str], userns_fd: int = -1,
) -> None:  # fmt: skip
    """Make the image (``layers``, bottom first) this mount namespace's root (see the
    module docstring). ``staging``: an empty folder of the template's root (its tmpfs
    holds the overlay's upper and work directories); ``work_dir``: the session's work
    directory inside the image (its own, ``0700``); ``roots``: the host folders bound
    read-only under :data:`HOST`; ``userns_fd`` (:func:`user_namespace`): the layers are
    idmapped by it, so the image's root-owned files are the session uid's to change (in its
    copy-on-write layer); ``-1``: they stay root's, read-only to the session."""
    libc = _libc()
    rebase = _plan or _plan_rebase()  # real paths: resolved here, in the host's tree
    _mount(libc, "tmpfs", staging, "tmpfs", _MS_NOSUID | _MS_NODEV,
           f"size={disk_mib}m,mode=0755")  # fmt: skip
    upper, work, root = (os.path.join(staging, d) for d in ("upper", "work", "root"))
    for folder in (upper, work, root):
        os.mkdir(folder, 0o755)
    if userns_fd >= 0:  # each layer idmapped (root's files: the session's), then stacked
        mapped = []
        for i, layer in enumerate(layers):
            target = os.path.join(staging, f"lower{i}")
            os.mkdir(target, 0o755)
            _idmapped(libc, layer, target, userns_fd)
            mapped.append(target)
        layers = mapped
        os.chown(upper, uid, uid)  # the image's root directory is the session's too
    lower = ":".join(reversed(layers))  # overlayfs lists the top layer first
    _mount(libc, "overlay", root, "overlay", _MS_NOSUID | _MS_NODEV,
           f"lowerdir={lower},upperdir={upper},workdir={work}")  # fmt: skip
    for path in roots:  # the interpreter and the code, read-only
        target = root + HOST + path
        os.makedirs(target, exist_ok=True)
        _mount(libc, path, target, None, _MS_BIND | _MS_REC)
        _mount(libc, "none", target, None,
               _MS_BIND | _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID | _MS_NODEV)  # fmt: skip
    proc = root + "/proc"
    os.makedirs(proc, exist_ok=True)
    _mount(libc, "proc", proc, "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, "hidepid=2")
    _make_dev(libc, root + "/dev", ptys)
    tmp = root + "/tmp"
    os.makedirs(tmp, exist_ok=True)
    os.chmod(tmp, 0o1777)
    home = root + work_dir
    os.makedirs(home, exist_ok=True)
    os.chown(home, uid, uid)
    os.chmod(home, 0o700)
    os.chdir(root)
    number = _SYS_PIVOT_ROOT.get(platform.machine())
    if number is None:
        raise OSError(f"task images are not supported on {platform.machine()} (pivot_root)")
    _check(libc.syscall(number, b".", b"."), "pivot_root")
    _check(libc.umount2(b".", _MNT_DETACH), "detach the old root")  # stacked on the new one
    os.chdir("/")
    rebase()


def _make_dev(libc: Any, dev: str, ptys: int) -> None:
    os.makedirs(dev, exist_ok=True)
    _mount(libc, "tmpfs", dev, "tmpfs", _MS_NOSUID | _MS_NOEXEC, "size=64k,mode=0755")
    for name in DEVICES:
        node = os.path.join(dev, name)
        with open(node, "w"):
            pass
        _mount(libc, "/dev/" + name, node, None, _MS_BIND)
    for folder in ("pts", "shm"):
        os.mkdir(os.path.join(dev, folder), 0o755)
    _mount(libc, "devpts", dev + "/pts", "devpts", _MS_NOSUID | _MS_NOEXEC,
           f"newinstance,ptmxmode=0666,mode=0620,max={ptys}")  # fmt: skip
    _mount(libc, "tmpfs", dev + "/shm", "tmpfs", _MS_NOSUID | _MS_NODEV, "size=16m,mode=1777")
    for name, target in (("ptmx", "pts/ptmx"), ("fd", "/proc/self/fd"),
                         ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):  # fmt: skip
        os.symlink(target, os.path.join(dev, name))


def image_target(target: str) -> str:
    """``target`` (``file.py:Class`` or ``module:Class``) as a process inside an image sees
    it: a file's path under :data:`HOST` (its real path, resolved here on the host)."""
    module, sep, attr = target.rpartition(":")
    if sep and module.startswith("/"):
        return f"{HOST}{os.path.realpath(module)}:{attr}"
    return target


_plan: Any = None


def plan_rebase() -> None:
    """Plan the interpreter's move under :data:`HOST` once, in the template (after it
    imported what it imports): each session's init then only applies it, touching a few
    lists instead of every module (what a family's init writes before it forks the
    session's process is copied into that process)."""
    global _plan
    _plan = _plan_rebase()


def _plan_rebase() -> Any:
    """What points this interpreter at :data:`HOST` once the image is its root:
    ``sys.path``, the search paths of the packages imported so far (a later import of a
    submodule looks there), ``sys.executable``. Planned before ``pivot_root`` (the real
    paths are the host's), applied after, before anything else is imported."""

    def moved(path: str) -> str:
        return HOST + os.path.realpath(path) if path.startswith("/") else path

    new_path = [moved(p) for p in sys.path]
    packages = [
        (path, [moved(p) for p in path])
        for module in list(sys.modules.values())
        if isinstance(path := getattr(module, "__path__", None), list)
    ]
    executable = moved(sys.executable)

    def apply() -> None:
        sys.path[:] = new_path
        for path, moved_path in packages:
            path[:] = moved_path
        # (the importer cache keeps the host paths' finders: dropping them would touch,
        # and so copy, every page their directory listings are on)
        sys.executable = executable

    return apply

"""An image-backed session's root filesystem, set up by its family's init (as root, in the
family's fresh mount namespace, before :func:`~.sandbox.enter_sandbox` drops privileges).

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

#: Where the host's interpreter and code are, read-only, inside an image's root.
HOST = "/.stadium/host"
#: The device nodes an image-backed session gets (bound from the template's ``/dev``).
DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}

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


def _libc() -> Any:
    return ctypes.CDLL(None, use_errno=True)


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


def enter_image(
    layers: list[str], uid: int, disk_mib: int, staging: str, work_dir: str, ptys: int,
    roots: list[str],
) -> None:  # fmt: skip
    """Make the image (``layers``, bottom first) this mount namespace's root (see the
    module docstring). ``staging``: an empty folder of the template's root (its tmpfs
    holds the overlay's upper and work directories); ``work_dir``: the session's work
    directory inside the image (its own, ``0700``); ``roots``: the host folders bound
    read-only under :data:`HOST`."""
    libc = _libc()
    rebase = _plan_rebase()  # real paths: resolved here, in the host's tree
    _mount(libc, "tmpfs", staging, "tmpfs", _MS_NOSUID | _MS_NODEV,
           f"size={disk_mib}m,mode=0755")  # fmt: skip
    upper, work, root = (os.path.join(staging, d) for d in ("upper", "work", "root"))
    for folder in (upper, work, root):
        os.mkdir(folder, 0o755)
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
        sys.path_importer_cache.clear()
        sys.executable = executable

    return apply

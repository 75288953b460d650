"""The session's process enters its sandbox (the env's side of :mod:`..sandbox`): new mount,
network, ipc and uts namespaces, its cgroups, a private size-bounded tmpfs as its work
directory (or a task image as its root: :mod:`.rootfs`), its own ``devpts``, the cgroup tree
hidden, an unprivileged uid of its own and ``no_new_privs`` (:func:`enter_sandbox`). The
template then loads the seccomp filter (:mod:`.seccomp`)."""

from __future__ import annotations

import contextlib
import ctypes
import os

from stadium._server.isolation.sandbox import CGROUP_ROOT, WORK_DIR
from stadium._server.isolation.template import rootfs
from stadium._server.isolation.wire import Image
from stadium._util.libc import PR_SET_NO_NEW_PRIVS, libc

_MS_RDONLY = 1
_MS_REMOUNT = 32

_CLONE_NEWNS = 0x00020000
_CLONE_NEWUTS = 0x04000000
_CLONE_NEWIPC = 0x08000000
_CLONE_NEWNET = 0x40000000
_MS_REC = 0x4000
_MS_PRIVATE = 1 << 18
_MS_NOSUID = 2
_MS_NODEV = 4
_MS_NOEXEC = 8
_MS_BIND = 4096
_MNT_DETACH = 2
_c = libc


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source: str, target: str, fstype: str | None, flags: int, data: str | None) -> None:
    rc = _c().mount(
        source.encode(),
        target.encode(),
        fstype.encode() if fstype else None,
        ctypes.c_ulong(flags),
        data.encode() if data else None,
    )
    _check(rc, f"mount {target}")


def enter_sandbox(
    cgroups: list[str],
    uid: int,
    disk_mib: int,
    *,
    netns_fd: int = -1,
    hosts: str | None = None,
    ptys: int = 16,
    image: Image | None = None,
    host_roots: list[str] | None = None,
    userns_fd: int = -1,
) -> None:
    """Make the calling process (a session's, as root with capabilities inside the
    template's namespaces) a sandboxed one: see the module docstring. Irreversible.

    ``netns_fd``: the network namespace the worker made for it (``allowlist``,
    ``public``: :mod:`.netns`), joined instead of a new one with no network; ``hosts``:
    its ``/etc/hosts``; ``ptys``: the ``max`` of its own ``devpts`` instance; ``image``:
    the task image that becomes its root (:func:`.rootfs.enter_image`, with
    ``host_roots`` under ``/.stadium/host``; its layers idmapped by ``userns_fd``, when
    given: see :func:`.rootfs.enter_image`); it then starts in the image's workdir."""
    for path in cgroups:
        with open(os.path.join(path, "cgroup.procs"), "w") as f:
            f.write("0")
    flags = _CLONE_NEWNS | _CLONE_NEWIPC | _CLONE_NEWUTS
    if netns_fd >= 0:
        _check(_c().setns(netns_fd, _CLONE_NEWNET), "setns (the session's network)")
        os.close(netns_fd)
    else:
        flags |= _CLONE_NEWNET
    _check(_c().unshare(flags), "unshare")
    _mount("none", "/", None, _MS_REC | _MS_PRIVATE, None)
    _check(_c().umount2(str(CGROUP_ROOT).encode(), _MNT_DETACH), "umount cgroup tree")
    if image is not None:  # its root: the image's layers under a private, bounded one
        roots = host_roots or []
        rootfs.enter_image(image.layers, uid, disk_mib, WORK_DIR, WORK_DIR, ptys, roots, userns_fd)
    else:
        _own_mounts(uid, disk_mib, ptys)
    if hosts is not None:  # names of the allowed hosts: no DNS needed
        _bind_file(hosts, "/etc/hosts")
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    _check(_c().prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    os.chdir(WORK_DIR)
    if image is not None:
        os.environ.update(image.env)
        with contextlib.suppress(OSError):  # the image's workdir, where it can be entered
            os.chdir(session_workdir(image))
    os.environ["HOME"] = os.environ["TMPDIR"] = WORK_DIR
    os.environ.pop("PWD", None)


def session_workdir(image: Image) -> str:
    """Where an image-backed session starts: the image's workdir, or its own work
    directory when the image names none (``/`` is not the session's to write)."""
    return image.workdir if image.workdir not in ("", "/") else WORK_DIR


def _own_mounts(uid: int, disk_mib: int, ptys: int) -> None:
    """A session's mounts without an image: its ``/proc``, work directory, ``/tmp``,
    ``/dev/shm`` and pseudo-terminals."""
    # A /proc of its own that shows only its uid's processes (not the other sessions').
    _mount("proc", "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, "hidepid=2")
    opts = f"size={disk_mib}m,mode=0700,uid={uid},gid={uid}"
    _mount("tmpfs", WORK_DIR, "tmpfs", _MS_NOSUID | _MS_NODEV, opts)
    if not os.statvfs("/tmp").f_flag & os.ST_RDONLY:  # no code under /tmp: the same tmpfs
        _mount(WORK_DIR, "/tmp", None, _MS_BIND, None)
    if os.path.isdir("/dev/shm"):
        _mount("tmpfs", "/dev/shm", "tmpfs", _MS_NOSUID | _MS_NODEV, "size=16m,mode=1777")
    # Pseudo-terminals of its own (``/dev/ptmx`` is bubblewrap's link to ``pts/ptmx``): at
    # most ``ptys``; none of the host's nor of another session's instance.
    _mount(
        "devpts", "/dev/pts", "devpts", _MS_NOSUID | _MS_NOEXEC,
        f"newinstance,ptmxmode=0666,mode=0620,max={ptys}",
    )  # fmt: skip


def _bind_file(text: str, target: str) -> None:
    """``text`` as the read-only file ``target`` in this mount namespace only."""
    staged = os.path.join(WORK_DIR, ".stadium-" + os.path.basename(target))
    with open(staged, "w") as f:
        f.write(text)
    os.chmod(staged, 0o644)
    with open(target, "a"):  # a mount point (an empty file the template's /etc keeps)
        pass
    _mount(staged, target, None, _MS_BIND, None)
    _mount("none", target, None, _MS_BIND | _MS_REMOUNT | _MS_RDONLY, None)
    os.unlink(staged)  # reachable as ``target`` only, read-only

"""The init (pid 1) of an ``--isolation vm`` guest: ``python -P -S vmguest.py``.

Runs inside the VM the worker started (:mod:`.vm`), from the initramfs :mod:`.vmimage`
built. Standard library only until the worker's settings set ``sys.path``. It:

1. mounts ``/proc``, ``/sys`` (read-only), ``/dev`` (devtmpfs) and a ``/tmp`` tmpfs, in
   which what the image holds under ``/tmp`` (code the worker runs from there: a checkout in
   ``/tmp``, a target in a temporary folder) stays visible, read-only (:func:`_tmp`);
2. loads the kernel modules of its channel to the worker (virtio-mmio, virtio-console);
3. opens the virtio-serial port named ``stadium`` (the worker's end is a socket of its
   own: the same framed messages as a sandboxed process's socket, :mod:`.wire`);
4. reads the settings frame (JSON: ``sys_path``, ``target``, ``env_kwargs``), fences
   itself off from what it will start (:func:`_fence`: not dumpable, no capability that
   reaches another process's memory or the kernel, ``/`` and ``/proc/sys`` read-only: a
   grader env's submission cannot reach its grader), imports the env's code and answers
   ``Ready`` (or ``Failed``);
5. waits for the ``go`` frame (fresh entropy, mixed into the kernel's pool: VMs restored
   from one snapshot must not share their random state), then serves one session
   (:func:`~stadium._server.isolation.template.env_process.session_main`) on the port.

The worker may snapshot the VM between 4 and 5 (:mod:`.vm`): every restored copy starts
at step 5. When the session's process ends, pid 1 ends, the kernel panics and the VM
exits (``panic=-1`` and QEMU's ``-no-reboot``): the worker sees its channel close.
"""

from __future__ import annotations

import ctypes
import glob
import json
import os
import struct
import sys
import time

_HEADER = struct.Struct("<I")
#: The largest settings frame the guest reads.
_SETTINGS_MAX = 64 * 1024 * 1024
_GUEST_DIR = os.path.dirname(os.path.abspath(__file__))
_MODULES = ("virtio_ring.ko", "virtio.ko", "virtio_mmio.ko", "virtio_console.ko")
_SYS_FINIT_MODULE = 313
_MS_RDONLY = 1
_MS_REMOUNT = 32
_MS_BIND = 4096
_MS_MOVE = 8192
_MS_REC = 16384
_PR_SET_DUMPABLE = 4
_PR_CAPBSET_DROP = 24
_CAP_V3 = 0x20080522
#: The capabilities no process of the guest holds once its init is set up (:func:`_fence`):
#: ``CAP_MKNOD``, ``CAP_SYS_MODULE``, ``CAP_SYS_RAWIO``, ``CAP_SYS_PTRACE``,
#: ``CAP_SYS_ADMIN``, ``CAP_SYS_BOOT``, ``CAP_PERFMON``, ``CAP_BPF``,
#: ``CAP_CHECKPOINT_RESTORE``.
_DROPPED = (27, 16, 17, 19, 21, 22, 38, 39, 40)
#: Where the guest's ``/tmp`` is made before it is moved onto ``/tmp``.
_NEW_TMP = _GUEST_DIR + "/tmp"
#: Seconds the guest waits for its port to appear, unless the worker says (below).
_PORT_WAIT_S = 180.0
#: The kernel command line's parameter that sets it: the worker's own boot bound (a guest
#: that is only slow must not end itself before the worker calls it slow).
_PORT_WAIT_ARG = "stadium.boot_s="


class Port:
    """The virtio-serial port as the session's loop wants a socket: ``recv``, ``sendall``."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def fileno(self) -> int:
        return self.fd

    def recv(self, size: int) -> bytes:
        return os.read(self.fd, min(size, 1 << 20))

    def sendall(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data)
        while view:
            n = os.write(self.fd, view[: 1 << 20])
            view = view[n:]

    def close(self) -> None:
        os.close(self.fd)


def _mount(
    libc: ctypes.CDLL, source: str, target: str, fstype: str | None, flags: int, data: str | None
) -> None:
    how = [x.encode() if x is not None else None for x in (source, target, fstype, data)]
    if libc.mount(how[0], how[1], how[2], flags, how[3]) != 0:
        raise OSError(ctypes.get_errno(), f"mount {target}")


def _mounts(libc: ctypes.CDLL) -> None:
    _mount(libc, "proc", "/proc", "proc", 0, None)
    _mount(libc, "sysfs", "/sys", "sysfs", _MS_RDONLY, None)
    _mount(libc, "devtmpfs", "/dev", "devtmpfs", 0, None)
    _tmp(libc)


def _tmp(libc: ctypes.CDLL) -> None:
    """The guest's ``/tmp``: a tmpfs of its own (sized later: ``--sandbox-disk``), in which
    each entry the image holds under ``/tmp`` (host paths: the worker's code may live
    there) is bound read-only, so that mounting it hides none of the image's files."""
    os.makedirs(_NEW_TMP, exist_ok=True)
    _mount(libc, "tmpfs", _NEW_TMP, "tmpfs", 0, "mode=1777")
    for name in sorted(os.listdir("/tmp")):
        held, there = os.path.join("/tmp", name), os.path.join(_NEW_TMP, name)
        if os.path.islink(held):
            os.symlink(os.readlink(held), there)
            continue
        if os.path.isdir(held):
            os.mkdir(there)
        else:
            open(there, "wb").close()  # a mount point
        _mount(libc, held, there, None, _MS_BIND | _MS_REC, None)
        _mount(libc, "", there, None, _MS_BIND | _MS_REMOUNT | _MS_RDONLY, None)
    _mount(libc, _NEW_TMP, "/tmp", None, _MS_MOVE, None)


def _fence(libc: ctypes.CDLL) -> None:
    """Put the env's process (this one, pid 1: a grader, say) out of reach of the processes
    it starts (a graded submission, uid 0 as it is), as a sandbox's changed uid does: it
    is not dumpable (no ``/proc/1/mem``, ``/proc/1/fd``, ``pidfd_getfd``, ``ptrace`` without
    ``CAP_SYS_PTRACE``), and neither it nor anything it starts holds :data:`_DROPPED` (those
    capabilities, dropped from its bounding set and its own sets, would reach it anyway:
    the kernel's memory, modules, a new kernel). The image's files and the kernel's
    settings are read-only (``/``, ``/proc/sys``; ``/sys`` is mounted so): no lazy import
    of the env's reads a file a child rewrote, no usermode helper (``core_pattern``,
    ``modprobe``) runs what a child named. Its ``/tmp`` stays writable, as a sandbox's."""
    _mount(libc, "", "/", None, _MS_REMOUNT | _MS_RDONLY, None)
    _mount(libc, "/proc/sys", "/proc/sys", None, _MS_BIND, None)
    _mount(libc, "", "/proc/sys", None, _MS_BIND | _MS_REMOUNT | _MS_RDONLY, None)
    for cap in _DROPPED:
        if libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), f"dropping capability {cap}")
    header = (ctypes.c_uint32 * 2)(_CAP_V3, 0)
    sets = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable; twice (caps 0-63)
    if libc.capget(header, sets) != 0:
        raise OSError(ctypes.get_errno(), "capget")
    for cap in _DROPPED:
        for which in range(3):
            sets[3 * (cap // 32) + which] &= ~(1 << (cap % 32)) & 0xFFFFFFFF
    if libc.capset(header, sets) != 0:
        raise OSError(ctypes.get_errno(), "capset")
    if libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "not dumpable")


def _modules(libc: ctypes.CDLL) -> None:
    for name in _MODULES:
        fd = os.open(os.path.join(_GUEST_DIR, name), os.O_RDONLY)
        try:
            if libc.syscall(_SYS_FINIT_MODULE, fd, b"", 0) != 0:
                errno = ctypes.get_errno()
                if errno != 17:  # EEXIST: built in
                    raise OSError(errno, f"loading {name}")
        finally:
            os.close(fd)


def _port_wait() -> float:
    try:
        with open("/proc/cmdline") as f:
            words = f.read().split()
    except OSError:
        return _PORT_WAIT_S
    for word in words:
        if word.startswith(_PORT_WAIT_ARG):
            try:
                return min(float(word[len(_PORT_WAIT_ARG) :]), 24 * 3600.0)
            except ValueError:
                break
    return _PORT_WAIT_S


def _port(name: str) -> int:
    deadline = time.monotonic() + _port_wait()
    while time.monotonic() < deadline:
        for path in glob.glob("/sys/class/virtio-ports/*/name"):
            try:
                with open(path) as f:
                    found = f.read().strip()
            except OSError:
                continue
            if found == name:
                dev = "/dev/" + os.path.basename(os.path.dirname(path))
                if os.path.exists(dev):
                    return os.open(dev, os.O_RDWR)
        time.sleep(0.001)
    raise OSError(f"no virtio port named {name!r}")


def _recv(port: Port, limit: int) -> bytes:
    head = _exact(port, _HEADER.size)
    (size,) = _HEADER.unpack(head)
    if size > limit:
        raise ValueError(f"a frame of {size} bytes (at most {limit})")
    return _exact(port, size)


def _exact(port: Port, size: int) -> bytes:
    buf = bytearray()
    while len(buf) < size:
        chunk = port.recv(size - len(buf))
        if not chunk:
            raise EOFError("the worker closed the channel")
        buf += chunk
    return bytes(buf)


def _output() -> None:
    """stdout and stderr: the guest's console (``hvc0``, read by the worker, bounded)."""
    try:
        fd = os.open("/dev/hvc0", os.O_WRONLY | os.O_NOCTTY)
    except OSError:
        fd = os.open(os.devnull, os.O_WRONLY)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    if fd > 2:
        os.close(fd)


def _last_words(text: str) -> None:
    """Say why the init ends where the worker reads it (:mod:`.vmconsole`): the kernel's
    log at its highest level, printed on the console before the panic that follows (what
    is written to the console's tty may be lost then), else stderr."""
    line = text.encode("utf-8", "backslashreplace")[:900].replace(b"\n", b" ")
    try:
        fd = os.open("/dev/kmsg", os.O_WRONLY)
        try:
            os.write(fd, b"<0>" + line + b"\n")
        finally:
            os.close(fd)
    except OSError:
        print(line.decode(), file=sys.stderr, flush=True)


def main() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    _mounts(libc)
    _modules(libc)
    port = Port(_port("stadium"))
    _output()
    settings = json.loads(_recv(port, _SETTINGS_MAX))
    disk = int(settings.get("disk_mib", 256))  # /tmp's size: --sandbox-disk
    if libc.mount(b"tmpfs", b"/tmp", b"tmpfs", _MS_REMOUNT, f"size={disk}m".encode()) != 0:
        raise OSError(ctypes.get_errno(), "remount /tmp")
    sys.path[:] = [str(p) for p in settings["sys_path"]]
    os.environ.update({"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/root", "LANG": "C.UTF-8"})
    os.chdir("/tmp")
    _fence(libc)
    from stadium._server.isolation.template import vmchild

    vmchild.serve(port, settings, _recv)


if __name__ == "__main__":
    try:
        main()
    except BaseException as exc:  # pid 1 ends: the kernel panics, the VM exits
        _last_words(f"stadium vm guest: {type(exc).__name__}: {exc}")
    os._exit(1)

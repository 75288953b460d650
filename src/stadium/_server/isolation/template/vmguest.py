"""The init (pid 1) of an ``--isolation vm`` guest: ``python -P -S vmguest.py``.

Runs inside the VM the worker started (:mod:`.vm`), from the initramfs :mod:`.vmimage`
built. Standard library only until the worker's settings set ``sys.path``. It:

1. mounts ``/proc``, ``/sys``, ``/dev`` (devtmpfs) and a ``/tmp`` tmpfs;
2. loads the kernel modules of its channel to the worker (virtio-mmio, virtio-console);
3. opens the virtio-serial port named ``stadium`` (the worker's end is a socket of its
   own: the same framed messages as a sandboxed process's socket, :mod:`.wire`);
4. reads the settings frame (JSON: ``sys_path``, ``target``, ``env_kwargs``), imports
   the env's code and answers ``Ready`` (or ``Failed``);
5. waits for the ``go`` frame (fresh entropy, mixed into the kernel's pool: VMs restored
   from one snapshot must not share their random state), then serves one session
   (:func:`~stadium._server.isolation.child.session_main`) on the port.

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
_MS_REMOUNT = 32
#: Seconds the guest waits for its port to appear.
_PORT_WAIT_S = 10.0


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


def _mounts(libc: ctypes.CDLL) -> None:
    for source, target, fstype, data in (
        (b"proc", b"/proc", b"proc", None),
        (b"sysfs", b"/sys", b"sysfs", None),
        (b"devtmpfs", b"/dev", b"devtmpfs", None),
        (b"tmpfs", b"/tmp", b"tmpfs", b"mode=1777"),
    ):
        if libc.mount(source, target, fstype, 0, data) != 0:
            raise OSError(ctypes.get_errno(), f"mount {target.decode()}")


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


def _port(name: str) -> int:
    deadline = time.monotonic() + _PORT_WAIT_S
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
    from stadium._server.isolation.template import vmchild

    vmchild.serve(port, settings, _recv)


if __name__ == "__main__":
    try:
        main()
    except BaseException as exc:  # pid 1 ends: the kernel panics, the VM exits
        _last_words(f"stadium vm guest: {type(exc).__name__}: {exc}")
    os._exit(1)

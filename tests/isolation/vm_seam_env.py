"""The VM hostile env (:mod:`.vm_env`) with what an env's code inside its guest, as the
guest's root, can send its worker past the session loop: raw frames on its channel, a
forged out-of-memory panic on its console, a flood of output, and a look at what of the
host its guest is given (``tests/isolation/test_vm_seam.py``)."""

from __future__ import annotations

import ctypes
import glob
import mmap
import os
import struct
import threading

from tests.isolation.vm_env import VmHostile

#: What a guest kernel prints when its memory is gone (:data:`...vm.OUT_OF_MEMORY`).
PANIC = b"Kernel panic - not syncing: System is deadlocked on memory"


def _channel() -> int:
    """The descriptor of the guest's virtio-serial port to the worker (held by its init)."""
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("/dev/vport"):
                return int(fd)
        except OSError:
            continue
    raise RuntimeError("no channel")


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _jit(passes: int, blocks: int = 1 << 19) -> int:
    """Run ``passes`` times a fresh chain of ``blocks`` basic blocks (``add rax, n``;
    ``jmp`` to the next): under QEMU's emulator each is one more translation block in its
    code buffer (a guest's RAM does not bound that buffer; ``tb-size`` does)."""
    code = mmap.mmap(-1, 3 + 8 * blocks, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    run = ctypes.CFUNCTYPE(ctypes.c_long)(ctypes.addressof(ctypes.c_char.from_buffer(code)))
    total = 0
    for n in range(passes):
        code[0:2] = b"\x31\xc0"  # xor eax, eax
        code[2 : 2 + 8 * blocks] = (b"\x48\x05" + struct.pack("<i", n + 1) + b"\xeb\x00") * blocks
        code[2 + 8 * blocks] = 0xC3  # ret
        total += run()
    return total


class VmSeam(VmHostile):
    """``forge_oom``, ``oversize``, ``flood``, ``jit``, ``shares``, and :class:`VmHostile`'s."""

    def _do(self, do: str, arg: str) -> str:
        if do == "forge_oom":  # the kernel's out-of-memory panic, said by the env, then out
            os.write(1, b"[   12.345678] " + PANIC + b"\n")  # stdout: the console
            try:  # and in the kernel's own log (the guest's root may write it)
                with open("/dev/kmsg", "wb", buffering=0) as kmsg:
                    kmsg.write(b"<0>" + PANIC + b"\n")
            except OSError:
                pass
            os._exit(1)
        if do == "oversize":  # a reply header claiming 2 GiB, straight on the channel
            os.write(_channel(), struct.pack("<I", 2**31))
            return "sent"
        if do == "flood":  # stdout (the guest's console) written as fast as it goes
            line = b"x" * 4095 + b"\n"

            def flood() -> None:
                while True:
                    os.write(1, line)

            threading.Thread(target=flood, daemon=True).start()
            return "flooding"
        if do == "jit":  # new guest code, pass after pass: each translated anew by TCG
            return str(_jit(int(arg or 8)))
        if do == "shares":  # what of the host the guest has: devices, mounts, sockets
            ids = sorted(_read(p).strip() for p in glob.glob("/sys/bus/virtio/devices/*/device"))
            mounts = sorted({line.split()[2] for line in _read("/proc/mounts").splitlines()})
            nets = sorted(os.listdir("/sys/class/net"))
            vsock = os.path.exists("/dev/vsock") or os.path.exists("/dev/vhost-vsock")
            return (
                f"virtio={','.join(ids)} fs={','.join(mounts)} net={','.join(nets)} vsock={vsock}"
            )
        return super()._do(do, arg)

"""The hostile env of ``hostile.py`` plus what an env might try against the kernel and its
neighbours: each step's ``text`` names what happened (``ok``, or the errno's name), so the
tests tell a seccomp refusal (``EPERM``) from the kernel's own answer."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import signal
import socket
import threading
import time

from tests.isolation.hostile import Hostile

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long

PTRACE_ATTACH = 16
CLONE_NEWUSER = 0x10000000
#: x86_64 numbers of the calls made raw below (no libc wrapper in Python).
SYS = {
    "bpf": 321, "perf_event_open": 298, "add_key": 248, "clone3": 435, "io_uring_setup": 425,
    "fanotify_init": 300,
}  # fmt: skip


def _errno(rc: int) -> str:
    if rc >= 0:
        return "ok"
    return errno.errorcode.get(ctypes.get_errno(), str(ctypes.get_errno()))


class KernelHostile(Hostile):
    def _do(self, do: str, arg: str) -> str:
        if do == "status":  # the lines of /proc/self/status the tests look at
            with open("/proc/self/status") as f:
                lines = f.read().splitlines()
            return "\n".join(x for x in lines if x.startswith(("Seccomp:", "NSpid:", "Pid:")))
        if do == "pidns":  # the pid namespace it is in
            return os.readlink("/proc/self/ns/pid")
        if do == "zombies":  # processes it can see that ended and were not reaped
            dead = []
            for p in os.listdir("/proc"):
                if p.isdigit():
                    with contextlib.suppress(OSError), open(f"/proc/{p}/stat") as f:
                        if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                            dead.append(p)
            return ",".join(dead)
        if do == "orphan":  # a process whose parent exits first: the namespace's init reaps it
            pid = os.fork()
            if pid == 0:
                if os.fork() == 0:
                    time.sleep(float(arg or 0))
                    os._exit(0)
                os._exit(0)
            os.waitpid(pid, 0)
            return "orphaned"
        if do == "init-mem":  # take over its family's init (outside the cgroups) by its memory
            try:
                with open("/proc/1/mem", "r+b"):
                    return "ok"
            except OSError as exc:
                return errno.errorcode.get(exc.errno or 0, str(exc.errno))
        if do == "pids":  # every process this session can see
            return ",".join(sorted((p for p in os.listdir("/proc") if p.isdigit()), key=int))
        if do == "ptrace":  # attach to pid ``arg`` (another session's, or "child": its own)
            if arg == "child":
                pid = os.fork()
                if pid == 0:
                    time.sleep(60)
                    os._exit(0)
                try:
                    return _errno(_libc.ptrace(PTRACE_ATTACH, pid, None, None))
                finally:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
            return _errno(_libc.ptrace(PTRACE_ATTACH, int(arg), None, None))
        if do == "unshare-user":
            return _errno(_libc.unshare(CLONE_NEWUSER))
        if do == "mount":
            os.makedirs("/sandbox/mnt", exist_ok=True)
            return _errno(_libc.mount(b"none", b"/sandbox/mnt", b"tmpfs", 0, None))
        if do == "bpf":  # BPF_MAP_CREATE with no attributes
            return _errno(_libc.syscall(SYS["bpf"], 0, None, 0))
        if do == "perf":  # perf_event_open(NULL, self, any cpu)
            return _errno(_libc.syscall(SYS["perf_event_open"], None, 0, -1, -1, 0))
        if do == "keyctl":  # add_key("user", ...) to the process keyring
            rc = _libc.syscall(SYS["add_key"], b"user", b"stadium", b"v", 1, -2)
            return _errno(rc)
        if do == "clone3":
            return _errno(_libc.syscall(SYS["clone3"], None, 0))
        if do == "fanotify":  # fanotify_init(FAN_CLASS_NOTIF, O_RDONLY)
            return _errno(_libc.syscall(SYS["fanotify_init"], 0, 0))
        if do == "personality":  # personality(int(arg, 16)); the query 0xffffffff changes none
            return _errno(_libc.personality(ctypes.c_ulong(int(arg, 16))))
        if do == "io_uring":
            return _errno(_libc.syscall(SYS["io_uring_setup"], 1, None))
        if do == "socket":  # family number ``arg``, raw (netlink, packet) or stream
            family = int(arg)
            raw = family in (socket.AF_NETLINK, socket.AF_PACKET)
            kind = socket.SOCK_RAW if raw else socket.SOCK_STREAM
            try:
                socket.socket(family, kind, 0).close()
            except OSError as exc:
                return errno.errorcode.get(exc.errno or 0, str(exc))
            return "ok"
        if do == "kill-all":
            try:
                os.kill(-1, signal.SIGKILL)
            except OSError as exc:
                return errno.errorcode.get(exc.errno or 0, str(exc))
            return "ok"
        if do == "spawn":  # what stays allowed: a thread (clone3 -> clone) and a subprocess
            box: list[int] = []
            t = threading.Thread(target=lambda: box.append(1))
            t.start()
            t.join()
            pid = os.posix_spawn("/bin/sh", ["sh", "-c", "exit 7"], {})
            _, status = os.waitpid(pid, 0)
            return f"thread {len(box)} exit {os.waitstatus_to_exitcode(status)}"
        return super()._do(do, arg)

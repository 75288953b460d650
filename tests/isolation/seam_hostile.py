"""The kernel-hostile env plus what sandboxed code might try through its descriptors and
its inheritance: the server's stdout, stderr and terminal, the host's pseudo-terminals,
the template's environment block. Each step's ``text`` names what happened."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import pty
import stat
import subprocess
import termios
import time

from tests.isolation.kernel_hostile import KernelHostile


def _err(exc: OSError) -> str:
    return errno.errorcode.get(exc.errno or 0, str(exc.errno))


class SeamHostile(KernelHostile):
    def __init__(self, secret: str = "") -> None:
        super().__init__()
        self.secret = secret
        self.held: list[int] = []

    def _do(self, do: str, arg: str) -> str:
        if do == "fds":  # what fds 0, 1, 2 are: "dev:ino:kind" each
            out = []
            for fd in (0, 1, 2):
                info = os.fstat(fd)
                kind = (
                    "fifo"
                    if stat.S_ISFIFO(info.st_mode)
                    else "chr"
                    if stat.S_ISCHR(info.st_mode)
                    else "reg"
                    if stat.S_ISREG(info.st_mode)
                    else "other"
                )
                out.append(f"{info.st_dev}:{info.st_ino}:{kind}:{os.isatty(fd)}")
            return ",".join(out)
        if do == "read-typed":  # read what an operator typed on the terminal behind fd 1
            os.set_blocking(1, False)
            try:
                return "read " + os.read(1, 4096).decode(errors="replace")
            except OSError as exc:
                return _err(exc)
        if do == "echo-off":  # turn the terminal's echo off
            try:
                attrs = termios.tcgetattr(1)
                attrs[3] &= ~termios.ECHO
                termios.tcsetattr(1, termios.TCSANOW, attrs)
                return "ok"
            except (OSError, termios.error) as exc:
                return errno.errorcode.get(exc.args[0], str(exc))
        if do == "tiocsti":  # push a character into the terminal's input on fds 0..2
            out = []
            for fd in (0, 1, 2):
                try:
                    fcntl.ioctl(fd, termios.TIOCSTI, b"x")
                    out.append("ok")
                except OSError as exc:
                    out.append(_err(exc))
            return ",".join(out)
        if do == "dev-tty":
            try:
                os.close(os.open("/dev/tty", os.O_RDWR))
                return "ok"
            except OSError as exc:
                return _err(exc)
        if do == "say":  # ``arg`` on stdout and stderr; through /proc/self/fd/1 if it opens
            os.write(1, arg.encode() + b"\n")
            os.write(2, arg.encode() + b"\n")
            try:
                with open("/proc/self/fd/1", "w") as f:
                    f.write(arg + " via proc\n")
            except OSError as exc:  # not dumpable (it changed uid): /proc/self is root's
                return f"said, proc {_err(exc)}"
            return "said, proc ok"
        if do == "flood":  # write up to ``arg`` bytes to stdout for at most 1 s, never blocking
            total, end = int(arg), time.monotonic() + 1.0
            os.set_blocking(1, False)
            chunk = b"flood " * 1000 + b"\n"
            written = 0
            while written < total and time.monotonic() < end:
                try:
                    written += os.write(1, chunk)
                except BlockingIOError:
                    time.sleep(0.001)
            os.set_blocking(1, True)
            return str(written)
        if do == "grab-ptys":  # open pseudo-terminals (/dev/ptmx) until refused; kept open
            while len(self.held) < 4096:
                try:
                    self.held.append(os.open("/dev/ptmx", os.O_RDWR | os.O_NOCTTY))
                except OSError as exc:
                    return f"{len(self.held)} {_err(exc)}"
            return f"{len(self.held)} ok"
        if do == "openpty":
            try:
                master, slave = pty.openpty()
            except OSError as exc:
                return _err(exc)
            os.close(master)
            os.close(slave)
            return "ok"
        if do == "stack-has":  # whether ``arg`` is in its stack (the initial environment
            # block sits at its top; /proc/self/environ is root's: it is not dumpable)
            with open("/proc/self/maps") as f:
                line = next(x for x in f if x.rstrip().endswith("[stack]"))
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            return str(arg.encode() in ctypes.string_at(start, end - start))
        if do == "child-env":  # an exec'd child's environment
            child = subprocess.run(["/usr/bin/env"], capture_output=True, text=True).stdout
            return ",".join(sorted(x.split("=")[0] for x in child.splitlines()))
        if do == "secret":
            return self.secret
        return super()._do(do, arg)

    def close(self) -> None:
        for fd in self.held:
            with contextlib.suppress(OSError):
                os.close(fd)

"""Snapshots of ``--isolation vm`` guests: boot once, restore per session.

The worker boots one *template* VM per env (:mod:`.vm`) with its RAM in a file
(``memory-backend-file``, ``share=on``, in a ``0700`` folder of ``/dev/shm``), lets its
guest import the env's code (``Ready``), stops it and saves its device state through
QMP (``migrate`` to a descriptor the worker passes with ``getfd``) with the
``x-ignore-shared`` capability: the RAM is not copied into the stream, the file holds it.
Each session's VM then starts with ``-incoming`` from that state, its RAM the same file
mapped *private* (``share=off``): restored VMs share the template's pages copy-on-write
and copy only the pages they write. Every restored guest waits for the worker's ``go``
(fresh entropy: :mod:`.vmchild`) before it builds its env.

``fork`` (:func:`copy`) saves a running session's VM whole, its RAM included (a restored
VM's RAM is its own: private pages over the template's), paused meanwhile, into a file
of the template's folder, then runs it on; the copy is a VM restored from that file as
any session's is, continuing where its parent was.

QMP here is a socket pair (``-chardev socket,fd=``), read without blocking the loop, each
reply bounded (:data:`QMP_MAX`), decoded as JSON and checked for the shape expected (an
object; its ``return`` an object, its ``error`` an object); anything else is refused with
an :class:`~stadium.ExecutionError`, as QEMU's fault: a QEMU the guest has taken over
through its device models writes these lines (issue #30: nothing out of a VM is trusted).
"""

from __future__ import annotations

import asyncio
import dataclasses
import glob
import json
import os
import shutil
import socket
import tempfile
from typing import Any

from stadium._errors import ExecutionError

#: The longest QMP line read (a reply or an event).
QMP_MAX = 1 << 20
#: Seconds a template's state may take to save.
SAVE_S = 60.0
#: The bytes per second a fork's copy is written at (QEMU's default, 32 MiB/s, would take
#: seconds for a guest's RAM): as fast as it goes.
COPY_BANDWIDTH = 1 << 40


@dataclasses.dataclass(frozen=True, slots=True)
class Snapshot:
    """A template's saved state: its RAM file and its device state file."""

    folder: str
    ram: str
    state: str
    memory_mib: int

    def restore_argv(self, qmp_fd: int) -> list[str]:
        """QEMU arguments restoring this snapshot: its RAM mapped private, QMP on
        ``qmp_fd``, waiting for :func:`restore` (``-incoming defer``: the capability
        ``x-ignore-shared`` is set through QMP first)."""
        return [
            "-object", f"memory-backend-file,id=ram,size={self.memory_mib}M,"
            f"mem-path={self.ram},share=off",
            "-chardev", f"socket,id=qmp,fd={qmp_fd}", "-mon", "chardev=qmp,mode=control",
            "-incoming", "defer",
        ]  # fmt: skip

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def new_folder(memory_mib: int) -> str:
    """A ``0700`` folder for one template's files: in ``/dev/shm`` (RAM) when it has room
    for the guest's whole RAM, else in ``/var/tmp`` (the page cache holds it)."""
    base = "/var/tmp"
    try:
        shm = os.statvfs("/dev/shm")
        if shm.f_bavail * shm.f_frsize > (memory_mib + 64) << 20:
            base = "/dev/shm"
    except OSError:
        pass
    sweep()
    return tempfile.mkdtemp(prefix=f"stadium-vm-{os.getpid()}-", dir=base)


def sweep() -> None:
    """Remove templates' folders left by workers that died (their pid in the name)."""
    for base in ("/dev/shm", "/var/tmp"):
        for folder in glob.glob(os.path.join(base, "stadium-vm-*-*")):
            pid = os.path.basename(folder).split("-")[2]
            if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
                shutil.rmtree(folder, ignore_errors=True)


def template_argv(folder: str, memory_mib: int, qmp_fd: int) -> list[str]:
    """QEMU arguments of a template: its RAM in ``folder/ram`` (shared: the file is the
    RAM) and QMP on ``qmp_fd``."""
    return [
        "-object", f"memory-backend-file,id=ram,size={memory_mib}M,"
        f"mem-path={os.path.join(folder, 'ram')},share=on",
        "-chardev", f"socket,id=qmp,fd={qmp_fd}", "-mon", "chardev=qmp,mode=control",
    ]  # fmt: skip


class Qmp:
    """A QMP connection over a socket (non-blocking; one command at a time)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        sock.setblocking(False)
        self._buf = b""

    async def _line(self) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        while b"\n" not in self._buf:
            if len(self._buf) > QMP_MAX:
                raise ExecutionError("QEMU's QMP sent a line over its limit")
            data = await loop.sock_recv(self.sock, 65536)
            if not data:
                raise ExecutionError("QEMU's QMP closed (the template VM ended)")
            self._buf += data
        line, self._buf = self._buf.split(b"\n", 1)
        try:
            msg = json.loads(line)
        except (ValueError, RecursionError) as exc:  # not JSON, or nested past the parser
            what = type(exc).__name__
            raise ExecutionError(f"QEMU's QMP sent what is not JSON ({what})") from None
        if not isinstance(msg, dict):
            raise ExecutionError("QEMU's QMP sent what is not an object")
        return msg

    async def greet(self) -> None:
        await self._line()  # the greeting
        await self.command("qmp_capabilities")

    async def command(self, name: str, fd: int = -1, **arguments: Any) -> dict[str, Any]:
        """Run ``name``; its ``return``, an object (events on the way are skipped). ``fd``:
        a descriptor sent along (``getfd``).

        Raises:
            ExecutionError: QEMU refused it, or its QMP sent what is not a reply.
        """
        body = json.dumps({"execute": name, "arguments": arguments}).encode() + b"\n"
        if fd >= 0:
            socket.send_fds(self.sock, [body], [fd])
        else:
            await asyncio.get_running_loop().sock_sendall(self.sock, body)
        for _ in range(1000):
            msg = await self._line()
            if "return" in msg:
                said = msg["return"]
                if not isinstance(said, dict):
                    raise ExecutionError(f"QEMU's QMP sent a {name} reply that is not an object")
                return said
            if "error" in msg:
                error = msg["error"]
                desc = error.get("desc") if isinstance(error, dict) else None
                if not isinstance(desc, str):
                    raise ExecutionError(f"QEMU's QMP sent a {name} error that is not an object")
                raise ExecutionError(f"QEMU refused {name}: {desc[:500]}")
        raise ExecutionError(f"QEMU's QMP sent no reply to {name}")


async def restore(qmp: Qmp, state_fd: int) -> None:
    """Load the saved state (from ``state_fd``, a descriptor QEMU inherited) into a VM
    started with :meth:`Snapshot.restore_argv`; it runs once loaded."""
    await qmp.greet()
    await qmp.command(
        "migrate-set-capabilities",
        capabilities=[{"capability": "x-ignore-shared", "state": True}],
    )
    await qmp.command("migrate-incoming", uri=f"fd:{state_fd}")
    for _ in range(int(SAVE_S / 0.002)):  # what the channel gets before this is lost
        status = (await qmp.command("query-migrate")).get("status")
        if status == "completed":  # paused, as the template was when saved
            await qmp.command("cont")
            return
        if status in ("failed", "cancelled"):
            raise ExecutionError(f"restoring a VM {status}")
        await asyncio.sleep(0.002)
    raise ExecutionError(f"restoring a VM took over {SAVE_S:g} s")


async def copy(qmp: Qmp, path: str, within: float) -> None:
    """Save the whole state of a running VM (its QMP: ``qmp``, greeted) into ``path`` (a
    new file); the VM is paused meanwhile and runs on after, whatever happened.

    Raises:
        ExecutionError: QEMU refused, the copy failed, or took over ``within`` seconds.
    """
    await qmp.command("migrate-set-parameters", **{"max-bandwidth": COPY_BANDWIDTH})
    await qmp.command("stop")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        if not await _migrate(qmp, fd, "fork", within, 0.002, "copying the VM's state"):
            await qmp.command("migrate_cancel")
            raise ExecutionError(f"copying the VM's state took over {within:g} s")
    finally:
        await qmp.command("cont")


async def _migrate(qmp: Qmp, fd: int, name: str, within: float, poll: float, what: str) -> bool:
    """Hand QEMU ``fd`` (closed here) and migrate the stopped VM's state into it: whether it
    completed within ``within`` seconds (polled every ``poll``).

    Raises:
        ExecutionError: the migration failed or was cancelled.
    """
    try:
        await qmp.command("getfd", fd=fd, fdname=name)
    finally:
        os.close(fd)
    await qmp.command("migrate", uri=f"fd:{name}")
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while loop.time() < deadline:
        status = (await qmp.command("query-migrate")).get("status")
        if status == "completed":
            return True
        if status in ("failed", "cancelled"):
            raise ExecutionError(f"{what} {status}")
        await asyncio.sleep(poll)
    return False


async def save(qmp: Qmp, folder: str, memory_mib: int) -> Snapshot:
    """Stop the template and save its device state (its RAM stays in its file)."""
    await qmp.greet()
    await qmp.command(
        "migrate-set-capabilities",
        capabilities=[{"capability": "x-ignore-shared", "state": True}],
    )
    await qmp.command("stop")
    state = os.path.join(folder, "state")
    fd = os.open(state, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    if await _migrate(qmp, fd, "snapshot", SAVE_S, 0.02, "saving the template VM's state"):
        return Snapshot(folder, os.path.join(folder, "ram"), state, memory_mib)
    raise ExecutionError(f"saving the template VM's state took over {SAVE_S:g} s")

"""``--isolation vm``: each session's env in a microVM of its own (QEMU ``microvm``, KVM).

A :class:`VmIsolation` is the worker's :class:`~.isolation.Isolation` with a VM where the
others fork a process: the same warm pool, proxy env (:mod:`.proxy`), limits, errors and
metrics; the same wire (:mod:`.wire`), unchanged. Per session the worker starts one QEMU
process (``-M microvm``, KVM, no network device, no disk: :func:`qemu_argv`) whose guest
boots Debian's cloud kernel with the initramfs :mod:`.vmimage` built from the worker's own
interpreter and code. The guest's pid 1 (:mod:`.vmguest`) serves the session on a
virtio-serial port; QEMU's end of it is one end of a socket pair whose other end is the
:class:`~.proc.EnvProcess`'s socket, so the worker reads a VM exactly as it reads a
sandboxed process: non-blocking, every frame bounded and decoded into its type.

Before the session's frames, two of the VM's own: the worker sends the settings (JSON:
``sys_path``, ``target``, ``env_kwargs``), the guest answers ``Ready`` once it has
imported the env's code (or ``Failed``), the worker sends ``go`` (fresh entropy: see
:mod:`.vmchild`), and the guest's ``Hello`` follows once the env is built.

The VM's key is its QEMU process's pid; the worker holds a pidfd on it, reaps it when it
exits (its reader on the loop), and kills it (SIGKILL) at a limit or at release. A guest
that dies (a kernel panic, the env's process ending: pid 1) ends its QEMU process
(``panic=-1``, ``-no-reboot``): its socket closes and the session gets ``ENV_CRASHED``;
no other VM is touched. Each VM's output (QEMU's errors, the guest's console) is read on
the loop and its tail kept (:mod:`.vmconsole`): a VM that ends while it boots or starts
says why in its error (QEMU's exit status, its last output), one that ends during a
session in the log; a VM that is only slow (past :data:`VM_BOOT_S`) is told apart.

``fork`` copies a session's VM whole through the QMP connection kept to each restored VM
(:func:`.vmsnap.copy`) and restores the copy as a new VM (:meth:`VmIsolation.adopt_fork`).

Limits: ``--sandbox-memory`` is the guest's RAM (plus the initramfs it unpacks),
``--sandbox-cpus`` its vCPUs (rounded up), ``--sandbox-disk`` its ``/tmp``, the call and
episode timeouts kill the VM. The guest has no network device at all. A guest out of
memory panics (its env is its init, which its OOM killer spares): ``LIMIT_EXCEEDED``
(``memory``), told by the panic's line in its console, believed only when its QEMU's peak
memory shows the guest filled its RAM (:data:`FILLED`: the guest's root can print the
line). Under TCG, QEMU's code buffer is bounded (:data:`TB_MIB`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import math
import os
import shutil
import socket
import subprocess
import sys
import time

import msgspec

from stadium._errors import (
    ConfigError,
    EnvCrashedError,
    ExecutionError,
    LimitExceededError,
    SnapshotError,
    StadiumError,
)
from stadium._server.isolation import wire
from stadium._server.isolation.worker import vmimage, vmsnap
from stadium._server.isolation.worker.isolation import Isolation
from stadium._server.isolation.worker.output import escape
from stadium._server.isolation.worker.proc import EnvProcess, Gone
from stadium._server.isolation.worker.template_host import (
    EXIT_REPORT_S,
    FORK_S,
    TEMPLATE_START_S,
    IsolationConfig,
    _ShutDown,
)
from stadium._server.isolation.worker.vmconsole import Console, exit_text, why

log = logging.getLogger("stadium.isolation")

QEMU = "qemu-system-x86_64"
#: Seconds a VM has to boot, import the env's code and say ``Ready`` (or, restored, to
#: build its env and say ``Hello``); past it, it is killed as slow, not as crashed.
#: ``STADIUM_VM_BOOT_S`` sets it (an emulated guest on a loaded host boots in minutes).
VM_BOOT_S = float(os.environ.get("STADIUM_VM_BOOT_S", "0") or 0) or 3 * TEMPLATE_START_S
#: QEMU's own confinement: its seccomp filter (no exec, no resource changes, no obsolete
#: calls), and, once set up, the uid ``nobody`` (its files and descriptors are open by
#: then; privilege changes stay allowed by the filter only so that it can drop to it).
HARDENING = (
    "-sandbox", "on,obsolete=deny,spawn=deny,resourcecontrol=deny", "-runas", "nobody",
)  # fmt: skip
#: MiB of QEMU's emulator's code buffer (``tb-size``): QEMU 7.2's default is 1 GiB, which
#: a guest running new code fills (QEMU grew by 1,235 MiB past its 512 MiB guest); this
#: bounds what a VM's QEMU holds past its guest's RAM (and what a forged out-of-memory line
#: can add to its peak, :data:`FILLED`). 32 MiB was QEMU's own default until 5.0.
TB_MIB = 64
#: Seconds a VM's ``fork`` may take (its whole RAM copied to a file and restored: seconds
#: under TCG on a loaded host), where a process's takes ``FORK_S``; still within the call's
#: time limit.
VM_FORK_S = 6 * FORK_S
#: What a guest kernel says when its memory is gone: the env, its init, cannot be killed by
#: its OOM killer, so the kernel panics with it (``LIMIT_EXCEEDED memory``, not a crash).
OUT_OF_MEMORY = b"Kernel panic - not syncing: System is deadlocked on memory"
#: The share of a VM's RAM (``--sandbox-memory`` and its initramfs) its QEMU must have held
#: (its peak resident memory, ``wait4``'s: the host kernel's word), and at least the limit,
#: for its guest's :data:`OUT_OF_MEMORY` line to be believed: the guest's root can print
#: that line (on its console, in its kernel's log) but not fill its RAM without filling it.
#: Measured under TCG, 512 MiB limit, a 653 MiB RAM: a guest out of memory held 663 MiB,
#: one that only said so 361 (the pages it touched since its restore, QEMU's own), and at
#: most :data:`TB_MIB` more by running new code.
FILLED = 0.85
MIB = 1 << 20
#: Seconds to wait for a killed VM's QEMU process to be reaped.
REAP_S = 5.0
_READY: msgspec.msgpack.Decoder[wire.Ready | wire.Failed] = msgspec.msgpack.Decoder(
    wire.Ready | wire.Failed
)
_GO = msgspec.msgpack.Encoder()


def accelerator() -> str | None:
    """How VMs run here: ``kvm`` (hardware virtualization), ``tcg`` (QEMU's emulator: this
    host's ``/dev/kvm`` is PVM, the pagetable-based software hypervisor, which cannot run a
    stock guest kernel: it fails to emulate its ``cmpxchg16b`` at boot), or ``None`` (no
    ``/dev/kvm`` at all). ``STADIUM_VM_ACCEL`` (``kvm`` or ``tcg``) overrides it."""
    try:
        fd = os.open("/dev/kvm", os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return None
    os.close(fd)
    forced = os.environ.get("STADIUM_VM_ACCEL")
    if forced in ("kvm", "tcg"):
        return forced
    return "tcg" if os.path.isdir("/sys/module/kvm_pvm") else "kvm"


def vm_unavailable() -> str | None:
    """Why ``--isolation vm`` cannot run here (``None``: it can)."""
    if os.geteuid() != 0:
        return "it needs root (to open /dev/kvm and read the guest kernel)"
    if accelerator() is None:
        return "/dev/kvm cannot be opened: this machine offers no KVM"
    if shutil.which(QEMU) is None:
        return f"{QEMU} is not installed: make vm-deps (apt-get install qemu-system-x86)"
    if vmimage.guest_kernel() is None:
        return "no guest kernel: make vm-deps (apt-get install linux-image-cloud-amd64)"
    return None


def qemu_argv(
    image: vmimage.GuestImage,
    memory_mib: int,
    cpus: float,
    chan_fd: int,
    out_fd: int,
    accel: str = "kvm",
    ram_file: bool = False,
) -> list[str]:
    """The QEMU command of one VM: ``microvm``, no network, no disk, no devices but the
    virtio-serial port (``chan_fd``, the session's channel) and the console (``out_fd``,
    its output, :mod:`.vmconsole`; -1: none). ``kvm``: no legacy timers (kvmclock);
    ``tcg``: the PIT, the TSC's rate given (the emulator cannot calibrate it), and its code
    buffer bounded (:data:`TB_MIB`)."""
    console = (
        ["-chardev", f"socket,id=out,fd={out_fd}", "-device", "virtconsole,chardev=out"]
        if out_fd >= 0
        else ["-chardev", "null,id=out", "-device", "virtconsole,chardev=out"]
    )
    if accel == "kvm":
        machine, cpu, extra = (
            "microvm,pit=off,pic=off,rtc=off,isa-serial=off",
            "host,-arch-capabilities",
            "",
        )
    else:
        machine, cpu, extra = "microvm,isa-serial=off", "max", "tsc_early_khz=2000000"
    if ram_file:  # the RAM is the memory-backend-file object named ram (:mod:`.vmsnap`)
        machine += ",memory-backend=ram"
    accel_opts = accel if accel == "kvm" else f"tcg,tb-size={TB_MIB}"
    return [
        QEMU, "-M", machine, "-accel", accel_opts, "-cpu", cpu, "-m", str(memory_mib),
        "-smp", str(max(1, math.ceil(cpus))), "-nodefaults", "-no-user-config",
        "-display", "none", "-no-reboot", *HARDENING,
        "-kernel", image.kernel, "-initrd", image.initrd,
        "-append", image.cmdline(f"{extra} stadium.boot_s={VM_BOOT_S:g}"),
        "-chardev", f"socket,id=chan,fd={chan_fd}",
        "-device", "virtio-serial-device,max_ports=2",
        "-device", "virtserialport,chardev=chan,name=stadium", *console,
    ]  # fmt: skip


class VmIsolation(Isolation):
    """A worker's isolated sessions, one microVM each (see the module docstring)."""

    fork_s = VM_FORK_S

    def __init__(self, config: IsolationConfig) -> None:
        super().__init__(config)
        self.image: vmimage.GuestImage | None = None
        self._sys_path = [os.path.abspath(p) for p in sys.path if p]
        self.accel = accelerator() or "kvm"
        """``kvm`` or ``tcg`` (see :func:`accelerator`)."""
        self.snapshots = os.environ.get("STADIUM_VM_SNAPSHOT", "on") != "off"
        """Start each session's VM from the template's snapshot (:mod:`.vmsnap`); off: boot
        each one (``STADIUM_VM_SNAPSHOT=off``)."""
        self.snapshot: vmsnap.Snapshot | None = None
        self.boot_seconds = 0.0
        """The template VM's boot to ``Ready`` (or the last cold VM's)."""
        self._built: asyncio.Future[None] | None = None
        self._qemu: dict[int, subprocess.Popen[bytes]] = {}
        """Each VM's QEMU process, by its key (its pid), until reaped."""
        self._qmps: dict[int, vmsnap.Qmp] = {}
        """Each restored VM's QMP connection (kept for ``fork``), by its key."""
        self._copies = itertools.count(1)
        self.peaks: dict[int, int] = {}
        """Each ended VM's QEMU's peak resident memory (bytes, ``wait4``'s), by its key,
        until its death is told."""
        self.consoles: dict[int, Console] = {}
        """Each VM's output's tail (:mod:`.vmconsole`), by its key, until it is released
        or its death is told."""

    def start(self) -> None:
        """Build (or find) the guest image and the template's snapshot, then fill the
        warm pool."""
        if self.accel == "tcg":
            log.warning(
                "--isolation vm runs its VMs in QEMU's emulator (TCG): this host's KVM cannot "
                "run a stock guest kernel; each session still has a kernel of its own"
            )
        self._ensure_template()
        self.refill()

    def _ensure_template(self) -> asyncio.Future[None]:
        """The guest image (built off the loop) and, with snapshots, the template's saved
        state: made once, again only after a failure."""
        if self._closed:
            raise _ShutDown("the worker's isolation is shut down; no VM starts")
        if self._built is None or (self._built.done() and self._built.exception()):
            loop = self._loop = asyncio.get_running_loop()
            self._built = loop.create_future()
            task = loop.create_task(self._prepare(self._built))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return self._built

    async def _prepare(self, built: asyncio.Future[None]) -> None:
        try:
            loop = asyncio.get_running_loop()
            self.image = await loop.run_in_executor(
                None, vmimage.build_image, self._sys_path, self.config.target,
                self.config.env_kwargs,
            )  # fmt: skip
            if self.snapshots and self.snapshot is None:
                self.snapshot = await self._make_template()
        except BaseException as exc:
            if not built.done():
                built.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
            return
        if not built.done():
            built.set_result(None)

    def _memory(self) -> int:
        assert self.image is not None
        return self.limits.memory_mib + self.image.initrd_mib

    async def _make_template(self) -> vmsnap.Snapshot:
        """Boot the template VM to ``Ready`` and save it (:mod:`.vmsnap`)."""
        memory = self._memory()
        folder = vmsnap.new_folder(memory)
        qmp_ours, qmp_theirs = socket.socketpair()
        try:
            extra = vmsnap.template_argv(folder, memory, qmp_theirs.fileno())
            proc = self._launch(extra, [qmp_theirs.fileno()], track=False)
        except BaseException:
            qmp_ours.close()
            vmsnap.Snapshot(folder, "", "", 0).remove()
            raise
        finally:
            qmp_theirs.close()
        try:
            await self._boot(proc)
            return await vmsnap.save(vmsnap.Qmp(qmp_ours), folder, memory)
        except BaseException:
            vmsnap.Snapshot(folder, "", "", 0).remove()
            raise
        finally:
            qmp_ours.close()
            await self._end(proc)

    def _launch(self, extra: list[str], fds: list[int], track: bool = True) -> EnvProcess:
        """Start one VM's QEMU process (``extra``: its snapshot or template arguments);
        its channel is the returned process's socket."""
        image, loop = self.image, self._loop
        assert image is not None
        assert loop is not None
        ours, theirs = socket.socketpair()
        out_r, out_w = socket.socketpair()  # its output: always read, its tail kept
        memory = self._memory()
        argv = qemu_argv(
            image, memory, self.limits.cpus, theirs.fileno(), out_w.fileno(), self.accel,
            ram_file=bool(extra),
        ) + extra  # fmt: skip
        try:
            qemu = _popen(argv, [theirs.fileno(), *fds, out_w.fileno()], out_w.fileno())
        except OSError as exc:
            ours.close()
            out_r.close()
            raise ExecutionError(f"could not start {QEMU}: {exc}") from None
        finally:
            theirs.close()
            out_w.close()
        key = qemu.pid
        self._qemu[key] = qemu
        proc = self._process(ours)
        proc.pid = key
        console = Console(
            loop, out_r.detach(), f"vm {key}" if track else "template vm",
            forward=self.config.output == "log", on_close=lambda: self.outputs.pop(key, None),
        )  # fmt: skip
        self.outputs[key] = self.consoles[key] = console
        if track:
            self._track(proc)
            if proc.pidfd >= 0:
                loop.add_reader(proc.pidfd, self._reap, key)
        return proc

    async def _end(self, proc: EnvProcess) -> None:
        """Kill and reap an untracked VM (the template), waiting on the loop without
        blocking it (at most ``EXIT_REPORT_S``; past it ``subprocess`` reaps it later)."""
        proc.close()
        self.consoles.pop(proc.pid, None)
        qemu = self._qemu.pop(proc.pid, None)
        if qemu is not None:
            qemu.kill()
            await _wait_status(qemu)

    async def _boot(self, proc: EnvProcess) -> None:
        """Send a booting VM its settings; wait for its ``Ready``."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        ready = proc.expect(_READY)
        settings = {
            "sys_path": self._sys_path,
            "target": self.config.target,
            "env_kwargs": self.config.env_kwargs,
            "disk_mib": self.limits.disk_mib,
        }
        try:
            await loop.sock_sendall(proc.sock, wire.frame(json.dumps(settings).encode()))
            said = await asyncio.wait_for(ready, VM_BOOT_S)
        except (Gone, TimeoutError, OSError) as exc:
            raise await self._failed(proc, "boot", exc) from None
        if isinstance(said, wire.Failed):
            reason = escape(said.reason[: wire.MESSAGE_CHARS].encode("utf-8", "replace"))
            raise ConfigError(f"the isolated env's VM failed to start: {reason}")
        self.boot_seconds = loop.time() - started

    async def _spawn_once(self, ref: str | None = None) -> EnvProcess:
        started = time.perf_counter()
        await self._ensure_template()
        snapshot = self.snapshot
        qmp: vmsnap.Qmp | None = None
        if snapshot is not None:
            proc, qmp = await self._restored(snapshot, snapshot.state, VM_BOOT_S)
            log.debug("VM %d restored in %.3f s", proc.pid, time.perf_counter() - started)
        else:
            proc = self._launch([], [])
        loop = asyncio.get_running_loop()
        try:
            if qmp is None:
                await self._boot(proc)
            hello = proc.expect(wire.HELLO_REPLY)
            await loop.sock_sendall(proc.sock, wire.frame(_GO.encode(wire.Go(os.urandom(32)))))
            reply = await asyncio.wait_for(hello, VM_BOOT_S)
        except (Gone, TimeoutError, OSError, ExecutionError) as exc:
            if qmp is not None:
                qmp.sock.close()
            raise await self._failed(proc, "start", exc) from None
        except BaseException:
            if qmp is not None:
                qmp.sock.close()
            self.kill(proc)
            proc.close()
            raise
        if isinstance(reply, wire.Raised):
            if qmp is not None:
                qmp.sock.close()
            self.kill(proc)
            proc.close()
            raise ExecutionError(reply.message, exception=reply.exception, operation="create")
        if qmp is not None:
            self._qmps[proc.pid] = qmp
        self.starts += 1
        self.pools.starts[ref] += 1
        self.start_seconds.append(time.perf_counter() - started)
        del self.start_seconds[:-1024]
        return proc

    async def _restored(
        self, snapshot: vmsnap.Snapshot, state_path: str, within: float
    ) -> tuple[EnvProcess, vmsnap.Qmp]:
        """A VM restored from ``state_path`` (the template's saved state, or a fork's copy),
        running, and its QMP connection."""
        state = os.open(state_path, os.O_RDONLY | os.O_CLOEXEC)
        qmp_ours, qmp_theirs = socket.socketpair()
        try:
            proc = self._launch(
                snapshot.restore_argv(qmp_theirs.fileno()), [state, qmp_theirs.fileno()]
            )
        except BaseException:
            os.close(state)
            qmp_ours.close()
            raise
        finally:
            qmp_theirs.close()
        qmp = vmsnap.Qmp(qmp_ours)
        try:
            await asyncio.wait_for(vmsnap.restore(qmp, state), within)
        except (Gone, TimeoutError, OSError, ExecutionError) as exc:
            qmp_ours.close()
            raise await self._failed(proc, "start", exc) from None
        except BaseException:
            qmp_ours.close()
            self.kill(proc)
            proc.close()
            raise
        finally:
            os.close(state)
        return proc, qmp

    async def _failed(self, proc: EnvProcess, stage: str, exc: BaseException) -> ExecutionError:
        """The error of a VM that did not ``boot`` (to ``Ready``) or ``start`` (restored, to
        its env's hello): a slow one (killed at :data:`VM_BOOT_S`) told apart from one that
        ended, each with QEMU's exit status and its last output (:mod:`.vmconsole`)."""
        qemu = self._qemu.get(proc.pid)
        tracked = proc.pid in self.live
        # its channel closed: QEMU is ending (a TimeoutError is an OSError too: slow, not that)
        if isinstance(exc, Gone | OSError) and not isinstance(exc, TimeoutError):
            what = f"ended while it {'booted' if stage == 'boot' else 'started'}"
        else:  # alive: ended here
            what = (
                f"did not {stage} within {VM_BOOT_S:g} s (killed then: the host is slow)"
                if isinstance(exc, TimeoutError)
                else f"could not {stage} (killed then): {exc}"  # QMP's answer
            )
            self.kill(proc)
            if qemu is not None and not tracked:
                qemu.kill()
        proc.close()
        if tracked:  # the pidfd's reader reaps it (_reap), the status comes through _on_exit
            status = await self.exit_status(proc.pid)
        else:
            status = await _wait_status(qemu)
        self.kill(proc)
        console = self.consoles.pop(proc.pid, None)
        if console is not None:
            await console.drained()
        err = ExecutionError(f"an isolated env's VM {what}; {why(status, console)}")
        log.warning("%s", err.message)
        return err

    def _reap(self, key: int) -> None:
        """A VM's QEMU process ended: its wait status, then the base's exit handling."""
        qemu = self._qemu.pop(key, None)
        proc = self.live.get(key)
        if proc is not None and proc.pidfd >= 0 and self._loop is not None:
            self._loop.remove_reader(proc.pidfd)
        status = -1
        if qemu is not None:
            with contextlib.suppress(ChildProcessError, OSError):
                _pid, status, used = os.wait4(key, os.WNOHANG)
                if _pid == key:  # the host kernel's word, not the guest's
                    self.peaks[key] = used.ru_maxrss * 1024
                    if len(self.peaks) > 4096:  # never asked for: forget the oldest
                        self.peaks.pop(next(iter(self.peaks)))
            qemu.returncode = 0  # reaped here: Popen must not wait on it again
        self._on_exit(key, status)

    def _cleanup(self, proc: EnvProcess) -> None:
        if proc.pidfd >= 0 and self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(proc.pidfd)
        if proc.released:  # no death to tell
            self.consoles.pop(proc.pid, None)
        qmp = self._qmps.pop(proc.pid, None)
        if qmp is not None:
            qmp.sock.close()
        super()._cleanup(proc)

    def release(self, proc: EnvProcess) -> None:
        self.consoles.pop(proc.pid, None)
        super().release(proc)

    async def death(self, proc: EnvProcess, op: str) -> StadiumError:
        """Why ``proc``'s VM ended during ``op`` (and count it)."""
        proc.close()  # its channel closed: QEMU is ending (a limit's kill, or its own end)
        status = await self.exit_status(proc.pid)
        if status is None:  # still alive after all
            self.kill(proc)
        console = self.consoles.pop(proc.pid, None)
        if (late := self.time_limit_error(proc, op, "VM")) is not None:
            return late
        if console is not None:  # the guest's last words: the log (they may be the env's)
            await console.drained()
        peak = self.peaks.pop(proc.pid, None)
        said_oom = console is not None and OUT_OF_MEMORY in console.tail
        filled = max(self.limits.memory_mib, FILLED * self._memory()) * MIB
        if said_oom and peak is not None and peak >= filled:
            self.limit_kills += 1
            return LimitExceededError(
                f"{op} used more than the {self.limits.memory_mib} MiB memory limit: the "
                f"env's VM ran out of memory (its guest kernel stopped; its QEMU held "
                f"{peak // MIB} MiB); reset to start a fresh one",
                operation=op, limit="memory", value=self.limits.memory_mib,
            )  # fmt: skip
        self.crashes += 1
        session = console.session if console is not None else None
        if said_oom:  # the guest's word alone: a crash (see FILLED)
            log.warning(
                "the VM of session %s said it ran out of memory, but its QEMU held %s MiB "
                "(%d MiB needed): not believed, told as a crash", session or "-",
                "?" if peak is None else peak // MIB, filled // MIB,
                extra={"session": session} if session else {},
            )  # fmt: skip
        log.warning(
            "the VM of session %s ended during %s: %s", session or "-", op, why(status, console),
            extra={"session": session} if session else {},
        )  # fmt: skip
        return EnvCrashedError(
            f"the env's VM ended during {op} (its guest kernel stopped: a panic, or the "
            f"env's process, the guest's init, ended; {exit_text(status)}); no other "
            "session was affected: reset to start a fresh one (the server's log has the "
            "guest's last output)",
            operation=op, reason="vm",
        )  # fmt: skip

    async def adopt_fork(self, parent: EnvProcess) -> EnvProcess:
        """The copy of ``parent``'s VM made by ``fork``: its whole state saved (paused
        meanwhile: :func:`.vmsnap.copy`) into the template's folder and restored into a new
        VM, which continues where ``parent`` was (the same guest kernel, env and session
        state); the file is removed once it is loaded.

        Raises:
            SnapshotError: no snapshots (``STADIUM_VM_SNAPSHOT=off``), or the copy failed.
        """
        qmp, snapshot = self._qmps.get(parent.pid), self.snapshot
        if qmp is None or snapshot is None:
            raise SnapshotError(
                "fork under --isolation vm needs VMs restored from the template's snapshot "
                "(STADIUM_VM_SNAPSHOT=off boots each one)", reason="fork",
            )  # fmt: skip
        started = time.perf_counter()
        within = min(VM_FORK_S, self.limits.call_timeout)
        path = os.path.join(snapshot.folder, f"fork-{parent.pid}-{next(self._copies)}")
        try:
            try:
                await vmsnap.copy(qmp, path, within)
            except (ExecutionError, OSError) as exc:
                raise SnapshotError(f"copying the env's VM failed: {exc}", reason="fork") from None
            try:
                proc, copy_qmp = await self._restored(snapshot, path, within)
            except ExecutionError as exc:
                raise SnapshotError(f"the env's VM's copy {exc.message}", reason="fork") from None
        finally:
            with contextlib.suppress(OSError):
                os.unlink(path)
        self._qmps[proc.pid] = copy_qmp
        self.starts += 1
        log.debug(
            "VM %d forked to %d in %.3f s", parent.pid, proc.pid, time.perf_counter() - started
        )
        return proc

    def shutdown(self) -> None:
        """End every VM (SIGKILL) and reap their QEMU processes."""
        qemus = list(self._qemu.values())
        super().shutdown()
        deadline = time.monotonic() + REAP_S
        for qemu in qemus:
            with contextlib.suppress(ProcessLookupError):
                qemu.kill()
            with contextlib.suppress(subprocess.TimeoutExpired, ChildProcessError):
                qemu.wait(max(0.0, deadline - time.monotonic()))
        self._qemu.clear()
        for qmp in self._qmps.values():
            qmp.sock.close()
        self._qmps.clear()
        if self.snapshot is not None:
            self.snapshot.remove()
            self.snapshot = None


async def _wait_status(qemu: subprocess.Popen[bytes] | None) -> int | None:
    """An untracked QEMU's wait status, once it exits (at most ``EXIT_REPORT_S`` later)."""
    if qemu is None:
        return None
    for _ in range(int(EXIT_REPORT_S / 0.01)):
        if qemu.poll() is not None:
            break
        await asyncio.sleep(0.01)
    code = qemu.returncode
    if code is None:
        return None
    return -code if code < 0 else code << 8  # as waitpid's status


def _popen(argv: list[str], fds: list[int], out: int) -> subprocess.Popen[bytes]:
    """Start one VM's QEMU process (its own session: killed with its group), passing
    ``fds``; its stdout and stderr are the VM's output (``out``, as its guest's console),
    or nowhere (-1)."""
    sink: int = out if out >= 0 else subprocess.DEVNULL
    return subprocess.Popen(
        argv, pass_fds=fds, stdin=subprocess.DEVNULL, stdout=sink, stderr=sink,
        start_new_session=True, cwd="/",
    )  # fmt: skip

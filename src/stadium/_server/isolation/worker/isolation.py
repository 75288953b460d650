"""The worker side of isolated sessions: the template process, the warm pool, the env
processes' lifecycle (the proxy env a session drives is :mod:`.proxy`'s).

An :class:`Isolation` (one per worker) starts the template (under bubblewrap for
``sandbox``), keeps ``warm_pool`` processes forked ahead (their envs built), hands
them out, and turns a process's death into the error its session gets:
:class:`~stadium.EnvCrashedError` (a signal, an exit) or
:class:`~stadium.LimitExceededError` (memory, processes, wall time). A reply the worker
refuses (:mod:`.wire`'s limits) is :class:`~stadium.EnvProtocolError`, and its process
is killed. The session stays open; its next ``reset`` takes a fresh process.

Nothing a template or a session's process sends is taken on its word: control packets
are decoded into their types (others are logged and dropped, their descriptors closed),
and a ``fork``'s copy is known by the kernel's word (:meth:`Isolation._fork_key`).

It hands the template its settings in a memfd (:mod:`.boot`), each spawn the write end of
a pipe for the family's stdout and stderr (read here by an :class:`.output.OutputReader`),
and, sandboxed, a uid from the worker's node-wide lease (:class:`.sandbox.UidLease`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import itertools
import json
import logging
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import msgspec

from stadium._errors import (
    ConfigError,
    EnvCrashedError,
    EnvProtocolError,
    ExecutionError,
    LimitExceededError,
    SnapshotError,
    StadiumError,
)
from stadium._server.isolation import wire
from stadium._server.isolation.sandbox import Cgroups, Limits, UidLease, bwrap_argv
from stadium._server.isolation.worker import proc as procs
from stadium._server.isolation.worker.imaging import ImagePolicy, ImageSet, WarmPools
from stadium._server.isolation.worker.netns import Networks, SessionNet
from stadium._server.isolation.worker.output import OutputReader
from stadium._server.isolation.worker.proc import EnvProcess, Gone, WireStats, foreign_error
from stadium._server.isolation.worker.reaper import Reaper
from stadium._util.throttle import ThrottledLog

log = logging.getLogger("stadium.isolation")
_CONTROL_REFUSED = ThrottledLog(log, logging.WARNING)

MODES = ("none", "process", "sandbox", "vm")
#: The script a template process starts with (:mod:`.boot`).
BOOT = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "template", "boot.py"
)
#: Seconds a template has to import the env's code and say it is ready.
TEMPLATE_START_S = 60.0
#: Seconds to wait for the template's report of a dead process's wait status.
EXIT_REPORT_S = 2.0
#: Seconds a released process has to close its env and exit before it is killed.
RELEASE_GRACE_S = 5.0
#: Seconds a ``fork`` may take (its reply, then the copy's hello), at most.
FORK_S = 10.0
#: Sandbox cgroups each worker makes ahead at its start (then recycled from ended sessions).
SPARE_CGROUPS = 32


@dataclasses.dataclass(frozen=True, slots=True)
class IsolationConfig:
    """How a worker isolates its sessions (``--isolation``, ``--warm-pool``, the limits)."""

    mode: str
    target: str
    env_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    warm_pool: int = 0
    limits: Limits = dataclasses.field(default_factory=Limits)
    seccomp: bool = True
    """``sandbox``: each session's process runs under the seccomp filter (:mod:`.seccomp`)."""
    output: str = "log"
    """What env processes print: ``log`` (a pipe per family, read into the server's log,
    bounded: :mod:`.output`) or ``drop`` (``/dev/null``)."""
    untrusted: bool = False
    """``--untrusted-env-code``: the template never imports the target; each session's
    process does, in its sandbox (:mod:`.remote`)."""
    preload: tuple[str, ...] = ()
    """``--preload``: operator-trusted modules the template imports (with ``untrusted``)."""
    action_model: str | None = None
    """``--action-model``, applied where the target is loaded (``untrusted``: the sandbox)."""
    replies: wire.WireLimits = dataclasses.field(default_factory=wire.WireLimits)
    """What one reply from a session's process may cost the worker (``--sandbox-reply-mib``)."""
    image: str | None = None
    images: str | None = None
    image_cache_mib: int = 0
    """Task images (``sandbox``; :mod:`.imaging`): ``--image``, ``--images`` (what a reset may
    choose: a file of REFs, or patterns), ``--image-cache-mib`` (the store's budget)."""


class _TemplateGone(ExecutionError):
    """The template died before it forked a process asked of it."""


class _ShutDown(ExecutionError):
    """Asked for a process after :meth:`Isolation.shutdown` (a warm fill still on its way)."""


class Isolation:
    """One worker's template process, warm pool and isolated-session counters."""

    fork_s = FORK_S  #: the bound on a fork's copy (a VM's, ``vm.VM_FORK_S``, is longer)

    def __init__(self, config: IsolationConfig) -> None:
        self.config = config
        self.sandbox = config.mode == "sandbox"
        self.limits = config.limits
        self.durable = False
        """``--durable``: sessions' env processes send their env's snapshot with each reply."""
        self.cgroups = Cgroups(config.limits, f"w{os.getpid()}") if self.sandbox else None
        self.uids = UidLease(start=os.getpid()) if self.sandbox else None
        """Sandboxed: the node-wide lease of this worker's session uids."""
        lim, tag = config.limits, f"w{os.getpid()}"
        networked = self.sandbox and lim.network != "none"
        self.networks = Networks(lim.network, lim.allowed_hosts, tag) if networked else None
        self.encoder = msgspec.msgpack.Encoder()
        self.replies = config.replies
        self.wire_stats = WireStats()
        """Bytes env processes sent, held now, replies refused (``/metrics``)."""
        self.control_refused = 0
        """Packets of the template's control socket that were no control message."""
        self.spilled = 0
        """Bytes of durable snapshots in spill files now (:meth:`spill_path`)."""
        self._spill_dir: str | None = None
        self.spill_ids = itertools.count(1)
        self.action_encode: Callable[[Any], bytes] = self.encoder.encode
        """Actions to MessagePack (the env spec's encoder, set by :func:`isolated_spec`)."""
        self.policy = ImagePolicy.of(config.image, config.images)
        """The task images sessions may run in (:mod:`.imaging`)."""
        self.images = ImageSet(config.image_cache_mib)  # prepared and leased, by REF
        if self.policy.default is not None:  # a bad --image stops the server's start
            self.images.prepare(self.policy.default)
        self.pools = WarmPools(config.warm_pool, self.policy.default)
        self.warm: collections.deque[EnvProcess] = self.pools.pool(self.policy.default)
        """The default image's warm processes (another image's: :attr:`pools`)."""
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False  # shut down: no template is started again
        self._numbers = itertools.count(1)
        self._template: subprocess.Popen[bytes] | None = None
        self._ended_templates: list[subprocess.Popen[bytes]] = []
        """Templates found dead by their socket before the kernel let them be reaped."""
        self._control: socket.socket | None = None
        self._ready: asyncio.Future[None] | None = None
        self._spawns: collections.deque[asyncio.Future[tuple[int, int]]] = collections.deque()
        self._exits: dict[int, int] = {}
        self._exit_waiters: dict[int, asyncio.Future[int]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self.live: dict[int, EnvProcess] = {}
        self.reaper = Reaper(self.cgroups)
        """Closes released processes' sockets and recycles or removes ended ones' cgroups,
        off the loop."""
        self._cgroup_users: dict[str, int] = {}
        """Live processes per cgroup (a fork shares its parent's): released at the last exit."""
        self.outputs: dict[int, OutputReader] = {}
        """The output pipe of each family, by its first process's key, while it is open."""
        self._template_output: OutputReader | None = None
        # Counters (``/metrics``: stadium_isolated_*).
        self.starts = 0
        self.crashes = 0
        self.limit_kills = 0
        self.start_seconds: list[float] = []
        self.seccomp = "off"
        """The seccomp filter sandboxed sessions run under (its template's report), or off."""

    def counts(self) -> tuple[int, ...]:
        """Processes alive, started, crashed, stopped at a limit; bytes they sent, replies
        refused, bytes of reply buffers held, bytes spilled (``/metrics``)."""
        w = self.wire_stats
        return (len(self.live), self.starts, self.crashes, self.limit_kills, w.received,
                w.refused, w.held, self.spilled)  # fmt: skip

    # -- the template ---------------------------------------------------------------

    def start(self) -> None:
        """Start the template (and fill the warm pool, make spare cgroups) on the running loop."""
        if self.cgroups is not None:  # beside its sessions' (scheduling: see the method)
            self.cgroups.place_worker(os.getpid())
        self._ensure_template()
        self.refill()
        self.reaper.make_spares(SPARE_CGROUPS)

    async def ready(self) -> None:
        """Wait until the template has imported the env's code (an env with heavy imports
        takes seconds: the first session waits for it otherwise)."""
        await self._ensure_template()

    def _ensure_template(self) -> asyncio.Future[None]:
        if self._closed:
            raise _ShutDown("the worker's isolation is shut down; no env process starts")
        if self._ready is not None and self._template is not None:
            return self._ready
        loop = self._loop = asyncio.get_running_loop()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sys_path = [os.path.abspath(p) for p in sys.path if p]
        settings: dict[str, Any] = {
            "target": self.config.target,
            "env_kwargs": self.config.env_kwargs,
            "control_fd": theirs.fileno(),
            "sandbox": self.sandbox,
            "disk_mib": self.limits.disk_mib,
            "ptys": self.limits.ptys,
            "seccomp": self.sandbox and self.config.seccomp,
            "sys_path": sys_path,
            "output": self.config.output,
        }
        if self.config.untrusted:
            settings.update(
                untrusted=True, preload=list(self.config.preload),
                action_model=self.config.action_model,
            )  # fmt: skip
        # The settings (env kwargs may hold secrets) go in a memfd the template reads and
        # closes first (:mod:`.boot`): not in argv, which every process can read, nor in its
        # environment, which would stay in every session's initial environment block.
        settings_fd = os.memfd_create("stadium-template-settings", os.MFD_CLOEXEC)
        os.write(settings_fd, json.dumps(settings).encode())
        argv = [sys.executable, "-P", BOOT, str(settings_fd)]
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}
        if self.sandbox:
            binds = sys_path + self.policy.roots()  # every allowed image's layers, read-only
            binds += [self.images.root()] if self.policy.any else []
            argv = bwrap_argv(binds, resolver=self.limits.network == "public") + argv
        else:
            env = dict(os.environ)
        # Its stdout and stderr (bubblewrap's, the env's import-time output): a pipe the
        # worker reads, bounded, never the server's own descriptors.
        out_r, out_w = os.pipe2(os.O_CLOEXEC)
        try:
            self._template = subprocess.Popen(
                argv, pass_fds=[theirs.fileno(), settings_fd], env=env,
                stdin=subprocess.DEVNULL, stdout=out_w, stderr=out_w,
                cwd="/" if self.sandbox else None,
            )  # fmt: skip
        except BaseException:
            os.close(out_r)
            raise
        finally:
            os.close(settings_fd)
            os.close(out_w)
        if self._template_output is not None:
            self._template_output.close()
        self._template_output = OutputReader(loop, out_r, "template")
        theirs.close()
        ours.setblocking(False)
        self._control = ours
        self._ready = loop.create_future()
        loop.add_reader(ours.fileno(), self._on_control)
        return self._ready

    def _on_control(self) -> None:
        control = self._control
        assert control is not None
        for _ in range(1024):  # bounded: the loop's other callbacks run between batches
            try:
                data, fds, flags, _addr = socket.recv_fds(control, 65536, 4)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                data, fds, flags = b"", [], 0
            if not data and not fds:
                self._template_gone()
                return
            try:
                if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
                    raise EnvProtocolError("a control packet cut short", limit="frame_bytes")
                msg = wire.decode_control(data)
            except EnvProtocolError as exc:  # never acted on: logged, its descriptors closed
                self.control_refused += 1
                _CONTROL_REFUSED("the isolation template sent what is refused: %s", exc)
                msg = None
            if isinstance(msg, wire.Spawned):
                self._on_spawned(msg, fds)
                fds = []
            else:
                if isinstance(msg, wire.Exit):
                    self._on_exit(msg.key, msg.status)
                elif isinstance(msg, wire.Ready | wire.Failed):
                    self._on_ready(msg)
            for fd in fds:
                os.close(fd)

    def _on_exit(self, key: int, status: int) -> None:
        waiter = self._exit_waiters.pop(key, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(status)
        else:
            self._exits[key] = status
            if len(self._exits) > 4096:  # never asked for: forget the oldest
                self._exits.pop(next(iter(self._exits)))
        proc = self.live.pop(key, None)
        if proc is not None:
            self._cleanup(proc)

    def _on_spawned(self, msg: wire.Spawned, fds: list[int]) -> None:
        """A spawned process's socket: to the oldest spawn waiting (in order)."""
        fut = self._spawns.popleft() if self._spawns else None
        if fut is None or fut.done() or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            if fut is not None and not fut.done():
                fut.set_exception(ExecutionError("the isolation template sent no socket"))
            return
        fut.set_result((fds[0], msg.key))

    def _on_ready(self, msg: wire.Ready | wire.Failed) -> None:
        ready = self._ready
        if ready is None or ready.done():
            return
        if isinstance(msg, wire.Failed):
            ready.set_exception(
                ConfigError(f"the isolated env's template failed to start: {msg.reason}")
            )
            return
        if self.sandbox:
            self.seccomp = msg.seccomp or "off"
            log.log(
                logging.INFO if msg.seccomp else logging.WARNING,
                "sandboxed sessions' seccomp filter: %s%s", self.seccomp,
                "" if msg.seccomp else " (--sandbox-seccomp off: no filter)",
            )  # fmt: skip
            log.log(
                logging.INFO if msg.init else logging.WARNING, "sandboxed sessions' init: %s",
                f"native, {msg.init}" if msg.init else "a forked interpreter, ~0.8 MiB more (the "
                "native init is missing, others may write it, or this kernel runs no memfd: "
                "make sandbox-deps builds native/stadium-init; a wheel built with cargo has it)",
            )  # fmt: skip
        ready.set_result(None)

    def _template_gone(self) -> None:
        """The template died (killed, or failed): later sessions start a new one."""
        if self._control is not None and self._loop is not None:
            self._loop.remove_reader(self._control.fileno())
            self._control.close()
        self._control = None
        proc, self._template = self._template, None
        if proc is not None and proc.poll() is None:  # its socket closed before it exited:
            self._ended_templates.append(proc)  # reaped later (shutdown at the latest)
        self._ended_templates = [p for p in self._ended_templates if p.poll() is None]
        ready, self._ready = self._ready, None
        err = _TemplateGone("the isolation template process ended; retry")
        if ready is not None and not ready.done():
            ready.set_exception(err)
        while self._spawns:
            fut = self._spawns.popleft()
            if not fut.done():
                fut.set_exception(err)
        for waiter in self._exit_waiters.values():
            if not waiter.done():
                waiter.set_result(-1)
        self._exit_waiters.clear()

    # -- processes ------------------------------------------------------------------

    async def _spawn(self, image: str | None = None) -> EnvProcess:
        """A new env process (in ``image``); a template found dead on the way is started
        again (twice)."""
        for attempt in range(3):
            try:
                return await self._spawn_once(image)
            except _TemplateGone:
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    async def _spawn_once(self, ref: str | None = None) -> EnvProcess:
        started = time.perf_counter()
        image = await self.images.get(ref)
        await self._ensure_template()
        n = next(self._numbers)
        cgroups: list[str] = []
        baseline: dict[str, int] = {}
        if self.cgroups is not None:
            cgroups, baseline = await asyncio.get_running_loop().run_in_executor(
                None, self._new_cgroups, str(n)
            )
        uid = self.uids.take() if self.uids is not None else 0  # held until _track's
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[tuple[int, int]] = loop.create_future()
        net: SessionNet | None = None
        out_r = -1
        try:
            if self.networks is not None:  # its own namespace, veth pair and rules
                net = await self.networks.acquire()
            if self._closed:
                raise _ShutDown("the worker's isolation is shut down; no env process starts")
            if self._control is None:
                raise _TemplateGone("the isolation template process ended; retry")
            fds = [net.fd] if net is not None else []
            if self.config.output == "log":  # the family's stdout and stderr: first
                out_r, out_w = os.pipe2(os.O_CLOEXEC)
                fds.insert(0, out_w)
            try:
                hosts = None
                if net is not None:  # the namespace goes along; the template joins it
                    hosts = None if self.limits.network == "public" else net.hosts
                msg = wire.encode(wire.Spawn(cgroups, uid, hosts, image))
                socket.send_fds(self._control, [msg], fds)
            except OSError:  # it died; its end of stream may not have been read yet
                self._template_gone()
                raise _TemplateGone("the isolation template process ended; retry") from None
            finally:
                if out_r >= 0:
                    os.close(out_w)
            self._spawns.append(fut)  # its reply comes in order (never before the next await)
            fd, pid = await fut
        except BaseException:
            if self.uids is not None:
                self.uids.release(uid)
            if out_r >= 0:
                os.close(out_r)
            if cgroups:
                self.reaper.remove(cgroups)
            if net is not None and self.networks is not None:
                self.networks.remove(net)
            raise
        proc = self._process(socket.socket(fileno=fd))
        proc.pid, proc.uid, proc.cgroups, proc.baseline = pid, uid, cgroups, baseline
        proc.net, proc.image = net, ref
        if out_r >= 0:
            self.outputs[pid] = OutputReader(
                loop, out_r, f"env process {pid}", on_close=lambda: self.outputs.pop(pid, None)
            )
        self._track(proc)
        if self.uids is not None:
            self.uids.release(uid)  # _track holds it while the process lives
        await self._hello(proc)
        self.starts += 1
        self.pools.starts[ref] += 1
        self.start_seconds.append(time.perf_counter() - started)
        del self.start_seconds[:-1024]
        return proc

    def _process(self, sock: socket.socket) -> EnvProcess:
        assert self._loop is not None
        return EnvProcess(self._loop, sock, self.replies, self.wire_stats)

    async def _hello(self, proc: EnvProcess, within: float = TEMPLATE_START_S) -> None:
        """Wait for a new process's hello (its env built); kill it if none comes in time."""
        try:
            hello = await asyncio.wait_for(proc.expect(wire.HELLO_REPLY), within)
        except (Gone, TimeoutError, EnvProtocolError) as exc:
            self.kill(proc)
            proc.close()
            why = exc.message if isinstance(exc, EnvProtocolError) else "died while starting"
            raise ExecutionError(f"an isolated env process {why}") from None
        if isinstance(hello, wire.Raised):  # the sandbox could not be set up
            self.kill(proc)
            proc.close()
            raise ExecutionError(hello.message, exception=hello.exception, operation="create")

    def _new_cgroups(self, name: str) -> tuple[list[str], dict[str, int]]:
        """A session's cgroups and their counters' start (in the executor: the kernel's
        cgroup files are slow to make and read)."""
        assert self.cgroups is not None
        paths = self.reaper.take(name)  # a spare (an ended session's, emptied), else new
        return paths, self.cgroups.counters(paths)

    async def acquire(self, session: str | None = None, image: str | None = None) -> EnvProcess:
        """A process with the env built: from the warm pool, else forked now. ``session``:
        the short id of the session taking it, which its output's log lines then name;
        ``image``: the task image it runs in (``None``: the default, ``--image``)."""
        proc: EnvProcess | None = None
        ref = image if image is not None else self.policy.default
        pool = self.pools.pool(ref)
        while pool:
            warm = pool.popleft()
            self.refill()
            if warm.sock.fileno() >= 0 and warm.pid in self.live and warm.broken is None:
                proc = warm
                break
            self.kill(warm)  # it sent what was refused while it waited
            self.release(warm)
        if proc is None:
            proc = await self._spawn(ref)
            self.refill()  # an image's first use makes its pool
        reader = self.outputs.get(proc.pid)
        if reader is not None and session is not None:
            reader.session = session
        return proc

    def refill(self) -> None:
        """Fork processes ahead until each image's warm pool holds ``warm_pool`` of them."""
        loop = asyncio.get_running_loop()
        for image in self.pools.short() if not self._closed else ():
            self.pools.filling[image] += 1
            task = loop.create_task(self._fill(image))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _fill(self, image: str | None) -> None:
        try:
            proc = await self._spawn(image)
        except _ShutDown:
            return
        except Exception as exc:
            log.warning("could not fork a warm isolated env process: %s", exc)
            return
        finally:
            self.pools.filling[image] -= 1
        if self._closed:  # shut down while it started: ended like the others
            self.kill(proc)
            proc.close()
            return
        self.pools.pool(image).append(proc)

    async def adopt_fork(self, parent: EnvProcess) -> EnvProcess:
        """The copy of ``parent``'s process made by ``fork`` (its env copied by the kernel).

        Read without blocking the loop. The copy's key comes from the kernel, never from
        the process: the copy makes its socket itself, so the socket's peer credentials
        (``SO_PEERCRED``) name it (:meth:`_fork_key`).

        Raises:
            Gone: ``parent`` died. EnvProtocolError: it answered with what is refused.
            SnapshotError: the fork failed or its copy cannot be told apart."""
        reply = await parent.request_fds(wire.encode(wire.Fork()), wire.DONE_REPLY)
        fd = parent.take_fd()
        if isinstance(reply, wire.Raised) or fd < 0:
            if fd >= 0:
                os.close(fd)
            why = reply.message if isinstance(reply, wire.Raised) else "no socket came with it"
            raise SnapshotError(f"forking the env's process failed: {why}", reason="fork")
        try:
            sock = socket.socket(fileno=fd)
        except OSError:
            os.close(fd)
            raise procs.forged("its socket is no socket") from None
        if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_STREAM:
            sock.close()
            raise procs.forged("its socket is not a Unix stream socket")
        try:
            key = self._fork_key(parent, sock)
        except EnvProtocolError:
            sock.close()
            raise
        proc = self._process(sock)
        proc.pid, proc.uid, proc.cgroups = key, parent.uid, parent.cgroups
        proc.net = parent.net
        proc.baseline = parent.baseline
        self._track(proc)
        try:
            await self._hello(proc, min(FORK_S, self.limits.call_timeout))
        except ExecutionError as exc:
            raise SnapshotError(f"the forked env process {exc.message}", reason="fork") from None
        self.starts += 1
        return proc

    def _fork_key(self, parent: EnvProcess, sock: socket.socket) -> int:
        """The key of the process that made ``sock`` (the copy), from the kernel: its pid
        (``SO_PEERCRED``, as the worker sees it) and, sandboxed, its pid in its family's
        namespace (``/proc/PID/status``), in ``parent``'s family (the worker knows that
        one). A socket made by another process of the session names that one: never
        another session's, nor a process already tracked."""
        pid, uid, _gid = struct.unpack(
            "3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
        )
        if pid <= 0:
            raise procs.forged("its socket's maker is not visible")
        key: int = pid
        if self.sandbox:
            if uid != parent.uid:
                raise procs.forged(f"its socket was made by uid {uid}, not the session's")
            pids = procs.ns_pids(pid)
            if len(pids) != procs.ns_depth() + 2:  # the template's namespace, then the family's
                raise procs.forged("its socket was made outside the session's pid namespace")
            key = (parent.pid >> wire.KEY_SHIFT << wire.KEY_SHIFT) | pids[-1]
        if key in self.live:
            raise procs.forged("its socket was made by a process already known")
        return key

    def spill_path(self, spill_id: int) -> str:
        """The spill file of a session's proxy (its ``spill_id``): in a ``0700`` directory
        of the worker's, made at the first spill, removed at :meth:`shutdown`."""
        if self._spill_dir is None:
            self._spill_dir = tempfile.mkdtemp(prefix="stadium-spill-")
        return os.path.join(self._spill_dir, str(spill_id))

    def unspill(self, spill_id: int) -> None:
        """Remove a spill file (superseded by a small snapshot, or its session ended)."""
        with contextlib.suppress(OSError):
            os.unlink(self.spill_path(spill_id))

    def _track(self, proc: EnvProcess) -> None:
        """Count ``proc`` alive; in ``process`` mode hold a pidfd on it: a kill never reaches
        a process that took its pid over (its exit may go unreported if the template died)."""
        self.live[proc.pid] = proc
        if self.uids is not None:
            self.uids.hold(proc.uid)
        if proc.cgroups:
            key = proc.cgroups[0]
            self._cgroup_users[key] = self._cgroup_users.get(key, 0) + 1
        if not self.sandbox:  # a sandboxed process's key is no pid here: cgroups kill
            try:
                proc.pidfd = os.pidfd_open(proc.pid)
            except OSError:  # gone already: its exit report is on its way
                proc.pidfd = -1

    def release(self, proc: EnvProcess) -> None:
        """The session is done with ``proc``: close its socket (its env closes, it exits);
        killed if it has not exited ``RELEASE_GRACE_S`` later. The socket is closed off the
        loop (:class:`~stadium._server.isolation.worker.reaper.Reaper`)."""
        proc.released = True
        proc.close(self.reaper)
        if proc.pid in self.live and self._loop is not None and not self._loop.is_closed():
            self._loop.call_later(RELEASE_GRACE_S, self._kill_if_alive, proc)

    def _kill_if_alive(self, proc: EnvProcess) -> None:
        if self.live.get(proc.pid) is proc:
            self.kill(proc)

    def kill(self, proc: EnvProcess) -> None:
        """SIGKILL the process (and, sandboxed, everything in its cgroup)."""
        if self.cgroups is not None and proc.cgroups:
            self.cgroups.kill(proc.cgroups)
        elif proc.pidfd >= 0:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                signal.pidfd_send_signal(proc.pidfd, 0)  # still this process: its group too
                os.killpg(proc.pid, signal.SIGKILL)

    def _cleanup(self, proc: EnvProcess) -> None:
        if self.uids is not None:
            self.uids.release(proc.uid)
        if proc.pidfd >= 0:
            os.close(proc.pidfd)
            proc.pidfd = -1
        if proc.sock.fileno() >= 0 and proc.waiter is None:
            proc.close()
        if self.cgroups is not None and proc.cgroups:
            if not proc.released:  # why it ended may be asked (death): read them before rmdir
                proc.final = self.cgroups.counters(proc.cgroups)
            key = proc.cgroups[0]
            users = self._cgroup_users.pop(key, 1) - 1
            if users > 0:  # a fork of it still lives in them
                self._cgroup_users[key] = users
            else:  # emptied and recycled, or removed: off the loop, batched
                self.reaper.remove(proc.cgroups)
        net, proc.net = proc.net, None
        if (
            net is not None
            and self.networks is not None
            and not any(p.net is net for p in self.live.values())  # a fork's copy shares it
        ):
            self.networks.release(net)

    async def exit_status(self, pid: int) -> int | None:
        """The wait status the template reported for ``pid`` (``None``: none in time)."""
        if pid in self._exits:
            return self._exits.pop(pid)
        loop = asyncio.get_running_loop()
        waiter = self._exit_waiters.setdefault(pid, loop.create_future())
        try:
            return await asyncio.wait_for(asyncio.shield(waiter), EXIT_REPORT_S)
        except TimeoutError:
            self._exit_waiters.pop(pid, None)
            return None

    async def death(self, proc: EnvProcess, op: str) -> StadiumError:
        """The error naming why ``proc`` died during ``op`` (and count it)."""
        proc.close()
        if not proc.expired:  # it may still be alive (closed its socket): make sure
            self.kill(proc)
        status = await self.exit_status(proc.pid)
        counters = proc.final
        if counters is None:
            counters = self.cgroups.counters(proc.cgroups) if self.cgroups and proc.cgroups else {}
        base = proc.baseline
        limits = self.limits
        if (late := self.time_limit_error(proc, op)) is not None:
            return late
        if counters.get("oom_kill", 0) > base.get("oom_kill", 0):
            self.limit_kills += 1
            return LimitExceededError(
                f"{op} used more than the {limits.memory_mib} MiB memory limit; the env's "
                "process was killed by the kernel: reset to start a fresh one",
                operation=op, limit="memory", value=limits.memory_mib,
            )  # fmt: skip
        self.crashes += 1
        if status is not None and os.WIFSIGNALED(status):
            sig = os.WTERMSIG(status)
            try:
                name = signal.Signals(sig).name
            except ValueError:
                name = f"signal {sig}"
            return EnvCrashedError(
                f"the env's process died of {name} during {op}; no other session was "
                "affected: reset to start a fresh one",
                operation=op, reason="signal", signal=name,
            )  # fmt: skip
        if status is not None and os.WIFEXITED(status):
            code = os.WEXITSTATUS(status)
            return EnvCrashedError(
                f"the env's process exited (code {code}) during {op}; reset to start a "
                "fresh one",
                operation=op, reason="exit", exit_code=code,
            )  # fmt: skip
        return EnvCrashedError(
            f"the env's process ended during {op} (its exit status is unknown); reset to "
            "start a fresh one",
            operation=op, reason="unknown",
        )  # fmt: skip

    def raised(self, proc: EnvProcess, op: str, reply: wire.Raised) -> StadiumError:
        """A call the env raised in: a fork refused past ``pids`` ``LIMIT_EXCEEDED``, else
        ``EXECUTION_ERROR`` (the message bounded: ``Raised.said``)."""
        if self.cgroups is not None and proc.cgroups:
            counters = self.cgroups.counters(proc.cgroups)
            if counters.get("pids_max", 0) > proc.baseline.get("pids_max", 0):
                proc.baseline = counters
                self.limit_kills += 1
                return LimitExceededError(
                    f"{op} tried to run more than {self.limits.pids} processes at once and "
                    f"was refused ({reply.exception}: {reply.said})",
                    operation=op, limit="pids", value=self.limits.pids,
                )  # fmt: skip
        if reply.data is not None:  # a Stadium error: itself
            return foreign_error(reply)  # type: ignore[return-value]
        return ExecutionError(
            f"{op} raised {reply.exception}: {reply.said}", exception=reply.exception,
            operation=op,
        )  # fmt: skip

    def time_limit_error(
        self, proc: EnvProcess, op: str, what: str = "process"
    ) -> LimitExceededError | None:
        """The episode's or the call's time limit (counted) that ended ``proc``, or ``None``."""
        lim, then = self.limits, f"the env's {what} was killed: reset to start a"
        if proc.episode_over:  # counted when it was killed
            return LimitExceededError(
                f"the episode ran longer than its {lim.episode_timeout:g} s limit; {then} new "
                "episode in a fresh one", operation=op, limit="episode_time",
                value=lim.episode_timeout,
            )  # fmt: skip
        if proc.expired:
            self.limit_kills += 1
            return LimitExceededError(
                f"{op} ran longer than the {lim.call_timeout:g} s limit per call; {then} fresh "
                "one", operation=op, limit="wall_time", value=lim.call_timeout,
            )  # fmt: skip
        return None

    def shutdown(self) -> None:
        """End every env process and the template; a fill on its way starts none again."""
        self._closed = True
        for task in self._tasks:
            task.cancel()
        for proc in list(self.live.values()) + self.pools.all():
            self.kill(proc)
            proc.close()
        for reader in [*self.outputs.values(), self._template_output]:
            if reader is not None:
                reader.close()
        self.outputs.clear()
        self._template_output = None
        if self._control is not None and self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._control.fileno())
        if self._control is not None:
            self._control.close()
            self._control = None
        template, self._template = self._template, None
        if template is not None:
            template.kill()
            template.wait(5)
        for ended in self._ended_templates:
            with contextlib.suppress(subprocess.TimeoutExpired):
                ended.wait(5)
        self._ended_templates.clear()
        left = [list(paths) for paths in {tuple(p.cgroups) for p in self.live.values()} if paths]
        self.reaper.flush(RELEASE_GRACE_S, left)  # killed: gone in a few ms
        if self.networks is not None:
            self.networks.close([p.net for p in self.live.values() if p.net is not None])
        self.live.clear()
        self._cgroup_users.clear()
        if self.uids is not None:  # every session's process is gone: the block is free
            self.uids.close()
        self.images.close()
        if self._spill_dir is not None:
            shutil.rmtree(self._spill_dir, ignore_errors=True)
            self._spill_dir = None

"""The worker side of isolated sessions, its lower half: the template process as the worker
runs it, and the env processes it forked as the worker keeps them (the base of
:class:`.isolation.Isolation`, which hands processes to sessions).

A :class:`TemplateHost` holds an :class:`IsolationConfig` and every piece of a worker's
isolation state. It starts the template (under bubblewrap for ``sandbox``), handing it its
settings in a memfd (:mod:`.boot`; never argv nor the environment) and the write end of a
pipe for its stdout and stderr (read here by an :class:`.output.OutputReader`); reads its
control socket (``spawned``, ``exit``, ``ready`` / ``failed``); starts it again after it
died (the next spawn does); tracks the live processes (their uid from the worker's
node-wide lease, :class:`.sandbox.UidLease`; their cgroups, shared with a fork's copy; their
network); kills, releases and cleans them up; and shuts everything down.

What it trusts: the kernel (pidfds, cgroups, ``SO_PEERCRED``) and its own state. Nothing the
template sends is taken on its word: a control packet is decoded into its type
(:func:`~stadium._server.isolation.wire.decode_control`); one cut short or of no known type
is counted, logged (throttled) and dropped, its descriptors closed; a ``spawned`` goes to
the oldest spawn waiting, with exactly one descriptor, else the spawn fails.
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
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import msgspec

from stadium._errors import ConfigError, EnvProtocolError, ExecutionError
from stadium._server.isolation import wire
from stadium._server.isolation.sandbox import Cgroups, Limits, UidLease, bwrap_argv
from stadium._server.isolation.worker.imaging import ImagePolicy, ImageSet, WarmPools
from stadium._server.isolation.worker.netns import Networks
from stadium._server.isolation.worker.output import OutputReader
from stadium._server.isolation.worker.proc import EnvProcess, WireStats
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


class TemplateHost:
    """One worker's template process and the env processes it forked, as the worker keeps
    them: the state and lower half of :class:`.isolation.Isolation` (see the module
    docstring)."""

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

    # -- processes, as tracked -------------------------------------------------------

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

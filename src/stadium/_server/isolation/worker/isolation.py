"""The worker side of isolated sessions, its upper half: the env processes sessions get (the
proxy env a session drives is :mod:`.proxy`'s; the template and the processes' bookkeeping,
:mod:`.template_host`'s).

An :class:`Isolation` (one per worker; a :class:`~.template_host.TemplateHost`, which starts
the template and tracks what it forks) keeps ``warm_pool`` processes forked ahead (their envs
built), per task image, hands them out, spawns one when none is warm, adopts a ``fork``'s
copy, and turns a process's death into the error its session gets:
:class:`~stadium.EnvCrashedError` (a signal, an exit) or
:class:`~stadium.LimitExceededError` (memory, processes, wall time). A reply the worker
refuses (:mod:`.wire`'s limits) is :class:`~stadium.EnvProtocolError`, and its process
is killed. The session stays open; its next ``reset`` takes a fresh process.

Nothing a template or a session's process sends is taken on its word: control packets
are decoded into their types (:mod:`.template_host`), a new process's hello is awaited
within a bound, and a ``fork``'s copy is known by the kernel's word
(:meth:`Isolation._fork_key`).

Each spawn hands the template the write end of a pipe for the family's stdout and stderr
(read here by an :class:`.output.OutputReader`) and, sandboxed, a uid from the worker's
node-wide lease (:class:`.sandbox.UidLease`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import struct
import tempfile
import time

from stadium._errors import (
    EnvCrashedError,
    EnvProtocolError,
    ExecutionError,
    LimitExceededError,
    SnapshotError,
    StadiumError,
)
from stadium._server.isolation import wire
from stadium._server.isolation.worker import proc as procs
from stadium._server.isolation.worker.netns import SessionNet
from stadium._server.isolation.worker.output import OutputReader
from stadium._server.isolation.worker.proc import EnvProcess, Gone, foreign_error
from stadium._server.isolation.worker.template_host import (
    FORK_S,
    SPARE_CGROUPS,
    TEMPLATE_START_S,
    TemplateHost,
    _ShutDown,
    _TemplateGone,
)

log = logging.getLogger("stadium.isolation")


class Isolation(TemplateHost):
    """One worker's template process, warm pool and isolated-session counters."""

    fork_s = FORK_S  #: the bound on a fork's copy (a VM's, ``vm.VM_FORK_S``, is longer)

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

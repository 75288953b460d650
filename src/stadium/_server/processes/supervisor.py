"""The worker supervisor of ``stadium serve --workers N`` (N >= 2).

The supervisor forks N workers, which share the listening socket (bound before
the fork) and a server-wide session limit (:class:`~stadium._server.admission.slots.SharedSlots`),
and from then on only waits: for a signal, a worker's exit or a deadline. It
serves no connection and runs no environment code, so it has nothing to hang on.

* **Crash**: a worker that exits while the server runs is restarted in its slot
  after a delay: :data:`BACKOFF_BASE_S`, doubled with each further quick crash of
  that slot, at most ``restart_max_delay``; a worker that served for
  :data:`STABLE_AFTER_S` resets it. Its session slots are freed at once. The
  supervisor never gives up and never touches the other workers; it logs a
  crash at ERROR (exit code or signal, the next delay), at most once per
  :data:`CRASH_LOG_INTERVAL_S` per slot (the next line counts those not logged).
* **Recycle** (not a crash: no backoff, nothing counted): a worker whose event
  loop is stuck past ``--stall-limit`` ends itself with
  :data:`~stadium._util.process.RECYCLE_EXIT_CODE` and is restarted at once (its
  sessions are lost: a stuck loop cannot drain). A worker past
  ``--max-worker-memory``, or with too many threads stuck in abandoned env
  calls, marks itself retiring (its byte in the shared ready array), stops
  accepting and drains; the supervisor sees the mark within
  :data:`MAX_WAIT_S` and forks its replacement at once (SIGKILL if the drain
  outlasts ``stop_grace_s``).
* **SIGHUP**: a rolling recycle, one slot at a time: a replacement is forked;
  once it accepts connections, the old worker gets SIGTERM, stops accepting at
  once and drains its sessions as on shutdown (they keep being served for up to
  ``drain_timeout``, then are closed with 1001 after their in-flight request).
  A replacement that exits or does not serve within :data:`READY_TIMEOUT_S` is
  given up and the old worker keeps serving. The replacements are forks of the
  supervisor: the environment's code and the configuration are not reloaded.
  With ``--tenants``, SIGHUP instead reloads the tenants file in place (no worker
  is recycled, no session dropped): the supervisor reads and checks it and publishes
  it to the workers (:class:`~stadium._server.admission.tenants.TenantDirectory`); a bad file is
  refused with an ERROR line and the old tenants kept.
* **SIGTERM / SIGINT**: every worker gets SIGTERM and drains; the supervisor
  exits when all have exited: 0, or 1 if one had to be killed (see below).

A worker that was sent SIGTERM (stop or recycle) and is still running
``stop_grace_s`` later (its drain, the final grace and a margin) gets SIGKILL.
Workers ignore SIGHUP, and get SIGTERM from Linux if the supervisor dies.

Signals are caught by handlers that only queue them and wake the loop through
:func:`signal.set_wakeup_fd`, so the supervisor answers them within
milliseconds whatever it is waiting for (whichever thread the kernel delivers
them to).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import enum
import logging
import multiprocessing.sharedctypes
import os
import selectors
import signal
import socket
import time
from collections.abc import Callable
from types import FrameType
from typing import NoReturn

from stadium._server.admission.slots import SharedSlots
from stadium._server.admission.tenants import TenantDirectory
from stadium._server.metrics import MetricsBoard
from stadium._util.libc import die_with_parent
from stadium._util.process import RECYCLE_EXIT_CODE
from stadium._util.throttle import Throttle

log = logging.getLogger("stadium.supervisor")

BACKOFF_BASE_S = 0.05
"""Delay before restarting a worker after its first crash; it doubles with each quick crash."""
STABLE_AFTER_S = 30.0
"""A worker that served this long before crashing is restarted after :data:`BACKOFF_BASE_S`."""
CRASH_LOG_INTERVAL_S = 10.0
"""At most one crash line per worker slot per interval (the next line counts the others)."""
READY_TIMEOUT_S = 30.0
"""How long a SIGHUP replacement may take to accept connections before it is given up."""
MAX_WAIT_S = 1.0
"""The longest the loop sleeps without a signal (a bound, should a wake-up be lost)."""
READY_POLL_S = 0.02
"""How often a starting replacement is checked for readiness."""

WATCHED = (signal.SIGCHLD, signal.SIGHUP, signal.SIGINT, signal.SIGTERM)

WorkerMain = Callable[[SharedSlots, Callable[[], None], Callable[[], None]], int]
"""Runs one worker in the forked process until it stops: its session slots, a
callback to call once it accepts connections, and one to call when it starts
draining on its own to be replaced (memory cap, stuck threads); returns the exit
code (:data:`~stadium._util.process.RECYCLE_EXIT_CODE` after such a recycle)."""

_SERVING = 1
_RETIRING = 2
"""Values of a worker's ready byte: accepting connections; draining to be replaced."""


class SupervisorState(enum.Enum):
    """Lifecycle of the supervisor: ``RUNNING → STOPPING`` (then it returns)."""

    RUNNING = "running"
    STOPPING = "stopping"


class WorkerRole(enum.Enum):
    """Lifecycle of a worker process: ``STARTING → SERVING → RETIRING``, then reaped.

    A crash-restart starts directly as ``SERVING``; only a SIGHUP replacement is
    ``STARTING`` until it accepts connections.
    """

    STARTING = "starting"
    SERVING = "serving"
    RETIRING = "retiring"
    """Sent SIGTERM: draining its sessions, no longer accepting."""


@dataclasses.dataclass(slots=True)
class _Child:
    pid: int
    slot: int
    counter: int
    role: WorkerRole
    started: float
    kill_at: float | None = None


@dataclasses.dataclass(slots=True)
class _Slot:
    index: int
    crashes: int = 0
    """Consecutive quick crashes (reset by a worker that serves :data:`STABLE_AFTER_S`)."""
    restart_at: float | None = None
    crash_log: Throttle = dataclasses.field(default_factory=lambda: Throttle(CRASH_LOG_INTERVAL_S))


class Supervisor:
    """Forks ``workers`` workers and keeps them running (see the module docstring).

    Args:
        workers: worker processes (slots).
        max_sessions: the server-wide session limit.
        max_sessions_per_client: ``--max-sessions-per-client``, counted over every worker
            (0: no quota).
        rate_limit, rate_burst: ``--rate-limit`` / ``--rate-burst``, one budget per client
            over every worker (0: no rate limit).
        restart_max_delay: the longest delay before a crashed worker is restarted.
        stop_grace_s: how long a worker sent SIGTERM may take to exit before SIGKILL.
        run_worker: runs one worker in the forked process.
        listener: the listening socket the workers share; the supervisor closes its
            own copy when it stops, so that once every draining worker has closed
            theirs new connections are refused at once (not left in the backlog,
            where a router's health check or a client would wait for a timeout).
        metrics: the workers' metrics rows (one per counter, :meth:`counters_for`); a
            dead worker's row is moved into its retired row, so counters never go down.
        tenants: ``--tenants`` (made with :meth:`counters_for` columns): SIGHUP reloads
            it instead of recycling the workers.
    """

    def __init__(
        self,
        *,
        workers: int,
        max_sessions: int,
        max_sessions_per_client: int = 0,
        rate_limit: float = 0.0,
        rate_burst: int = 1,
        restart_max_delay: float,
        stop_grace_s: float,
        run_worker: WorkerMain,
        listener: socket.socket | None = None,
        metrics: MetricsBoard | None = None,
        tenants: TenantDirectory | None = None,
    ) -> None:
        self.tenants = tenants
        self.state = SupervisorState.RUNNING
        self.metrics = metrics
        self._listener = listener
        self.restart_max_delay = restart_max_delay
        self.stop_grace_s = stop_grace_s
        self._run_worker = run_worker
        # One counter per process that can be alive at once: the workers, a
        # starting replacement, and the retiring workers of up to one recycle.
        counters = self.counters_for(workers)
        self.session_slots = SharedSlots(
            max_sessions, counters, per_client=max_sessions_per_client, rate=rate_limit,
            burst=rate_burst, tenants=None if tenants is None else tenants.shared,
        )  # fmt: skip
        self._ready = memoryview(multiprocessing.sharedctypes.RawArray("b", counters)).cast("B")
        self._free = list(range(counters - 1, -1, -1))  # pop() takes the lowest
        self._slots = [_Slot(i) for i in range(workers)]
        self.children: dict[int, _Child] = {}  # pid -> child
        self._recycle: collections.deque[int] = collections.deque()  # slots to recycle
        self._recycle_deadline = 0.0
        self._signals: collections.deque[int] = collections.deque()
        self._wakeup: tuple[int, int] | None = None
        self._selector: selectors.BaseSelector | None = None
        self._pid = os.getpid()
        self.forced = False
        """A worker had to be killed while stopping."""

    @staticmethod
    def counters_for(workers: int) -> int:
        """Worker processes that can be alive at once: the workers, a starting
        replacement, and the retiring workers of up to one recycle."""
        return 2 * workers + 1

    # -- the loop ----------------------------------------------------------------

    def run(self) -> int:
        """Fork the workers and supervise them until stopped; the exit code."""
        rfd, wfd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._wakeup = (rfd, wfd)
        self._selector = selector = selectors.DefaultSelector()
        selector.register(rfd, selectors.EVENT_READ)
        previous_fd = signal.set_wakeup_fd(wfd, warn_on_full_buffer=False)
        previous = {sig: signal.signal(sig, self._queue_signal) for sig in WATCHED}
        try:
            now = time.monotonic()
            for slot in self._slots:
                self._spawn(slot, WorkerRole.SERVING, now)
            while self.children or self.state is SupervisorState.RUNNING:
                selector.select(self._wait_s(time.monotonic()))
                _drain(rfd)
                while self._signals:
                    self._on_signal(self._signals.popleft())
                self._reap()
                self._tick(time.monotonic())
        finally:
            for sig, handler in previous.items():
                if handler is not None:  # None: set outside Python, cannot be restored
                    signal.signal(sig, handler)
            signal.set_wakeup_fd(previous_fd)
            selector.close()
            os.close(rfd)
            os.close(wfd)
        return 1 if self.forced else 0

    def _queue_signal(self, signum: int, frame: FrameType | None) -> None:
        self._signals.append(signum)

    def _wait_s(self, now: float) -> float:
        waits = [MAX_WAIT_S]
        if self.state is SupervisorState.RUNNING and self._free:
            waits += [s.restart_at - now for s in self._slots if s.restart_at is not None]
        if any(c.role is WorkerRole.STARTING for c in self.children.values()):
            waits.append(READY_POLL_S)
        waits += [c.kill_at - now for c in self.children.values() if c.kill_at is not None]
        return max(0.0, min(waits))

    def _on_signal(self, signum: int) -> None:
        if signum == signal.SIGHUP:
            if self.tenants is not None:
                self.tenants.reload()  # in place: no worker recycled, no session dropped
            elif self.state is SupervisorState.RUNNING:
                self._recycle.extend(s.index for s in self._slots if s.index not in self._recycle)
                log.info("SIGHUP: recycling the workers one at a time; old ones drain")
        elif signum in (signal.SIGTERM, signal.SIGINT):
            self._stop(signal.Signals(signum).name)

    def _stop(self, why: str) -> None:
        if self.state is SupervisorState.STOPPING:
            return
        self.state = SupervisorState.STOPPING
        log.info("%s: stopping %d worker(s)", why, len(self.children))
        if self._listener is not None:  # no restarts from now on: no forks need it
            self._listener.close()
        self._recycle.clear()
        for slot in self._slots:
            slot.restart_at = None
        now = time.monotonic()
        for child in self.children.values():
            if child.role is not WorkerRole.RETIRING:
                self._terminate(child, now)

    def _tick(self, now: float) -> None:
        if self.state is SupervisorState.RUNNING:
            for child in list(self.children.values()):
                if child.role is WorkerRole.SERVING and self._ready[child.counter] == _RETIRING:
                    self._replace_retiring(child, now)
            for slot in self._slots:
                if slot.restart_at is not None and slot.restart_at <= now and self._free:
                    slot.restart_at = None
                    self._spawn(slot, WorkerRole.SERVING, now)
            self._advance_recycle(now)
        for child in list(self.children.values()):
            if child.kill_at is not None and child.kill_at <= now:
                child.kill_at = None
                log.warning(
                    "worker %d (pid %d) still running %.1f s after SIGTERM; killing it",
                    child.slot, child.pid, self.stop_grace_s,
                )  # fmt: skip
                if self.state is SupervisorState.STOPPING:
                    self.forced = True
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child.pid, signal.SIGKILL)

    # -- workers -------------------------------------------------------------------

    def _spawn(self, slot: _Slot, role: WorkerRole, now: float) -> bool:
        counter = self._free.pop()
        self._ready[counter] = 0
        # Blocked across fork: a signal for the new worker waits until it has its own handlers.
        signal.pthread_sigmask(signal.SIG_BLOCK, WATCHED)
        try:
            pid = os.fork()
        except OSError as exc:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, WATCHED)
            self._free.append(counter)
            log.error("cannot fork worker %d: %s", slot.index, exc)
            if role is WorkerRole.SERVING:
                self._schedule_restart(slot, now, now, f"could not be forked ({exc})")
            return False
        if pid == 0:
            self._worker(counter)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, WATCHED)
        self.children[pid] = _Child(pid, slot.index, counter, role, now)
        return True

    def _worker(self, counter: int) -> NoReturn:
        """The forked worker process: set up, serve, exit (never returns to the loop)."""
        code = 1
        try:
            _die_with_parent()
            if os.getppid() != self._pid:
                os._exit(1)  # the supervisor died before prctl took effect
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGHUP, signal.SIG_IGN)  # SIGHUP is the supervisor's
            for sig in (signal.SIGCHLD, signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, signal.SIG_DFL)
            if self._selector is not None:
                self._selector.close()
            if self._wakeup is not None:
                for fd in self._wakeup:
                    os.close(fd)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, WATCHED)
            self.session_slots.bind(counter)
            if self.metrics is not None:
                self.metrics.bind(counter)
            ready = self._ready

            def serving() -> None:
                ready[counter] = _SERVING

            def retiring() -> None:
                ready[counter] = _RETIRING

            code = self._run_worker(self.session_slots, serving, retiring)
        except BaseException:
            log.exception("worker (pid %d) failed", os.getpid())
        finally:
            os._exit(code)

    def _replace_retiring(self, child: _Child, now: float) -> None:
        """``child`` drains on its own to be replaced: fork its replacement now."""
        child.role = WorkerRole.RETIRING
        child.kill_at = now + self.stop_grace_s
        slot = self._slots[child.slot]
        slot.restart_at = now  # forked by this tick, or once a counter is free
        log.warning(
            "worker %d (pid %d) asked to be replaced (see its log); it drains its sessions "
            "while a new worker takes its place",
            child.slot, child.pid,
        )  # fmt: skip

    def _terminate(self, child: _Child, now: float) -> None:
        """SIGTERM ``child``: it stops accepting and drains; SIGKILL after the grace."""
        child.role = WorkerRole.RETIRING
        child.kill_at = now + self.stop_grace_s
        with contextlib.suppress(ProcessLookupError):
            os.kill(child.pid, signal.SIGTERM)

    def _find(self, slot: int, role: WorkerRole) -> _Child | None:
        for child in self.children.values():
            if child.slot == slot and child.role is role:
                return child
        return None

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            child = self.children.pop(pid, None)
            if child is None:
                continue
            # Dead and reaped: no process writes its counter any more.
            self.session_slots.forget_worker(child.counter)
            if self.metrics is not None:
                self.metrics.retire(child.counter)
            if self._ready[child.counter] == _RETIRING and child.role is WorkerRole.SERVING:
                child.role = WorkerRole.RETIRING  # it drained to be replaced before we saw it
                self._replace_retiring(child, time.monotonic())
            self._ready[child.counter] = 0
            self._free.append(child.counter)
            self._exited(child, status, time.monotonic())

    def _exited(self, child: _Child, status: int, now: float) -> None:
        how = describe_exit(status)
        name = f"worker {child.slot} (pid {child.pid})"
        if child.role is WorkerRole.RETIRING or self.state is SupervisorState.STOPPING:
            log.info("%s %s", name, how)
            return
        if child.role is WorkerRole.STARTING:
            current = self._find(child.slot, WorkerRole.SERVING)
            log.error(
                "replacement %s %s before serving; %s keeps serving",
                name, how, f"pid {current.pid}" if current else "the old worker",
            )  # fmt: skip
            self._end_recycle(child.slot)
            return
        successor = self._find(child.slot, WorkerRole.STARTING)
        if successor is not None:  # mid-recycle: the replacement takes over
            successor.role = WorkerRole.SERVING
            self._end_recycle(child.slot)
            log.error("%s %s; its replacement (pid %d) takes over", name, how, successor.pid)
            return
        slot = self._slots[child.slot]
        if os.WIFEXITED(status) and os.WEXITSTATUS(status) == RECYCLE_EXIT_CODE:
            slot.restart_at = now  # not a crash: no backoff, nothing counted
            log.warning(
                "%s ended itself to be replaced (exit code %d: its event loop was stuck past "
                "--stall-limit; see its log); starting a new worker now",
                name, RECYCLE_EXIT_CODE,
            )  # fmt: skip
            return
        self._schedule_restart(slot, now, child.started, f"(pid {child.pid}) {how}")

    def _schedule_restart(self, slot: _Slot, now: float, started: float, how: str) -> None:
        """Restart ``slot`` after its backoff delay, and report the crash (rate-limited)."""
        if now - started >= STABLE_AFTER_S:
            slot.crashes = 0
        delay = min(self.restart_max_delay, BACKOFF_BASE_S * 2.0 ** min(slot.crashes, 40))
        slot.crashes += 1
        slot.restart_at = now + delay
        held = slot.crash_log.report(now)
        if held is None:
            return
        not_logged = f"; {held} more crash(es) of this worker since the last report" if held else ""
        log.error(
            "worker %d %s after %.1f s; restarting it in %.2f s (crash %d in a row%s)",
            slot.index, how, now - started, delay, slot.crashes, not_logged,
        )  # fmt: skip

    # -- SIGHUP ----------------------------------------------------------------------

    def _advance_recycle(self, now: float) -> None:
        """Move the rolling recycle on: fork the head slot's replacement, or switch to it."""
        while self._recycle:
            index = self._recycle[0]
            current = self._find(index, WorkerRole.SERVING)
            successor = self._find(index, WorkerRole.STARTING)
            if successor is None:
                if current is None:  # crashed: its restart is a fresh worker anyway
                    self._recycle.popleft()
                    continue
                if not self._free:
                    return  # wait for a retiring worker to exit
                if not self._spawn(self._slots[index], WorkerRole.STARTING, now):
                    self._recycle.popleft()
                    continue
                self._recycle_deadline = now + READY_TIMEOUT_S
                return
            if self._ready[successor.counter]:
                successor.role = WorkerRole.SERVING
                self._recycle.popleft()
                if current is not None:
                    self._terminate(current, now)
                    log.info(
                        "worker %d recycled: pid %d serves, pid %d drains its sessions",
                        index, successor.pid, current.pid,
                    )  # fmt: skip
                continue
            if now < self._recycle_deadline:
                return
            log.error(
                "replacement worker %d (pid %d) not serving after %.0f s; killing it, "
                "the old worker keeps serving",
                index, successor.pid, READY_TIMEOUT_S,
            )  # fmt: skip
            successor.role = WorkerRole.RETIRING
            successor.kill_at = None
            with contextlib.suppress(ProcessLookupError):
                os.kill(successor.pid, signal.SIGKILL)
            self._recycle.popleft()

    def _end_recycle(self, slot: int) -> None:
        if self._recycle and self._recycle[0] == slot:
            self._recycle.popleft()


def describe_exit(status: int) -> str:
    """``exited with code N`` or ``killed by SIGNAME``, from a wait status."""
    code = os.waitstatus_to_exitcode(status)
    if code >= 0:
        return f"exited with code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    return f"killed by {name}"


def _drain(fd: int) -> None:
    with contextlib.suppress(BlockingIOError):
        while os.read(fd, 512):
            pass


def _die_with_parent() -> None:
    """Ask Linux to SIGTERM this worker if the supervisor dies (no orphaned workers)."""
    with contextlib.suppress(OSError, AttributeError):  # not Linux
        die_with_parent(signal.SIGTERM)

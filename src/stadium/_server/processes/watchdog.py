"""The worker watchdog: event-loop stalls, resident memory and stuck threads.

An environment can wedge a worker in ways no request timeout catches: an async
``step`` that never yields (a busy loop, a blocking call inside ``async def``),
an inline call that never returns, memory that only grows, threads stuck in
calls nobody waits for. :class:`Watchdog` watches one worker for all three:

* **Heartbeat**: a timer on the event loop writes ``time.monotonic()`` every
  :data:`HEARTBEAT_S` (no per-step cost). A daemon thread checks it. A loop that
  has not beaten for over :data:`STALL_LOG_S` is *stalled*: logged at WARNING
  with the stack the loop's thread is running (at most one such report per
  :data:`STALL_LOG_INTERVAL_S`) and counted. Past ``stall_limit`` the worker is
  beyond saving: the loop cannot drain anything, so the thread logs at ERROR
  and ends the process at once with
  :data:`~stadium._util.process.RECYCLE_EXIT_CODE`; the sessions it held are lost
  (their clients see the connection drop). The supervisor forks a replacement at
  once; a single worker exits for its process manager to restart it.
* **Memory**: every :data:`SAMPLE_S` the loop reads the process's resident
  memory; past ``max_memory_mib`` it asks to be recycled (``on_recycle``) with a
  WARNING giving the figures.
* **Stuck threads**: the same sampling reads the invoker's count of threads stuck
  in abandoned calls; past its limit, it asks to be recycled.

Asking to be recycled is graceful (the loop is alive): the server stops
accepting, drains its sessions as on SIGTERM and exits with the recycle code
(see ``server._serve_until_signal``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable

from stadium._util.process import RECYCLE_EXIT_CODE, flush_logs, rss_bytes
from stadium._util.throttle import Throttle

log = logging.getLogger("stadium.watchdog")

HEARTBEAT_S = 0.25
"""How often the event loop writes its heartbeat (and the thread checks it)."""
STALL_LOG_S = 1.0
"""A loop that has not beaten for this long is stalled: logged with its stack."""
STALL_LOG_INTERVAL_S = 30.0
"""At most one stall report per interval (the next counts those held back)."""
SAMPLE_S = 1.0
"""How often resident memory and stuck threads are checked."""
STACK_FRAMES = 16
"""The innermost frames of the loop's stack shown in a stall report."""
MIB = 1024 * 1024


class Watchdog:
    """Watches one worker's event loop, memory and stuck threads (see the module docstring).

    Args:
        loop: the worker's running event loop.
        stall_limit: seconds the loop may be stuck before the process exits with
            the recycle code (0: no heartbeat thread at all).
        max_memory_mib: resident memory, in MiB, past which ``on_recycle`` is
            called (0: not checked).
        stuck_threads: how many pool threads are stuck now, and the limit past
            which ``on_recycle`` is called (``None``: not checked).
        on_recycle: called once, on the loop, with the reason, when the worker
            should be drained and replaced.
        exit: ends the process (tests replace it).
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        *,
        stall_limit: float,
        max_memory_mib: int,
        stuck_threads: Callable[[], tuple[int, int]] | None,
        on_recycle: Callable[[str], None],
        exit: Callable[[int], object] = os._exit,
    ) -> None:
        self.loop = loop
        self.stall_limit = stall_limit
        self.max_memory_mib = max_memory_mib
        self._stuck_threads = stuck_threads
        self._on_recycle: Callable[[str], None] | None = on_recycle
        self._exit = exit
        self.stalls = 0
        """Stalls over :data:`STALL_LOG_S` seen so far."""
        self.longest_stall_s = 0.0
        self.beat = time.monotonic()
        self._beats = 0
        self._timer: asyncio.TimerHandle | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop_thread = threading.get_ident()
        self._log = Throttle(STALL_LOG_INTERVAL_S)

    def start(self) -> None:
        """Start the heartbeat (call on the loop's thread) and, with a stall limit, the thread."""
        self._loop_thread = threading.get_ident()
        if self.max_memory_mib and rss_bytes() > self.max_memory_mib * MIB:
            log.error(
                "this worker already holds %.0f MiB at start, over --max-worker-memory %d MiB: "
                "the cap is ignored (it would replace every worker at once, forever); raise it",
                rss_bytes() / MIB, self.max_memory_mib,
            )  # fmt: skip
            self.max_memory_mib = 0
        self.beat = time.monotonic()
        self._timer = self.loop.call_later(HEARTBEAT_S, self._heartbeat)
        if self.stall_limit > 0:
            self._thread = threading.Thread(
                target=self._watch, name="stadium-watchdog", daemon=True
            )
            self._thread.start()

    def stop(self) -> None:
        """Stop the heartbeat and the thread (the worker is stopping anyway)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(2 * HEARTBEAT_S)

    # -- on the loop ---------------------------------------------------------------

    def _heartbeat(self) -> None:
        self.beat = time.monotonic()
        self._timer = self.loop.call_later(HEARTBEAT_S, self._heartbeat)
        self._beats += 1
        if self._beats * HEARTBEAT_S >= SAMPLE_S:
            self._beats = 0
            self.sample()

    def sample(self) -> None:
        """Check memory and stuck threads now; ask for a recycle past a limit."""
        if self._on_recycle is None:
            return
        if self.max_memory_mib:
            rss = rss_bytes()
            if rss > self.max_memory_mib * MIB:
                self._recycle(
                    f"resident memory {rss / MIB:.0f} MiB is over --max-worker-memory "
                    f"{self.max_memory_mib} MiB"
                )
                return
        if self._stuck_threads is not None:
            stuck, limit = self._stuck_threads()
            if stuck > limit:
                self._recycle(
                    f"{stuck} threads are stuck in abandoned env calls (more than {limit}, "
                    "4 x the env pool's core of cpus+4)"
                )

    def _recycle(self, why: str) -> None:
        on_recycle, self._on_recycle = self._on_recycle, None
        if on_recycle is not None:
            log.warning("%s: this worker (pid %d) stops taking sessions, drains them and "
                        "is replaced", why, os.getpid())  # fmt: skip
            on_recycle(why)

    # -- on the watchdog thread -------------------------------------------------------

    def _watch(self) -> None:
        stalled_since = 0.0
        while not self._stop.wait(HEARTBEAT_S):
            now = time.monotonic()
            lag = now - self.beat
            if lag <= STALL_LOG_S:
                if stalled_since:
                    log.warning(
                        "the event loop ran again after a stall of %.1f s", now - stalled_since
                    )
                    stalled_since = 0.0
                continue
            if not stalled_since:
                stalled_since = self.beat
                self.stalls += 1
                self._report_stall(lag)
            self.longest_stall_s = max(self.longest_stall_s, lag)
            if lag > self.stall_limit:
                self._give_up(lag)
                return

    def _loop_stack(self) -> str:
        frame = sys._current_frames().get(self._loop_thread)
        if frame is None:
            return "  (the loop's thread is gone)\n"
        return "".join(traceback.format_stack(frame, limit=STACK_FRAMES))

    def _report_stall(self, lag: float) -> None:
        held = self._log.report(time.monotonic())
        if held is None:
            return
        log.warning(
            "the event loop has been stalled for %.1f s (an env call that does not yield: a "
            "busy loop or a blocking call in async code?); its sessions get no replies "
            "meanwhile, and past --stall-limit %g s the worker is replaced%s. The loop is "
            "running:\n%s",
            lag, self.stall_limit,
            f" ({held} more stall(s) since the last report)" if held else "",
            self._loop_stack(),
        )  # fmt: skip

    def _give_up(self, lag: float) -> None:
        log.error(
            "the event loop has been stuck for %.1f s, over --stall-limit %g s: ending this "
            "worker (pid %d, exit code %d) so that it is replaced; a stuck loop cannot drain, "
            "so its sessions are lost. The loop is running:\n%s",
            lag, self.stall_limit, os.getpid(), RECYCLE_EXIT_CODE, self._loop_stack(),
        )  # fmt: skip
        flush_logs()
        self._exit(RECYCLE_EXIT_CODE)

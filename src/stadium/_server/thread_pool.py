"""The worker's thread pool for blocking sync env calls: grows with demand, to a bound.

One design for two needs (issues 22 and 23): N sessions blocked in sync calls run
concurrently (OpenEnv gives each session an executor of its own), and calls that
never return cannot wedge the worker. :class:`ElasticPool` starts a thread whenever
a call is submitted and no idle thread is waiting for it, up to ``limit`` threads
(``--executor-threads``; by default the worker's session capacity, see
:func:`auto_limit`), since each session has at most one call running at a time. An
idle thread above ``core`` exits after :data:`IDLE_S`. A thread running a call that
was abandoned (timed out, its session gone) can be :meth:`ElasticPool.write_off`:
it no longer counts against ``limit``, so a replacement can start; it counts again
(and serves on) if its call ever returns.

Memory: a thread blocked in a call costs ~16 KiB resident here (its stack is
reserved, not touched; measured with 1,000 and 8,192 threads, see BENCHMARKS.md), a
session of OpenEnv ~112 KB: a thread per running call is cheap next to a session.

Threads are daemons: a call that never returns does not hold the process's exit
(``server._exit_past_stuck_threads`` still ends it with ``os._exit``).
"""

from __future__ import annotations

import collections
import concurrent.futures
import itertools
import threading
from collections.abc import Callable
from typing import Any

#: An idle thread above the core count exits after this many seconds.
IDLE_S = 30.0
#: The most threads :func:`auto_limit` gives (a machine has a finite pid space).
MAX_AUTO_THREADS = 4096


def auto_limit(max_sessions: int, core: int) -> int:
    """The default bound: one thread per session the worker can hold (every session may
    be in a blocking call at once), at least ``core``, at most :data:`MAX_AUTO_THREADS`."""
    return max(core, min(max_sessions, MAX_AUTO_THREADS))


class _Item:
    __slots__ = ("args", "fn", "future")

    def __init__(
        self, future: concurrent.futures.Future[Any], fn: Callable[..., Any], args: tuple[Any, ...]
    ) -> None:
        self.future = future
        self.fn = fn
        self.args = args

    def run(self) -> None:
        future = self.future
        if not future.set_running_or_notify_cancel():
            return
        try:
            result = self.fn(*self.args)
        except BaseException as exc:
            future.set_exception(exc)
            del self, exc  # no cycle through the traceback
        else:
            future.set_result(result)


class ElasticPool(concurrent.futures.Executor):
    """A thread pool that grows with demand up to ``limit`` live threads (see module doc).

    Args:
        core: threads kept when idle (started on demand too).
        limit: live threads at most (written-off ones not counted).
        name: thread name prefix (``name_0``, ``name_1``, ...).
        idle_s: seconds an idle thread above ``core`` waits for work before exiting.
    """

    def __init__(self, core: int, limit: int, name: str, idle_s: float = IDLE_S) -> None:
        if not 1 <= core <= limit:
            raise ValueError(f"need 1 <= core <= limit, got core={core}, limit={limit}")
        self.core = core
        self.limit = limit
        self.name = name
        self.idle_s = idle_s
        self._cond = threading.Condition(threading.Lock())
        self._queue: collections.deque[_Item] = collections.deque()
        self._numbers = itertools.count()
        self._shut = False
        self.threads = 0
        """Threads alive (written-off ones included)."""
        self.idle = 0
        """Threads waiting for work."""
        self.written_off = 0
        """Threads running an abandoned call, not counted against ``limit``."""
        self.peak = 0
        """The most live threads at once so far."""
        self.saturated = 0
        """Calls that found every one of ``limit`` threads busy and had to wait."""

    @property
    def live(self) -> int:
        """Threads counted against ``limit``."""
        return self.threads - self.written_off

    @property
    def busy(self) -> int:
        """Live threads running a call."""
        return max(0, self.live - self.idle)

    @property
    def queued(self) -> int:
        """Calls waiting for a thread."""
        return len(self._queue)

    def submit(
        self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any
    ) -> concurrent.futures.Future[Any]:
        """Run ``fn(*args, **kwargs)`` on a pool thread: an idle one, a new one (below
        ``limit``), or the first to free up."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        call = (lambda: fn(*args, **kwargs)) if kwargs else fn
        item = _Item(future, call, () if kwargs else args)
        with self._cond:
            if self._shut:
                raise RuntimeError("the worker's thread pool is shut down")
            queue = self._queue
            queue.append(item)
            if len(queue) <= self.idle:
                self._cond.notify()
                return future
            if self.threads - self.written_off < self.limit:
                if not self._start():
                    queue.remove(item)
                    raise RuntimeError(
                        "cannot start a thread for a blocking env call (the system's thread "
                        "limit?) and the pool has none"
                    )
            else:
                self.saturated += 1
        return future

    def _start(self) -> bool:  # with the lock held
        """Start a thread; ``False`` when none could be started and the pool has none (a
        queued call would wait forever)."""
        self.threads += 1
        thread = threading.Thread(
            target=self._work, name=f"{self.name}_{next(self._numbers)}", daemon=True
        )
        try:
            thread.start()
        except RuntimeError:  # "can't start new thread": the queued call waits for one
            self.threads -= 1
            self.saturated += 1
            return self.threads > 0
        self.peak = max(self.peak, self.threads - self.written_off)
        return True

    def _work(self) -> None:
        cond, queue = self._cond, self._queue
        while True:
            with cond:
                while not queue:
                    if self._shut:
                        self.threads -= 1
                        return
                    self.idle += 1
                    woken = cond.wait(self.idle_s)
                    self.idle -= 1
                    if not woken and not queue and self.threads - self.written_off > self.core:
                        self.threads -= 1
                        return
                item = queue.popleft()
            item.run()
            del item

    def write_off(self, future: concurrent.futures.Future[Any]) -> None:
        """The thread running ``future``'s call is stuck in it (abandoned): stop counting
        it against ``limit`` until the call returns."""
        with self._cond:
            if future.done():
                return
            self.written_off += 1
        future.add_done_callback(self._written_back)

    def _written_back(self, _future: concurrent.futures.Future[Any]) -> None:
        with self._cond:
            self.written_off -= 1

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """No more calls; idle threads exit. ``cancel_futures``: queued calls are cancelled.
        ``wait`` is ignored: running calls are never waited for (they may never return)."""
        with self._cond:
            self._shut = True
            if cancel_futures:
                while self._queue:
                    self._queue.popleft().future.cancel()
            self._cond.notify_all()

"""How an environment call runs (task, thread pool or inline), carried out in one place.

An environment method is either a coroutine function (run as an *eager* task
on the event loop where Python has them, so a call that never suspends
completes in place), a blocking sync function (run on the worker's thread pool,
:class:`~stadium._server.thread_pool.ElasticPool`, which grows with demand up to a bound
tied to the session capacity, so N sessions blocked in sync calls run at once),
or a non-blocking sync
function (``blocking = False``: called inline). That decision is made once,
when the env class is compiled (:class:`~stadium._env.spec.CallMode`);
:class:`Invoker` carries a call out and reports its outcome to a callback, at
once when the call did not wait (no future, no task switch: the per-step path
of a session). Sessions, the HTTP endpoints and environment teardown all go
through it.

**Started calls** (``STARTED``). Such a function returns, instead of a coroutine (run
as a ``TASK``), a :class:`Started`: a call already under way (an isolated env's ``step``,
whose request is sent) that reports its outcome itself, from an event-loop callback (the
reply's reader), once it is given its ``on_done``, token and limit
(:meth:`Started.start`): no task, no future, no timer of the invoker's. It keeps the
contract of any call that waits: it is the pending call :meth:`Invoker.run` returns
(``done()``, ``cancel()``: ``on_done`` then gets :class:`asyncio.CancelledError`), it
reports exactly once, and past its limit it reports :class:`~stadium.CallTimeoutError`
and counts it in :attr:`Invoker.timeouts`.

**Time limits.** A call that waits (a suspended task, a pool call) may be given
a limit (``--step-timeout``, or a request's ``timeout_s``): a timer is armed
only then (a call that completed at once, or an inline call, needs none; with
no limit nothing is armed at all). When it fires, the call is abandoned (its
task cancelled, its pool future cancelled) and its outcome is
:class:`~stadium.CallTimeoutError`. An inline call cannot be interrupted: the
event-loop watchdog (:mod:`stadium._server.processes.watchdog`) covers those.

**Hung and stuck threads.** With no time limit (the default) a call that never
returns holds its thread, and its session waits; the pool grows past it, so other
sessions' calls still run (up to the bound, one thread per session). A pool call
that is abandoned while it runs (timed out, or its session gone) cannot be
stopped: Python cannot kill a thread. If it is still running
:data:`STUCK_GRACE_S` later its thread is *written off*: counted in
:attr:`Invoker.stuck`, logged (rate-limited), and no longer counted against the
pool's bound (:meth:`~stadium._server.thread_pool.ElasticPool.write_off`), so a
replacement thread can start. Past :attr:`Invoker.stuck_limit` the worker asks to
be replaced (see :mod:`stadium._server.processes.watchdog`). A stuck thread that finally
returns is no longer counted. The pool's growth past its core and every call that
finds the bound reached are logged (rate-limited) and in ``/metrics``
(``stadium_executor_*``, docs/METRICS.md).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import os
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from types import CoroutineType
from typing import Any, Protocol

from stadium._env.spec import CallMode
from stadium._errors import CallTimeoutError
from stadium._server.thread_pool import ElasticPool
from stadium._util.throttle import Throttle

log = logging.getLogger("stadium.invoke")

OnDone = Callable[[Any, Any, "BaseException | None"], None]
"""``on_done(token, result, error)``: the outcome of one call (see :meth:`Invoker.run`)."""


class Pending(Protocol):
    """A call that waits (a task, a pool call's future, a :class:`Started`)."""

    def done(self) -> bool: ...
    def cancel(self) -> bool: ...


class Started:
    """A call under way that reports its outcome to a callback (see the module docstring):
    what a ``STARTED`` function returns (or a coroutine)."""

    __slots__ = ()

    def start(self, invoker: Invoker, on_done: OnDone, token: Any, limit: float) -> Pending:
        """Report the outcome to ``on_done(token, result, error)`` (later, from the loop),
        under ``limit`` seconds (0: none); returns the pending call."""
        raise NotImplementedError


#: Tasks run synchronously up to their first suspension (``eager_start``), so a
#: call that never waits completes with no event-loop trip (Python >= 3.12).
EAGER_TASKS = sys.version_info >= (3, 12)


async def awaited(value: Awaitable[Any]) -> Any:
    """``value`` awaited: what an env gave that is awaitable (an async ``state``, an
    isolated env's ``state`` read in its process), to run as a ``TASK`` call, so that
    the invoker's limit applies to it as to any other env call."""
    return await value


# Module constants: an enum member looked up on its class costs ~20 ns, per step.
_INLINE = CallMode.INLINE
_TASK = CallMode.TASK
_STARTED = CallMode.STARTED
_CORO = CoroutineType

#: An abandoned pool call still running this long after is counted as a stuck thread.
STUCK_GRACE_S = 0.5
#: At most one stuck-thread warning per interval (the next counts those held back).
STUCK_LOG_INTERVAL_S = 10.0
#: Stuck threads, as a multiple of the pool's core size, past which the worker asks to be
#: replaced.
STUCK_LIMIT_FACTOR = 4
#: At most one pool-growth or pool-full log line per interval.
POOL_LOG_INTERVAL_S = 10.0
#: Name prefix of the pool threads (``stadium-env_0``, ...).
THREAD_PREFIX = "stadium-env"


class Invoker:
    """Runs environment calls for one worker; owns the worker's thread pool.

    Args:
        threads: the most live threads of the pool for blocking sync calls
            (:class:`~stadium._server.thread_pool.ElasticPool`; threads start on demand).
        timeout: the default limit, in seconds, of a call that waits (0: none);
            ``--step-timeout``.
        core: threads the pool keeps when idle (at most ``threads``).
    """

    __slots__ = (
        "_grown",
        "_lock",
        "_log",
        "_pool_log",
        "_saturated",
        "executor",
        "stuck",
        "stuck_limit",
        "threads",
        "timeout",
        "timeouts",
    )

    def __init__(self, threads: int, timeout: float = 0.0, core: int | None = None) -> None:
        core = min(threads, core if core is not None else min(32, (os.cpu_count() or 1) + 4))
        self.threads = threads
        self.timeout = timeout
        self.executor = ElasticPool(core, threads, THREAD_PREFIX)
        """The pool (``live``, ``busy``, ``queued``, ``peak``, ``saturated`` for metrics)."""
        self._lock = threading.Lock()
        self._log = Throttle(STUCK_LOG_INTERVAL_S)
        self._pool_log = Throttle(POOL_LOG_INTERVAL_S)
        self._grown = core
        self._saturated = 0
        self.stuck = 0
        """Pool threads running an abandoned call right now (written off)."""
        self.stuck_limit = STUCK_LIMIT_FACTOR * core
        """Past this many stuck threads the worker should be replaced."""
        self.timeouts = 0
        """Calls abandoned because they ran past their limit."""

    def run(
        self,
        loop: asyncio.AbstractEventLoop,
        mode: CallMode,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        on_done: OnDone,
        token: Any = None,
        limit: float | None = None,
    ) -> Pending | None:
        """Start ``fn(*args)`` as ``mode`` says; report its outcome to ``on_done`` once.

        ``on_done(token, result, error)`` gets ``error`` ``None`` on success, the
        exception ``fn`` raised, :class:`~stadium.CallTimeoutError` (context
        ``timeout_s``) when the call waited longer than ``limit`` seconds (``None``:
        the invoker's default; 0: no limit), or :class:`asyncio.CancelledError`. It is
        called before this returns when the call did not wait (an inline call, a
        task that never suspended; then ``None`` is returned), else later from the
        event loop, and the pending future is returned (cancel it to abandon the
        call). A ``STARTED`` function's :class:`Started` reports through itself.
        Never raises for what ``fn`` raises.
        """
        if mode is _INLINE:
            try:
                result = fn(*args)
            except Exception as exc:
                on_done(token, None, exc)
                return None
            on_done(token, result, None)
            return None
        try:
            if mode is _TASK:  # every async step: keywords spelled out, no **kwargs dict
                cf = pool = None
                if EAGER_TASKS:
                    fut: asyncio.Future[Any] = asyncio.Task(
                        fn(*args),
                        loop=loop,
                        eager_start=True,  # type: ignore[call-arg,unused-ignore]
                    )
                else:
                    fut = loop.create_task(fn(*args))
            elif mode is _STARTED:  # an isolated step: it reports itself (or is a coroutine)
                started = fn(*args)
                if type(started) is not _CORO:
                    limit = self.timeout if limit is None else limit
                    return started.start(self, on_done, token, limit)  # type: ignore[no-any-return]
                cf = pool = None
                if EAGER_TASKS:
                    fut = asyncio.Task(
                        started,
                        loop=loop,
                        eager_start=True,  # type: ignore[call-arg,unused-ignore]
                    )
                else:
                    fut = loop.create_task(started)
            else:
                pool = self.executor
                cf = pool.submit(fn, *args)
                fut = asyncio.wrap_future(cf, loop=loop)
                if pool.peak > self._grown or pool.saturated > self._saturated:
                    self._pool_changed(pool)
        except Exception as exc:  # e.g. a coroutine function that raised before its coroutine
            on_done(token, None, exc)
            return None
        if fut.done():
            _settle(on_done, token, fut)
            return None
        return self.follow(loop, fut, cf, pool, on_done, token, limit)

    def follow(
        self,
        loop: asyncio.AbstractEventLoop,
        fut: asyncio.Future[Any],
        cf: concurrent.futures.Future[Any] | None,
        pool: concurrent.futures.Executor | None,
        on_done: OnDone,
        token: Any,
        limit: float | None = None,
    ) -> asyncio.Future[Any]:
        """Report the outcome of a call that waits (``fut``, not done) to ``on_done``, under
        the time limit (see :meth:`run`); returns ``fut``."""
        if limit is None:
            limit = self.timeout
        if limit > 0:
            deadline = _Deadline(self, fut, cf, pool, on_done, token, limit)
            deadline.timer = loop.call_later(limit, deadline.expire)
            fut.add_done_callback(deadline.settle)
        elif cf is None:
            fut.add_done_callback(functools.partial(_settle, on_done, token))
        else:
            fut.add_done_callback(functools.partial(self._settle_pool, cf, pool, on_done, token))
        return fut

    def bound(self, timeout_s: float | None) -> float:
        """The limit of a call whose request asked for ``timeout_s`` (OpenEnv's field):
        the smaller of it and the default; the default when ``None``."""
        if timeout_s is None or (self.timeout and self.timeout < timeout_s):
            return self.timeout
        return timeout_s

    async def call(
        self,
        loop: asyncio.AbstractEventLoop,
        mode: CallMode,
        fn: Callable[..., Any],
        *args: Any,
        limit: float | None = None,
    ) -> Any:
        """``fn(*args)`` run as ``mode`` says, awaited (for request/response code paths).

        Raises what ``fn`` raises, or :class:`~stadium.CallTimeoutError` past
        ``limit`` seconds (``None``: the invoker's default; 0: no limit).
        """
        waiter: asyncio.Future[Any] = loop.create_future()
        pending = self.run(loop, mode, fn, args, _resolve, waiter, limit)
        try:
            return await waiter
        finally:
            if pending is not None and not pending.done():
                pending.cancel()

    def shutdown(self) -> None:
        """Stop the pool without waiting for running calls; queued calls are cancelled."""
        self.executor.shutdown(wait=False, cancel_futures=True)

    def _pool_changed(self, pool: ElasticPool) -> None:
        """The pool grew to a new peak past its core, or a call found it full: say so
        (at most once per :data:`POOL_LOG_INTERVAL_S`)."""
        grew, full = pool.peak > self._grown, pool.saturated > self._saturated
        self._grown, self._saturated = pool.peak, pool.saturated
        held = self._pool_log.report(time.monotonic())
        if held is None:
            return
        if full:
            log.warning(
                "all %d env threads (--executor-threads) are busy in blocking env calls; "
                "%d call(s) wait for one (%d stuck in abandoned calls). Raise "
                "--executor-threads, or set --step-timeout if calls hang",
                pool.limit, pool.queued, self.stuck,
            )  # fmt: skip
        elif grew:
            log.info(
                "%d blocking env calls ran at once: the env thread pool grew to %d threads "
                "(bound %d, --executor-threads)",
                pool.busy, pool.peak, pool.limit,
            )  # fmt: skip

    # -- abandoned pool calls -------------------------------------------------------

    def _settle_pool(
        self,
        cf: concurrent.futures.Future[Any],
        pool: concurrent.futures.Executor | None,
        on_done: OnDone,
        token: Any,
        fut: asyncio.Future[Any],
    ) -> None:
        if fut.cancelled() and not cf.done():  # running: asyncio's cancel could not stop it
            self._abandoned(cf, pool, fut.get_loop())
        _settle(on_done, token, fut)

    def _abandoned(
        self,
        cf: concurrent.futures.Future[Any],
        pool: concurrent.futures.Executor | None,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        """A pool call nobody waits for any more is still running: check on it soon."""
        if not loop.is_closed():
            loop.call_later(STUCK_GRACE_S, self._check_stuck, cf, pool)

    def _check_stuck(
        self, cf: concurrent.futures.Future[Any], pool: concurrent.futures.Executor | None
    ) -> None:
        if cf.done():
            return
        with self._lock:
            self.stuck += 1
        cf.add_done_callback(self._unstuck)
        if isinstance(pool, ElasticPool):  # its thread no longer counts against the bound
            pool.write_off(cf)
        held = self._log.report(time.monotonic())
        if held is not None:
            log.warning(
                "%d thread(s) stuck in abandoned blocking env calls (timed out or their "
                "session gone); Python cannot stop them, so they are written off and new "
                "threads serve later calls%s. Past %d stuck the worker asks to be replaced; "
                "set --step-timeout and check the env for calls that never return",
                self.stuck,
                f" ({held} more written off since the last report)" if held else "",
                self.stuck_limit,
            )  # fmt: skip

    def _unstuck(self, _cf: concurrent.futures.Future[Any]) -> None:
        with self._lock:  # on the thread that finally returned
            self.stuck -= 1


class _Deadline:
    """The time limit of one call that waits: the timer and the outcome's one report."""

    __slots__ = ("cf", "expired", "fut", "invoker", "limit", "on_done", "pool", "timer", "token")

    def __init__(
        self,
        invoker: Invoker,
        fut: asyncio.Future[Any],
        cf: concurrent.futures.Future[Any] | None,
        pool: concurrent.futures.Executor | None,
        on_done: OnDone,
        token: Any,
        limit: float,
    ) -> None:
        self.invoker = invoker
        self.fut = fut
        self.cf = cf
        self.pool = pool
        self.on_done = on_done
        self.token = token
        self.limit = limit
        self.timer: asyncio.TimerHandle | None = None
        self.expired = False

    def expire(self) -> None:
        """The limit passed: abandon the call and report the timeout now (a task that
        ignores its cancellation must not hold the reply back)."""
        self.timer = None
        if self.fut.done():
            return  # settled meanwhile; its callback is on its way
        self.expired = True
        self.invoker.timeouts += 1
        self.fut.cancel()
        self.on_done(
            self.token,
            None,
            CallTimeoutError(
                f"the call ran longer than its {self.limit:g} s limit", timeout_s=self.limit
            ),
        )

    def settle(self, fut: asyncio.Future[Any]) -> None:
        cf = self.cf
        if self.expired:
            if cf is not None and not cf.done():
                self.invoker._abandoned(cf, self.pool, fut.get_loop())
            return
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if cf is not None:
            self.invoker._settle_pool(cf, self.pool, self.on_done, self.token, fut)
        else:
            _settle(self.on_done, self.token, fut)


def _settle(on_done: OnDone, token: Any, fut: asyncio.Future[Any]) -> None:
    if fut.cancelled():
        on_done(token, None, asyncio.CancelledError())
        return
    exc = fut.exception()
    if exc is None:
        on_done(token, fut.result(), None)
    else:
        on_done(token, None, exc)


def _resolve(waiter: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if waiter.done():
        return
    if error is None:
        waiter.set_result(result)
    else:
        waiter.set_exception(error)


def running_pool_threads(wait_s: float) -> int:
    """How many env pool threads are still alive after waiting up to ``wait_s`` for them.

    Called once the pools are shut down (idle threads then exit at once): the ones
    left are running calls, possibly forever (stuck).
    """
    deadline = time.monotonic() + wait_s
    alive = 0
    for thread in threading.enumerate():
        if thread.name.startswith(THREAD_PREFIX):
            thread.join(max(0.0, deadline - time.monotonic()))
            alive += thread.is_alive()
    return alive

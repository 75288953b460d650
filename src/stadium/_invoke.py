"""How an environment call runs (task, thread pool or inline), carried out in one place.

An environment method is either a coroutine function (run as an *eager* task
on the event loop where Python has them, so a call that never suspends
completes in place), a blocking sync function (run on the worker's one bounded
thread pool, so threads stay flat as sessions grow), or a non-blocking sync
function (``blocking = False``: called inline). That decision is made once,
when the env class is compiled (:class:`~stadium._spec.CallMode`);
:class:`Invoker` carries a call out and reports its outcome to a callback, at
once when the call did not wait (no future, no task switch: the per-step path
of a session). Sessions, the HTTP endpoints and environment teardown all go
through it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import sys
from collections.abc import Callable
from typing import Any

from stadium._spec import CallMode

OnDone = Callable[[Any, Any, "BaseException | None"], None]
"""``on_done(token, result, error)``: the outcome of one call (see :meth:`Invoker.run`)."""

#: Tasks run synchronously up to their first suspension (``eager_start``), so a
#: call that never waits completes with no event-loop trip (Python >= 3.12).
EAGER_TASKS = sys.version_info >= (3, 12)

# Module constants: an enum member looked up on its class costs ~20 ns, per step.
_INLINE = CallMode.INLINE
_TASK = CallMode.TASK


class Invoker:
    """Runs environment calls for one worker; owns the worker's thread pool.

    Args:
        threads: size of the pool for blocking sync calls (created on first use).
    """

    __slots__ = ("_executor", "threads")

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None

    @property
    def executor(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                self.threads, thread_name_prefix="stadium-env"
            )
        return self._executor

    def run(
        self,
        loop: asyncio.AbstractEventLoop,
        mode: CallMode,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        on_done: OnDone,
        token: Any = None,
    ) -> asyncio.Future[Any] | None:
        """Start ``fn(*args)`` as ``mode`` says; report its outcome to ``on_done`` once.

        ``on_done(token, result, error)`` gets ``error`` ``None`` on success, the
        exception ``fn`` raised, or :class:`asyncio.CancelledError`. It is called
        before this returns when the call did not wait (an inline call, a task
        that never suspended; then ``None`` is returned), else later from the
        event loop, and the pending future is returned (cancel it to abandon the
        call). Never raises for what ``fn`` raises.
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
                if EAGER_TASKS:
                    fut: asyncio.Future[Any] = asyncio.Task(
                        fn(*args),
                        loop=loop,
                        eager_start=True,  # type: ignore[call-arg,unused-ignore]
                    )
                else:
                    fut = loop.create_task(fn(*args))
            else:
                fut = loop.run_in_executor(self.executor, fn, *args)
        except Exception as exc:  # e.g. a coroutine function that raised before its coroutine
            on_done(token, None, exc)
            return None
        if fut.done():
            _settle(on_done, token, fut)
            return None
        fut.add_done_callback(functools.partial(_settle, on_done, token))
        return fut

    async def call(
        self, loop: asyncio.AbstractEventLoop, mode: CallMode, fn: Callable[..., Any], *args: Any
    ) -> Any:
        """``fn(*args)`` run as ``mode`` says, awaited (for request/response code paths)."""
        waiter: asyncio.Future[Any] = loop.create_future()
        pending = self.run(loop, mode, fn, args, _resolve, waiter)
        try:
            return await waiter
        finally:
            if pending is not None and not pending.done():
                pending.cancel()

    def shutdown(self) -> None:
        """Stop the pool without waiting for running calls; queued calls are cancelled."""
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)


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

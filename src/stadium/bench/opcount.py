"""Operation counts: a deterministic, socket-free regression check of the server's per-step work.

Wall-clock and CPU-time thresholds are noise on a shared machine; the number of
function calls the server makes per request is not. :func:`count_ops` drives the
server's real per-session path (:class:`~stadium._server.runtime.Runtime`,
:class:`~stadium._server.sessions.runner.Session`, the protocol core, the environment) in an
event loop, exactly as the picows transport does (``Session(...)``, ``start()``,
``feed(message)`` per message, a channel with ``send``/``close``), but with an
in-memory channel (:class:`stadium.testing.MemoryChannel`) instead of a WebSocket,
and counts with :func:`sys.setprofile`:

* **Python calls**: ``call`` events (function entries and coroutine/generator
  resumptions);
* **C calls**: ``c_call`` events (builtins and extension functions called from
  Python code, e.g. msgspec's encode and decode).

**The harness's own work is excluded by location:** an event is not counted
when the function entered (``call``) or the calling function (``c_call``) is
defined in this module or in :mod:`stadium.testing`. The driver loop, the
in-memory channel and the futures it creates and resolves are therefore
invisible; everything the session runs,
including the asyncio/uvloop machinery it triggers, is counted. A
:class:`Session` stand-in that replies at once counts one call per step, its
own ``feed`` (see the tests).

Only the event loop's thread is profiled: a blocking sync environment's calls on
the thread pool are not counted (their loop-side cost is). The figures depend
on the Python version (eager tasks exist from 3.12) and little else.

Allocations per step are :func:`sys.getallocatedblocks` growth across the same
number of steps run without the profiler and with the cyclic GC off, so both
leaks and per-step cyclic garbage show up as growth.

Used by ``stadium bench ops`` and by ``tests/bench/test_opcount.py``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import sys
from collections.abc import Callable, Coroutine
from types import FrameType
from typing import Any

import msgspec

from stadium import testing
from stadium._core.frames import Request
from stadium._env.contract import Environment
from stadium._env.spec import EnvSpec
from stadium._server.config import ServerConfig
from stadium._server.loader import load_target
from stadium._server.processes.worker import Worker
from stadium._server.runtime import Runtime
from stadium._server.sessions.runner import Session
from stadium._util.process import new_event_loop
from stadium.testing import MemoryChannel

_UNCOUNTED = frozenset({__file__, testing.__file__})
"""Files whose calls are the harness's own: this module and the in-memory channel."""
_BENCHMARK_ACTION: dict[str, Any] = {"wait_seconds": 0}
_RESET = msgspec.json.encode(Request("reset", {}))
_CLOSE = msgspec.json.encode(Request("close"))
_WARMUP_STEPS = 8


@dataclasses.dataclass(frozen=True)
class OpCount:
    """What one step and one session lifecycle cost, in calls (see the module docstring).

    Attributes:
        target: the environment served.
        steps: steady-state steps measured (round-robin over ``sessions``).
        sessions: sessions open during the steady state.
        python_calls_per_step, c_calls_per_step: per step, steady state.
        python_calls_per_lifecycle, c_calls_per_lifecycle: per session
            open → reset → one step → close.
        blocks_per_step: growth of allocated memory blocks per step (0 without a leak).
        reply_bytes_per_step: mean size of a step's reply frame.
        replies: step replies received, in the fewer of the two step loops
            (should equal ``steps``).
        errors: error replies during the whole run (should be 0).
    """

    target: str
    steps: int
    sessions: int
    python_calls_per_step: float
    c_calls_per_step: float
    python_calls_per_lifecycle: float
    c_calls_per_lifecycle: float
    blocks_per_step: float
    reply_bytes_per_step: float
    replies: int
    errors: int

    def lines(self) -> list[str]:
        """The figures as aligned text lines."""
        return [
            f"target              {self.target} ({self.sessions} sessions, {self.steps} steps, "
            f"Python {sys.version_info[0]}.{sys.version_info[1]})",
            f"per step            {self.python_calls_per_step:9.2f} Python calls"
            f"  {self.c_calls_per_step:9.2f} C calls",
            f"per lifecycle       {self.python_calls_per_lifecycle:9.2f} Python calls"
            f"  {self.c_calls_per_lifecycle:9.2f} C calls   (open, reset, step, close)",
            f"blocks per step     {self.blocks_per_step:9.3f}",
            f"reply bytes / step  {self.reply_bytes_per_step:9.1f}",
            f"replies, errors     {self.replies}, {self.errors}",
        ]


class _Counter:
    """``sys.setprofile`` hook counting calls outside this module."""

    __slots__ = ("c_calls", "python_calls")

    def __init__(self) -> None:
        self.python_calls = 0
        self.c_calls = 0

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if event == "call":
            if frame.f_code.co_filename not in _UNCOUNTED:
                self.python_calls += 1
        elif event == "c_call" and frame.f_code.co_filename not in _UNCOUNTED:
            self.c_calls += 1

    def start(self) -> None:
        sys.setprofile(self)

    def stop(self) -> None:
        sys.setprofile(None)


SessionFactory = Callable[[Runtime, MemoryChannel], Any]
"""Builds a session from the runtime and its channel: :class:`Session`, or a stand-in."""


class _Driver:
    """Opens sessions, feeds them frames and awaits each reply, as a transport would."""

    def __init__(
        self, runtime: Runtime, step_frame: bytes, new_session: SessionFactory | None
    ) -> None:
        self.runtime = runtime
        self.step_frame = step_frame
        self.new_session: SessionFactory = new_session or Session
        self.loop = asyncio.get_running_loop()

    async def request(self, session: Any, channel: MemoryChannel, frame: bytes) -> None:
        reply = channel.sent()
        session.feed(frame)
        await reply

    async def open(self) -> tuple[Any, MemoryChannel]:
        channel = MemoryChannel(keep_frames=False)
        session = self.new_session(self.runtime, channel)
        session.start()
        await self.request(session, channel, _RESET)
        return session, channel

    async def lifecycle(self) -> None:
        session, channel = await self.open()
        await self.request(session, channel, self.step_frame)
        session.feed(_CLOSE)  # no reply; the server closes with 1000
        session.connection_lost()  # what the transport reports once the socket is gone

    async def steps(self, opened: list[tuple[Any, MemoryChannel]], steps: int) -> None:
        frame = self.step_frame
        n = len(opened)
        for i in range(steps):
            session, channel = opened[i % n]
            reply = channel.sent()
            session.feed(frame)
            await reply


async def _measure(
    spec: EnvSpec,
    step_frame: bytes,
    steps: int,
    sessions: int,
    new_session: SessionFactory | None,
) -> OpCount:
    config = ServerConfig(target=spec.name, max_sessions=sessions + 2)
    runtime = Worker.build(config, spec.env_cls).runtime
    driver = _Driver(runtime, step_frame, new_session)
    counter = _Counter()
    try:
        # Lifecycles: one to warm up, then ``sessions`` counted.
        await driver.lifecycle()
        counter.start()
        for _ in range(sessions):
            await driver.lifecycle()
        counter.stop()
        life_py, life_c = counter.python_calls, counter.c_calls

        opened = [await driver.open() for _ in range(sessions)]
        await driver.steps(opened, _WARMUP_STEPS * sessions)
        for _, channel in opened:
            channel.replies = channel.bytes = 0

        # Allocations: the same steps, without the profiler, with the cyclic GC off.
        gc_was_enabled = gc.isenabled()
        gc.collect()
        gc.disable()
        try:
            blocks_before = sys.getallocatedblocks()
            await driver.steps(opened, steps)
            blocks = sys.getallocatedblocks() - blocks_before
        finally:
            if gc_was_enabled:
                gc.enable()

        unprofiled_replies = sum(ch.replies for _, ch in opened)
        for _, channel in opened:
            channel.replies = channel.bytes = 0
        counter.python_calls = counter.c_calls = 0
        counter.start()
        await driver.steps(opened, steps)
        counter.stop()

        replies = min(unprofiled_replies, sum(ch.replies for _, ch in opened))
        reply_bytes = sum(ch.bytes for _, ch in opened)
        for session, _ in opened:
            session.connection_lost()
    finally:
        counter.stop()
        runtime.shutdown()
    return OpCount(
        target=spec.name,
        steps=steps,
        sessions=sessions,
        python_calls_per_step=counter.python_calls / steps,
        c_calls_per_step=counter.c_calls / steps,
        python_calls_per_lifecycle=life_py / sessions,
        c_calls_per_lifecycle=life_c / sessions,
        blocks_per_step=blocks / steps,
        reply_bytes_per_step=reply_bytes / steps,
        replies=replies,
        errors=sum(runtime.errors_total.values()),
    )


def _run(coro: Coroutine[Any, Any, OpCount]) -> OpCount:
    with asyncio.Runner(loop_factory=new_event_loop) as runner:  # the servers' loop
        return runner.run(coro)


def count_ops(
    target: str | type[Environment[Any, Any, Any]] = "benchmark",
    steps: int = 1000,
    sessions: int = 4,
    *,
    action: dict[str, Any] | None = None,
    new_session: SessionFactory | None = None,
) -> OpCount:
    """Count the calls the server makes per step and per session lifecycle.

    Args:
        target: what ``stadium serve`` would serve (a built-in name or
            ``module:Class``), or an environment class.
        steps: steady-state steps to count, round-robin over the sessions.
        sessions: sessions open during the steady state; also the number of
            lifecycles (open → reset → step → close) counted.
        action: the step's ``data`` (default: ``{"wait_seconds": 0}`` for an env
            named ``benchmark``, ``{}`` otherwise).
        new_session: stand-in for :class:`Session` (tests measure the harness with it).

    Runs its own event loop (uvloop when installed); call it outside one.

    Example:
        >>> ops = count_ops("benchmark", steps=100, sessions=2)
        >>> ops.replies, ops.errors
        (100, 0)
    """
    if steps < 1 or sessions < 1:
        raise ValueError("steps and sessions must be at least 1")
    spec = EnvSpec.of(load_target(target) if isinstance(target, str) else target)
    if action is None:
        action = _BENCHMARK_ACTION if spec.name == "benchmark" else {}
    return _run(_measure(spec, step_frame(action), steps, sessions, new_session))


def step_frame(action: Any) -> bytes:
    """The ``step`` frame of ``action`` that every counted step sends."""
    return msgspec.json.encode(Request("step", action))

"""``StepCall``'s races, made deterministic: a real :class:`EnvProcess` over a socket pair
(its far end plays the env process), a stand-in for the worker's isolation, and the reader
callback run by hand where the loop could run it (a handle queued in the same turn)."""

from __future__ import annotations

import asyncio
import itertools
import socket
import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from stadium._errors import EnvCrashedError, StadiumError
from stadium._server.isolation import wire
from stadium._server.isolation.worker.proc import EnvProcess, WireStats
from stadium._server.isolation.worker.proxy import Clock, ProcessEnv, Stage, StepCall


@pytest.fixture(autouse=True)
async def _no_loop_errors() -> Any:
    """Nothing reaches the loop's exception handler (a callback's error fails no test by
    itself); a test expecting one sets its own handler meanwhile."""
    loop = asyncio.get_running_loop()
    seen: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, context: seen.append(context))
    yield
    for _ in range(5):
        await asyncio.sleep(0)
    loop.set_exception_handler(None)
    assert seen == []


class _Isolation:
    """What a :class:`ProcessEnv` and its steps use of the worker's isolation."""

    def __init__(self) -> None:
        self.limits = types.SimpleNamespace(call_timeout=60.0, episode_timeout=0.0)
        self.durable = False
        self.spill_ids = itertools.count()
        self.policy = types.SimpleNamespace(default=None)
        self.killed: list[EnvProcess] = []
        self.released: list[EnvProcess] = []

    def action_encode(self, action: Any) -> Any:
        return action

    def kill(self, proc: EnvProcess) -> None:
        self.killed.append(proc)

    def release(self, proc: EnvProcess) -> None:
        self.released.append(proc)
        proc.close()

    async def death(self, proc: EnvProcess, op: str) -> StadiumError:
        proc.close()
        return EnvCrashedError(f"the env's process ended during {op}", operation=op)


@contextmanager
def _env() -> Iterator[tuple[ProcessEnv, EnvProcess, socket.socket]]:
    loop = asyncio.get_running_loop()
    ours, theirs = socket.socketpair()
    proc = EnvProcess(loop, ours, wire.WireLimits(), WireStats())
    env = ProcessEnv(_Isolation(), Clock(60.0))  # type: ignore[arg-type]
    env.proc = proc
    try:
        yield env, proc, theirs
    finally:
        proc.close()
        theirs.close()


def _reply(text: str) -> bytes:
    return wire.frame(wire.encode(wire.StepOk({"text": text}, 1.0, False, False, None)))


def _start(call: Any) -> list[tuple[Any, BaseException | None]]:
    outcomes: list[tuple[Any, BaseException | None]] = []
    assert isinstance(call, StepCall)
    call.start(None, lambda _token, result, error: outcomes.append((result, error)), None, 0.0)  # type: ignore[arg-type]
    return outcomes


async def test_a_frame_read_after_the_request_could_not_be_sent_is_not_its_reply() -> None:
    """The request's send fails (the env stopped reading: EPIPE), so the step is dying;
    a frame the env wrote, read in the same turn before the death is looked into, is no
    reply to a request it never got: the step ends as the process's death, once."""
    with _env() as (env, proc, theirs):
        theirs.sendall(_reply("forged"))
        theirs.shutdown(socket.SHUT_RD)  # the worker's send now fails (EPIPE)
        call = env.step({"do": "echo"})
        outcomes = _start(call)
        assert call.stage is Stage.DYING
        proc._readable()  # the reader's handle, queued in this turn of the loop
        for _ in range(20):
            await asyncio.sleep(0)
            if outcomes:
                break
        assert len(outcomes) == 1, outcomes
        result, error = outcomes[0]
        assert result is None
        assert isinstance(error, EnvCrashedError), outcomes
        assert env.clock.calls == {}
        for _ in range(5):  # reported once
            await asyncio.sleep(0)
        assert len(outcomes) == 1


async def test_a_reply_racing_a_cancel_reports_the_cancel_once() -> None:
    with _env() as (env, proc, theirs):
        call = env.step({"do": "echo"})
        outcomes = _start(call)
        theirs.sendall(_reply("late"))
        assert call.cancel()
        proc._readable()  # the reply, read in the same turn as the cancel
        await asyncio.sleep(0)
        assert len(outcomes) == 1
        assert isinstance(outcomes[0][1], asyncio.CancelledError)
        assert env.clock.calls == {}


async def test_a_reply_racing_the_clock_reports_one_outcome() -> None:
    with _env() as (env, proc, theirs):
        call = env.step({"do": "echo"})
        outcomes = _start(call)
        theirs.sendall(_reply("late"))
        env.clock.calls[call] = 0.0  # its deadline passed
        env.clock._fire()  # the timer first, the reply's read in the same turn
        proc._readable()
        for _ in range(20):
            await asyncio.sleep(0)
            if outcomes:
                break
        await asyncio.sleep(0)
        assert len(outcomes) == 1, outcomes
        assert env.clock.calls == {}


@pytest.mark.parametrize("n", [1, 50])
async def test_every_step_leaves_the_clock(n: int) -> None:
    with _env() as (env, _proc, theirs):
        for i in range(n):
            call = env.step({"do": "echo"})
            outcomes = _start(call)
            theirs.recv(1 << 16)
            theirs.sendall(_reply(str(i)))
            for _ in range(20):
                await asyncio.sleep(0)
                if outcomes:
                    break
            assert outcomes[0][0].observation == {"text": str(i)}
        assert env.clock.calls == {}


async def test_a_callback_that_raises_stops_no_other_sessions_time_limit() -> None:
    """Two steps past the per-call limit (the invoker's the same: ``CallTimeoutError``):
    the first one's session callback raises (into the loop's exception handler); the
    second is still stopped."""
    loop = asyncio.get_running_loop()
    seen: list[dict[str, Any]] = []
    before = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: seen.append(context))
    invoker = types.SimpleNamespace(timeouts=0)

    def boom(_token: Any, _result: Any, _error: BaseException | None) -> None:
        raise RuntimeError("a session's callback broke")

    try:
        with _env() as (first, _p1, _t1), _env() as (second, _p2, _t2):
            clock = second.clock = first.clock  # one worker's clock
            one = first.step({"do": "echo"})
            two = second.step({"do": "echo"})
            outcomes: list[BaseException | None] = []
            one.start(invoker, boom, None, clock.limit)  # type: ignore[arg-type]
            two.start(invoker, lambda _t, _r, e: outcomes.append(e), None, clock.limit)  # type: ignore[arg-type]
            assert clock.timer is not None
            clock.timer.cancel()
            clock.calls[one] = clock.calls[two] = loop.time() - 1  # both past their limit
            clock.arm(loop)
            for _ in range(20):
                await asyncio.sleep(0)
                if outcomes:
                    break
            assert [type(e).__name__ for e in outcomes] == ["CallTimeoutError"]
            assert clock.calls == {}
            assert invoker.timeouts == 2
    finally:
        loop.set_exception_handler(before)
    assert [str(c.get("exception")) for c in seen] == ["a session's callback broke"]


async def _outcome(outcomes: list[Any]) -> None:
    for _ in range(200):
        if outcomes:
            return
        await asyncio.sleep(0.005)


async def test_a_process_gone_while_its_request_is_sent_in_parts_is_a_death_once() -> None:
    with _env() as (env, _proc, theirs):
        call = env.step({"do": "x" * (8 << 20)})  # more than the socket takes at once
        outcomes = _start(call)
        assert call.stage is Stage.SENDING
        theirs.close()  # it died: the reader's end of stream, then the send's EPIPE
        await _outcome(outcomes)
        for _ in range(5):
            await asyncio.sleep(0)
        assert len(outcomes) == 1
        assert isinstance(outcomes[0][1], EnvCrashedError), outcomes
        assert env.clock.calls == {}
        assert call.task is None


async def test_a_step_past_its_own_limit_while_its_request_is_sent_is_stopped_once() -> None:
    with _env() as (env, proc, _theirs):
        call = env.step({"do": "x" * (8 << 20)})
        outcomes: list[BaseException | None] = []
        invoker = types.SimpleNamespace(timeouts=0)
        assert isinstance(call, StepCall)
        call.start(invoker, lambda _t, _r, e: outcomes.append(e), None, 0.05)  # type: ignore[arg-type]
        assert call.stage is Stage.SENDING
        await _outcome(outcomes)
        for _ in range(5):
            await asyncio.sleep(0)
        assert [type(e).__name__ for e in outcomes] == ["CallTimeoutError"]
        assert env.proc is None
        iso: Any = env.isolation
        assert proc in iso.killed
        assert proc in iso.released
        assert env.clock.calls == {}

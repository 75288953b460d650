"""The session runner, driven in memory (stadium.testing): no sockets, no clocks but the loop's.

The same ``Session`` every transport uses, fed frames as a transport feeds them;
the channel records what the session sends and how it closes.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import msgspec
import pytest

from stadium import Environment, State, StepResult
from stadium._server.runtime import (
    CLOSE_INTERNAL_ERROR,
    CLOSE_NORMAL,
    CLOSE_TRY_AGAIN_LATER,
    MAX_PENDING,
)
from stadium.testing import MemoryChannel, memory_runtime, open_session
from tests.conftest import UNIT


class Act(msgspec.Struct):
    value: int


class Obs(msgspec.Struct):
    value: int
    thread: str = ""


class Gated(Environment[Act, Obs, State]):
    """An async env whose steps wait for a gate when asked; records its close."""

    blocking = False
    gate: asyncio.Event
    closed: list[int] = []

    def __init__(self) -> None:
        self.steps = 0

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Obs:
        return Obs(seed or 0)

    async def step(self, action: Act) -> StepResult[Obs]:  # type: ignore[override]
        if action.value < 0:
            await Gated.gate.wait()
        if action.value == 13:
            raise RuntimeError("unlucky")
        self.steps += 1
        return StepResult(Obs(action.value), reward=1.0)

    def close(self) -> None:
        Gated.closed.append(self.steps)


class Unencodable(Environment[Act, Any, State]):
    blocking = False

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Any:
        return {"ok": True}

    def step(self, action: Act) -> Any:
        return {"bad": object()} if action.value == 1 else {"ok": True}


class Broken(Environment[Act, Obs, State]):
    blocking = False

    def __init__(self) -> None:
        raise OSError("no GPU here")

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Obs:
        raise AssertionError("never built")

    def step(self, action: Act) -> Obs:
        raise AssertionError("never built")


class SyncBlocking(Environment[Act, Obs, State]):
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Obs:
        return Obs(0, threading.current_thread().name)

    def step(self, action: Act) -> Obs:
        return Obs(action.value, threading.current_thread().name)


def frame(kind: str, data: Any = None, rid: int | None = None) -> bytes:
    msg: dict[str, Any] = {"type": kind}
    if data is not None:
        msg["data"] = data
    if rid is not None:
        msg["id"] = rid
    return msgspec.json.encode(msg)


def reply(raw: bytes) -> dict[str, Any]:
    out: dict[str, Any] = msgspec.json.decode(raw)
    return out


@pytest.fixture(autouse=True)
def _gate() -> None:
    Gated.gate = asyncio.Event()
    Gated.closed = []


async def test_reset_step_state_in_memory() -> None:
    async with memory_runtime(Gated) as rt:
        session, ch = open_session(rt)
        first = reply(await ch.request(session, frame("reset", {"seed": 4}, rid=1)))
        assert first == {
            "type": "observation",
            "data": {"observation": {"value": 4, "thread": ""}, "reward": None, "done": False},
            "id": 1,
        }
        step = reply(await ch.request(session, frame("step", {"value": 2})))
        assert step["data"]["observation"]["value"] == 2
        state = reply(await ch.request(session, frame("state")))
        assert state["data"]["step_count"] == 1
        assert rt.steps_total == 1
        assert rt.sessions_total == 1


async def test_requests_queue_behind_a_waiting_step_and_are_answered_in_order() -> None:
    async with memory_runtime(Gated) as rt:
        session, ch = open_session(rt)
        await ch.request(session, frame("reset"))
        session.feed(frame("step", {"value": -1}, rid=1))  # waits for the gate
        session.feed(frame("step", {"value": 5}, rid=2))
        session.feed(frame("state", rid=3))
        await asyncio.sleep(0)
        assert session.busy
        assert not ch.frames  # nothing answered while the first waits
        Gated.gate.set()
        ids = [reply(await ch.next_frame(5 * UNIT)).get("id") for _ in range(3)]
        assert ids == [1, 2, 3]


async def test_a_failing_step_is_an_error_reply_and_the_session_lives_on() -> None:
    async with memory_runtime(Gated) as rt:
        session, ch = open_session(rt)
        await ch.request(session, frame("reset"))
        err = reply(await ch.request(session, frame("step", {"value": 13})))
        assert err["type"] == "error"
        assert err["data"]["code"] == "EXECUTION_ERROR"
        assert err["data"]["exception"] == "RuntimeError"
        ok = reply(await ch.request(session, frame("step", {"value": 1})))
        assert ok["type"] == "observation"
        assert rt.errors_total == {"EXECUTION_ERROR": 1}


async def test_an_observation_that_cannot_be_encoded_is_an_error_not_a_hang() -> None:
    async with memory_runtime(Unencodable) as rt:
        session, ch = open_session(rt)
        await ch.request(session, frame("reset"))
        err = reply(await ch.request(session, frame("step", {"value": 1})))
        assert err["data"]["code"] == "EXECUTION_ERROR"
        assert "encode" in err["data"]["message"]
        ok = reply(await ch.request(session, frame("step", {"value": 2})))
        assert ok["data"]["observation"] == {"ok": True}


async def test_lost_connection_mid_step_cancels_it_frees_the_slot_and_closes_the_env() -> None:
    async with memory_runtime(Gated, max_sessions=1) as rt:
        session, ch = open_session(rt)
        await ch.request(session, frame("reset"))
        session.feed(frame("step", {"value": -1}))
        await asyncio.sleep(0)
        assert session.busy
        session.connection_lost()
        assert rt.admission.slots.active() == 0
        assert rt.sessions == set()
        assert Gated.closed == [0]
        Gated.gate.set()
        await asyncio.sleep(0)
        assert not ch.frames  # the cancelled step is never answered
        again, ch2 = open_session(rt)  # the slot is really free
        assert reply(await ch2.request(again, frame("reset")))["type"] == "observation"


async def test_close_after_a_waiting_step_answers_it_then_closes_normally() -> None:
    async with memory_runtime(Gated) as rt:
        session, ch = open_session(rt)
        await ch.request(session, frame("reset"))
        session.feed(frame("step", {"value": -1}, rid=7))
        session.feed(frame("close"))
        Gated.gate.set()
        assert reply(await ch.next_frame(5 * UNIT))["id"] == 7
        await asyncio.sleep(0)
        assert ch.closed == (CLOSE_NORMAL, "session closed by client")
        assert rt.admission.slots.active() == 0


async def test_an_env_that_cannot_be_built_gets_an_error_and_1011() -> None:
    async with memory_runtime(Broken) as rt:
        _session, ch = open_session(rt)
        err = reply(await ch.next_frame(5 * UNIT))
        assert err["data"]["code"] == "EXECUTION_ERROR"
        assert err["data"]["operation"] == "create"
        assert "no GPU here" in err["data"]["message"]
        assert ch.closed is not None
        assert ch.closed[0] == CLOSE_INTERNAL_ERROR
        assert rt.admission.slots.active() == 0


async def test_full_server_refuses_with_a_hint_and_1013() -> None:
    async with memory_runtime(Gated, max_sessions=1, admission_timeout=0) as rt:
        first, _ = open_session(rt)
        _second, ch = open_session(rt)
        err = reply(await ch.next_frame(5 * UNIT))
        assert err["data"]["code"] == "CAPACITY_REACHED"
        assert err["data"]["retry_after_s"] > 0
        assert ch.closed is not None
        assert ch.closed[0] == CLOSE_TRY_AGAIN_LATER
        assert rt.admission.slots.active() == 1
        first.connection_lost()
        assert rt.admission.slots.active() == 0


async def test_a_flood_of_queued_requests_is_refused_past_the_bound() -> None:
    async with memory_runtime(Gated) as rt:
        session, ch = open_session(rt)
        await ch.request(session, frame("reset"))
        session.feed(frame("step", {"value": -1}))
        for _ in range(MAX_PENDING + 3):
            session.feed(frame("state"))
        refused = [reply(f) for f in ch.frames]
        assert len(refused) == 3
        assert all(r["data"]["code"] == "SESSION_ERROR" for r in refused)
        ch.frames.clear()
        Gated.gate.set()
        for _ in range(MAX_PENDING + 1):  # the step, then every queued state
            await ch.next_frame(5 * UNIT)


async def test_a_blocking_sync_env_runs_on_the_pool() -> None:
    async with memory_runtime(SyncBlocking) as rt:
        session, ch = open_session(rt)
        first = reply(await ch.request(session, frame("reset")))
        step = reply(await ch.request(session, frame("step", {"value": 3})))
        for r in (first, step):
            assert r["data"]["observation"]["thread"].startswith("stadium-env")


async def test_the_memory_channel_counts_without_keeping_frames() -> None:
    ch = MemoryChannel(keep_frames=False)
    waiter = ch.sent()
    ch.send(b"abc")
    assert waiter.done()
    assert (ch.replies, ch.bytes, list(ch.frames)) == (1, 3, [])


async def test_a_long_queue_of_steps_that_complete_at_once_is_drained_without_recursion() -> None:
    """Steps that finish without waiting (eager tasks) are answered in a loop, not by recursion."""
    async with memory_runtime(Gated) as rt:
        session, ch = open_session(rt)
        await ch.request(session, frame("reset"))
        session.feed(frame("step", {"value": -1}, rid=0))  # waits for the gate
        for i in range(1, MAX_PENDING + 1):
            session.feed(frame("step", {"value": i}, rid=i))
        Gated.gate.set()
        ids = [reply(await ch.next_frame(5 * UNIT)).get("id") for _ in range(MAX_PENDING + 1)]
        assert ids == list(range(MAX_PENDING + 1))
        assert rt.errors_total == {"EXECUTION_ERROR": 1}  # step 13 raises, in its place
        assert rt.steps_total == MAX_PENDING

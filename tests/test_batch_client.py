"""The batch client: many sessions on one connection (docs/PROTOCOL.md, "Batches").

Literal reply frames against the client's listener first; then the real in-process
server: mixed batches with errors, sessions in different states in one batch, both
encodings, ``first=K`` streaming, ``SessionPool`` batching and its EnvPool-style
``send``/``recv``, admission, drain, a lost connection, and the fallback to one
connection per session (OpenEnv's server; a Stadium server that refuses batches).
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from typing import Any, cast

import msgspec
import pytest
import uvicorn

import stadium
from stadium._client import batch as _batch_client
from stadium._client.batch import (
    BatchConnection,
    _BatchListener,
    call,
    checked,
    result_of,
)
from stadium._client.batch_pool import BatchSession
from stadium._client.session import AsyncClient
from stadium._core.client import BatchProtocol
from stadium._core.frames import BatchCall, BatchReply, Reply
from tests.conftest import UNIT, serve, wait_until
from tests.relay import relay_to

ENCODINGS = pytest.mark.parametrize("msgpack", [False, True], ids=["json", "msgpack"])


def _kinds(entries: list[Reply]) -> list[str]:
    return [e.type for e in entries]


def _busy(server: Any) -> int:
    """The server's sessions with a call running."""
    return sum(1 for s in server.runtime.sessions if s.busy)


def _code(entry: Reply) -> str:
    return str(entry.data["code"])


# -- the listener, with literal frames --------------------------------------------


def _calls(n: int) -> list[BatchCall[Any]]:
    return [call(i, "state") for i in range(n)]


def _frame(frame: dict[str, Any]) -> BatchReply[Reply]:
    """A batch reply frame as the listener gets it (its protocol decoded it)."""
    return msgspec.convert(frame, BatchReply[Reply])


def _r(n: int) -> Reply:
    return Reply("state", {"n": n})


async def test_listener_routes_replies_by_id_in_call_order() -> None:
    loop = asyncio.get_running_loop()
    listener = _BatchListener(BatchProtocol())
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    a = _batch_client._Pending(loop, _calls(2), None)
    b = _batch_client._Pending(loop, _calls(3), queue)
    listener.pending.update({1: a, 2: b})
    # the first K ready of batch 2 arrive before batch 1's reply, out of call order
    listener._route(BatchReply(id=2, results=[_r(2)], index=[2], done=False))
    listener._route(BatchReply(id=1, results=[_r(0), _r(1)]))
    assert await a.future == [_r(0), _r(1)]
    assert not b.future.done()
    listener._route(_frame({"type": "batch", "id": 2, "index": [0, 1], "done": True,
                            "results": [{"type": "state", "data": {"n": 0}}, _r(1)]}))  # fmt: skip
    assert await b.future == [_r(0), _r(1), _r(2)]
    assert [queue.get_nowait()[0] for _ in range(3)] == [2, 0, 1]
    assert listener.pending == {}
    listener._route(BatchReply(id=9, results=[]))  # unknown id: ignored


async def test_listener_fails_a_refused_frame_and_everything_on_disconnect() -> None:
    loop = asyncio.get_running_loop()
    listener = _BatchListener(BatchProtocol())
    refused = _batch_client._Pending(loop, _calls(1), None)
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    lost = _batch_client._Pending(loop, _calls(2), queue)
    listener.pending.update({1: refused, 2: lost})
    listener._route(
        _frame({"type": "error", "id": 1, "data": {"code": "INVALID_JSON", "message": "no calls"}})
    )
    with pytest.raises(stadium.ProtocolError, match="no calls"):
        await refused.future
    listener.on_ws_disconnected(cast(Any, None))
    with pytest.raises(stadium.SessionClosedError, match="not resumable"):
        await lost.future
    at, exc = queue.get_nowait()
    assert at == -1
    assert isinstance(exc, stadium.SessionClosedError)


def test_entries_become_results_or_the_errors_they_stand_for() -> None:
    obs = Reply("observation", {"observation": {"x": 1}, "reward": 2.0, "done": True})
    result = result_of(checked(obs))
    assert (result.observation, result.reward, result.done) == ({"x": 1}, 2.0, True)
    with pytest.raises(stadium.ValidationError, match="bad"):
        checked(Reply("error", {"code": "VALIDATION_ERROR", "message": "bad"}))
    with pytest.raises(stadium.SessionClosedError, match="1001") as info:
        checked(Reply("closed", {"code": 1001, "reason": "draining"}))
    assert info.value.context["close_code"] == 1001
    with pytest.raises(stadium.SessionError, match="'state' where 'observation'"):
        result_of(Reply("state", {}))
    assert msgspec.json.decode(msgspec.json.encode(call(3, "step", {"a": 1}, timeout_s=2))) == {
        "session": 3,
        "type": "step",
        "data": {"a": 1},
        "timeout_s": 2,
    }


# -- against the server -----------------------------------------------------------


@ENCODINGS
async def test_a_mixed_batch_fails_only_its_bad_entry(msgpack: bool) -> None:
    async with serve("benchmark") as server:
        conn = await BatchConnection.open(server.url, msgpack=msgpack)
        try:
            assert conn.accepted
            firsts = await conn.batch([call(i, "reset", {"seed": i}) for i in range(3)])
            assert _kinds(firsts) == ["observation"] * 3
            results = await conn.batch(
                [
                    call(0, "step", {"wait_seconds": 0}),
                    call(1, "step", {"wait_seconds": "later"}),  # a bad action
                    call(2, "step", {"wait_seconds": 0}),
                ]
            )
            assert _kinds(results) == ["observation", "error", "observation"]
            assert _code(results[1]) == "VALIDATION_ERROR"
            assert [r.data["observation"]["step_count"] for r in (results[0], results[2])] == [
                1,
                1,
            ]
            # the failed session goes on
            again = await conn.batch([call(1, "step", {"wait_seconds": 0})])
            assert again[0].data["observation"]["step_count"] == 1
        finally:
            await conn.close()


async def test_one_batch_over_sessions_in_different_states() -> None:
    async with serve("benchmark") as server:
        conn = await BatchConnection.open(server.url)
        try:
            await conn.batch([call(0, "reset"), call(2, "reset"), call(3, "reset")])
            await conn.batch([call(0, "step", {"wait_seconds": 0}), call(3, "close")])
            results = await conn.batch(
                [
                    call(0, "step", {"wait_seconds": 0}),  # mid-episode
                    call(1, "step", {"wait_seconds": 0}),  # never reset: no session
                    call(2, "state"),  # reset, not stepped
                    call(3, "step", {"wait_seconds": 0}),  # closed
                    call(4, "close"),  # a close in the batch
                ]
            )
            assert _kinds(results) == ["observation", "error", "state", "error", "error"]
            assert results[0].data["observation"]["step_count"] == 2
            assert [_code(results[i]) for i in (1, 3, 4)] == ["SESSION_ERROR"] * 3
            assert results[2].data["step_count"] == 0
            closing = await conn.batch([call(0, "close"), call(2, "step", {"wait_seconds": 0})])
            assert _kinds(closing) == ["closed", "observation"]
            assert closing[0].data["code"] == 1000
            # a closed number is free again: a reset opens a new session there
            reopened = await conn.batch([call(3, "reset")])
            assert reopened[0].data["observation"]["step_count"] == 0
        finally:
            await conn.close()


@ENCODINGS
async def test_first_k_stream_the_ready_results_first(msgpack: bool) -> None:
    async with serve("benchmark") as server:
        conn = await BatchConnection.open(server.url, msgpack=msgpack)
        try:
            await conn.batch([call(i, "reset") for i in range(4)])
            waits = [0.5 * UNIT, 0.0, 0.5 * UNIT, 0.0]
            calls = [call(i, "step", {"wait_seconds": w}) for i, w in enumerate(waits)]
            order = [at async for at, entry in conn.stream(calls, first=2)]
            assert sorted(order[:2]) == [1, 3]  # the quick ones first
            assert sorted(order) == [0, 1, 2, 3]
            # many batches in flight on one connection, each answered under its own id
            futures = [conn.submit([call(i, "state")]) for i in range(4)]
            states = [(await f)[0] for f in futures]
            assert [s.data["step_count"] for s in states] == [1] * 4
        finally:
            await conn.close()


@ENCODINGS
async def test_pool_batches_over_a_few_connections(msgpack: bool) -> None:
    async with (
        serve("benchmark") as server,
        stadium.SessionPool[Any](server.url, 5, sessions_per_connection=2, msgpack=msgpack) as pool,
    ):
        assert pool.batching is True
        assert all(isinstance(c, BatchSession) for c in pool.clients)
        group = pool._group
        assert group is not None
        assert len(group.conns) == 3
        firsts = await pool.reset(seeds=range(5))
        assert [r.observation["step_count"] for r in firsts] == [0] * 5
        assert server.runtime.admission.slots.active() == 5
        results = await pool.step([{"wait_seconds": 0.0}] * 5)
        assert [r.observation["step_count"] for r in results] == [1] * 5
        assert [s["step_count"] for s in await pool.state()] == [1] * 5
        bad: list[dict[str, Any]] = [{"wait_seconds": 0.0}] * 5
        bad[3] = {"wait_seconds": "later"}
        with pytest.raises(stadium.ValidationError):
            await pool.step(bad)
        mixed = await pool.step(bad, return_exceptions=True)
        assert isinstance(mixed[3], stadium.ValidationError)
        assert [r.observation["step_count"] for i, r in enumerate(mixed) if i != 3] == [3] * 4
        # one session by itself, as an AsyncClient would be
        assert (await pool.clients[4].step({"wait_seconds": 0})).observation["step_count"] == 4
    await wait_until(lambda: server.runtime.admission.slots.active() == 0, 5 * UNIT)


async def test_pool_step_is_one_frame_per_connection_without_a_call_per_session(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``SessionPool.step`` puts every session's step in its connection's frame at once
    (``BatchGroup.step_all``), not through each ``BatchSession.step``; results, errors and
    ``return_exceptions`` are the sessions' own."""
    frames: list[int] = []
    submit = BatchConnection.submit

    def counted(self: BatchConnection, calls: Any, *args: Any, **kwargs: Any) -> Any:
        frames.append(len(calls))
        return submit(self, calls, *args, **kwargs)

    async def one_by_one(self: Any, action: Any) -> Any:
        raise AssertionError("pool.step went through BatchSession.step")

    async with (
        serve("benchmark") as server,
        stadium.SessionPool[Any](server.url, 5, sessions_per_connection=3) as pool,
    ):
        await pool.reset(seeds=range(5))
        monkeypatch.setattr(BatchConnection, "submit", counted)
        monkeypatch.setattr(BatchSession, "step", one_by_one)
        for round_ in range(1, 4):
            results = await pool.step([{"wait_seconds": 0.0}] * 5)
            assert [r.observation["step_count"] for r in results] == [round_] * 5
            assert [r.reward for r in results] == [1.0] * 5
        assert frames == [3, 2] * 3  # one frame per connection per round
        bad: list[dict[str, Any]] = [{"wait_seconds": 0.0}] * 5
        bad[1] = bad[4] = {"wait_seconds": "later"}
        mixed = await pool.step(bad, return_exceptions=True)
        assert isinstance(mixed[1], stadium.ValidationError)
        assert isinstance(mixed[4], stadium.ValidationError)
        assert [mixed[i].observation["step_count"] for i in (0, 2, 3)] == [4] * 3
        with pytest.raises(stadium.ValidationError, match="wait_seconds"):
            await pool.step(bad)
        # the sessions stepped by that failed round still count it
        assert [s["step_count"] for s in await pool.state()] == [5, 3, 5, 5, 3]
        # a round cancelled while in flight: its calls are given up, the sessions go on
        stepping = asyncio.ensure_future(pool.step([{"wait_seconds": 0.5 * UNIT}] * 5))
        await wait_until(lambda: _busy(server) == 5, 5 * UNIT, "steps running")
        stepping.cancel()
        with pytest.raises(asyncio.CancelledError):
            await stepping
        await wait_until(lambda: _busy(server) == 0, 5 * UNIT, "steps done")
        results = await pool.step([{"wait_seconds": 0.0}] * 5)
        assert [r.observation["step_count"] for r in results] == [7, 5, 7, 7, 5]


@pytest.mark.parametrize("batch", [None, False], ids=["batched", "per-session"])
async def test_send_recv_returns_the_first_ready(batch: bool | None) -> None:
    async with (
        serve("benchmark") as server,
        stadium.SessionPool[Any](server.url, 4, batch=batch, batch_size=2) as pool,
    ):
        assert pool.batching is (batch is None)
        await pool.reset(seeds=range(4))
        with pytest.raises(stadium.SessionError, match="send"):
            await pool.recv()
        slow = {"wait_seconds": 0.5 * UNIT}
        quick = {"wait_seconds": 0.0}
        await pool.send([slow, quick, slow, quick])
        with pytest.raises(stadium.SessionError, match="in flight"):
            await pool.send([quick], [1])
        first = await pool.recv()
        ids = [i for i, _ in first]
        assert len(first) >= 2
        assert {1, 3} <= set(ids)
        assert not {0, 2} & set(ids)
        await pool.send([quick, {"wait_seconds": "later"}], [1, 3])  # step the quick ones again
        rest: list[tuple[int, Any]] = []
        for _ in range(4):  # bounded: each recv returns at least one
            if len(rest) == 4:
                break
            rest += await pool.recv(1, return_exceptions=True)
        got = dict(rest)
        assert sorted(got) == [0, 1, 2, 3]
        assert isinstance(got[3], stadium.ValidationError)
        assert got[1].observation["step_count"] == 2
        assert got[0].observation["step_count"] == got[2].observation["step_count"] == 1
        # a session's error raises from recv; the other results stay for the next one
        await pool.send([quick, {"wait_seconds": "later"}], [0, 2])
        await wait_until(lambda: len(pool._ready) == 2, 5 * UNIT, "both results in")
        with pytest.raises(stadium.ValidationError):
            await pool.recv(2)
        [(index, result)] = await pool.recv()
        assert index == 0
        assert result.observation["step_count"] == 2


async def test_refused_admissions_are_retried_when_slots_free() -> None:
    async with (
        serve("benchmark", max_sessions=2, admission_timeout=0.1 * UNIT) as server,
        stadium.SessionPool[Any](server.url, 4) as pool,
    ):
        assert pool.batching is True
        resets = [asyncio.ensure_future(c.reset(seed=i)) for i, c in enumerate(pool.clients)]
        await wait_until(lambda: sum(r.done() for r in resets) == 2, 5 * UNIT, "two admitted")
        await wait_until(
            lambda: server.runtime.errors_total["CAPACITY_REACHED"] >= 2, 5 * UNIT, "refusals"
        )
        admitted = [i for i, r in enumerate(resets) if r.done()]
        await asyncio.gather(*(pool.clients[i].close() for i in admitted))
        results = await asyncio.wait_for(asyncio.gather(*resets), 20 * UNIT)
        assert [r.observation["step_count"] for r in results] == [0] * 4
        assert server.runtime.admission.slots.active() == 2


async def test_admission_gives_up_after_max_retries() -> None:
    async with (
        serve("benchmark", max_sessions=1, admission_timeout=0.05 * UNIT) as server,
        stadium.SessionPool[Any](server.url, 2, max_retries=0) as pool,
    ):
        results: list[Any] = await pool.reset(return_exceptions=True)
        refused = [r for r in results if isinstance(r, stadium.CapacityError)]
        assert len(refused) == 1
        assert refused[0].retry_after_s > 0
        assert server.runtime.admission.slots.active() == 1


async def test_drain_finishes_the_calls_in_flight_and_closes_the_rest() -> None:
    # The drain lets sessions go on for drain_timeout, then closes them (1001): a call
    # running then is finished and answered, the calls queued behind it are `closed`.
    async with serve("benchmark", drain_timeout=0.2 * UNIT) as server:
        conn = await BatchConnection.open(server.url)
        try:
            await conn.batch([call(0, "reset"), call(1, "reset")])
            # (long enough that the drain's end, 0.2 s after the stop, comes before it ends
            # on a loaded machine too: 1 s did not, once, and the step queued behind it ran)
            in_flight = conn.submit(
                [call(0, "step", {"wait_seconds": 3.0 * UNIT}), call(1, "state")]
            )
            # session 0's step queued behind its running one; session 1's state is not
            behind = conn.submit([call(0, "step", {"wait_seconds": 0}), call(1, "state")])
            await wait_until(lambda: _busy(server) >= 1, 5 * UNIT, "step running")
            stopping = asyncio.ensure_future(server.stop())
            done = await in_flight
            assert _kinds(done) == ["observation", "state"]
            assert done[0].data["observation"]["step_count"] == 1
            rest = await behind
            assert _kinds(rest) == ["closed", "state"]
            assert rest[0].data["code"] == 1001
            await stopping
            await wait_until(lambda: conn.closed, 5 * UNIT, "connection closed")
            with pytest.raises(stadium.SessionClosedError, match="not resumable"):
                conn.submit([call(1, "state")])
        finally:
            await conn.close()


async def test_a_lost_connection_resumes_the_sessions() -> None:
    async with (
        serve("benchmark") as server,
        relay_to(server.url) as relay,
        stadium.SessionPool[Any](relay.url, 3) as pool,
    ):
        assert pool.batching is True
        await pool.reset()
        first = await pool.step([{"wait_seconds": 0.0}] * 3)
        stepping = asyncio.ensure_future(pool.step([{"wait_seconds": 0.3 * UNIT}] * 3))
        await wait_until(lambda: _busy(server) >= 1, 5 * UNIT, "steps running")
        relay.cut()  # mid-step: the steps finish on the server, their replies come back
        results = await stepping
        assert [r.observation["step_count"] for r in results] == [2] * 3
        assert [r.observation["session_hash"] for r in results] == [
            r.observation["session_hash"] for r in first
        ]
        assert all(c.resumes == 1 for c in pool.clients)
        after = await pool.step([{"wait_seconds": 0.0}] * 3)
        assert [r.observation["step_count"] for r in after] == [3] * 3
        assert server.runtime.steps_total == 9  # each step ran once
        assert server.runtime.outcomes["resumed"] == 3


async def test_sessions_not_taken_back_within_the_grace_period_fail_clearly() -> None:
    async with (
        serve("benchmark", resume_grace=0.3 * UNIT) as server,
        relay_to(server.url) as relay,
        stadium.SessionPool[Any](relay.url, 2) as pool,
    ):
        assert pool.batching is True
        await pool.reset()
        relay.refusing = True  # the pool cannot get back in time
        relay.cut()
        with pytest.raises(stadium.ResumeError, match="grace period"):
            await pool.step([{"wait_seconds": 0.0}] * 2)
        await wait_until(lambda: not server.runtime.sessions, 5 * UNIT, "sessions expired")
        assert server.runtime.outcomes["expired"] == 2
        assert server.runtime.admission.slots.active() == 0


async def test_a_lost_connection_fails_its_sessions_calls_until_a_reset() -> None:
    async with (
        serve("benchmark", resume_grace=0) as server,
        relay_to(server.url) as relay,
        stadium.SessionPool[Any](relay.url, 3) as pool,
    ):
        assert pool.batching is True
        await pool.reset()
        stepping = asyncio.ensure_future(pool.step([{"wait_seconds": 0.5 * UNIT}] * 3))
        await wait_until(lambda: _busy(server) >= 1, 5 * UNIT, "steps running")
        relay.cut()
        with pytest.raises(stadium.SessionClosedError, match="not resumable"):
            await stepping
        with pytest.raises(stadium.SessionClosedError, match="reset to start anew"):
            await pool.clients[0].step({"wait_seconds": 0})
        with pytest.raises(stadium.SessionClosedError, match="reset to start anew"):
            await pool.step([{"wait_seconds": 0}] * 3)  # the pool's own path, too
        # a reset starts anew, on a new connection (as AsyncClient reconnects for a reset)
        assert [r.observation["step_count"] for r in await pool.reset()] == [0] * 3
        results = await pool.step([{"wait_seconds": 0.0}] * 3)
        assert [r.observation["step_count"] for r in results] == [1] * 3
        assert relay.accepted == 2


# -- fallback: one connection per session -------------------------------------------


async def test_fallback_when_a_stadium_server_refuses_batches(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # An older Stadium server knows no batch subprotocol; offering one this server does
    # not know makes the server answer exactly as such a server would (no subprotocol).
    monkeypatch.setattr(_batch_client, "BATCH_SUBPROTOCOL", "stadium.batch.v0")
    async with serve("benchmark") as server:
        conn = await BatchConnection.open(server.url)
        assert not conn.accepted
        await conn.close()
        async with stadium.SessionPool[Any](server.url, 3) as pool:
            assert pool.batching is False
            assert all(isinstance(c, AsyncClient) for c in pool.clients)
            await pool.reset(seeds=range(3))
            results = await pool.step([{"wait_seconds": 0.0}] * 3)
            assert [r.observation["step_count"] for r in results] == [1] * 3
            await pool.send([{"wait_seconds": 0.0}] * 3)
            assert len(await pool.recv()) == 3
            assert all(c.session_id for c in pool.clients)  # resumable, as before
        with pytest.raises(stadium.ConnectError, match="does not speak batches"):
            await stadium.SessionPool[Any](server.url, 2, batch=True).open()


async def test_batch_false_never_batches_and_several_nodes_do_not_either() -> None:
    async with serve("benchmark") as server:
        pool = stadium.SessionPool[Any](server.url, 2, batch=False)
        assert pool.batching is False
        assert len(pool.clients) == 2
        async with pool:
            assert [r.observation["step_count"] for r in await pool.reset()] == [0, 0]
        assert stadium.SessionPool[Any]([server.url, server.url], 2).batching is False
        with pytest.raises(stadium.ConfigError, match="batch=True"):
            stadium.SessionPool[Any]([server.url, server.url], 2, batch=True)
        undecided = stadium.SessionPool[Any](server.url, 2)
        with pytest.raises(stadium.SessionError, match="not open"):
            undecided.clients  # noqa: B018
        # opened on first use
        assert [r.observation["step_count"] for r in await undecided.reset()] == [0, 0]
        assert undecided.batching is True
        await undecided.close()


async def test_a_host_name_for_one_address_batches_too() -> None:
    addrs = {a[4][0] for a in socket.getaddrinfo("localhost", 80, type=socket.SOCK_STREAM)}
    if addrs != {"127.0.0.1"}:
        pytest.skip(f"localhost resolves to {sorted(addrs)} here, not 127.0.0.1 alone")
    async with serve("benchmark") as server:
        url = server.url.replace("127.0.0.1", "localhost")
        async with stadium.SessionPool[Any](url, 2) as pool:
            assert pool.batching is True
            assert [r.observation["step_count"] for r in await pool.reset()] == [0, 0]


async def test_fallback_against_an_openenv_server(openenv_server: str) -> None:
    conn = await BatchConnection.open(openenv_server)
    assert not conn.accepted
    await conn.close()
    async with stadium.SessionPool[Any](openenv_server, 3) as pool:
        assert pool.batching is False
        firsts = await pool.reset(seeds=range(3))
        assert [r.observation["echoed_message"] for r in firsts] == ["ready"] * 3
        results = await pool.step([{"message": m} for m in ("a", "bb", "ccc")])
        assert [r.observation["echoed_message"] for r in results] == ["a", "bb", "ccc"]
        assert [s["step_count"] for s in await pool.state()] == [1, 1, 1]


@pytest.fixture
async def openenv_server() -> AsyncIterator[str]:
    """OpenEnv's own server (its ``create_app`` under uvicorn), in this event loop."""
    app = pytest.importorskip("tests.openenv_compat.openenv_echo_app").app
    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    task = asyncio.ensure_future(uv.serve())
    await wait_until(lambda: uv.started or task.done(), 60 * UNIT, "OpenEnv server started")
    if task.done():
        task.result()
    port = uv.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        uv.should_exit = True
        await task


async def test_gym_make_vec_rides_on_a_batching_pool() -> None:
    pytest.importorskip("gymnasium")
    import numpy as np

    import stadium.gym

    async with serve("gymnasium:CartPole-v1") as server:

        def work() -> None:
            envs = stadium.gym.make_vec(server.url, num_envs=3)
            try:
                obs, _ = envs.reset(seed=0)
                assert obs.shape == (3, 4)
                assert envs._pool.batching is True
                obs, rewards, *_ = envs.step(np.zeros(3, dtype=np.int64))
                assert rewards.tolist() == [1.0, 1.0, 1.0]
            finally:
                envs.close()

        await asyncio.to_thread(work)

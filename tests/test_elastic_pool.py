"""The env thread pool grows with demand to a bound tied to the session capacity: blocking
sync envs run concurrently, and sync calls that never return do not wedge a worker with
the default settings (issue 22 item 4, issue 23 item 4)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import urllib.request
from typing import Any

import msgspec
import pytest

from stadium import AsyncClient, Environment, State, StepResult
from stadium._server.thread_pool import MAX_AUTO_THREADS, ElasticPool, auto_limit
from tests.conftest import UNIT, serve, wait_until

_HANG = threading.Event()
_GATE = threading.Event()


class Act(msgspec.Struct):
    hang: bool = False


class Obs(msgspec.Struct):
    ok: bool = True


class Hangs(Environment[Act, Obs, State]):
    """A blocking sync step that never returns when asked to (until the test ends)."""

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Obs:
        return Obs()

    def step(self, action: Act) -> StepResult[Obs]:
        if action.hang:
            _HANG.wait()
        return StepResult(Obs())


def _wait_all(futures: list[concurrent.futures.Future[Any]]) -> None:
    _, pending = concurrent.futures.wait(futures, timeout=10 * UNIT)
    assert not pending, f"{len(pending)} calls never ran"


def test_the_pool_grows_to_its_bound_then_queues() -> None:
    pool = ElasticPool(core=1, limit=4, name="test-pool")
    try:
        started = threading.Semaphore(0)

        def block() -> int:
            started.release()
            _GATE.wait(10 * UNIT)
            return 1

        futures = [pool.submit(block) for _ in range(6)]
        for _ in range(4):
            assert started.acquire(timeout=10 * UNIT)
        assert pool.live == 4  # grew past its core, to its bound
        assert pool.busy == 4
        assert pool.queued == 2
        assert pool.saturated == 2  # two calls found every thread busy
        assert not started.acquire(timeout=0.05 * UNIT)
        _GATE.set()
        _wait_all(futures)
        assert [f.result() for f in futures] == [1] * 6
        assert pool.peak == 4
    finally:
        _GATE.clear()
        pool.shutdown(cancel_futures=True)


def test_a_written_off_thread_makes_room_and_idle_threads_retire() -> None:
    pool = ElasticPool(core=1, limit=2, name="test-pool", idle_s=0.05 * UNIT)
    release = threading.Event()
    try:
        stuck = [pool.submit(release.wait, 10 * UNIT) for _ in range(2)]
        behind = pool.submit(lambda: "ran")
        assert pool.saturated == 1
        for f in stuck:
            pool.write_off(f)
        assert pool.live == 0
        # A new call starts a thread of its own (the queued one is served too).
        assert pool.submit(lambda: "new").result(timeout=10 * UNIT) == "new"
        assert behind.result(timeout=10 * UNIT) == "ran"
        release.set()
        _wait_all(stuck)
        assert pool.written_off == 0
        # Threads above the core exit once idle.
        deadline = threading.Event()
        for _ in range(200):
            if pool.threads <= pool.core:
                break
            deadline.wait(0.02 * UNIT)
        assert pool.threads == pool.core
    finally:
        release.set()
        pool.shutdown()


def test_a_shut_pool_refuses_calls_and_cancels_queued_ones() -> None:
    pool = ElasticPool(core=1, limit=1, name="test-pool")
    release, started = threading.Event(), threading.Event()

    def run() -> bool:
        started.set()
        return release.wait(10 * UNIT)

    running = pool.submit(run)
    assert started.wait(10 * UNIT)
    queued = pool.submit(lambda: None)
    pool.shutdown(cancel_futures=True)
    assert queued.cancelled()
    with pytest.raises(RuntimeError, match="shut down"):
        pool.submit(lambda: None)
    release.set()
    assert running.result(timeout=10 * UNIT) is True


def test_the_default_bound_is_the_session_capacity() -> None:
    assert auto_limit(8192, 6) == MAX_AUTO_THREADS
    assert auto_limit(100, 6) == 100
    assert auto_limit(2, 6) == 6
    with pytest.raises(ValueError, match="core <= limit"):
        ElasticPool(core=3, limit=2, name="x")


@pytest.mark.asyncio
async def test_hung_sync_steps_do_not_wedge_a_default_worker() -> None:
    """Issue 22: 6 sync steps that never return (the old pool's size), then 20 fresh
    sessions on the same one-worker server, default settings: all 20 complete a step."""
    try:
        async with serve(Hangs) as server:
            hung: list[asyncio.Future[Any]] = []
            clients: list[AsyncClient[Any]] = [
                AsyncClient(server.url, max_retries=0) for _ in range(6)
            ]
            for client in clients:
                await client.reset()
                hung.append(asyncio.ensure_future(client.step({"hang": True})))
            pool = server.runtime.invoke.executor
            await wait_until(lambda: pool.busy >= 6, 10 * UNIT, "six hung steps running")

            async def fresh() -> bool:
                client: AsyncClient[Any]
                async with AsyncClient(server.url, max_retries=0) as client:
                    await client.reset()
                    return bool((await client.step({})).observation["ok"])

            results = await asyncio.wait_for(
                asyncio.gather(*(fresh() for _ in range(20))), 30 * UNIT
            )
            assert results == [True] * 20
            assert not any(h.done() for h in hung)
            assert pool.limit >= 26
            # The server says so: /metrics has the pool's threads and busy ones.
            text = await asyncio.to_thread(_get, server.url + "/metrics")
            metrics = _samples(text)
            assert metrics["stadium_executor_busy_threads"] >= 6
            assert metrics["stadium_executor_threads"] >= 7
            assert metrics["stadium_executor_queued_calls"] == 0
            assert metrics["stadium_executor_saturated_total"] == 0
            _HANG.set()
            await asyncio.wait_for(asyncio.gather(*hung), 10 * UNIT)
            for client in clients:
                await client.close()
    finally:
        _HANG.set()
    _HANG.clear()


@pytest.mark.asyncio
async def test_a_full_pool_is_logged_and_counted(caplog: pytest.LogCaptureFixture) -> None:
    try:
        async with serve(Hangs, executor_threads=2) as server:
            clients: list[AsyncClient[Any]] = [
                AsyncClient(server.url, max_retries=0) for _ in range(3)
            ]
            hung = []
            for client in clients:  # resets first: they are pool calls too
                await client.reset()
            for client in clients:
                hung.append(asyncio.ensure_future(client.step({"hang": True})))
            pool = server.runtime.invoke.executor
            await wait_until(lambda: pool.queued == 1, 10 * UNIT, "a call waiting")
            text = await asyncio.to_thread(_get, server.url + "/metrics")
            metrics = _samples(text)
            assert metrics["stadium_executor_queued_calls"] == 1
            assert metrics["stadium_executor_saturated_total"] == 1
            assert "all 2 env threads (--executor-threads) are busy" in caplog.text
            _HANG.set()
            await asyncio.wait_for(asyncio.gather(*hung), 10 * UNIT)
            for client in clients:
                await client.close()
    finally:
        _HANG.set()
    _HANG.clear()


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10 * UNIT) as resp:
        body: bytes = resp.read()
    return body.decode()


def _samples(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_a_thread_that_cannot_start_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = ElasticPool(core=1, limit=4, name="test-pool")

    def refuse(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", refuse)
    with pytest.raises(RuntimeError, match="cannot start a thread"):
        pool.submit(lambda: None)
    assert pool.queued == 0
    assert pool.threads == 0
    monkeypatch.undo()
    assert pool.submit(lambda: 7).result(timeout=10 * UNIT) == 7
    pool.shutdown()

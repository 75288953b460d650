"""Whole-server behaviour in a subprocess: the limit across workers, flat threads, drain."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

import stadium
from stadium import AsyncClient
from stadium._cli.demo import _proc_stats, spawn_server
from tests.conftest import UNIT, proc_alive, proc_children, wait_until

#: Process-level: servers, tools or interpreters in subprocesses (`make check` skips it).
pytestmark = pytest.mark.slow


async def _open(url: str, n: int) -> list[AsyncClient]:
    clients = [AsyncClient(url, max_retries=0) for _ in range(n)]
    await asyncio.gather(*(c.reset() for c in clients))
    return clients


async def test_session_limit_holds_across_two_workers() -> None:
    m = 6
    with spawn_server(
        "benchmark", "--workers", "2", "--max-sessions", str(m),
        "--admission-timeout", str(0.5 * UNIT),
    ) as (proc, url):  # fmt: skip
        admitted = await _open(url, m)
        pids = {(await c.step({"wait_seconds": 0})).observation["pid"] for c in admitted}
        await wait_until(lambda: len(proc_children(proc.pid)) == 2, 10 * UNIT)
        assert pids <= set(proc_children(proc.pid))  # served by the workers, not the supervisor
        # the next one is queued, then refused with the hint
        extra = AsyncClient(url, max_retries=0)
        t0 = time.monotonic()
        with pytest.raises(stadium.CapacityError) as info:
            await extra.reset()
        assert time.monotonic() - t0 >= 0.4 * UNIT  # it waited in the queue first
        ctx = info.value.context
        assert (ctx["active_sessions"], ctx["max_sessions"]) == (m, m)
        assert ctx["retry_after_s"] > 0
        # a queued one is admitted when any worker frees a slot in time
        late = AsyncClient(url, max_retries=0)
        pending = asyncio.ensure_future(late.reset())
        await asyncio.sleep(0.1 * UNIT)
        assert not pending.done()
        await admitted[0].close()
        assert (await pending).observation["step_count"] == 0
        # still exactly m: one more is refused
        with pytest.raises(stadium.CapacityError):
            await AsyncClient(url, max_retries=0).reset()
        await asyncio.gather(late.close(), *(c.close() for c in admitted[1:]))


async def test_thread_count_is_flat_from_10_to_1000_sessions() -> None:
    with spawn_server("benchmark", "--max-sessions", "2000") as (proc, url):
        few = await _open(url, 10)
        await asyncio.gather(*(c.step({"wait_seconds": 0}) for c in few))
        _, _, threads_10 = _proc_stats(proc.pid)
        many = await _open(url, 990)
        await asyncio.gather(*(c.step({"wait_seconds": 0}) for c in many))
        _, _, threads_1000 = _proc_stats(proc.pid)
        await asyncio.gather(*(c.close() for c in few + many))
    assert threads_1000 == threads_10


async def test_sigterm_drains_in_flight_steps_and_exits_zero() -> None:
    with spawn_server("benchmark", "--drain-timeout", str(0.3 * UNIT)) as (proc, url):
        clients = await _open(url, 3)
        steps = [asyncio.ensure_future(c.step({"wait_seconds": 1.0 * UNIT})) for c in clients]
        await asyncio.sleep(0.3 * UNIT)
        os.kill(proc.pid, signal.SIGTERM)
        results = await asyncio.gather(*steps)
        assert [r.observation["waited_seconds"] for r in results] == [1.0 * UNIT] * 3
        # then the server closes the sessions with 1001 and exits 0
        for c in clients:
            with pytest.raises(stadium.SessionClosedError) as info:
                await c.step({"wait_seconds": 0})
            assert info.value.context.get("close_code") == 1001
        assert await asyncio.to_thread(proc.wait, 30 * UNIT) == 0


async def test_a_crashed_worker_is_restarted_and_its_slots_freed() -> None:
    m = 4
    with spawn_server(
        "benchmark", "--workers", "2", "--max-sessions", str(m), "--admission-timeout", "0"
    ) as (proc, url):
        clients = await _open(url, m)
        pids = [(await c.step({"wait_seconds": 0})).observation["pid"] for c in clients]
        victim = pids[0]
        os.kill(victim, signal.SIGKILL)
        # the victim's sessions are gone; the survivors keep working
        for c, pid in zip(clients, pids, strict=True):
            if pid == victim:
                with pytest.raises(stadium.SessionClosedError):
                    await c.step({"wait_seconds": 0})
            else:
                assert (await c.step({"wait_seconds": 0})).observation["pid"] == pid
        lost = pids.count(victim)
        # its slots are free again, and a replacement worker comes up
        await wait_until(
            lambda: victim not in proc_children(proc.pid) and len(proc_children(proc.pid)) == 2,
            10 * UNIT,
        )
        assert len(proc_children(proc.pid)) == 2
        assert victim not in proc_children(proc.pid)
        fresh = [AsyncClient(url, max_retries=20) for _ in range(lost)]
        await asyncio.gather(*(c.reset() for c in fresh))
        with pytest.raises(stadium.CapacityError):
            await AsyncClient(url, max_retries=0).reset()
        await asyncio.gather(*(c.close() for c in clients + fresh))


async def test_sigterm_stops_every_worker_and_exits_zero() -> None:
    with spawn_server("echo", "--workers", "2", "--drain-timeout", "0") as (proc, url):
        async with AsyncClient(url) as env:
            await env.reset()
        await wait_until(lambda: len(proc_children(proc.pid)) == 2, 10 * UNIT)
        workers = proc_children(proc.pid)
        assert len(workers) == 2
        os.kill(proc.pid, signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait, 30 * UNIT) == 0
    assert not any(proc_alive(pid) for pid in workers)

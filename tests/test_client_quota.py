"""``--max-sessions-per-client`` over every worker: the shared count-min sketch
(``stadium._server.admission.client_counts``) in one process, raced by forked processes, and a
two-worker server holding a client to its quota wherever the kernel puts its
connections."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
from typing import Any

import pytest
import websockets

from stadium._server.admission.client_counts import (
    MAX_BUCKETS,
    MIN_BUCKETS,
    SharedClientCounts,
    buckets_for,
)
from stadium._server.admission.slots import SharedSlots
from tests.conftest import UNIT
from tests.test_admission import race
from tests.test_supervisor import _serve


def test_a_client_is_held_to_its_quota_over_every_column() -> None:
    counts = SharedClientCounts(2, 3)
    a, b = counts.keys("10.0.0.1"), counts.keys("10.0.0.2")
    assert counts.keys("10.0.0.1") == a  # stable
    assert counts.try_acquire(a)
    counts.bind(1)  # another worker
    assert counts.try_acquire(a)
    counts.bind(2)
    assert not counts.try_acquire(a)  # two held, on two other workers
    assert counts.try_acquire(b)  # another client is not held back
    assert counts.sessions("10.0.0.1") == 2
    counts.forget_worker(1)  # as the supervisor does for a dead worker
    assert counts.sessions("10.0.0.1") == 1
    assert counts.try_acquire(a)
    counts.release(a)
    counts.bind(0)
    counts.release(a)
    assert counts.sessions("10.0.0.1") == 0


def test_a_full_server_rarely_refuses_a_new_client_early() -> None:
    """Every slot of a server held by other clients (one session each, a quota of 1, the
    worst case for a count-min sketch): new clients are refused early at most rarely
    (expected ~0.16 %: the tables are sized from the session limit)."""
    max_sessions = 8192
    counts = SharedClientCounts(1, 1, buckets=buckets_for(max_sessions))
    held = sum(
        counts.try_acquire(counts.keys(f"10.{n >> 16}.{n >> 8 & 255}.{n & 255}"))
        for n in range(max_sessions)
    )
    assert held >= max_sessions * 0.99, f"only {held} of {max_sessions} clients admitted"
    refused = 0
    for n in range(4000):
        keys = counts.keys(f"fd00::{n:x}")
        if counts.try_acquire(keys):
            counts.release(keys)
        else:
            refused += 1
    assert refused <= 40, f"{refused} of 4,000 new clients refused early"


def test_the_tables_grow_with_the_session_limit() -> None:
    assert buckets_for(1) == MIN_BUCKETS
    assert buckets_for(8192) == 65536
    assert buckets_for(10**9) == MAX_BUCKETS


def test_the_keys_are_secret_per_server() -> None:
    """Another server (another key) puts the same address elsewhere: a peer cannot aim."""
    spots = {SharedClientCounts(1, 1).keys("10.0.0.1") for _ in range(8)}
    assert len(spots) > 1


def test_shared_slots_carry_the_per_client_counts() -> None:
    slots = SharedSlots(100, 2, per_client=1)
    assert slots.clients is not None
    keys = slots.clients.keys(None)
    assert slots.clients.try_acquire(keys)
    slots.bind(1)
    assert not slots.clients.try_acquire(keys)
    slots.forget_worker(0)
    assert slots.clients.try_acquire(keys)
    assert SharedSlots(100, 2).clients is None


def test_forked_processes_racing_for_one_client_never_exceed_its_quota() -> None:
    counts = SharedClientCounts(3, 4)
    keys = counts.keys("192.0.2.7")
    race(
        counts.bind,
        functools.partial(counts.try_acquire, keys),
        functools.partial(counts.release, keys),
        limit=3,
        procs=4,
    )
    assert counts.sessions("192.0.2.7") == 0


@pytest.mark.slow
async def test_two_workers_hold_a_client_to_its_quota() -> None:
    quota, tries = 2, 12
    with _serve("benchmark", "--workers", "2", "--max-sessions-per-client", str(quota)) as s:
        url = s.url.replace("http", "ws") + "/ws"
        held: list[websockets.ClientConnection] = []
        refusals = 0
        try:
            for _ in range(tries):
                ws = await websockets.connect(url, open_timeout=10 * UNIT)
                reply = await _reset(ws)
                if reply["type"] == "error":
                    assert reply["data"]["code"] == "CAPACITY_REACHED", reply
                    assert "--max-sessions-per-client" in reply["data"]["message"]
                    refusals += 1
                    await ws.close()
                    continue
                held.append(ws)
            assert len(held) == quota, f"{len(held)} sessions held by one client over 2 workers"
            assert refusals == tries - quota
            # Once one is closed, the client may open another (its count was given back).
            await held.pop().close()
            ws = await websockets.connect(url, open_timeout=10 * UNIT)
            for _ in range(int(50 * UNIT)):  # the close reaches its worker asynchronously
                reply = await _reset(ws)
                if reply["type"] != "error":
                    break
                await ws.close()
                await asyncio.sleep(0.02)
                ws = await websockets.connect(url, open_timeout=10 * UNIT)
            held.append(ws)
            assert reply["type"] == "observation", reply
        finally:
            for ws in held:
                await ws.close()


async def _reset(ws: websockets.ClientConnection) -> dict[str, Any]:
    """A reset's reply, or the refusal a session over the quota gets at once on connecting."""
    with contextlib.suppress(websockets.ConnectionClosed):  # refused and closed already
        await ws.send(json.dumps({"type": "reset"}))
    reply: dict[str, Any] = json.loads(await ws.recv(10 * UNIT))
    return reply

"""``--rate-limit`` over every worker: the sliding windows of
``stadium._core.limits.window_take`` (pure, time passed in), their shared table
(``stadium._server.admission.client_counts.SharedClientRates``), and a two-worker server holding a
client to the node-wide rate wherever the kernel puts its connections."""

from __future__ import annotations

import array
import http.client
import json
import time

import pytest

from stadium._core.limits import COUNT_BITS, window_take
from stadium._server.admission.client_counts import (
    MAX_RATE_BUCKETS,
    MIN_RATE_BUCKETS,
    SharedClientRates,
    rate_buckets_for,
)
from stadium._server.admission.slots import SharedSlots
from tests.conftest import UNIT
from tests.test_supervisor import _serve


def _words(width: int, keys: int = 1) -> memoryview:
    return memoryview(array.array("q", [0] * (2 * width * keys)))


def test_a_client_is_held_to_one_window_over_every_column() -> None:
    words = _words(width=3)
    take = lambda column, now: window_take(words, (0,), 3, column, 4, 2.0, now)  # noqa: E731
    assert [take(n % 3, 100.0 + n * 0.01) for n in range(4)] == [0.0] * 4  # the burst
    wait = take(1, 100.05)  # a fifth, on any worker: refused until the window turns
    assert wait > 0
    assert take(2, 100.05 + wait) == 0.0  # due when it said
    assert take(0, 100.05 + wait) > 0  # and only one


def test_the_long_run_rate_is_the_rate() -> None:
    """A client asking 10 times the rate, spread over 4 workers, gets the rate (and the
    burst once): ``burst / window_s`` a second."""
    words = _words(width=4)
    rate, burst = 5.0, 10
    admitted = sum(
        window_take(words, (0,), 4, n % 4, burst, burst / rate, 1000.0 + n / (10 * rate)) == 0.0
        for n in range(10 * 60 * int(rate))  # 60 s of asking
    )
    assert 60 * rate <= admitted <= 60 * rate + burst + 1


def test_words_of_old_windows_count_nothing() -> None:
    words = _words(width=1)
    words[0] = (7 << COUNT_BITS) | 1_000  # window 7, long ago
    words[1] = (8 << COUNT_BITS) | 1_000  # window 8, long ago
    assert window_take(words, (0,), 1, 0, 1, 1.0, 50.5) == 0.0  # window 50
    assert words[0] == (50 << COUNT_BITS) | 1  # even windows' word, now this window's


def test_the_shared_table_forgets_a_dead_worker_and_hashes_by_a_secret() -> None:
    rates = SharedClientRates(rate=1.0, burst=2, counters=2)
    keys = rates.keys("10.0.0.1")
    assert rates.take(keys, 10.0) == 0.0
    rates.bind(1)
    assert rates.take(keys, 10.0) == 0.0
    assert rates.take(keys, 10.0) > 0  # two over both workers
    assert rates.take(rates.keys("10.0.0.2"), 10.0) == 0.0  # another client is not held
    rates.forget_worker(0)  # as the supervisor does for a dead worker
    assert rates.take(keys, 10.0) == 0.0
    bucket = rates.bucket("10.0.0.1", 10.0)
    assert bucket.take(10.0) > 0
    assert bucket.full(10.0)  # nothing to keep: its state is shared
    spots = {SharedClientRates(1.0, 1, 1).keys("10.0.0.1") for _ in range(8)}
    assert len(spots) > 1
    assert rate_buckets_for(1) == MIN_RATE_BUCKETS
    assert rate_buckets_for(10**9) == MAX_RATE_BUCKETS


def test_shared_slots_carry_the_rates() -> None:
    slots = SharedSlots(100, 2, rate=1.0, burst=1)
    assert slots.rates is not None
    keys = slots.rates.keys(None)
    assert slots.rates.take(keys, 5.0) == 0.0
    slots.bind(1)
    assert slots.rates.take(keys, 5.0) > 0
    slots.forget_worker(0)
    assert slots.rates.take(keys, 5.0) == 0.0
    assert SharedSlots(100, 2).rates is None


def _get(port: int, source: str) -> tuple[int, int | None]:
    """``GET /metadata`` from ``source`` (a loopback address: a client of its own) on a
    connection of its own: the status, and the pid of the worker that served it."""
    conn = http.client.HTTPConnection(
        "127.0.0.1", port, timeout=10 * UNIT, source_address=(source, 0)
    )
    try:
        conn.request("GET", "/metadata")
        resp = conn.getresponse()
        body = resp.read()
        return resp.status, json.loads(body)["worker"]["pid"] if resp.status == 200 else None
    finally:
        conn.close()


@pytest.mark.slow
def test_two_workers_hold_a_client_to_the_node_wide_rate() -> None:
    """Each request on a connection of its own (the kernel spreads them over the
    workers): ``burst`` are served, the rest refused, as with one worker."""
    burst, tries = 4, 24
    with _serve("echo", "--workers", "2", "--rate-limit", "0.01", "--rate-burst", str(burst)) as s:
        # Both workers serving, as seen by other clients (each address its own budget).
        seen: set[int | None] = set()
        deadline = time.monotonic() + 30 * UNIT
        for n in range(1, 1 << 16):
            seen.add(_get(s.port, f"127.1.{n >> 8}.{n & 255}")[1])
            if len(seen - {None}) == 2:
                break
            assert time.monotonic() < deadline, "the second worker never served"
        codes = [_get(s.port, "127.0.0.3")[0] for _ in range(tries)]
        assert codes.count(200) == burst, codes
        assert codes.count(429) == tries - burst

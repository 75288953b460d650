"""The bench client watching itself: its loop's lag and its own collections, with when they
happened (``stadium.bench.clientwatch``), and its collector run as a server's."""

from __future__ import annotations

import asyncio
import gc
import time

from stadium.bench.clientwatch import CLIENT_GC_THRESHOLDS, ClientWatch, quiet_collector


async def test_the_watch_records_a_stalled_loop_and_a_collection() -> None:
    t0 = time.monotonic()
    watch = ClientWatch(t0, interval_s=0.001, keep_ms=2.0)
    watch.start()
    await asyncio.sleep(0.02)  # the probe runs freely for a while
    stalled_at = time.monotonic() - t0
    time.sleep(0.05)  # noqa: ASYNC251  (blocks the loop: the probe wakes ~50 ms late, idle)
    gc.collect()
    await asyncio.sleep(0.01)
    stats = await watch.stop()
    assert stats.probes >= 3
    assert stats.lag_ms["max"] is not None
    assert stats.lag_ms["max"] >= 45.0
    # The stall, kept with when the probe was due (just before it) and the CPU the
    # process used meanwhile: far below the lag, as the loop slept rather than worked.
    stall = [(at, lag, cpu) for at, lag, cpu in stats.lags if lag >= 45.0]
    assert any(
        stalled_at - 0.02 <= at <= stalled_at + 0.002 and cpu < lag for at, lag, cpu in stall
    ), stall
    assert all(lag > 2.0 for _, lag, _ in stats.lags)  # only lags past keep_ms are kept
    assert [g for _, g, _ in stats.gcs].count(2) >= 1  # the explicit full collection
    assert stats.gc_ms == sum(d for _, _, d in stats.gcs) >= 0.0
    assert watch._on_gc not in gc.callbacks  # stopped: unhooked
    n = len(stats.gcs)
    gc.collect()
    assert len(stats.gcs) == n


def test_quiet_collector_freezes_and_restores() -> None:
    before = gc.get_threshold()
    frozen = gc.get_freeze_count()
    with quiet_collector():
        assert gc.get_threshold() == CLIENT_GC_THRESHOLDS
        assert gc.get_freeze_count() > frozen
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == 0

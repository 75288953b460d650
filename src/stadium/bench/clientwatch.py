"""What the load generator itself did while it timed a server: its event loop's lag and its
own garbage collections, each with when it happened.

A bench client times every reply on its own event loop, so any stall of the client (a
cyclic collection, a burst of callbacks) is counted as the server's latency. A
:class:`ClientWatch` running beside the load records those stalls, so that a slow reply
can be matched to what the client was doing at that moment:

* a probe task sleeps ``interval_s`` again and again and records how late it woke (the
  loop's lag: time the loop spent on other callbacks, or the process off the CPU);
* a :data:`gc.callbacks` hook records each collection's generation and duration.

:func:`quiet_collector` runs the client's cyclic collector as a Stadium server runs its
own (start-up objects frozen, thresholds raised), so that the client's collections of a
burst of connections do not stall the loop that times the replies.

Times are ``time.monotonic()`` seconds relative to ``t0`` (the run's start).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
from array import array
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from stadium.bench.stats import percentile


@dataclass(frozen=True, slots=True)
class ClientStats:
    """The watch's findings. ``lag_ms``: lag percentiles of all probe wake-ups;
    ``lags``: ``(at_s, lag_ms, cpu_ms)`` of every wake-up later than ``keep_ms``, with the
    CPU time the process used meanwhile (near ``lag_ms``: the client was busy; far below:
    it was off the CPU); ``gcs``:
    ``(at_s, generation, duration_ms)`` of every collection."""

    probes: int
    lag_ms: dict[str, float | None]
    lags: list[tuple[float, float, float]] = field(default_factory=list)
    gcs: list[tuple[float, int, float]] = field(default_factory=list)

    @property
    def gc_ms(self) -> float:
        """Wall time spent in the client's cyclic collector."""
        return sum(d for _, _, d in self.gcs)


# The same as a Stadium worker's (stadium._server.server.GC_THRESHOLDS) and the floor's;
# repeated here: the bench does not import the server.
CLIENT_GC_THRESHOLDS = (50_000, 50, 100)


@contextlib.contextmanager
def quiet_collector(thresholds: tuple[int, int, int] = CLIENT_GC_THRESHOLDS) -> Iterator[None]:
    """Within: what exists now frozen out of the cyclic collector (:func:`gc.freeze`), and
    the collector run at ``thresholds``; on exit, the thresholds restored and the frozen
    objects handed back to the collector."""
    before = gc.get_threshold()
    gc.collect()
    gc.freeze()
    gc.set_threshold(*thresholds)
    try:
        yield
    finally:
        gc.set_threshold(*before)
        gc.unfreeze()


class ClientWatch:
    """Loop-lag probe and GC recorder for the running loop; :meth:`start` then :meth:`stop`."""

    def __init__(self, t0: float, interval_s: float = 0.001, keep_ms: float = 2.0) -> None:
        self.t0 = t0
        self.interval_s = interval_s
        self.keep_ms = keep_ms
        self._lags = array("d")
        self._kept: list[tuple[float, float, float]] = []
        self._gcs: list[tuple[float, int, float]] = []
        self._gc_start = 0.0
        self._task: asyncio.Task[None] | None = None

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        now = time.monotonic()
        if phase == "start":
            self._gc_start = now
        else:
            start = self._gc_start
            self._gcs.append((start - self.t0, int(info["generation"]), (now - start) * 1e3))

    async def _probe(self) -> None:
        interval, keep, now, cpu = self.interval_s, self.keep_ms, time.monotonic, time.process_time
        lags, kept = self._lags, self._kept
        while True:
            t = now()
            c = cpu()
            await asyncio.sleep(interval)
            late = (now() - t - interval) * 1e3
            lags.append(late)
            if late > keep:
                kept.append((t + interval - self.t0, late, (cpu() - c) * 1e3))

    def start(self) -> None:
        """Begin watching (on the running loop)."""
        gc.callbacks.append(self._on_gc)
        self._task = asyncio.get_running_loop().create_task(self._probe())

    async def stop(self) -> ClientStats:
        """Stop watching; what was seen."""
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        task = self._task
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        lags = list(self._lags)
        return ClientStats(
            probes=len(lags),
            lag_ms={
                "p50": percentile(lags, 50),
                "p99": percentile(lags, 99),
                "p999": percentile(lags, 99.9),
                "max": max(lags) if lags else None,
            },
            lags=list(self._kept),
            gcs=list(self._gcs),
        )


__all__ = ["CLIENT_GC_THRESHOLDS", "ClientStats", "ClientWatch", "quiet_collector"]

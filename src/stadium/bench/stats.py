"""The benchmark's arithmetic: pure functions, no I/O, unit tested.

Definitions (also in ``BENCHMARKS.md``):

* **Percentile** — nearest rank: the ``p``-th percentile of ``n`` sorted values
  is the value at 1-based rank ``ceil(p / 100 * n)`` (rank 1 for ``p = 0``).
  It is always one of the measured values, never an interpolation.
* **Success rate** — sessions that completed connect, reset, every step and
  sent close, over sessions attempted.
* **Max batch** — for one arm and wait: the largest N whose success rate is
  at least 95 % in *every* repetition (the OpenEnv scaling study's rule);
  0 when no N qualifies.
* **Latency inflation** — total latency (p50 or p99) over the ideal total:
  ``wait x steps + think x steps``. Undefined (``None``) when the ideal is 0.
* **Effective concurrency** — Little's law: the sum of session durations over
  the makespan of the point (first session start to last session end).
* **Peak open** — the largest number of sessions open at one instant.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

SUCCESS_THRESHOLD = 0.95
"""A point "holds" when at least this fraction of its sessions succeed."""


class ErrorKind(enum.StrEnum):
    """Why a session failed; the ``error`` column of ``raw.jsonl``."""

    NONE = ""
    REFUSED = "refused"
    """The TCP connection or the WebSocket handshake was refused or reset."""
    TIMEOUT = "timeout"
    """A phase (connect, reset, step, close) passed its timeout."""
    CAPACITY = "capacity"
    """The server answered CAPACITY_REACHED or closed with 1013."""
    PROTOCOL = "protocol"
    """An error frame other than capacity, or a reply of the wrong shape."""
    DISCONNECTED = "disconnected"
    """The server closed the connection in the middle of the session."""
    CLIENT = "client"
    """The load generator itself failed (no free port, no file descriptor)."""
    DEADLINE = "deadline"
    """The point's deadline passed before the session finished."""


ERROR_KINDS: tuple[ErrorKind, ...] = tuple(k for k in ErrorKind if k is not ErrorKind.NONE)
"""Every way a session can fail (``ErrorKind`` but ``NONE``), in declaration order."""


def percentile(values: Sequence[float], p: float) -> float | None:
    """Nearest-rank percentile of ``values`` (need not be sorted).

    Returns ``None`` for an empty sequence. ``p`` is in [0, 100].

    >>> percentile([1.0, 2.0, 3.0, 4.0], 50)
    2.0
    >>> percentile([1.0, 2.0, 3.0, 4.0], 99)
    4.0
    >>> percentile([], 50) is None
    True
    """
    if not 0.0 <= p <= 100.0:
        raise ValueError(f"percentile must be within [0, 100], got {p}")
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(p / 100.0 * len(ordered)))
    return ordered[rank - 1]


@dataclass(frozen=True, slots=True)
class Quantiles:
    """p50, p90, p99 and max of one latency, in seconds (``None`` if no sample)."""

    p50: float | None
    p90: float | None
    p99: float | None
    max: float | None

    @classmethod
    def of(cls, values: Sequence[float]) -> Quantiles:
        """The quantiles of ``values`` by the nearest-rank rule."""
        return cls(
            percentile(values, 50),
            percentile(values, 90),
            percentile(values, 99),
            max(values) if values else None,
        )


def ideal_total(wait_s: float, steps: int, think_s: float) -> float:
    """The total latency of a session on an infinitely fast server and network.

    ``think_s`` is the think time before *each* step.
    """
    return (wait_s + think_s) * steps


def inflation(total: float | None, ideal: float) -> float | None:
    """``total / ideal``; ``None`` when either is missing or the ideal is 0.

    >>> inflation(1.5, 1.0)
    1.5
    >>> inflation(1.0, 0.0) is None
    True
    """
    if total is None or ideal <= 0.0:
        return None
    return total / ideal


def success_rate(ok: int, attempted: int) -> float:
    """``ok / attempted``; 0 for an empty point."""
    return ok / attempted if attempted > 0 else 0.0


def holds(rate: float, threshold: float = SUCCESS_THRESHOLD) -> bool:
    """Whether a success rate counts as holding the batch (``>= threshold``)."""
    return rate >= threshold - 1e-12


def max_batch(
    rates_by_n: Mapping[int, Iterable[float]], threshold: float = SUCCESS_THRESHOLD
) -> int:
    """The largest N whose success rate is ``>= threshold`` in every repetition.

    ``rates_by_n`` maps a batch size N to the success rates of its repetitions.
    An N with no repetition does not qualify. Returns 0 if none qualifies.

    >>> max_batch({32: [1.0, 1.0], 128: [0.99, 0.96], 512: [1.0, 0.90]})
    128
    """
    best = 0
    for n, rates in rates_by_n.items():
        rs = list(rates)
        if rs and all(holds(r, threshold) for r in rs):
            best = max(best, n)
    return best


def batch_per_core(batch: int, cores: float) -> float:
    """Max batch divided by the cores the server was allowed to use."""
    if cores <= 0:
        raise ValueError("cores must be positive")
    return batch / cores


def effective_concurrency(intervals: Sequence[tuple[float, float]]) -> float:
    """Little's law over ``(start, end)`` intervals: busy time / makespan.

    >>> effective_concurrency([(0.0, 1.0), (0.0, 1.0), (0.5, 1.0)])
    2.5
    """
    if not intervals:
        return 0.0
    makespan = max(e for _, e in intervals) - min(s for s, _ in intervals)
    if makespan <= 0.0:
        return float(len(intervals))
    return sum(e - s for s, e in intervals) / makespan


def peak_open(intervals: Sequence[tuple[float, float]]) -> int:
    """The largest number of intervals open at one instant (ends before starts on ties).

    >>> peak_open([(0.0, 2.0), (1.0, 3.0), (2.0, 4.0)])
    2
    """
    events: list[tuple[float, int]] = []
    for s, e in intervals:
        events.append((s, 1))
        events.append((e, -1))
    events.sort()  # (t, -1) sorts before (t, +1): a session that ends frees its slot first
    best = cur = 0
    for _, delta in events:
        cur += delta
        best = max(best, cur)
    return best


def per_unit(total: float | None, units: int, scale: float = 1.0) -> float | None:
    """``total * scale / units``; ``None`` when the total is missing or there are no units."""
    if total is None or units <= 0:
        return None
    return total * scale / units


def ratio(b: float | None, a: float | None) -> float | None:
    """``b / a`` for a before/after comparison; ``None`` if either is missing or ``a`` is 0."""
    if a is None or b is None or a == 0:
        return None
    return b / a


def collapsed(rate: float, *, oom: bool = False, deadline_hit: bool = False) -> bool:
    """The ramp's stop rule: success below the threshold, an OOM kill, or a missed deadline."""
    return oom or deadline_hit or not holds(rate)

"""The per-client limits across worker processes (``--max-sessions-per-client`` and
``--rate-limit`` with ``--workers`` > 1): :class:`SharedClientCounts` (sessions) and
:class:`SharedClientRates` (requests).

Each worker keeps its own :class:`~stadium._core.limits.ClientLimits` (records, buckets),
which sees only that worker's sessions: with W workers, a client whose connections the
kernel spreads over them could hold up to W times its quota. :class:`SharedClientCounts`
closes that: a count of every client's sessions over all workers, in shared memory made
by the supervisor before it forks, with no lock.

It is a count-min sketch with one column per worker process: a client's address is
hashed (BLAKE2b, keyed with a secret drawn before the fork, so a peer choosing its
address cannot aim at another client's buckets) to one bucket in each of
:data:`TABLES` tables; a worker counts a session of that client by adding one to its own
counter of each bucket. A bucket's sum over the workers is at least the sessions of
every client hashed there, so the smallest of a client's sums is at least its own
sessions: the quota is never exceeded. It can refuse early, when each of a client's
buckets already holds ``quota`` sessions of other clients. The tables are sized from the
server's session limit (:func:`buckets_for`: at least 8 buckets per session), so the
sessions of all other clients fill a bucket to 1/8 on average at most: with a quota of
1 and every slot held by other clients, a new client is refused early with a chance of
about (1 - e^-1/8)^3 ≈ 0.16 % (less with a larger quota or fewer sessions held).

Like :class:`~stadium._server.admission.slots.SharedSlots`, a counter is written only by its
own process (and zeroed by the supervisor once that process is dead and reaped), an
increment is made visible (a full fence) before the sums are read, and a refused try
takes its increment back: processes racing for a client's last session may each see the
others' tentative increments and all refuse (the client retries), but never all admit.
"""

from __future__ import annotations

import hashlib
import multiprocessing.sharedctypes
import secrets

from stadium._core.limits import Bucket, window_take
from stadium._util.fence import full_fence

__all__ = ["TABLES", "SharedClientCounts", "SharedClientRates", "buckets_for", "rate_buckets_for"]

#: Buckets per table: bounds of :func:`buckets_for`.
MIN_BUCKETS, MAX_BUCKETS = 1 << 12, 1 << 20
#: Tables (hashes) per client.
TABLES = 3


def buckets_for(max_sessions: int) -> int:
    """Buckets per table for a server of ``max_sessions`` sessions: the power of two at
    least 8 times that, within [:data:`MIN_BUCKETS`, :data:`MAX_BUCKETS`] (4 bytes per
    bucket, table and worker process)."""
    want = max(MIN_BUCKETS, 8 * max_sessions)
    return min(MAX_BUCKETS, 1 << (want - 1).bit_length())


Keys = tuple[int, ...]
"""Where a client's counters are: the first index of each of its buckets."""


class SharedClientCounts:
    """Sessions per client address over all worker processes (see the module docstring).

    Args:
        quota: sessions per client (``--max-sessions-per-client``, > 0).
        counters: worker processes that may be alive at once (one column each).
        buckets: buckets per table (a power of two; :func:`buckets_for`).
    """

    __slots__ = ("_counts", "_fence", "_index", "_key", "_mask", "_width", "quota")

    def __init__(self, quota: int, counters: int, *, buckets: int = MIN_BUCKETS) -> None:
        assert quota > 0, quota
        assert counters > 0, counters
        assert buckets > 0 and buckets & (buckets - 1) == 0, buckets  # noqa: PT018
        self.quota = quota
        self._width = counters
        self._mask = buckets - 1
        shared = multiprocessing.sharedctypes.RawArray("i", TABLES * buckets * counters)
        self._counts = memoryview(shared).cast("B").cast("i")
        self._key = secrets.token_bytes(16)  # drawn before the fork: every worker has it
        self._index = 0
        self._fence = full_fence()

    def bind(self, index: int) -> None:
        """Make this process count in column ``index`` (no other live process uses it)."""
        self._index = index

    def keys(self, address: str | None) -> Keys:
        """Where ``address``'s counters are (``None``, an unknown peer, is one client)."""
        digest = hashlib.blake2b(
            (address or "").encode(), key=self._key, digest_size=4 * TABLES
        ).digest()
        size = (self._mask + 1) * self._width
        return tuple(
            t * size
            + (int.from_bytes(digest[4 * t : 4 * t + 4], "little") & self._mask) * self._width
            for t in range(TABLES)
        )

    def try_acquire(self, keys: Keys) -> bool:
        """Count a session of the client at ``keys``; ``False`` (nothing counted) when the
        client holds its quota over all workers already."""
        counts = self._counts
        index = self._index
        for k in keys:
            counts[k + index] += 1  # only this process writes its column
        self._fence()  # the increments are visible before the sums are read
        width = self._width
        if min(sum(counts[k : k + width]) for k in keys) <= self.quota:
            return True
        for k in keys:
            counts[k + index] -= 1
        return False

    def release(self, keys: Keys) -> None:
        """A session counted by :meth:`try_acquire` in this process ended."""
        counts = self._counts
        index = self._index
        for k in keys:
            counts[k + index] -= 1

    def sessions(self, address: str | None) -> int:
        """The sessions counted for ``address`` (at least its own; a test's view)."""
        counts, width = self._counts, self._width
        return min(sum(counts[k : k + width]) for k in self.keys(address))

    def forget_worker(self, index: int) -> None:
        """Zero the column of the dead, reaped worker that used ``index`` (supervisor)."""
        counts = self._counts
        for start in range(index, len(counts), self._width):
            counts[start] = 0


#: Buckets per table of the shared rate windows: bounds of :func:`rate_buckets_for`.
MIN_RATE_BUCKETS, MAX_RATE_BUCKETS = 1 << 10, 1 << 14


def rate_buckets_for(max_sessions: int) -> int:
    """Buckets per table of :class:`SharedClientRates` for a server of ``max_sessions``
    sessions: the power of two at least twice that, within [:data:`MIN_RATE_BUCKETS`,
    :data:`MAX_RATE_BUCKETS`] (16 bytes per bucket, table and worker process: 768 KiB
    per worker at most)."""
    want = max(MIN_RATE_BUCKETS, 2 * max_sessions)
    return min(MAX_RATE_BUCKETS, 1 << (want - 1).bit_length())


class SharedClientRates:
    """``--rate-limit`` per client address over all worker processes: one budget per
    client for the node (:func:`~stadium._core.limits.window_take`'s sliding windows).

    A client's address is hashed (keyed BLAKE2b, as for :class:`SharedClientCounts`) to a
    bucket of each of :data:`TABLES` tables; a bucket holds two groups (even and odd
    windows) of one 64-bit counter per worker process, each written only by its process
    (and zeroed by the supervisor once that process is dead and reaped). Requests of
    other clients hashed to the same buckets count against a client only where all its
    buckets are shared (the smallest count wins), and only while they are recent (two
    windows).

    Args:
        rate: requests per second per client (``--rate-limit``, > 0).
        burst: requests at once (``--rate-burst``, >= 1): the window holds ``burst``
            requests and lasts ``burst / rate`` seconds.
        counters: worker processes that may be alive at once (one column each).
        buckets: buckets per table (a power of two; :func:`rate_buckets_for`).
    """

    __slots__ = ("_index", "_key", "_mask", "_width", "_words", "limit", "window_s")

    def __init__(
        self, rate: float, burst: int, counters: int, *, buckets: int = MIN_RATE_BUCKETS
    ) -> None:
        assert rate > 0 and burst >= 1, (rate, burst)  # noqa: PT018
        assert counters > 0, counters
        assert buckets > 0 and buckets & (buckets - 1) == 0, buckets  # noqa: PT018
        self.limit = burst
        self.window_s = burst / rate
        self._width = counters
        self._mask = buckets - 1
        shared = multiprocessing.sharedctypes.RawArray("q", TABLES * buckets * 2 * counters)
        self._words = memoryview(shared).cast("B").cast("q")
        self._key = secrets.token_bytes(16)  # drawn before the fork: every worker has it
        self._index = 0

    def bind(self, index: int) -> None:
        """Make this process count in column ``index`` (no other live process uses it)."""
        self._index = index

    def keys(self, address: str | None) -> Keys:
        """Where ``address``'s counters are (``None``, an unknown peer, is one client)."""
        digest = hashlib.blake2b(
            (address or "").encode(), key=self._key, digest_size=4 * TABLES
        ).digest()
        group = 2 * self._width
        size = (self._mask + 1) * group
        return tuple(
            t * size + (int.from_bytes(digest[4 * t : 4 * t + 4], "little") & self._mask) * group
            for t in range(TABLES)
        )

    def take(self, keys: Keys, now: float) -> float:
        """Spend one request of the client at ``keys`` at ``now`` (a monotonic time, the
        same clock in every worker): ``0.0``, or the seconds until one is due."""
        return window_take(
            self._words, keys, self._width, self._index, self.limit, self.window_s, now
        )

    def bucket(self, address: str | None, now: float) -> Bucket:
        """``address``'s bucket: a view of its shared counters (``ClientLimits.new_bucket``)."""
        return SharedBucket(self, self.keys(address))

    def forget_worker(self, index: int) -> None:
        """Zero the column of the dead, reaped worker that used ``index`` (supervisor)."""
        words = self._words
        for start in range(index, len(words), self._width):
            words[start] = 0


class SharedBucket:
    """A client's rate budget in :class:`SharedClientRates` (what a session spends from)."""

    __slots__ = ("keys", "rates")

    def __init__(self, rates: SharedClientRates, keys: Keys) -> None:
        self.rates = rates
        self.keys = keys

    def take(self, now: float) -> float:
        return self.rates.take(self.keys, now)

    def full(self, now: float) -> bool:
        return True  # its state is in shared memory: the record may go at once

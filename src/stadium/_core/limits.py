"""Per-client limits: concurrent sessions and a request rate per client address.

A *client* is the peer's IP address as the transport sees it (``None`` when the
transport does not know it: every such peer is one client). Behind a reverse
proxy every request comes from the proxy's address, so all clients share one
quota and one bucket there: leave these limits off and use the proxy's own (or
run without the proxy); PROXY-protocol support is future work.

Two limits, each off unless configured (``--max-sessions-per-client``,
``--rate-limit`` / ``--rate-burst``):

* **sessions per client**: a session beyond the quota is refused at once, whichever
  door it comes through (a WebSocket or batch session, a ``fork``, a ``POST /reset`` /
  ``POST /step`` / ``GET /state`` while it runs, an MCP ``openenv/session/create``, a
  restore: ``stadium._server.admission.doorway``);
* **request rate**: a token bucket per client (``rate`` tokens a second, at most
  ``burst`` saved up), one token per WebSocket request or HTTP request; a request
  that finds the bucket empty is refused, with the seconds until a token is due.

Counting here is per worker process; both limits also hold over every worker
(``stadium._server.admission.client_counts``, shared memory made before the fork). With one
worker the rate is a :class:`TokenBucket`; with several, each client's bucket is a view
of windowed counters every worker adds to (:func:`window_take`, below): one budget per
client for the node, however the kernel spreads its connections over the workers.

**The shared rate** is a sliding window of ``burst / rate`` seconds holding at most
``burst`` requests (the same long-run rate and the same burst as the bucket). Each
client has a counter per worker and window (the current and the previous one); a
request is admitted when ``current + previous * (1 - elapsed share of the current
window)`` over every worker's counters is below ``burst``, and then counted in its own
worker's current counter. A counter is a 64-bit word: the window's number in its high
bits, the count in the low :data:`COUNT_BITS`, so one store updates it and a stale
word (an older window's) reads as 0: no lock, nothing to reset, nothing a killed
worker could leave held. Two workers admitting one client's requests at the same
instant may let through one extra each (the check and the count are not one step): the
bound is soft by at most the number of workers.

Pure: no clock of its own (callers pass ``now``, a monotonic time, so it is
tested without waiting) and no I/O. Memory is bounded: a client's record lives
while it holds sessions; afterwards it is kept only while its bucket is not yet
full again (a full bucket is the same as none), and at most ``max_idle`` such
records are kept, the oldest dropped first, so an attacker cycling addresses
cannot grow the table.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from stadium._errors import CapacityError, RateLimitError

#: Records of clients without sessions kept (their partly used buckets), at most.
MAX_IDLE_CLIENTS = 16384


def client_address(peer: Any) -> str | None:
    """The client (its IP address) of a socket's ``peername`` or an ASGI scope's ``client``.

    ``(host, port[, ...])`` gives ``host``; anything else (a Unix socket's path,
    ``None``) gives ``None``: those peers count as one client.
    """
    if isinstance(peer, tuple | list) and peer and isinstance(peer[0], str):
        return peer[0]
    return None


class Bucket(Protocol):
    """A client's request budget: :class:`TokenBucket`, or its view of the shared windows."""

    def take(self, now: float) -> float:
        """Spend one request: ``0.0`` if allowed, else the seconds until one is due."""
        ...

    def full(self, now: float) -> bool:
        """Whether forgetting it now loses nothing (it is as good as a fresh one)."""
        ...


class TokenBucket:
    """``rate`` tokens a second, at most ``burst`` saved; :meth:`take` spends one.

    Starts full. A clock that goes backwards refills nothing.
    """

    __slots__ = ("burst", "rate", "stamp", "tokens")

    def __init__(self, rate: float, burst: float, now: float) -> None:
        self.rate = rate
        self.burst = burst
        self.tokens = burst
        self.stamp = now

    def take(self, now: float) -> float:
        """Spend a token: ``0.0`` if there was one, else the seconds until one is due."""
        tokens = self.tokens
        elapsed = now - self.stamp
        if elapsed > 0:
            tokens += elapsed * self.rate
            if tokens > self.burst:
                tokens = self.burst
            self.stamp = now
        if tokens >= 1.0:
            self.tokens = tokens - 1.0
            return 0.0
        self.tokens = tokens
        return (1.0 - tokens) / self.rate

    def full(self, now: float) -> bool:
        """Whether the bucket has refilled to ``burst`` by ``now``."""
        return self.tokens + max(0.0, now - self.stamp) * self.rate >= self.burst


#: Low bits of a window counter that hold the count (the rest: the window's number).
COUNT_BITS = 24
_COUNT_MASK = (1 << COUNT_BITS) - 1
_WINDOW_MASK = (1 << (63 - COUNT_BITS)) - 1


def window_take(
    words: memoryview[int], keys: Sequence[int], width: int, column: int, limit: int,
    window_s: float, now: float,
) -> float:  # fmt: skip
    """Spend one of a client's ``limit`` requests per sliding window of ``window_s`` s.

    ``words`` (64-bit) holds, from each of ``keys``, two groups of ``width`` counters (one
    per worker; the group of even windows, then of odd ones); this process writes only
    the counters at ``column``. The client's count is the smallest over its keys (a
    count-min sketch: at least its own). ``0.0``: admitted and counted; else the seconds
    until the estimate leaves room for one (nothing counted). See the module docstring."""
    tick = now / window_s
    window = math.floor(tick)
    elapsed = tick - window
    current, previous = window & _WINDOW_MASK, (window - 1) & _WINDOW_MASK
    weight = 1.0 - elapsed
    group = 2 * width  # both groups: a word of either window is in its parity's group
    best = math.inf
    best_cur = best_prev = 0
    for key in keys:
        cur = prev = 0
        for word in words[key : key + group]:
            if word:
                stamp = word >> COUNT_BITS
                if stamp == current:
                    cur += word & _COUNT_MASK
                elif stamp == previous:
                    prev += word & _COUNT_MASK
        estimate = cur + prev * weight
        if estimate < best:
            best, best_cur, best_prev = estimate, cur, prev
    if best < limit:
        for key in keys:
            at = key + (window & 1) * width + column
            word = words[at]
            if word >> COUNT_BITS != current:
                word = current << COUNT_BITS
            if word & _COUNT_MASK != _COUNT_MASK:
                word += 1
            words[at] = word
        return 0.0
    if best_cur < limit:  # the previous window's share has to fade: within this one
        due = 1.0 - (limit - best_cur) / best_prev - elapsed
    else:  # this window's own count: in the next one, as it fades there
        due = 1.0 - elapsed + 1.0 - limit / best_cur
    return max(due * window_s, 0.0) + 0.001  # just past the moment it leaves room


class ClientRecord:
    """One client address's record: its open sessions and its bucket (``None``: no rate limit).

    ``holds`` counts everything that keeps the record (and so its bucket) alive: its
    sessions, and holders not counted against the quota (a WebSocket attached to an MCP
    session, which rides on that session's slot).
    """

    __slots__ = ("address", "bucket", "holds", "sessions")

    def __init__(self, address: str | None, bucket: Bucket | None) -> None:
        self.address = address
        self.bucket = bucket
        self.sessions = 0
        self.holds = 0


class ClientLimits:
    """The per-client session quota and request buckets of one worker process.

    Args:
        max_sessions: concurrent sessions per client (0: no quota).
        rate: requests per second per client (0: no rate limit).
        burst: requests a client may send at once (the bucket's size).
        max_idle: records of clients without sessions kept at most.

    ``new_bucket(address, now)`` makes a client's bucket (a :class:`TokenBucket` unless
    set: ``stadium._server.admission.client_counts`` sets its view of the shared windows).
    """

    __slots__ = ("_active", "_idle", "burst", "max_idle", "max_sessions", "new_bucket", "rate")

    def __init__(
        self, max_sessions: int, rate: float, burst: int, *, max_idle: int = MAX_IDLE_CLIENTS
    ) -> None:
        self.max_sessions = max_sessions
        self.rate = rate
        self.burst = burst
        self.max_idle = max_idle
        self._active: dict[str | None, ClientRecord] = {}
        self._idle: collections.OrderedDict[str | None, ClientRecord] = collections.OrderedDict()
        self.new_bucket: Callable[[str | None, float], Bucket] = self._token_bucket

    def _token_bucket(self, address: str | None, now: float) -> Bucket:
        return TokenBucket(self.rate, self.burst, now)

    @classmethod
    def of(cls, max_sessions: int, rate: float, burst: int) -> ClientLimits | None:
        """The limits, or ``None`` when both are off (then they cost nothing)."""
        if max_sessions <= 0 and rate <= 0:
            return None
        return cls(max_sessions, rate, burst)

    def __len__(self) -> int:
        """ClientRecord records held (with sessions, or with a bucket still refilling)."""
        return len(self._active) + len(self._idle)

    def sessions(self, address: str | None) -> int:
        """Sessions ``address`` holds now."""
        client = self._active.get(address)
        return 0 if client is None else client.sessions

    def _client(self, address: str | None, now: float) -> ClientRecord:
        client = self._active.get(address)
        if client is None:
            client = self._idle.pop(address, None)
            if client is None:
                bucket = self.new_bucket(address, now) if self.rate > 0 else None
                client = ClientRecord(address, bucket)
            self._active[address] = client
        return client

    def open_session(
        self, address: str | None, now: float, *, counted: bool = True
    ) -> ClientRecord | None:
        """Count a new session of ``address``; ``None`` (nothing counted) when over the quota.

        ``counted=False``: hold the record (its bucket) without a session of the quota.
        Give the record back with :meth:`close_session` (the same ``counted``) when done.
        """
        client = self._client(address, now)
        if counted:
            if self.max_sessions and client.sessions >= self.max_sessions:
                self._settle(client, now)
                return None
            client.sessions += 1
        client.holds += 1
        return client

    def close_session(self, client: ClientRecord, now: float, *, counted: bool = True) -> None:
        """A session of ``client`` (from :meth:`open_session`, same ``counted``) ended."""
        if counted:
            client.sessions -= 1
        client.holds -= 1
        self._settle(client, now)

    def take(self, address: str | None, now: float) -> float:
        """Spend one of ``address``'s tokens (a request outside a session's own bucket).

        ``0.0``: go ahead; else the seconds until a token is due (refuse the request).
        """
        if self.rate <= 0:
            return 0.0
        client = self._client(address, now)
        assert client.bucket is not None
        wait = client.bucket.take(now)
        self._settle(client, now)
        return wait

    def rate_error(self, wait: float) -> RateLimitError:
        """The error for a request refused because its client's bucket is empty."""
        retry = math.ceil(wait * 1000) / 1000  # whole milliseconds, never 0
        return RateLimitError(
            f"too many requests: this client may send {self.rate:g} a second (bursts of "
            f"{self.burst}, --rate-limit/--rate-burst); retry after {retry:g}s",
            retry_after_s=retry,
            rate_limit=self.rate,
            rate_burst=self.burst,
        )

    def quota_error(self) -> CapacityError:
        """The error for a session refused because its client holds its quota already."""
        return CapacityError(
            f"this client already holds {self.max_sessions} sessions "
            "(--max-sessions-per-client); close one, then retry",
            max_sessions_per_client=self.max_sessions,
            retry_after_s=1.0,
        )

    def _settle(self, client: ClientRecord, now: float) -> None:
        """File a record without holders among the idle ones, or drop it; bound the table."""
        if client.holds > 0:
            return
        address = client.address
        self._active.pop(address, None)
        idle = self._idle
        bucket = client.bucket
        if bucket is not None and not bucket.full(now):
            idle[address] = client
            idle.move_to_end(address)
        # Oldest first: over the cap, or refilled (a full bucket is as good as none).
        while idle:
            oldest = next(iter(idle.values())).bucket
            if len(idle) <= self.max_idle and oldest is not None and not oldest.full(now):
                break
            idle.popitem(last=False)

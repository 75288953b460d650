"""What one point's load is: N sessions, their think time, and the limits they respect.

* :class:`ThinkModel` — the think time before each step (an LLM producing the
  next action);
* :class:`LoadSpec` — the point: sessions, wait, steps, timeouts, processes,
  CPUs, deadline, connect window;
* :func:`source_address` — which loopback address each session connects from.

Limits the load respects by construction:

* at most :data:`MAX_SESSIONS_PER_PROC` sessions per process (the machine's
  open-file limit is 20,000 per process), so ``procs >= ceil(N / that)``;
* past :data:`PORTS_PER_SOURCE` sessions, sessions are spread round-robin
  over source addresses 127.0.0.2, 127.0.0.3, ..., at most that many each
  (about 28k ephemeral ports exist per source address and destination, and
  the kernel's search for a free one slows down as they fill: with 25,000 on
  one address, a burst of 32,768 spent most of its CPU in the kernel).

Pure values, no I/O: the sessions (:mod:`stadium.bench.sessions`) and the
worker processes (:mod:`stadium.bench.loadgen`) read them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_SESSIONS_PER_PROC = 15_000
"""Sessions per worker process: under the 20,000 open-file limit with margin."""

PORTS_PER_SOURCE = 8_192
"""Most sessions per source address (under a third of the ~28k ephemeral ports)."""


@dataclass(frozen=True, slots=True)
class ThinkModel:
    """Think time before each step: an LLM producing the next action.

    ``ttft_ms + tokens * token_ms`` milliseconds, deterministic so that the
    ideal latency of a session is known exactly. ``--think-ms X`` is
    ``ThinkModel(ttft_ms=X)``.
    """

    ttft_ms: float = 0.0
    tokens: int = 0
    token_ms: float = 0.0

    @property
    def seconds(self) -> float:
        """Think time per step, in seconds."""
        return (self.ttft_ms + self.tokens * self.token_ms) / 1000.0


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """One point's load: N sessions, each connect → reset → steps → close.

    Timeouts are in seconds; a step's timeout is ``wait_s + request_timeout``
    (after its think time). ``mode`` is ``ws`` (WebSocket sessions) or ``http``
    (``POST /reset`` and ``POST /step`` on one keep-alive connection).
    ``procs`` 0 means as few as the file limit allows (at least one per load CPU
    when ``cpus`` is given). ``deadline_s`` 0 means derived: the ideal session
    time plus every phase's timeout plus 30 s. ``connect_window`` K > 0 lets at
    most K sessions of the point be connecting (TCP, and the WebSocket
    handshake) at once, split over the processes; the others wait their turn,
    and that wait counts in their connect and total latency (0: every session
    connects at the burst's instant, as the OpenEnv study did). ``duration_s``
    > 0 makes it a soak (``stadium bench soak``): each of the N session slots
    opens sessions one after another until ``duration_s`` has passed.
    """

    url: str
    sessions: int
    wait_s: float = 1.0
    steps: int = 1
    think: ThinkModel = field(default_factory=ThinkModel)
    state_kb: int = 0
    mode: str = "ws"
    connect_timeout: float = 30.0
    request_timeout: float = 30.0
    close_timeout: float = 5.0
    procs: int = 0
    cpus: tuple[int, ...] | None = None
    deadline_s: float = 0.0
    connect_window: int = 0
    duration_s: float = 0.0

    def n_procs(self) -> int:
        """The number of worker processes this load uses."""
        need = max(1, math.ceil(self.sessions / MAX_SESSIONS_PER_PROC))
        want = self.procs or (len(self.cpus) if self.cpus else 1)
        return max(need, min(want, max(1, self.sessions)))

    def deadline(self) -> float:
        """Seconds after the start by which every session must have finished."""
        if self.deadline_s > 0:
            return self.deadline_s
        per_step = self.wait_s + self.think.seconds + self.request_timeout
        return (
            self.duration_s
            + self.connect_timeout
            + self.request_timeout
            + per_step * self.steps
            + self.close_timeout
            + 30.0
        )


def source_address(index: int, sessions: int) -> str | None:
    """The source address of session ``index`` of a point of ``sessions``.

    ``None`` (the kernel's choice, 127.0.0.1) up to :data:`PORTS_PER_SOURCE`
    sessions; past that ``k = ceil(sessions / PORTS_PER_SOURCE)`` addresses
    127.0.0.2 ... 127.0.0.(k+1), round-robin.

    >>> source_address(0, 100) is None
    True
    >>> [source_address(i, 20_000) for i in range(4)]
    ['127.0.0.2', '127.0.0.3', '127.0.0.4', '127.0.0.2']
    """
    if sessions <= PORTS_PER_SOURCE:
        return None
    k = math.ceil(sessions / PORTS_PER_SOURCE)
    if k > 250:
        raise ValueError("too many sessions for 127.0.0.0/24 source addresses")
    return f"127.0.0.{2 + index % k}"

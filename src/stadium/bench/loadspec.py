"""What one point's load is: N sessions, their think time, and the limits they respect.

* :class:`ThinkModel` — the think time before each step (an LLM producing the
  next action);
* :class:`LoadSpec` — the point: sessions, wait, steps, timeouts, processes,
  CPUs, deadline, connect window;
* :func:`source_address` — which loopback address each session connects from;
* :func:`ws_url` — a server URL as users give it (``http://H:P``, ``ws://H:P/ws``,
  ``H:P`` ...) as the WebSocket URL the sessions open;
* :func:`spread` — which endpoint each session of a point goes to, when the
  load has several (:attr:`LoadSpec.urls`, weighted by :attr:`LoadSpec.weights`).

Several endpoints (nodes of a deployment) are spread over *statically*: the
point's sessions are assigned to endpoints by index, in proportion to the
weights (the free capacity each endpoint reported on ``GET /health`` at the
point's start), interleaved as smoothly as the weights allow. The same N and
weights always give the same assignment, so a burst is reproducible. A
session refused by its endpoint is a failure: the benchmark does not retry
it on another node (as the OpenEnv study counts it).

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

import functools
import math
import os
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass, field

from stadium._core.urls import ws_url
from stadium._errors import ConfigError
from stadium.deploy.deployment import Deployment

MAX_SESSIONS_PER_PROC = 15_000
"""Sessions per worker process: under the 20,000 open-file limit with margin."""

PORTS_PER_SOURCE = 8_192
"""Most sessions per source address (under a third of the ~28k ephemeral ports)."""

MAX_BATCH = 4_096
"""Most sessions per batched connection: the protocol's limit of calls per batch."""


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

    ``urls`` (several endpoints, WebSocket URLs) overrides ``url``: session
    ``i`` goes to :meth:`endpoint` ``(i)``, by :func:`spread` over ``weights``
    (one per URL; empty: equal).

    ``batch`` B > 0 puts B sessions on each WebSocket connection (Stadium's
    ``stadium.batch`` subprotocol, :mod:`stadium.bench.batched`): one batch frame
    resets them, one batch frame per round steps them all; 0 is one connection
    and one frame per session and step.
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
    urls: tuple[str, ...] = ()
    weights: tuple[int, ...] = ()
    batch: int = 0

    def __post_init__(self) -> None:
        if not self.batch:
            return
        if not 0 < self.batch <= MAX_BATCH:
            raise ConfigError(f"batch {self.batch} is out of range: give 1 to {MAX_BATCH:,}")
        if self.mode != "ws":
            raise ConfigError("batches are WebSocket frames: use --mode ws with --batch")
        if self.duration_s > 0:
            raise ConfigError("a soak runs one frame per step: drop --batch")

    def connections(self) -> int:
        """How many connections the load opens: one per session, or per ``batch`` sessions."""
        return math.ceil(self.sessions / self.batch) if self.batch else self.sessions

    def endpoint(self, index: int) -> str:
        """The URL session ``index`` connects to (``url`` when there is one endpoint)."""
        if len(self.urls) < 2:
            return self.urls[0] if self.urls else self.url
        weights = self.weights or (1,) * len(self.urls)
        return self.urls[spread(weights, self.sessions)[index % self.sessions]]

    def source(self, index: int) -> str | None:
        """The source address of session ``index`` (:func:`source_address`); ``None``
        (the kernel's choice) when its endpoint is not on loopback."""
        host = urllib.parse.urlsplit(self.endpoint(index)).hostname or ""
        if not host.startswith("127.") and host != "localhost":
            return None
        return source_address(index, self.sessions)

    def n_procs(self) -> int:
        """The number of worker processes this load uses."""
        need = max(1, math.ceil(self.connections() / MAX_SESSIONS_PER_PROC))
        want = self.procs or (len(self.cpus) if self.cpus else 1)
        return max(need, min(want, max(1, self.connections())))

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


@functools.lru_cache(maxsize=16)
def spread(weights: tuple[int, ...], sessions: int) -> tuple[int, ...]:
    """The endpoint (an index into ``weights``) of each of ``sessions`` sessions.

    Each endpoint gets its share of the sessions in proportion to its weight
    (largest remainders; ties to the earlier endpoint), and the shares are
    interleaved by smooth weighted round-robin, so that any prefix of the
    sessions is split about as the whole is. All weights 0 (or negative) count
    as equal. Deterministic.

    >>> spread((1, 1), 4)
    (0, 1, 0, 1)
    >>> spread((1, 3), 4)
    (1, 0, 1, 1)
    >>> spread((0, 5), 3)
    (1, 1, 1)
    """
    w = [max(0, x) for x in weights]
    if not w:
        raise ValueError("spread needs at least one endpoint")
    if sum(w) == 0:
        w = [1] * len(w)
    total = sum(w)
    exact = [sessions * x / total for x in w]
    quota = [math.floor(e) for e in exact]
    order = sorted(range(len(w)), key=lambda k: (-(exact[k] - quota[k]), k))
    for k in order[: sessions - sum(quota)]:
        quota[k] += 1
    current = [0] * len(w)
    out: list[int] = []
    for _ in range(sessions):
        for k, q in enumerate(quota):
            current[k] += q
        best = max(range(len(w)), key=lambda k: (current[k], -k))
        current[best] -= sessions
        out.append(best)
    return tuple(out)


def ws_urls(specs: Sequence[str]) -> tuple[str, ...]:
    """Every endpoint of ``specs`` as a WebSocket URL (:func:`ws_url`): each spec is a
    URL, several separated by commas, or a deployment file's path (its nodes)."""
    out: list[str] = []
    for spec in specs:
        for item in (x.strip() for x in spec.split(",")):
            if not item:
                continue
            if "://" not in item and (item.endswith(".json") or os.path.isfile(item)):
                out.extend(ws_url(n) for n in Deployment.read(item).nodes)
            else:
                out.append(ws_url(item))
    if not out:
        raise ConfigError("no server URL given (--url http://HOST:PORT, repeatable)")
    return tuple(out)

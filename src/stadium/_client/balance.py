"""Client-side balancing: a client spreads its sessions over many nodes itself.

Where a client takes a URL it also takes *endpoints*: a list of URLs, a deployment
file (``stadium slurm`` writes one), what :func:`stadium.launch` returns (its nodes)
or one URL whose host name resolves to several addresses (a Kubernetes headless
Service). Each new session goes to the node with the most room, one hop, no proxy on
the data path; balancing happens when a session opens, never per step.

The decision is pure (:func:`choose`, :func:`retry_delay`, :func:`apply_health`, ...:
state and a clock in, a choice out); :class:`Balancer` adds the thin I/O around it:

* **Capacity** from each node's open ``GET /health`` (``max_sessions``,
  ``active_sessions``, ``waiting_sessions``), probed concurrently with a short
  timeout (:func:`stadium._util.health.probe_async`) when the balancer is first used, then at most
  every ``probe_interval_s`` *while sessions open* (an idle trainer sends nothing),
  and at once after a failure. A node answering without them (OpenEnv) has unknown
  capacity: it counts as the mean of the known ones (all unknown: equal shares).
* **Local accounting**: the sessions this process holds on each node (opening ones
  included) are added to the last report, so a burst of 1,000 opens spreads before
  any probe comes back.
* **Choice**: the node whose utilisation after one more session,
  ``(load + 1) / capacity``, is lowest — a burst fills nodes in proportion to their
  capacity — ties broken at random; nodes down, full or draining are skipped.
* **Failures**: a refused or timed-out connect (or probe) marks a node down for a
  delay that doubles with consecutive failures (with jitter, capped); a
  ``CAPACITY_REACHED`` refusal marks it full for the ``retry_after_s`` it gave; a
  draining node (503) is skipped until a probe finds it healthy again.

One :class:`Balancer` per endpoint spec per process (:func:`balancer_for`): the
1,000 clients of a trainer share its state. (``stadium bench`` spreads its bursts
statically instead, by free capacity read once per point: a benchmark must be
reproducible; see :mod:`stadium.bench.loadspec`.)
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import os
import random
import socket
import ssl as ssl_module
import threading
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, Protocol, TypeGuard, cast

from stadium._core.urls import base_url
from stadium._util.health import probe_async
from stadium.deploy.deployment import endpoints


class HasNodes(Protocol):
    """A :class:`~stadium.deploy.deployment.Deployment`, or anything with its ``nodes``."""

    @property
    def nodes(self) -> tuple[str, ...]: ...


class HasDeployment(Protocol):
    """What a launcher returns (:class:`~stadium.deploy.running.Running`): its ``deployment``."""

    @property
    def deployment(self) -> HasNodes: ...


#: What clients accept where they take a URL: one URL, a deployment file, several URLs,
#: a :class:`~stadium.deploy.deployment.Deployment` or a running deployment (what
#: :func:`stadium.launch` returns; its nodes, never its router).
EndpointSpec = str | os.PathLike[str] | Sequence[str] | HasNodes | HasDeployment

#: ``resolver(host, port)`` → the host's addresses (tests inject one).
Resolver = Callable[[str, int], Awaitable[list[str]]]


@dataclasses.dataclass(eq=False, slots=True)
class Endpoint:
    """One node and what this process knows about it."""

    url: str  #: base URL ``http[s]://H:P`` (an address when expanded from a DNS name)
    host: str | None = None  #: the DNS name it was resolved from (``Host``, TLS SNI), else None
    capacity: int | None = None  #: ``max_sessions`` from ``/health``; None: unknown
    reported: int = 0  #: active + waiting sessions at the last report
    held_at_report: int = 0  #: :attr:`held` when that report came
    held: int = 0  #: sessions this process holds there now (opening ones included)
    failures: int = 0  #: consecutive failures (connects or probes)
    down_until: float = 0.0
    full_until: float = 0.0
    draining: bool = False
    error: str = ""  #: the last failure, for messages

    @property
    def ws_url(self) -> str:
        """The session endpoint, ``ws[s]://H:P/ws``."""
        return "ws" + self.url[4:] + "/ws"

    @property
    def load(self) -> int:
        """Sessions estimated there: the last report plus what this process changed since."""
        return max(self.held, self.reported + self.held - self.held_at_report)

    def available(self, now: float) -> bool:
        return now >= self.down_until and now >= self.full_until and not self.draining

    def __repr__(self) -> str:
        cap = "?" if self.capacity is None else self.capacity
        return f"<Endpoint {self.url} load={self.load}/{cap} held={self.held}>"


# -- the decision (pure) -----------------------------------------------------------


def assumed_capacity(eps: Iterable[Endpoint]) -> float:
    """The capacity of a node that did not say: the mean of the known ones (else 1)."""
    known = [e.capacity for e in eps if e.capacity]
    return sum(known) / len(known) if known else 1.0


def choose(
    eps: Sequence[Endpoint],
    now: float,
    rng: random.Random | None = None,
    exclude: Iterable[Endpoint] = (),
) -> Endpoint | None:
    """The available endpoint (not down, full nor draining, not in ``exclude``) with the
    lowest utilisation after one more session; ties at random. None when there is none."""
    skip = set(map(id, exclude))
    fair = assumed_capacity(eps)
    best: list[Endpoint] = []
    best_key = 0.0
    for ep in eps:
        if id(ep) in skip or not ep.available(now):
            continue
        key = (ep.load + 1) / (ep.capacity or fair)
        if not best or key < best_key - 1e-12:
            best, best_key = [ep], key
        elif abs(key - best_key) <= 1e-12:
            best.append(ep)
    if not best:
        return None
    return best[0] if len(best) == 1 else (rng or random).choice(best)


def soonest(eps: Sequence[Endpoint], exclude: Iterable[Endpoint] = ()) -> Endpoint | None:
    """Of the endpoints not in ``exclude``, the one that becomes available first."""
    skip = set(map(id, exclude))
    rest = [e for e in eps if id(e) not in skip]
    if not rest:
        return None
    return min(rest, key=lambda e: (max(e.down_until, e.full_until), e.draining, e.load))


def retry_delay(
    failures: int, rng: random.Random | None = None, base_s: float = 0.5, max_s: float = 30.0
) -> float:
    """Seconds a node stays down after ``failures`` consecutive failures: ``base_s`` doubling
    per failure, capped at ``max_s``, times a jitter in [0.5, 1.5)."""
    delay = min(max_s, base_s * 2 ** max(0, failures - 1))
    return float(delay * (0.5 + (rng or random).random()))


def mark_failed(
    ep: Endpoint,
    now: float,
    error: str,
    rng: random.Random | None = None,
    base_s: float = 0.5,
    max_s: float = 30.0,
) -> None:
    """A connect or probe failed: down for :func:`retry_delay`."""
    ep.failures += 1
    ep.down_until = now + retry_delay(ep.failures, rng, base_s, max_s)
    ep.error = error


def mark_full(ep: Endpoint, now: float, retry_after_s: float) -> None:
    """The node refused a session with ``CAPACITY_REACHED``: skip it for ``retry_after_s``."""
    ep.full_until = now + max(0.0, retry_after_s)
    ep.error = "at capacity"


def _count(value: object) -> TypeGuard[int]:
    """Whether a ``/health`` member is a count: an int, 0 or more (not a bool)."""
    return value.__class__ is int and value >= 0


def apply_health(ep: Endpoint, status: int, body: Any) -> None:
    """A ``/health`` answer: the node is up; take its capacity and load when it gives them."""
    ep.failures = 0
    ep.down_until = 0.0
    ep.draining = status == 503
    data = body if isinstance(body, dict) else {}
    cap, active, waiting = (
        data.get(k) for k in ("max_sessions", "active_sessions", "waiting_sessions")
    )
    if _count(cap) and cap > 0 and _count(active):  # a node's word, not a lie of -1 sessions
        ep.capacity = cap
        ep.reported = active + (waiting if _count(waiting) else 0)
        ep.held_at_report = ep.held
        if ep.reported < cap:
            ep.full_until = 0.0
    else:  # e.g. OpenEnv's {"status": "healthy"}: capacity unknown, our own sessions only
        ep.capacity = None
        ep.reported = ep.held_at_report = 0


def plan(eps: Sequence[Endpoint], n: int, rng: random.Random | None = None) -> list[Endpoint]:
    """Where ``n`` new sessions would go, one after the other (each counted as held)."""
    out: list[Endpoint] = []
    now = time.monotonic()
    for _ in range(n):
        ep = choose(eps, now, rng) or soonest(eps)
        if ep is None:
            break
        ep.held += 1
        out.append(ep)
    for ep in out:
        ep.held -= 1
    return out


# -- specs ---------------------------------------------------------------------------


def spec_key(spec: EndpointSpec) -> tuple[str, ...]:
    """``spec`` as a tuple of strings (URLs and deployment-file paths), the registry's key.

    A deployment (or a running one) gives its nodes' URLs: the same key, so the same
    balancer, as the list of those URLs."""
    if isinstance(spec, str | os.PathLike):
        return (os.fspath(spec),)
    nodes = getattr(getattr(spec, "deployment", spec), "nodes", None)
    urls: Iterable[str] = cast(Sequence[str], spec) if nodes is None else nodes
    items = tuple(os.fspath(s) for s in urls)
    if not items:
        raise ValueError("no endpoints given")
    return items


def static_urls(spec: EndpointSpec) -> list[str]:
    """The base URLs a spec names (deployment files read; no DNS)."""
    return list(endpoints(list(spec_key(spec))).nodes)


def is_url(spec: EndpointSpec) -> bool:
    """Whether ``spec`` is one URL (not a deployment file, not a list)."""
    if not isinstance(spec, str):
        return False
    text = spec.strip()
    return "://" in text or not (text.endswith(".json") or os.path.isfile(text))


def is_plain(spec: EndpointSpec) -> bool:
    """Whether ``spec`` is one URL with nothing to balance: its host is an IP address, or it
    has a path or query (a router's ``?stadium_node=``, a prefix behind an ingress)."""
    if not is_url(spec):
        return False
    assert isinstance(spec, str)
    text = spec.strip()
    parts = urllib.parse.urlsplit(text if "://" in text else "ws://" + text)
    if parts.query or parts.path not in ("", "/", "/ws"):
        return True
    try:
        ipaddress.ip_address(parts.hostname or "")
    except ValueError:
        return False
    return True


async def resolve(host: str, port: int) -> list[str]:
    """The host's IPv4 addresses (else its IPv6 ones), distinct, sorted."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    v4 = sorted({str(i[4][0]) for i in infos if i[0] == socket.AF_INET})
    return v4 or sorted({str(i[4][0]) for i in infos if i[0] == socket.AF_INET6})


# -- the balancer (I/O) ------------------------------------------------------------


class Lease:
    """One session's claim on an endpoint: counted as held until :meth:`release`."""

    __slots__ = ("balancer", "endpoint", "released")

    def __init__(self, balancer: Balancer, endpoint: Endpoint) -> None:
        self.balancer = balancer
        self.endpoint = endpoint
        self.released = False
        endpoint.held += 1

    def release(self, suspect: bool = False) -> None:
        """The session ended (idempotent); ``suspect``: it was lost, probe the node soon."""
        if not self.released:
            self.released = True
            self.endpoint.held -= 1
        if suspect:
            self.balancer.probe_soon()

    def failed(self, error: str) -> None:
        """The connect failed (refused, timed out, hung up): the node is down for a while."""
        self.release()
        b = self.balancer
        mark_failed(self.endpoint, b.clock(), error, b.rng, b.retry_base_s, b.retry_max_s)
        b.probe_soon()

    def refused(self, retry_after_s: float) -> None:
        """The node answered ``CAPACITY_REACHED``: full for ``retry_after_s``."""
        self.release()
        mark_full(self.endpoint, self.balancer.clock(), retry_after_s)


class Balancer:
    """The endpoints of one spec and their state, shared by the clients of a process.

    Args:
        spec: a URL, a list of URLs, or a deployment file's path.
        ssl: TLS context for ``https`` endpoints' probes.
        probe_timeout_s: limit of one ``/health`` probe.
        probe_interval_s: least time between probes (they happen only while sessions open).
        retry_base_s, retry_max_s: a failed node's first and largest down time.
        dns_ttl_s: a DNS name is resolved again after this long (pods come and go).
        resolver: ``async resolver(host, port) -> [address]`` (default: the loop's getaddrinfo).
    """

    def __init__(
        self,
        spec: EndpointSpec,
        *,
        ssl: ssl_module.SSLContext | None = None,
        probe_timeout_s: float = 1.0,
        probe_interval_s: float = 1.0,
        retry_base_s: float = 0.5,
        retry_max_s: float = 30.0,
        dns_ttl_s: float = 5.0,
        resolver: Resolver | None = None,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        self.urls = static_urls(spec)
        self.ssl = ssl
        self.probe_timeout_s = probe_timeout_s
        self.probe_interval_s = probe_interval_s
        self.retry_base_s = retry_base_s
        self.retry_max_s = retry_max_s
        self.dns_ttl_s = dns_ttl_s
        self.resolver = resolver or resolve
        self.clock = clock
        self.rng = rng or random.Random()
        self.endpoints: list[Endpoint] = [Endpoint(u) for u in self.urls]
        # one URL with a host name: maybe a DNS name for many nodes (resolved lazily)
        self._dns: tuple[str, int] | None = None
        if len(self.urls) == 1:
            parts = urllib.parse.urlsplit(self.urls[0])
            host = parts.hostname or ""
            try:
                ipaddress.ip_address(host)
            except ValueError:
                self._dns = (host, parts.port or 80)
        self._resolved_at: float | None = None
        self._probed_at = 0.0
        self._probed_once = False
        self._resolving: asyncio.Task[None] | None = None
        self._probing: asyncio.Task[None] | None = None

    # -- queries ---------------------------------------------------------------

    async def direct(self) -> bool:
        """Whether there is one node only (then clients connect as to a plain URL)."""
        await self._refresh_dns()
        return len(self.endpoints) == 1 and self.endpoints[0].host is None

    async def acquire(self, tried: Sequence[Endpoint] = ()) -> Lease | None:
        """A lease on the best endpoint not in ``tried`` — an available one, else the one
        available soonest; None once every endpoint was tried."""
        await self._refresh_dns()
        self.probe_soon(min_interval_s=self.probe_interval_s)
        task = self._probing
        if not self._probed_once and task is not None and not task.done():
            await asyncio.shield(task)  # the first sessions wait for the nodes' capacities
        ep = choose(self.endpoints, self.clock(), self.rng, tried) or soonest(self.endpoints, tried)
        return None if ep is None else Lease(self, ep)

    def any_available(self) -> bool:
        now = self.clock()
        return any(e.available(now) for e in self.endpoints)

    def describe(self) -> str:
        """The endpoints and their last errors, for messages."""
        return "; ".join(f"{e.url}: {e.error or 'ok'}" for e in self.endpoints)

    # -- probes ----------------------------------------------------------------

    def probe_soon(self, min_interval_s: float = 0.0) -> None:
        """Probe every endpoint's ``/health`` in the background (one probe at a time)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        task = self._probing
        if task is not None and task.get_loop() is not loop:
            self._probing = task = None  # a loop gone (tests; another thread's clients)
        if task is not None and not task.done():
            return
        if task is not None and self.clock() - self._probed_at < min_interval_s:
            return
        self._probed_at = self.clock()
        self._probing = loop.create_task(self.probe())

    async def probe(self) -> None:
        """Probe every endpoint once, concurrently; update their state."""
        try:
            await asyncio.gather(
                *(self._probe_one(ep) for ep in list(self.endpoints)), return_exceptions=True
            )
        finally:
            self._probed_once = True

    async def _probe_one(self, ep: Endpoint) -> None:
        try:
            async with asyncio.timeout(self.probe_timeout_s):
                health = await probe_async(ep.url, ssl=self.ssl, name=ep.host)
        except (OSError, ValueError) as exc:  # TimeoutError is an OSError
            error = f"health probe: {exc!r}"
            mark_failed(ep, self.clock(), error, self.rng, self.retry_base_s, self.retry_max_s)
            return
        apply_health(ep, health.status, health.body)

    # -- DNS -------------------------------------------------------------------

    async def _refresh_dns(self) -> None:
        if self._dns is None:
            return
        if self._resolved_at is not None and self.clock() - self._resolved_at < self.dns_ttl_s:
            return
        loop = asyncio.get_running_loop()
        task = self._resolving
        if task is None or task.done() or task.get_loop() is not loop:
            task = self._resolving = loop.create_task(self._resolve())
        await asyncio.shield(task)

    async def _resolve(self) -> None:
        assert self._dns is not None
        host, port = self._dns
        try:
            addrs = await self.resolver(host, port)
        except OSError:
            addrs = []
        self._resolved_at = self.clock()
        if len(addrs) < 2:  # one node (or none found): the URL as given
            if not (len(self.endpoints) == 1 and self.endpoints[0].host is None):
                self.endpoints = [Endpoint(self.urls[0])]
            return
        scheme = urllib.parse.urlsplit(self.urls[0]).scheme
        known = {e.url: e for e in self.endpoints}
        fresh = []
        for addr in addrs:
            url = base_url(f"{scheme}://{f'[{addr}]' if ':' in addr else addr}:{port}")
            fresh.append(known.get(url) or Endpoint(url, host=host))
        self.endpoints = fresh

    def __repr__(self) -> str:
        return f"<Balancer {self.endpoints}>"


_registry: dict[tuple[Any, ...], Balancer] = {}
_registry_lock = threading.Lock()


def balancer_for(
    spec: EndpointSpec, *, ssl: ssl_module.SSLContext | None = None, **options: Any
) -> Balancer:
    """The process's one :class:`Balancer` for ``spec`` (created on first use, with
    ``options``; later calls share it, whatever their options)."""
    key = (spec_key(spec), ssl)
    with _registry_lock:
        balancer = _registry.get(key)
        if balancer is None:
            balancer = _registry[key] = Balancer(spec, ssl=ssl, **options)
        return balancer


def forget_all() -> None:
    """Drop every shared balancer (tests; a process that wants fresh state)."""
    with _registry_lock:
        _registry.clear()


__all__ = [
    "Balancer",
    "Endpoint",
    "EndpointSpec",
    "HasDeployment",
    "HasNodes",
    "Lease",
    "apply_health",
    "balancer_for",
    "choose",
    "forget_all",
    "is_plain",
    "is_url",
    "mark_failed",
    "mark_full",
    "plan",
    "resolve",
    "retry_delay",
    "soonest",
    "spec_key",
    "static_urls",
]

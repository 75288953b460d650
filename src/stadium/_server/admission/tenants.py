"""Tenants (``--tenants FILE``): who shares the node, by token, and what each used.

The file (TOML, or YAML by its ``.yaml``/``.yml`` suffix; docs/TENANTS.md) names each
tenant, its tokens (SHA-256 digests, or files holding a token: never a token itself),
its weight in the fair share of session slots, a hard session quota and a rate limit,
both over every worker of the node. :func:`load_tenants` reads and checks it: a bad
file is a :class:`~stadium.ConfigError` naming the field.

:class:`SharedTenants` is shared memory made before the workers fork: per tenant
(a *row*, at most :data:`MAX_TENANTS`) and per worker process (a *column*, written only
by that process, as :class:`~stadium._server.admission.slots.SharedSlots`' counters) the
sessions it holds, is charged (held or waiting: the quota) and has waiting, and its
cumulative counts (refusals, steps, queue wait, whose histogram's count is the
sessions opened, the ended episodes' cost, counted once per episode at its end); a dead worker's
counts move to a retired column (:meth:`SharedTenants.forget_worker`). It also holds
the current tenant table, serialized, with a generation number: the process that
reloads the file on SIGHUP (the supervisor; a lone worker itself) writes it under a
sequence lock, and each worker's :class:`TenantDirectory` picks it up within
:data:`RELOAD_CHECK_S` and swaps its :class:`~stadium._core.access.TenantBook`. Nothing
is dropped: sessions keep their slots; a tenant keeps its row while it is in the file;
a tenant gone from the file keeps its sessions until they end, and its token is refused
from then on. A bad file on reload is refused with an ERROR line and the old table kept.

The fair choice of whose waiter gets a free slot is :mod:`stadium._server.admission.fair`.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import multiprocessing.sharedctypes
import re
import tomllib
from collections.abc import Iterator
from typing import Any

import msgspec
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from stadium._core.access import Tenant, TenantBook, TenantTable
from stadium._errors import ConfigError
from stadium._util.fence import full_fence

log = logging.getLogger("stadium.tenants")

__all__ = [
    "MAX_TENANTS",
    "SharedTenants",
    "TenantCollector",
    "TenantDirectory",
    "load_tenants",
    "tenant_exposition",
]

MAX_TENANTS = 64
"""Tenants a node may have at once (rows of the shared counters)."""
ANON = MAX_TENANTS
"""The row of sessions without a tenant (an in-process caller), weight 1."""
ROWS = MAX_TENANTS + 1
MAX_TOKENS = 16
"""Tokens one tenant may have."""
MAX_FILE_BYTES = 1 << 20
RELOAD_CHECK_S = 0.2
"""How often a worker looks for a reloaded table."""
_BLOB_BYTES = 1 << 17
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_HEX = re.compile(r"[0-9a-f]{64}")
_FIELDS = frozenset(
    {"token_sha256", "token_file", "weight", "max_sessions", "rate_limit", "operator"}
)

WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0)
"""Upper bounds (seconds) of a tenant's queue wait histogram (then +Inf): those of
``stadium_admission_wait_seconds``."""

# Fields of a (row, column): gauges, then cumulative counts, then the wait histogram
# (its count is the sessions opened: every seat counts in one bucket), then the ended
# episodes' cost (the ledger's, summed: episodes, wall and env CPU in microseconds,
# steps, bytes received and sent).
HELD, CHARGED, WAITING, REFUSED, STEPS, WAIT_US = range(6)
WAIT_HIST = 6
EPISODES = WAIT_HIST + len(WAIT_BUCKETS) + 1
EP_WALL_US, EP_CPU_US, EP_STEPS, EP_IN, EP_OUT = range(EPISODES + 1, EPISODES + 6)
NFIELDS = EPISODES + 6
_GAUGES = (HELD, CHARGED, WAITING)


class _TenantEntry(msgspec.Struct, frozen=True):
    """A tenant as the table travels between processes."""

    name: str
    row: int
    digests: list[str]
    weight: float
    max_sessions: int
    rate_limit: float
    operator: bool = False


_ENTRIES = msgspec.json.Decoder(list[_TenantEntry])


def load_tenants(path: str) -> list[_TenantEntry]:
    """The tenants in ``path`` (rows unassigned: -1). Raises :class:`ConfigError` naming
    the file and the field on anything wrong."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"cannot read --tenants {path}: {exc.strerror}", path=path) from None
    if len(raw) > MAX_FILE_BYTES:
        raise ConfigError(f"--tenants file over {MAX_FILE_BYTES} bytes", path=path)
    try:
        if path.endswith((".yaml", ".yml")):
            import yaml

            doc: Any = yaml.safe_load(raw.decode())
        else:
            doc = tomllib.loads(raw.decode())
    except Exception as exc:  # TOMLDecodeError, YAMLError, UnicodeDecodeError
        raise ConfigError(f"--tenants file is not valid: {exc}", path=path) from None

    def bad(field: str, what: str) -> ConfigError:
        return ConfigError(f"--tenants: {field} {what}", path=path, field=field)

    if not isinstance(doc, dict) or set(doc) != {"tenants"} or not isinstance(doc["tenants"], dict):
        raise bad("tenants", "must be the one top-level table, e.g. [tenants.alpha]")
    tenants: dict[str, Any] = doc["tenants"]
    if not tenants:
        raise bad("tenants", "names no tenant")
    if len(tenants) > MAX_TENANTS:
        raise bad("tenants", f"names {len(tenants)} tenants: at most {MAX_TENANTS}")
    owners: dict[str, str] = {}
    out = []
    for name, spec in tenants.items():
        where = f"tenants.{name}"
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise bad(where, "is not a valid name (1-64 of letters, digits, '_', '.', '-')")
        if not isinstance(spec, dict):
            raise bad(where, "must be a table")
        unknown = sorted(set(spec) - _FIELDS)
        if unknown:
            raise bad(f"{where}.{unknown[0]}", f"is not a field (fields: {sorted(_FIELDS)})")
        digests = [
            *_digests(spec.get("token_sha256", []), f"{where}.token_sha256", bad),
            *_token_files(spec.get("token_file", []), f"{where}.token_file", bad),
        ]
        if not digests:
            raise bad(where, "has no token: give token_sha256 or token_file")
        if len(digests) > MAX_TOKENS:
            raise bad(where, f"has {len(digests)} tokens: at most {MAX_TOKENS}")
        for digest in digests:
            if digest in owners:
                raise bad(where, f"shares a token with tenants.{owners[digest]}")
            owners[digest] = name
        weight = _number(spec.get("weight", 1), f"{where}.weight", bad)
        if not 0 < weight <= 1e6:
            raise bad(f"{where}.weight", "must be > 0 (and at most 1e6)")
        quota = spec.get("max_sessions", 0)
        if isinstance(quota, bool) or not isinstance(quota, int) or not 0 <= quota < 1 << 31:
            raise bad(f"{where}.max_sessions", "must be an integer >= 0 (0: no quota)")
        rate = _number(spec.get("rate_limit", 0), f"{where}.rate_limit", bad)
        if not 0 <= rate <= 1e9:
            raise bad(f"{where}.rate_limit", "must be >= 0 requests per second (0: none)")
        operator = spec.get("operator", False)
        if not isinstance(operator, bool):
            raise bad(f"{where}.operator", "must be true or false")
        out.append(_TenantEntry(name, -1, digests, weight, quota, rate, operator))
    return out


def _number(value: object, field: str, bad: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise bad(field, "must be a number")
    return float(value)


def _digests(value: object, field: str, bad: Any) -> list[str]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list):
        raise bad(field, "must be a hex SHA-256 digest or a list of them")
    out = []
    for item in items:
        if not isinstance(item, str) or not _HEX.fullmatch(item.strip().lower()):
            raise bad(field, "must hold 64 hex digits each (sha256sum of the token)")
        out.append(item.strip().lower())
    return out


def _token_files(value: object, field: str, bad: Any) -> list[str]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(p, str) for p in items):
        raise bad(field, "must be a path or a list of paths")
    out = []
    for token_path in items:
        try:
            with open(token_path, encoding="utf-8") as f:
                token = f.readline(4096).strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise bad(field, f"cannot be read ({token_path}): {exc}") from None
        if len(token) < 16 or not token.isprintable() or " " in token:
            raise bad(field, f"({token_path}) must hold a printable token of 16+ characters")
        out.append(hashlib.sha256(token.encode()).hexdigest())
    return out


class SharedTenants:
    """Per-tenant counters and the published tenant table, shared by a node's workers.

    Args:
        counters: worker processes that may be alive at once (one column each; one
            more column keeps the counts of dead workers).
    """

    def __init__(self, counters: int) -> None:
        self.width = counters + 1
        self.retired = counters
        cells = ROWS * NFIELDS * self.width
        self._counts = memoryview(multiprocessing.sharedctypes.RawArray("q", cells)).cast("B")
        self.counts = self._counts.cast("q")
        self.any_waiting = (
            memoryview(multiprocessing.sharedctypes.RawArray("q", counters)).cast("B").cast("q")
        )
        """Sessions waiting in each worker, every tenant (the fair choice's fast path)."""
        self.rate_words = (
            memoryview(multiprocessing.sharedctypes.RawArray("q", MAX_TENANTS * 2 * counters))
            .cast("B")
            .cast("q")
        )
        self.rate_width = counters
        self._head = memoryview(multiprocessing.sharedctypes.RawArray("q", 2)).cast("B").cast("q")
        self._blob = memoryview(multiprocessing.sharedctypes.RawArray("B", _BLOB_BYTES)).cast("B")
        self.fence = full_fence()
        self.bind(0)

    def bind(self, column: int) -> None:
        """Count in column ``column`` (no other live process uses it)."""
        self.column = column
        counts, width = self.counts, self.width
        self.mine = [
            counts[row * NFIELDS * width + column :: width][:NFIELDS] for row in range(ROWS)
        ]
        """Per row, this process's column of its fields (a strided view of the shared
        words: ``mine[row][STEPS] += n`` counts in place)."""

    def at(self, row: int, field: int) -> int:
        """Where ``row``'s ``field`` starts (one word per column)."""
        return (row * NFIELDS + field) * self.width

    def total(self, row: int, field: int) -> int:
        start = self.at(row, field)
        return int(sum(self.counts[start : start + self.width]))

    def opened(self, row: int) -> int:
        """Sessions ``row`` was given a slot: the count of its queue wait histogram."""
        return sum(self.total(row, WAIT_HIST + i) for i in range(len(WAIT_BUCKETS) + 1))

    def add(self, row: int, field: int, n: int = 1) -> None:
        self.mine[row][field] += n

    def forget_worker(self, column: int) -> None:
        """The dead, reaped worker of ``column``: its gauges zeroed, its counts retired."""
        counts, width = self.counts, self.width
        for row in range(ROWS):
            for field in range(NFIELDS):
                i = (row * NFIELDS + field) * width
                if field not in _GAUGES:
                    counts[i + self.retired] += counts[i + column]
                counts[i + column] = 0
        self.any_waiting[column] = 0
        for start in range(column, len(self.rate_words), self.rate_width):
            self.rate_words[start] = 0

    def clear_row(self, row: int) -> None:
        """Zero ``row`` for a tenant new to it (publisher, before the table names it)."""
        start = row * NFIELDS * self.width
        self.counts[start : start + NFIELDS * self.width] = memoryview(
            bytes(8 * NFIELDS * self.width)
        ).cast("q")

    # -- the published table (a sequence lock: even generation = stable) -------------

    def publish(self, blob: bytes) -> int:
        """Write a serialized table; returns its generation (the one writer process)."""
        if len(blob) > _BLOB_BYTES:
            raise ConfigError(f"--tenants: the table is over {_BLOB_BYTES} bytes serialized")
        head = self._head
        head[0] += 1  # odd: being written
        self.fence()
        self._blob[: len(blob)] = blob
        head[1] = len(blob)
        self.fence()
        head[0] += 1
        return int(head[0])

    @property
    def generation(self) -> int:
        return int(self._head[0])

    def read(self) -> tuple[int, bytes] | None:
        """The published table and its generation; ``None`` while it is being written."""
        head = self._head
        for _ in range(8):
            gen = int(head[0])
            if gen % 2 == 0:
                blob = bytes(self._blob[: int(head[1])])
                self.fence()
                if int(head[0]) == gen:
                    return gen, blob
        return None


class TenantDirectory:
    """A process's view of the node's tenants: the table, the shared counters, reloads.

    Made in the process that forks the workers (:meth:`open`), so every worker inherits
    it; :meth:`reload` re-reads the file and publishes it (the supervisor, or a lone
    worker, on SIGHUP); each worker's :meth:`start` picks up what was published."""

    def __init__(self, path: str, shared: SharedTenants) -> None:
        self.path = path
        self.shared = shared
        self.book = TenantBook(TenantTable(()))
        self.rows: list[Tenant | None] = [None] * MAX_TENANTS
        self.weights = [1.0] * ROWS
        self.active: tuple[int, ...] = (ANON,)
        """The rows of the current tenants, and :data:`ANON`."""
        self._generation = -1
        self._timer: asyncio.TimerHandle | None = None

    @classmethod
    def open(cls, path: str, counters: int) -> TenantDirectory:
        """Read ``path`` (a :class:`ConfigError` if bad) into new shared memory."""
        directory = cls(path, SharedTenants(counters))
        directory._publish(load_tenants(path))
        directory.refresh()
        return directory

    # -- the publisher -------------------------------------------------------------

    def reload(self) -> bool:
        """Re-read the file and publish it; on a bad file log why and keep the old one."""
        try:
            entries = load_tenants(self.path)
            self._publish(entries)
        except ConfigError as exc:
            log.error("SIGHUP: tenants not reloaded, the old ones kept: %s (%s)", exc, self.path)
            return False
        self.refresh()
        log.info("SIGHUP: %d tenants reloaded from %s", len(entries), self.path)
        return True

    def _publish(self, entries: list[_TenantEntry]) -> None:
        shared = self.shared
        old = {t.name: t.row for t in self.rows if t is not None}
        free = [r for r in range(MAX_TENANTS) if r not in old.values()]
        placed = []
        for entry in entries:
            row = old.get(entry.name)
            if row is None:
                # A row last used by a removed tenant is reused only once it holds nothing.
                row = next((r for r in free if not any(shared.total(r, f) for f in _GAUGES)), None)
                if row is None:
                    raise ConfigError("--tenants: no free tenant row (sessions of removed "
                                      "tenants still hold them); retry when they end")  # fmt: skip
                free.remove(row)
                shared.clear_row(row)
            placed.append(msgspec.structs.replace(entry, row=row))
        shared.publish(msgspec.json.encode(placed))

    # -- every worker --------------------------------------------------------------

    def refresh(self) -> bool:
        """Take the published table if it is newer than this process's."""
        shared = self.shared
        if shared.generation == self._generation:
            return False
        got = shared.read()
        if got is None:
            return False
        gen, blob = got
        entries = _ENTRIES.decode(blob)
        rows: list[Tenant | None] = [None] * MAX_TENANTS
        table = []
        for e in entries:
            tenant = Tenant(e.name, e.row, e.weight, e.max_sessions, e.rate_limit, e.operator)
            rows[e.row] = tenant
            table.append((tenant, [bytes.fromhex(d) for d in e.digests]))
        self.rows = rows
        self.weights = [1.0 if t is None else t.weight for t in rows] + [1.0]
        self.active = (*(e.row for e in entries), ANON)
        self.book.table = TenantTable(table)
        self._generation = gen
        return True

    def start(self) -> None:
        """Look for a reloaded table every :data:`RELOAD_CHECK_S` on the running loop."""
        loop = asyncio.get_running_loop()

        def check() -> None:
            self.refresh()
            self._timer = loop.call_later(RELOAD_CHECK_S, check)

        self._timer = loop.call_later(RELOAD_CHECK_S, check)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def current(self, tenant: Tenant) -> Tenant:
        """``tenant`` as the current table has it (its quota and rate may have changed)."""
        now = self.rows[tenant.row]
        return now if now is not None and now.name == tenant.name else tenant

    # -- accounting ----------------------------------------------------------------

    def usage(self, tenant: Tenant) -> dict[str, Any]:
        """What ``tenant`` holds and used over the node (``GET /tenant/usage``)."""
        tenant = self.current(tenant)
        shared, row = self.shared, tenant.row
        hist = [shared.total(row, WAIT_HIST + i) for i in range(len(WAIT_BUCKETS) + 1)]
        cumulative, buckets = 0, {}
        for bound, n in zip((*WAIT_BUCKETS, math.inf), hist, strict=True):
            cumulative += n
            buckets["+Inf" if bound == math.inf else f"{bound:g}"] = cumulative
        return {
            "tenant": tenant.name,
            "weight": tenant.weight,
            "max_sessions": tenant.max_sessions,
            "rate_limit": tenant.rate_limit,
            "sessions_active": shared.total(row, HELD),
            "sessions_waiting": shared.total(row, WAITING),
            "sessions_opened": cumulative,  # every seat counts in one bucket
            "refusals": shared.total(row, REFUSED),
            "steps": shared.total(row, STEPS),
            "queue_wait_seconds": {
                "count": cumulative,
                "sum": shared.total(row, WAIT_US) / 1e6,
                "buckets": buckets,
            },
            "episodes": {  # the ended episodes' cost, summed (docs/PROTOCOL.md)
                "ended": shared.total(row, EPISODES),
                "wall_s": shared.total(row, EP_WALL_US) / 1e6,
                "cpu_s": shared.total(row, EP_CPU_US) / 1e6,
                "steps": shared.total(row, EP_STEPS),
                "bytes_in": shared.total(row, EP_IN),
                "bytes_out": shared.total(row, EP_OUT),
            },
        }

    def each(self) -> Iterator[Tenant]:
        return (t for t in self.rows if t is not None)


def tenant_exposition(directory: TenantDirectory, viewer: Tenant | None) -> bytes:
    """``/metrics``' per-tenant series as ``viewer`` may see them (Prometheus text): every
    tenant's for an ``operator`` tenant, else its own only (none for no tenant): a tenant
    learns neither the names nor the figures of the others."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(TenantCollector(directory, viewer))
    return generate_latest(registry)


class TenantCollector:
    """``/metrics``' per-tenant series, summed over the node's workers (docs/METRICS.md):
    every tenant's when ``viewer`` is an ``operator`` tenant, else ``viewer``'s only."""

    def __init__(self, directory: TenantDirectory, viewer: Tenant | None) -> None:
        self.directory = directory
        self.viewer = viewer

    def collect(self) -> Iterator[Metric]:
        shared = self.directory.shared
        viewer = None if self.viewer is None else self.directory.current(self.viewer)
        tenants = [
            t
            for t in self.directory.each()
            if viewer is not None and (viewer.operator or t.name == viewer.name)
        ]
        label = ["tenant"]
        families: list[tuple[Any, str, str, int]] = [
            (GaugeMetricFamily, "stadium_tenant_sessions_active", "Sessions holding a slot.", HELD),
            (GaugeMetricFamily, "stadium_tenant_sessions_waiting", "Sessions waiting.", WAITING),
            (CounterMetricFamily, "stadium_tenant_refusals", "Sessions and requests refused "
             "(quota, rate, no slot in time, too many waiting).", REFUSED),
            (CounterMetricFamily, "stadium_tenant_steps", "Steps taken.", STEPS),
            (CounterMetricFamily, "stadium_tenant_episodes", "Episodes ended.", EPISODES),
            (CounterMetricFamily, "stadium_tenant_episode_steps", "Steps answered in ended "
             "episodes.", EP_STEPS),
            (CounterMetricFamily, "stadium_tenant_episode_received_bytes", "Bytes of ended "
             "episodes' request frames.", EP_IN),
            (CounterMetricFamily, "stadium_tenant_episode_sent_bytes", "Bytes of ended "
             "episodes' reply frames.", EP_OUT),
        ]  # fmt: skip
        opened = CounterMetricFamily(
            "stadium_tenant_sessions_opened", "Sessions admitted.", labels=label
        )
        for t in tenants:
            opened.add_metric([t.name], shared.opened(t.row))
        yield opened
        for kind, name, doc, field in families:
            family = kind(name, doc, labels=label)
            for t in tenants:
                family.add_metric([t.name], shared.total(t.row, field))
            yield family
        for name, doc, field in (
            ("stadium_tenant_episode_wall_seconds", "Ended episodes' wall time, summed.",
             EP_WALL_US),
            ("stadium_tenant_episode_cpu_seconds", "Ended episodes' env CPU seconds, summed.",
             EP_CPU_US),
        ):  # fmt: skip
            family = CounterMetricFamily(name, doc, labels=label)
            for t in tenants:
                family.add_metric([t.name], shared.total(t.row, field) / 1e6)
            yield family
        wait = HistogramMetricFamily(
            "stadium_tenant_queue_wait_seconds",
            "Time sessions waited for a slot (0 when admitted at once).",
            labels=label,
        )
        for t in tenants:
            cumulative, buckets = 0, []
            for i, bound in enumerate((*WAIT_BUCKETS, math.inf)):
                cumulative += shared.total(t.row, WAIT_HIST + i)
                buckets.append(("+Inf" if bound == math.inf else f"{bound:g}", cumulative))
            wait.add_metric([t.name], buckets, shared.total(t.row, WAIT_US) / 1e6)
        yield wait

"""The recorded episodes, browsed from ``GET /web/episodes`` (``stadium/web/episodes.html``).

When the server records (``--record DIR``), two JSON endpoints read its shards:

* ``POST /web/episodes`` with filters (``env``, ``min_reward``, ``max_reward``, ``error``:
  ``true``/``false``, ``min_cpu_s``, ``max_cpu_s``, ``min_wall_s``, ``max_wall_s``) and a
  page (``offset``, ``limit`` ≤ :data:`PAGE_MAX`): the matching episodes' per-episode
  columns, newest first, their count, the envs seen, and the distribution of their cost
  (``cpu_s``, ``wall_s``: :data:`BINS` bins each, per env);
* ``POST /web/episodes/one`` with ``file``, ``row`` and a window of steps
  (``step_offset``, ``step_limit`` ≤ :data:`STEPS_MAX`): one episode, its reset and those
  steps.

What is recorded comes from the least trusted parties there are (the clients' actions and
episode ids, the envs' observations and errors), so the reading side bounds what it reads
and holds, and the page shows every value as text, never as markup. Both read Parquet with
pyarrow in the loop's executor, never on the loop, one request at a time (a burst of them
takes one executor thread, not all: a sandbox's replies are decoded there), past
:data:`WAITING_MAX` waiting ``503``. A shard's per-episode columns are read once (a closed
shard never changes) and kept as Arrow columns (under 200 bytes an episode, texts cut at
:data:`LIST_TEXT_MAX` characters), for the :data:`FILES_MAX` shards written last and at most
:data:`ROWS_MAX` episodes; older ones are not browsed, and a Parquet file of another
schema is left out. Any other worker's shards of the same directory are read too (they
are files there). An opened episode's row group is read and only the window of steps
asked for becomes Python values; a row group over :data:`GROUP_BYTES_MAX` (by the footer) is
``413``, and a shard whose episodes would pass :data:`ROWS_MAX` is not read. Every answer
is bounded: a page of episodes, a window of steps, each text value cut at :data:`TEXT_MAX`
characters. Without ``--record``: ``404`` saying so. The routes pass the same access
checks as every HTTP endpoint (``--auth-token``) and are served when ``/web`` is
(``ENABLE_WEB_INTERFACE``): whoever may use the server may read every recorded episode
(docs/SECURITY.md); with ``--tenants``, an ``operator`` tenant only (``403`` for the
others: the recording holds every tenant's episodes).
"""

from __future__ import annotations

import asyncio
import heapq
import os
import re
import threading
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import msgspec

from stadium._server.admission.doorway import CALLER
from stadium._server.http.endpoints import HttpEndpoints
from stadium._server.http.responses import ExtraRoutes, HttpResponse, error_response

#: Episodes per page, at most.
PAGE_MAX = 200
#: Steps of one episode per answer, at most.
STEPS_MAX = 500
#: Shards browsed: the newest this many, and no older ones once ROWS_MAX episodes are read.
FILES_MAX = 500
ROWS_MAX = 200_000
#: A text value (an observation, an action) longer than this is cut (and says so).
TEXT_MAX = 20_000
#: A text value of the episodes' list (an episode id, an error) is cut at this many characters.
LIST_TEXT_MAX = 500
#: Requests waiting for the recording's reader (one read at a time), at most.
WAITING_MAX = 8
#: An episode is browsed only in a row group of at most this many bytes, uncompressed (as
#: its shard's footer says; the writers' rows are at most 64 MiB and one 16 MiB episode).
GROUP_BYTES_MAX = 256 << 20
#: What :meth:`RecordingIndex.one` answers for an episode in a larger row group.
TOO_LARGE: dict[str, Any] = {"too_large": True}
#: Bins of each cost distribution.
BINS = 20
SUMMARY = (
    "env", "env_version", "episode_id", "worker", "started_at", "seed", "end", "error",
    "clipped", "total_reward", "steps", "wall_s", "cpu_s", "cpu_source", "bytes_in",
    "bytes_out", "peak_rss_bytes",
)  # fmt: skip
_SHARD = re.compile(r"episodes-[A-Za-z0-9_.-]+\.parquet")  # fullmatch: no "\n" after
_NUMBER_FILTERS = {
    "min_reward": ("total_reward", 1), "max_reward": ("total_reward", -1),
    "min_cpu_s": ("cpu_s", 1), "max_cpu_s": ("cpu_s", -1),
    "min_wall_s": ("wall_s", 1), "max_wall_s": ("wall_s", -1),
}  # fmt: skip


class RecordingIndex:
    """The per-episode columns of a recording directory's shards, read once each and kept
    as Arrow tables (under 200 bytes an episode; Python dicts took 900)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._tables: dict[str, Any] = {}  # shard name -> its SUMMARY columns, file, row
        self._lock = threading.Lock()  # executor threads

    def episodes(self) -> Any:
        """Every episode of the newest :data:`FILES_MAX` shards (each with its ``file``
        and ``row``), newest first, as one ``pyarrow.Table``."""
        import pyarrow as pa  # only a recording server loads it

        names = _newest(self.directory, FILES_MAX)
        tables: list[Any] = []
        kept: set[str] = set()
        count = 0
        with self._lock:
            for name in names:
                if count >= ROWS_MAX:
                    break
                table = self._tables.get(name)
                if table is None:
                    table = self._summary(name, ROWS_MAX - count)
                    if table is None:  # gone, not a shard of ours, or past ROWS_MAX
                        continue
                    self._tables[name] = table
                elif table.num_rows > ROWS_MAX - count:
                    continue
                tables.append(table)
                kept.add(name)
                count += table.num_rows
            for name in set(self._tables) - kept:  # older shards are forgotten
                del self._tables[name]
        if not tables:
            return _summary_schema(pa).empty_table()
        out = pa.concat_tables(tables)
        return out.sort_by([("started_at", "descending")])

    def _summary(self, name: str, room: int) -> Any:
        """Shard ``name``'s per-episode columns (texts cut at :data:`LIST_TEXT_MAX`), its
        name and row numbers; ``None`` if it cannot be read, is not a shard of ours, or
        holds more than ``room`` episodes (then it is not read)."""
        import pyarrow as pa
        import pyarrow.compute as pc
        import pyarrow.parquet as pq

        try:
            shard = pq.ParquetFile(os.path.join(self.directory, name))
            if shard.metadata.num_rows > room:  # its rows would pass ROWS_MAX
                return None
            table = shard.read(columns=list(SUMMARY))
        except (OSError, ValueError, KeyError, pa.ArrowException):
            return None
        if table.schema.remove_metadata() != _summary_schema(pa, with_place=False):
            return None  # columns of other types: not a shard of ours
        for i, field in enumerate(table.schema):
            if pa.types.is_string(field.type):  # an episode id or error text may be long
                table = table.set_column(
                    i, field, pc.utf8_slice_codeunits(table.column(i), 0, LIST_TEXT_MAX)
                )
        n = table.num_rows
        return table.append_column("file", pa.array([name] * n, pa.string())).append_column(
            "row", pa.array(range(n), pa.int64())
        )

    def one(self, name: str, row: int, first: int, count: int) -> dict[str, Any] | None:
        """Episode ``row`` of shard ``name`` with steps ``first`` .. ``first + count``: only
        its row group is read, and only that window of its steps becomes Python values."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        if not _SHARD.fullmatch(name):
            return None
        try:
            shard = pq.ParquetFile(os.path.join(self.directory, name))
            meta = shard.metadata
            if not 0 <= row < meta.num_rows:
                return None
            group, start = 0, 0
            while row >= start + meta.row_group(group).num_rows:
                start += meta.row_group(group).num_rows
                group += 1
            if meta.row_group(group).total_byte_size > GROUP_BYTES_MAX:
                return TOO_LARGE
            table = shard.read_row_group(group)
        except (OSError, ValueError, KeyError, IndexError, pa.ArrowException):
            return None
        at = row - start
        episode: dict[str, Any] = {}
        window: dict[str, Any] = {}
        steps = 0
        for column in table.column_names:
            value = table.column(column)[at]
            if column not in _STEP_COLUMNS:
                episode[column] = _cut(value.as_py())
            elif isinstance(value, pa.ListScalar):
                items = value.values if value.is_valid else None
                if column == "actions":  # kept steps: a failed one is not counted
                    steps = 0 if items is None else len(items)
                kept = [] if items is None else items.slice(first, count).to_pylist()
                window[column] = [_cut(v) for v in kept]
        for column in _STEP_COLUMNS:
            window.setdefault(column, [])
        episode.update(
            file=name, row=row, step_offset=first, step_count=len(window["actions"]),
            steps_total=steps, window=window,
        )  # fmt: skip
        return episode


#: The per-step list columns of a shard.
_STEP_COLUMNS = ("actions", "observations", "rewards", "dones", "truncateds", "infos",
                 "step_errors", "step_s")  # fmt: skip


def _summary_schema(pa: Any, *, with_place: bool = True) -> Any:
    """The index's columns: :data:`SUMMARY` as a shard holds them, then (``with_place``)
    ``file`` and ``row``."""
    from stadium._server.ledger.rows import schema

    full = schema(pa)
    place = [pa.field("file", pa.string()), pa.field("row", pa.int64())] if with_place else []
    return pa.schema([full.field(name) for name in SUMMARY] + place)


def _newest(directory: str, count: int) -> list[str]:
    """The names of the ``count`` shards of ``directory`` written last (by their time of
    change: a shard is renamed into place once written), newest first. Worker start and
    shard number, in the name, do not order shards of different workers: a worker started
    later is not newer in all its shards."""

    def shards() -> Iterator[tuple[int, str]]:
        try:
            with os.scandir(directory) as entries:
                for entry in entries:
                    if _SHARD.fullmatch(entry.name):
                        try:
                            yield entry.stat(follow_symlinks=False).st_mtime_ns, entry.name
                        except OSError:  # gone meanwhile
                            continue
        except OSError:
            return

    return [name for _, name in heapq.nlargest(count, shards())]


def _cut(value: Any) -> Any:
    if isinstance(value, str) and len(value) > TEXT_MAX:
        return value[:TEXT_MAX] + f"… ({len(value) - TEXT_MAX} more characters)"
    return value


def select(episodes: Any, filters: dict[str, Any]) -> Any:
    """The rows of ``episodes`` (a table of :meth:`RecordingIndex.episodes`) matching
    ``filters`` (see the module doc; checked by :func:`filter_problem` first)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    masks = []
    env = filters.get("env")
    if isinstance(env, str) and env:
        masks.append(pc.equal(episodes["env"], env))
    error = filters.get("error")
    if error is not None:
        masks.append(pc.equal(pc.is_valid(episodes["error"]), bool(error)))
    for key, (column, sign) in _NUMBER_FILTERS.items():
        value = filters.get(key)
        if not isinstance(value, int | float) or isinstance(value, bool):
            continue
        compare = pc.greater_equal if sign > 0 else pc.less_equal
        masks.append(compare(episodes[column], pa.scalar(float(value))))
    if not masks:
        return episodes
    mask = masks[0]
    for more in masks[1:]:
        mask = pc.and_kleene(mask, more)
    return episodes.filter(pc.fill_null(mask, False))


def filter_problem(filters: dict[str, Any]) -> str | None:
    """What is wrong with ``filters`` (a value not of its type), or ``None``."""
    env = filters.get("env")
    if env is not None and not isinstance(env, str):
        return "env must be a string (an env's name)"
    error = filters.get("error")
    if error is not None and not isinstance(error, bool):
        return "error must be true or false"
    for key in _NUMBER_FILTERS:
        value = filters.get(key)
        if value is None:
            continue
        if not isinstance(value, int | float) or isinstance(value, bool):
            return f"{key} must be a number"
        if isinstance(value, int) and not -(2**1023) < value < 2**1023:  # float() overflows
            return f"{key} is out of range"
    return None


def histogram(values: Any) -> list[list[float]]:
    """``[low, high, count]`` for :data:`BINS` equal bins over the range of ``values`` (an
    Arrow array of floats; nulls and non-finite values left out)."""
    import pyarrow.compute as pc

    values = values.drop_null()
    values = values.filter(pc.is_finite(values))
    if len(values) == 0:
        return []
    bounds = pc.min_max(values)
    low, high = bounds["min"].as_py(), bounds["max"].as_py()
    if high <= low:
        return [[low, high, len(values)]]
    width = (high - low) / BINS
    where = pc.cast(pc.floor(pc.divide(pc.subtract(values, low), width)), "int64")
    where = pc.min_element_wise(where, BINS - 1)
    counts = [0] * BINS
    for item in pc.value_counts(where).to_pylist():
        counts[item["values"]] += item["counts"]
    return [[low + i * width, low + (i + 1) * width, c] for i, c in enumerate(counts)]


class RecordingsRoutes:
    """``POST /web/episodes`` and ``POST /web/episodes/one`` (module doc), before
    ``inner``'s routes (OpenEnv's web JSON endpoints and Task API). Served when ``/web`` is
    (``ENABLE_WEB_INTERFACE``). One read at a time, in the loop's executor (whose other
    threads stay free for the work that needs them: a sandbox's replies are decoded
    there); past :data:`WAITING_MAX` requests waiting, ``503``."""

    def __init__(self, endpoints: HttpEndpoints, inner: ExtraRoutes) -> None:
        self.endpoints = endpoints
        self.inner = inner
        self.web = inner.web
        recorder = endpoints.runtime.ledger.recorder
        self.index = None if recorder is None else RecordingIndex(recorder.config.directory)
        self._reading: asyncio.Lock | None = None
        self._waiting = 0

    def async_get(self, path: str) -> bool:
        return self.inner.async_get(path)

    def route(self, method: str, path: str) -> Callable[[bytes], Awaitable[HttpResponse]] | None:
        if method == "POST" and path == "/web/episodes" and self.endpoints.web:
            return self._list if self._may_read() else self._refused
        if method == "POST" and path == "/web/episodes/one" and self.endpoints.web:
            return self._one if self._may_read() else self._refused
        return self.inner.route(method, path)

    def _may_read(self) -> bool:
        """Whether the caller reads the recording: anyone who passed the access checks;
        with ``--tenants`` an ``operator`` tenant only (it holds every tenant's episodes)."""
        directory = self.endpoints.runtime.doors.tenants
        if directory is None:
            return True
        tenant = CALLER.get()[1]
        return tenant is not None and directory.current(tenant).operator

    async def _refused(self, body: bytes) -> HttpResponse:
        return error_response(
            403, "the recording holds every tenant's episodes: with --tenants only a tenant "
            "with operator = true reads it here", "FORBIDDEN",
        )  # fmt: skip

    async def _read(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` in the executor, after the reads before it; ``None`` when
        :data:`WAITING_MAX` requests already wait."""
        if self._waiting >= WAITING_MAX:
            return None
        if self._reading is None:
            self._reading = asyncio.Lock()
        self._waiting += 1
        try:
            async with self._reading:
                return await asyncio.get_running_loop().run_in_executor(None, fn, *args)
        finally:
            self._waiting -= 1

    async def _list(self, body: bytes) -> HttpResponse:
        index, filters = self.index, _body(body)
        if index is None:
            return _not_recording()
        if filters is None:
            return error_response(422, "the body must be a JSON object", "VALIDATION_ERROR")
        problem = filter_problem(filters)
        if problem is not None:
            return error_response(422, problem, "VALIDATION_ERROR")
        offset = _int(filters.get("offset"), 0, 0, 1 << 40)
        limit = _int(filters.get("limit"), 50, 1, PAGE_MAX)

        def answer() -> bytes:
            import pyarrow.compute as pc

            episodes = index.episodes()
            chosen = select(episodes, filters)
            envs = sorted(e for e in pc.unique(episodes["env"]).to_pylist() if e is not None)
            costs = {}
            for env in sorted(e for e in pc.unique(chosen["env"]).to_pylist() if e is not None):
                of_env = chosen.filter(pc.equal(chosen["env"], env))
                costs[env] = {
                    "cpu_s": histogram(of_env["cpu_s"]), "wall_s": histogram(of_env["wall_s"])
                }  # fmt: skip
            page = chosen.slice(min(offset, chosen.num_rows), limit).to_pylist()
            return msgspec.json.encode({
                "total": chosen.num_rows, "offset": offset, "limit": limit, "envs": envs,
                "episodes": page, "costs": costs,
            })  # fmt: skip

        encoded = await self._read(answer)
        return _busy() if encoded is None else HttpResponse(200, encoded)

    async def _one(self, body: bytes) -> HttpResponse:
        index, data = self.index, _body(body)
        if index is None:
            return _not_recording()
        if data is None or not isinstance(data.get("file"), str):
            return error_response(
                422, 'give {"file": NAME, "row": N} of an episode of POST /web/episodes',
                "VALIDATION_ERROR",
            )  # fmt: skip
        name = data["file"]
        row = _int(data.get("row"), 0, 0, 1 << 40)
        first = _int(data.get("step_offset"), 0, 0, 1 << 40)
        count = _int(data.get("step_limit"), 100, 1, STEPS_MAX)
        if self._waiting >= WAITING_MAX:
            return _busy()
        episode = await self._read(index.one, name, row, first, count)
        if episode is None:
            return error_response(404, f"no episode {row} in {name[:200]!r}", "NOT_FOUND")
        if episode is TOO_LARGE:
            return error_response(
                413, f"{name!r}'s row group is over {GROUP_BYTES_MAX >> 20} MiB uncompressed: "
                "too large to browse here; read it with pyarrow", "TOO_LARGE",
            )  # fmt: skip
        return HttpResponse(200, msgspec.json.encode(episode))


def _busy() -> HttpResponse:
    return error_response(
        503, f"{WAITING_MAX} reads of the recording are waiting already: try again later",
        "CAPACITY_REACHED",
    )  # fmt: skip


def _not_recording() -> HttpResponse:
    return error_response(
        404, "this server records no episodes: start it with --record DIR", "NOT_RECORDING"
    )


def _body(body: bytes) -> dict[str, Any] | None:
    if not body.strip():
        return {}
    try:
        data = msgspec.json.decode(body)
    except (ValueError, RecursionError):  # msgspec.DecodeError; UnicodeDecodeError (a
        return None  # string not UTF-8); RecursionError (nested too deep)
    return data if isinstance(data, dict) else None


def _int(value: Any, default: int, low: int, high: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        return default
    return max(low, min(high, value))


__all__ = ["RecordingIndex", "RecordingsRoutes", "filter_problem", "histogram", "select"]
